"""Turns choose their model: a runtime opened with several models runs each turn
on the one it names, swapping when the oldest waiting turn wants another; each
model keeps its own cache of every agent."""

from __future__ import annotations

import anyio
import pytest

from semantic.actors import Runtime, UnknownModel
from semantic.runtime.errors import ModelError
from tests.web.live import tiny_loaded

pytestmark = pytest.mark.anyio

TURNS = ["tiny-1", "tiny", "tiny-1", "tiny", "tiny-1"]


@pytest.mark.slow
async def test_alternating_turns_reuse_each_models_own_cache(tmp_path):
    a, b = tiny_loaded(), tiny_loaded(seed=1)
    async with Runtime.open(a, tmp_path / "cache", 256 << 20, models=[b]) as rt:
        assert rt.models == ("tiny", "tiny-1") and rt.model == "tiny"
        agent = await rt.agent("alice", system="You are terse.")
        results = []
        for i, model in enumerate(TURNS):
            await agent.reply(f"Question {i}?", model=model, max_tokens=4)
            assert rt.model == model
            results.append(agent.last_result)
        assert [r.reused_tokens for r in results[:2]] == [0, 0]  # each model's first turn is cold
        # From then on each model's turn reuses what that model computed for its last turn.
        for earlier, later in [(0, 2), (1, 3), (2, 4)]:
            covered = results[earlier].prompt_tokens + results[earlier].output_tokens
            assert results[later].reused_tokens >= results[earlier].prompt_tokens, (earlier, later)
            assert results[later].reused_tokens <= covered
        await agent.reply("And now?", max_tokens=2)  # no model named: the loaded one
        assert rt.model == "tiny-1"
    async with Runtime.open(a, tmp_path / "cache", 256 << 20, models=[b]) as rt:
        agent = await rt.agent("alice")
        await agent.reply("After a restart?", model="tiny", max_tokens=2)
        assert agent.last_result.reused_tokens >= results[3].prompt_tokens  # tiny's cache, from disk


@pytest.mark.slow
async def test_turns_for_two_models_at_once_match_one_at_a_time(tmp_path):
    """Four agents, two per model, sent at once: each reply is what the agent gets
    alone, and the swaps between models happen only when a batch drained."""
    a, b = tiny_loaded(), tiny_loaded(seed=1)
    plan = {"a1": "tiny", "b1": "tiny-1", "a2": "tiny", "b2": "tiny-1"}

    async def run(rt, agent_id, out):
        agent = await rt.agent(agent_id, system=f"You are {agent_id}.")
        out[agent_id] = [await agent.reply(f"Turn {i} of {agent_id}.", model=plan[agent_id], max_tokens=6)
                         for i in range(2)]

    alone: dict = {}
    async with Runtime.open(a, tmp_path / "alone", 256 << 20, models=[b]) as rt:
        for agent_id in plan:
            await run(rt, agent_id, alone)
    together: dict = {}
    async with Runtime.open(a, tmp_path / "together", 256 << 20, models=[b]) as rt:
        async with anyio.create_task_group() as tg:
            for agent_id in plan:
                tg.start_soon(run, rt, agent_id, together)
    assert together == alone
    assert alone["a1"] != alone["b1"]  # two different models answered


async def test_an_unknown_model_is_refused_at_once(tmp_path):
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", 256 << 20, models=[tiny_loaded(seed=1)]) as rt:
        agent = await rt.agent("alice")
        with pytest.raises(UnknownModel, match=r"'gpt-4' is not served here; available: tiny, tiny-1"):
            agent.send("Hi", model="gpt-4")
        assert await agent.reply("Hi", model="tiny-1", max_tokens=2) is not None


async def test_a_model_that_fails_to_load_fails_only_its_turns(tmp_path):
    missing = tmp_path / "no-such-model"
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", 256 << 20, models=[f"broken={missing}"]) as rt:
        assert rt.models == ("tiny", "broken")
        agent = await rt.agent("alice")
        with pytest.raises(ModelError, match="no-such-model"):
            await agent.reply("Hi", model="broken", max_tokens=2)
        assert rt.model == "tiny" and rt.healthy
        await agent.reply("Hi", model="tiny", max_tokens=2)
        assert agent.last_result.output_tokens > 0


def test_model_names_must_differ(tmp_path):
    from semantic.runtime.model.models import catalogue

    assert catalogue(["smollm2", "b=/models/qwen"]) == {"smollm2": "smollm2", "b": "/models/qwen"}
    with pytest.raises(ValueError, match="two models are named 'x'"):
        catalogue(["x=/a", "x=/b"])
    with pytest.raises(ValueError, match="needs a name"):
        catalogue(["=/a"])
