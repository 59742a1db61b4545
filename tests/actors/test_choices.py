"""A turn that asks for several replies (``choices``) through the actor
runtime: deltas say which reply they extend, the result holds every reply,
the agent keeps the first; under memory pressure its choices are cut, never
preempted, and cancelling it ends them all."""

from __future__ import annotations

import anyio
import pytest

from semantic.actors import MAX_CHOICES, Message, Runtime
from semantic.runtime.text.grammar import lark
from tests.web.live import kv_bytes, tiny_loaded

pytestmark = pytest.mark.anyio

ASK = (Message("system", "You count sheep."), Message("user", "Start counting."))
# A reply that cannot end by itself within 1,234 tokens (the longest token is 81 characters):
# whatever the random model prefers under this machine's kernels, it runs to max_tokens.
ENDLESS = lark("start: /[a-z ]{100000,}/")


async def streamed(reply, choices: int) -> list[str]:
    texts = [""] * choices
    async for delta in reply:
        texts[delta.choice] += delta.text
    return texts


async def test_choices_stream_apart_and_each_is_the_reply_of_its_seed(tmp_path):
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", 256 << 20) as rt:
        agent = await rt.agent("many")
        reply = agent.respond(ASK, choices=3, temperature=1.0, seed=11, max_tokens=16)
        texts = await streamed(reply, 3)
        result = reply.result
        assert len(result.choices) == 2
        assert texts == [result.text, *(c.text for c in result.choices)]
        assert agent.history[-1] == Message("assistant", result.text)  # the agent keeps choice 0
        assert result.prompt_tokens > 0 and all(c.prefilled_tokens <= 1 for c in result.choices)
        for i, text in enumerate(texts):
            alone = await rt.agent(f"alone-{i}")
            async with alone.respond(ASK, temperature=1.0, seed=11 + i, max_tokens=16) as one:
                assert await one.text() == text
        with pytest.raises(ValueError, match="choices"):
            agent.respond(ASK, choices=MAX_CHOICES + 1)


@pytest.mark.slow
async def test_choices_without_room_are_cut_and_nothing_is_preempted(tmp_path):
    """Three greedy choices that each grow to 2 blocks, in a 3-block budget:
    they cannot all fit, so some end at "length" before their 300 tokens --
    each a prefix of the reply alone -- and the budget holds."""
    async with Runtime.open(tiny_loaded(), tmp_path / "alone", kv_bytes(3)) as rt:
        want = await (await rt.agent("one")).reply("Start counting.", max_tokens=300, grammar=ENDLESS)
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", kv_bytes(3)) as rt:
        agent = await rt.agent("one")
        reply = agent.send("Start counting.", choices=3, max_tokens=300, grammar=ENDLESS)
        texts = await streamed(reply, 3)
        assert rt.memory()["hot_bytes"] <= kv_bytes(3)
        assert rt.stats()["preemptions"] == 0
        results = [reply.result, *reply.result.choices]
        assert {r.reason for r in results} == {"length"} and min(r.output_tokens for r in results) < 300
        assert all(want.startswith(text) and text == r.text for text, r in zip(texts, results))
        assert await agent.reply("Again.", max_tokens=4) is not None  # the runtime goes on


@pytest.mark.slow
async def test_beside_an_older_turn_the_choices_are_cut_and_the_older_turn_is_preempted(tmp_path):
    """A plain turn, then (the newest) a turn of 3 choices, in a 4-block budget
    where each reply grows to 2 blocks: the plain turn is preempted, not the
    choices, and resumes to its reply alone; the choices are cut where room
    ran out, each a prefix of that reply."""
    async with Runtime.open(tiny_loaded(), tmp_path / "alone", kv_bytes(4)) as rt:
        want = await (await rt.agent("plain")).reply("Start counting.", max_tokens=300, grammar=ENDLESS)
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", kv_bytes(4)) as rt:
        plain, many = await rt.agent("plain"), await rt.agent("many")
        texts: dict[str, list[str]] = {}
        async with plain.send("Start counting.", max_tokens=300, grammar=ENDLESS) as first:
            texts["plain"] = [(await first.__anext__()).text]  # it runs: the choices' turn is newer
            second = many.send("Start counting.", choices=3, max_tokens=300, grammar=ENDLESS)

            async def read_plain():
                texts["plain"] += [d.text async for d in first]

            async def read_many():
                texts["many"] = await streamed(second, 3)

            async with anyio.create_task_group() as tg:
                tg.start_soon(read_plain)
                tg.start_soon(read_many)
        assert rt.stats()["preemptions"] >= 1
        assert "".join(texts["plain"]) == want and first.result.output_tokens == 300
        results = [second.result, *second.result.choices]
        assert all(want.startswith(text) and text == r.text for text, r in zip(texts["many"], results))
        assert min(r.output_tokens for r in results) < 300  # cut: four blocks hold no four full replies


async def test_closing_a_turn_of_choices_cancels_them_all(tmp_path):
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", 256 << 20) as rt:
        agent = await rt.agent("many", system="You count sheep.")
        reply = agent.send("Start counting.", choices=4, max_tokens=200, grammar=ENDLESS)  # choice 3 speaks
        async with reply:
            async for delta in reply:
                if delta.choice == 3:
                    break
        with anyio.fail_after(10):
            while rt.stats()["turns"]:
                await anyio.sleep(0.01)
        assert agent.history[-1].role == "system"  # a cancelled turn leaves the history as it was
        assert await agent.reply("Start counting.", max_tokens=3)
