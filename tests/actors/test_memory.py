"""KV memory under pressure, through the actor runtime: turns reserve their
reply as it grows, and when turns in progress hold the whole budget the newest
is preempted (its cache goes to disk) and resumed later -- every reply is the
one it would have been with room to spare."""

from __future__ import annotations

import anyio
import pytest

from semantic.actors import Runtime
from tests.web.live import kv_bytes, tiny_loaded

pytestmark = pytest.mark.anyio

SYSTEMS = ["You count sheep.", "You count stars.", "You count waves."]


async def replies(rt: Runtime, together: bool, max_tokens: int) -> dict[str, str]:
    agents = [await rt.agent(f"agent-{i}", system=s) for i, s in enumerate(SYSTEMS)]
    out = {}

    async def one(agent):
        out[agent.id] = await agent.reply("Start counting.", max_tokens=max_tokens)

    if together:
        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(one, agent)
    else:
        for agent in agents:
            await one(agent)
    return out


@pytest.mark.slow
async def test_turns_that_outgrow_the_budget_together_are_preempted_and_resumed(tmp_path):
    """Three turns that each grow to 2 blocks, in a 3-block budget: each fits
    alone, so none fails; together the newest are preempted while the others
    grow, then resume from disk, and every reply equals its reply alone."""
    async with Runtime.open(tiny_loaded(), tmp_path / "alone", kv_bytes(3)) as rt:
        alone = await replies(rt, together=False, max_tokens=300)
    async with Runtime.open(tiny_loaded(), tmp_path / "together", kv_bytes(3)) as rt:
        together = await replies(rt, together=True, max_tokens=300)
        stats = rt.stats()
        assert rt.memory()["hot_bytes"] <= kv_bytes(3)
    assert stats["preemptions"] >= 1
    assert together == alone
    assert all(len(text) > 100 for text in together.values())


async def test_a_turn_that_outgrows_the_whole_budget_alone_ends_at_its_length(tmp_path):
    """Alone in a 1-block budget, a turn's reply stops where the budget ends
    (reason "length"), and its cache is kept."""
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", kv_bytes(1)) as rt:
        agent = await rt.agent("long", system="You count sheep.")
        await agent.reply("Start counting.", max_tokens=400)
        result = agent.last_result
        assert result.reason == "length" and result.prompt_tokens + result.output_tokens <= 257
        assert rt.cache_tier("long") in ("hot", "warm")  # kept (the eviction actor may have written it out)


@pytest.mark.slow
async def test_drafts_without_room_wait_and_the_reply_ends_where_it_would(tmp_path, monkeypatch):
    """Alone in a 1-block budget, a turn whose drafts would pass the budget
    verifies none there (``Engine.hold_drafts``) and ends at the same token
    as the same turn without drafts; drafts were taken before."""
    from semantic.runtime.engine import engine as engine_module
    from tests.web.test_drafts import Recalling

    Recalling.seen = []
    monkeypatch.setattr(engine_module, "Drafter", Recalling)  # a second agent gets the first one's reply as drafts
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", kv_bytes(1)) as rt:
        first, again = [await rt.agent(name, system="You count sheep.") for name in ("first", "again")]
        await first.reply("Start counting.", max_tokens=400)
        await again.reply("Start counting.", max_tokens=400)
    want, got = first.last_result, again.last_result
    assert want.reason == "length"
    assert (got.text, got.output_tokens, got.reason) == (want.text, want.output_tokens, want.reason)
    assert got.accepted_tokens > 0 and want.drafted_tokens == 0
