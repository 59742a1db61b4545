"""Scenarios on the real model through the in-process backend (the actor runtime):
permanent agents EXTEND their caches from turn to turn, closing a conversation
deletes its agent, and the cached run compares against a --no-cache run."""

from __future__ import annotations

import textwrap

import pytest

from semantic.actors import Runtime
from semantic.scenarios import compare, runner
from semantic.scenarios.local import LocalBackend
from semantic.scenarios.schema import loads

pytestmark = [pytest.mark.model, pytest.mark.anyio]

SCENARIO = loads(textwrap.dedent("""\
    id: tiny
    title: Tiny
    sampling: {max_tokens: 8}
    agents:
      ann: {name: Ann, system: You are Ann. Answer in one short sentence.}
      ben: {name: Ben, system: You are Ben. Answer in one short sentence.}
      judge: {name: Judge, system: You judge debates., lifecycle: ephemeral}
    phases:
      - name: debate
        agents: [ann, ben]
        rounds: 2
        opening: Is tea better than coffee?
      - name: verdict
        agents: [judge]
        opening: Who argued better?
        private:
          - visible_to: [judge]
            text: ${debate.messages}
        judge: {}
    """), "tiny.yaml")


async def play(rt: Runtime, run_id: str, use_cache: bool = True) -> runner.Result:
    return await runner.run(SCENARIO, LocalBackend(rt), run_id=run_id, seed=1, use_cache=use_cache)


@pytest.mark.slow
async def test_permanent_agents_reuse_their_whole_conversation(smollm2, tmp_path):
    async with Runtime.open(smollm2, cache_dir=tmp_path, budget=64 << 20) as rt:
        result = await play(rt, "r1")
        for agent in ("ann", "ben"):
            first, second = [t for t in result.turns if t.agent == agent]
            assert (first.result.reused_tokens, second.agent_turn) == (0, 2)
            first, second = first.result, second.result
            # Everything the agent had seen and said was served from its cache: only the new message was prefilled.
            assert second.reused_tokens >= first.prompt_tokens + first.output_tokens - 1
            assert second.prefilled_tokens < second.prompt_tokens - first.prompt_tokens
            assert second.ttft_s > 0 and second.prefill_s > 0
        judge = result.turns[-1]
        assert judge.agent == "judge" and "Ann:" in judge.prompt and result.verdict == judge.result.text
        await rt.flush()
        assert rt.stats()["agent_actors"] == 0 or not list((tmp_path / "histories").glob("scn.tiny.r1.*"))
    leftovers = [p.name for p in tmp_path.rglob("*scn.tiny.r1*")]
    assert leftovers == [], "closed conversations delete their agents' files"


@pytest.mark.slow
async def test_cached_run_against_no_cache_run(smollm2, tmp_path):
    async with Runtime.open(smollm2, cache_dir=tmp_path, budget=64 << 20) as rt:
        cached = await play(rt, "c")
        uncached = await play(rt, "n", use_cache=False)
    assert all(t.result.reused_tokens == 0 and t.result.prefilled_tokens == t.result.prompt_tokens
               for t in uncached.turns)
    c = compare.compare(cached, uncached)
    assert c["cached"]["prefilled_tokens"] < c["uncached"]["prefilled_tokens"]
    assert c["uncached"]["prompt_tokens"] == c["uncached"]["prefilled_tokens"]
    # The first turn of each conversation saw the same text in both runs, so a difference there is numerics.
    assert all(r["cause"] in (None, "numerics") for r in c["turns"][:2])
    assert c["identical_turns"] + sum(c["differ_by"].values()) == len(c["turns"]) == 5
    assert "identical replies:" in compare.render(c)
