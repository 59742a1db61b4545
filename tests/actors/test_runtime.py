"""The actor runtime on the real model, on asyncio and trio: concurrent agents
give the same greedy texts as one at a time, one agent's turns run in order,
cancellation frees the batch slot and leaves a consistent agent, errors stay in
their turn, a GPU failure fails what is in flight, and shutdown leaves every
completed turn on disk."""

from __future__ import annotations

import logging
import threading

import anyio
import pytest

from semantic.actors import (
    AgentExists,
    AgentGone,
    ContextTooLong,
    Runtime,
    RuntimeUnhealthy,
    TurnCancelled,
)
from semantic.actors.messages import Message
from semantic.runtime.memory.agent_cache import AgentCaches
from semantic.runtime.memory.block_pool import KVBudget
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.engine_options import EngineOptions
from semantic.runtime.memory.model_caches import kv_budget
from semantic.runtime.text.prefix import encode
from semantic.runtime.engine.row_counts import cached
from semantic.runtime.memory.turns import render, run_turn
from tests.actors.test_choices import ENDLESS

pytestmark = [pytest.mark.model, pytest.mark.anyio]

AGENTS = 8
QUESTIONS = ["Name a fruit.", "What colour is it?", "Is it sweet?"]
TOKENS = 6  # greedy tokens per turn in the equality test


def system(i: int) -> str:
    return f"You are assistant number {i}. Answer briefly."  # distinct: no shared prefixes


@pytest.fixture(scope="module")
def one_at_a_time(smollm2, tmp_path_factory) -> dict[str, list[str]]:
    """Each agent's 3 turns run alone through the synchronous driver, agent after agent."""
    engine = Engine(smollm2.model, smollm2.tokenizer, prefill_chunk=256)  # the runtime's chunking
    engine.use_row_counts(cached(engine))  # and its decode row counts: one class of this machine's
    spec = smollm2.spec
    caches = AgentCaches(CacheStore(tmp_path_factory.mktemp("reference")), smollm2.name, spec,
                         KVBudget(spec, 256 << 20, sliding_dtype_bytes=smollm2.dtype.size))
    texts = {}
    for i in range(AGENTS):
        messages, texts[f"a{i}"] = [{"role": "system", "content": system(i)}], []
        for q in QUESTIONS:
            messages.append({"role": "user", "content": q})
            r = run_turn(engine, caches, f"a{i}", messages, SamplingParams(max_tokens=TOKENS))
            texts[f"a{i}"].append(r.text)
            messages.append({"role": "assistant", "content": r.text})
    return texts


def temp_files(root) -> list:
    return [p for p in root.rglob(".tmp-*")]


@pytest.mark.slow
async def test_concurrent_agents_match_one_agent_at_a_time(open_runtime, one_at_a_time):
    texts: dict[str, list[str]] = {}
    async with open_runtime() as rt:
        agents = [await rt.agent(f"a{i}", system=system(i)) for i in range(AGENTS)]

        async def converse(agent):
            texts[agent.id] = []
            for q in QUESTIONS:
                chunks = [d.text async for d in agent.send(q, max_tokens=TOKENS)]
                texts[agent.id].append("".join(chunks))

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(converse, agent)
        assert rt.stats()["steps"] < AGENTS * len(QUESTIONS) * TOKENS, "turns were batched, not run one by one"
        for agent in agents:
            assert [m.content for m in agent.history[2::2]] == texts[agent.id]
    assert texts == one_at_a_time


async def test_two_sends_to_one_agent_run_in_submission_order(open_runtime):
    async with open_runtime() as rt:
        agent = await rt.agent("zed", system="You are a helpful assistant.")
        first = agent.send("My name is Zed. Say hello to me.", max_tokens=8)
        second = agent.send("What is my name?", max_tokens=8)
        results = {}

        async def read(name, reply):
            results[name] = await reply.text()

        async with anyio.create_task_group() as tg:
            tg.start_soon(read, "second", second)  # read in the other order: makes no difference
            tg.start_soon(read, "first", first)
        roles = [(m.role, m.content) for m in agent.history]
        assert roles == [
            ("system", "You are a helpful assistant."),
            ("user", "My name is Zed. Say hello to me."), ("assistant", results["first"]),
            ("user", "What is my name?"), ("assistant", results["second"]),
        ]
        # The second turn's prompt is the first's conversation plus its own message, served from the cache.
        assert second.result.reused_tokens >= first.result.prompt_tokens + first.result.output_tokens - 1
        assert second.result.prefilled_tokens < 30


async def test_use_cache_false_prefills_the_whole_prompt(open_runtime):
    async with open_runtime() as rt:
        agent = await rt.agent("nocache", system="You are a helpful assistant.")
        await agent.reply("Name a colour.", max_tokens=4)
        cached = agent.send("Name another.", max_tokens=4)
        await cached.text()
        assert cached.result.reused_tokens > 0
        fresh = agent.send("And one more.", max_tokens=4, use_cache=False)
        await fresh.text()
        r = fresh.result
        assert (r.reused_tokens, r.prefilled_tokens) == (0, r.prompt_tokens)
        assert r.prompt_tokens > cached.result.prompt_tokens
        assert 0 < r.prefill_s <= r.ttft_s and r.decode_s >= 0
        # The next cached turn extends the cache the uncached turn left.
        again = agent.send("Thanks.", max_tokens=4)
        await again.text()
        assert again.result.reused_tokens >= r.prompt_tokens


@pytest.mark.slow
async def test_consumer_that_stops_reading_frees_its_slot_within_one_step(open_runtime, smollm2):
    tok = smollm2.tokenizer
    async with open_runtime() as rt:
        agent = await rt.agent("quitter", system="You are a storyteller.")
        other = await rt.agent("other", system="You are a poet.")
        await agent.reply("Hello!", max_tokens=4)
        before = agent.history

        async def keep_busy():  # another sequence in the batch while we cancel
            await other.reply("Write a long poem about the sea.", max_tokens=16)

        async with anyio.create_task_group() as tg:
            tg.start_soon(keep_busy)
            read = 0
            async for _ in agent.send("Tell me a very long story about a dragon.", max_tokens=200):
                read += 1
                if read == 3:
                    break  # stop reading: the stream is dropped, the turn is cancelled
            await rt.agent("quitter")  # a mailbox round trip: the cancelled turn has ended
            cancelled = agent.last_result
            assert cancelled.reason == "cancelled"
            # Out of the batch before the GPU actor started another step: at most the step in
            # progress when the stream was dropped completed (cancel_lag_steps counts it).
            assert cancelled.cancel_lag_steps is not None and cancelled.cancel_lag_steps <= 1
            assert read <= cancelled.output_tokens
            assert agent.history == before  # a cancelled turn leaves no trace in the history
            assert rt.stats()["decoding"] <= 1  # only the other agent is left in the batch

        # The next turn works, reusing the history part of the cancelled turn's cache.
        answer = await agent.reply("Just say hi.", max_tokens=6)
        assert agent.last_result.reason in ("stop", "length") and agent.history[-1] == Message("assistant", answer)
        assert agent.last_result.reused_tokens > 0
        await rt.flush()
    record = CacheStore(rt.cache_dir).load("quitter", smollm2.name, smollm2.spec.hash)
    assert record is not None and record.cache[0].offset == len(record.tokens)
    assert tok.decode(record.tokens) == record.text
    assert record.text.startswith(render(tok, [{"role": m.role, "content": m.content} for m in agent.history[:-1]]))


async def test_cancelling_the_reading_task_cancels_the_turn(open_runtime):
    async with open_runtime() as rt:
        agent = await rt.agent("cancelled", system="You are a storyteller.")
        started = anyio.Event()

        async def consume():
            async for _ in agent.send("Tell me a long story.", max_tokens=200):
                started.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(consume)
            await started.wait()
            tg.cancel_scope.cancel()
        await rt.agent("cancelled")
        assert agent.last_result.reason == "cancelled" and agent.history == (
            Message("system", "You are a storyteller."),)
        # A turn closed before it starts never runs.
        first = agent.send("Count to three.", max_tokens=4)
        never = agent.send("This turn is dropped.", max_tokens=4)
        never.close()
        await first.text()
        await rt.agent("cancelled")
        assert [m.content for m in agent.history if m.role == "user"] == ["Count to three."]


async def test_an_error_in_one_turn_fails_only_that_turn(open_runtime):
    async with open_runtime() as rt:
        bad = await rt.agent("verbose", system="You are terse.")
        good = await rt.agent("fine", system="You are terse.")
        results = {}

        async def too_long():
            with pytest.raises(ContextTooLong, match="context"):
                await bad.reply("word " * 9000, max_tokens=8)
            results["bad"] = "raised"

        async def ok():
            results["good"] = await good.reply("Say yes.", max_tokens=4)

        async with anyio.create_task_group() as tg:
            tg.start_soon(too_long)
            tg.start_soon(ok)
        assert results["bad"] == "raised" and good.history[-1] == Message("assistant", results["good"])
        assert rt.healthy and bad.history == (Message("system", "You are terse."),)
        no = await bad.reply("Say no.", max_tokens=4)
        assert bad.history[1:] == (Message("user", "Say no."), Message("assistant", no))
        with pytest.raises(ValueError, match="temperature"):
            bad.send("x", temperature=-1)


async def test_gpu_failure_fails_turns_in_flight_and_marks_unhealthy(open_runtime, smollm2, monkeypatch):
    boom = threading.Event()
    step_once = Engine.step_once

    def failing_step(engine):
        if boom.is_set():
            raise RuntimeError("simulated device failure")
        return step_once(engine)

    monkeypatch.setattr(Engine, "step_once", failing_step)
    async with open_runtime() as rt:
        agents = [await rt.agent(f"g{i}", system="You are terse.") for i in range(2)]
        await agents[0].reply("Hi.", max_tokens=3)  # a completed turn: must survive on disk
        streaming = anyio.Event()
        errors = []

        async def generate(agent):
            try:
                async for _ in agent.send("Tell me a long story.", max_tokens=200):
                    streaming.set()
            except RuntimeUnhealthy as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(generate, agent)
            await streaming.wait()
            boom.set()
        assert len(errors) == 2 and "simulated device failure" in str(errors[0])
        assert not rt.healthy and "simulated device failure" in str(rt.error)
        with pytest.raises(RuntimeUnhealthy):
            agents[1].send("Anyone there?")
        await rt.flush()  # what needs no model still works
        await agents[1].delete()
    # The completed turn's cache was flushed at shutdown; the failed turns left the files alone.
    record = CacheStore(rt.cache_dir).load("g0", smollm2.name, smollm2.spec.hash)
    assert record is not None and record.cache[0].offset == len(record.tokens)
    assert not temp_files(rt.cache_dir)


@pytest.mark.slow
async def test_shutdown_mid_generation_keeps_every_completed_turn(open_runtime, smollm2, tmp_path):
    before_tasks = {t.id for t in anyio.get_running_tasks()}
    ids = [f"s{i}" for i in range(4)]
    completed = {}
    with anyio.CancelScope() as scope:
        async with open_runtime() as rt:
            agents = [await rt.agent(i, system="You are a storyteller.") for i in ids]
            for agent in agents:
                completed[agent.id] = await agent.reply("Name a colour.", max_tokens=4)
            generating = {agent.id: anyio.Event() for agent in agents}

            async def generate(agent):  # a story that cannot end before the runtime is cancelled
                async for _ in agent.send("Tell me a very long story.", max_tokens=300, grammar=ENDLESS):
                    generating[agent.id].set()

            async with anyio.create_task_group() as tg:
                for agent in agents:
                    tg.start_soon(generate, agent)
                for event in generating.values():
                    await event.wait()
                scope.cancel()  # cancel the runtime's scope while all four generate
                await anyio.sleep_forever()
    assert scope.cancelled_caught
    assert {t.id for t in anyio.get_running_tasks()} == before_tasks, "a task outlived the runtime"
    assert not any(t.name == "semantic-gpu" for t in threading.enumerate())
    assert not temp_files(tmp_path)

    # Reopen: histories hold the completed turns (not the cancelled ones); caches load from disk.
    async with open_runtime() as rt:
        for i in ids:
            agent = await rt.agent(i)
            assert [m.content for m in agent.history] == [
                "You are a storyteller.", "Name a colour.", completed[i]]
            await agent.reply("And another?", max_tokens=3)
            first_prompt = encode(smollm2.tokenizer, render(smollm2.tokenizer, [
                {"role": "system", "content": "You are a storyteller."}, {"role": "user", "content": "Name a colour."}]))
            assert agent.last_result.reused_tokens >= len(first_prompt)  # the completed turn, from disk


@pytest.mark.slow
async def test_fork_delete_and_restart(open_runtime, smollm2):
    async with open_runtime(agent_idle_s=0) as rt:
        alice = await rt.agent("alice", system="You are a geographer.")
        await alice.reply("What is the capital of France?", max_tokens=6)
        with pytest.raises(AgentExists, match="another system prompt"):
            await rt.agent("alice", system="You are a chef.")
        bob = await alice.fork("bob")
        assert bob.history == alice.history
        with pytest.raises(AgentExists):
            await alice.fork("bob")
        await bob.reply("And of Spain?", max_tokens=4)
        assert bob.last_result.reused_tokens >= alice.last_result.prompt_tokens  # the shared cached prefix
        assert len(alice.history) == 3 and len(bob.history) == 5
        await alice._slot.stopped.wait()  # idle actors retire (agent_idle_s=0) ...
        assert rt.stats()["agent_actors"] <= 1
        await alice.reply("And of Italy?", max_tokens=4)  # ... and come back on demand
        assert len(alice.history) == 5
        await bob.delete()
        with pytest.raises(AgentGone):
            bob.send("Hello?")
        assert (await rt.agent("bob")).history == ()  # a fresh agent under the old id
        store = CacheStore(rt.cache_dir)
        assert store.load("bob", smollm2.name, smollm2.spec.hash) is None
        swapped = await rt.swap_model(smollm2)  # drain, flush, unload, load: caches come back from disk
        assert swapped == smollm2.name
        await alice.reply("Thanks.", max_tokens=3)
        assert alice.last_result.reused_tokens > 0
    async with open_runtime() as rt:
        alice = await rt.agent("alice")
        assert len(alice.history) == 7 and alice.history[0] == Message("system", "You are a geographer.")


@pytest.mark.slow
async def test_tight_budget_demotes_to_disk_and_keeps_working(open_runtime, smollm2):
    """Hot caches exceed the budget: turns still run (dirty caches are written before
    they are dropped) and every agent's cache comes back from disk."""
    kv = kv_budget(smollm2, 1 << 30)
    async with open_runtime(budget=3 * kv.bytes_for(1, running=True), eviction_watermarks=(0.5, 0.3)) as rt:
        agents = [await rt.agent(f"t{i}", system="You are terse.") for i in range(5)]
        async def one_word(agent):
            await agent.reply("Say one word.", max_tokens=3)

        async with anyio.create_task_group() as tg:
            for agent in agents:
                tg.start_soon(one_word, agent)
        for agent in agents:
            await agent.reply("Another word.", max_tokens=3)
            assert agent.last_result.reused_tokens > 0
        assert rt.stats()["loaded"]
    assert not temp_files(rt.cache_dir)
    store = CacheStore(rt.cache_dir)
    assert all(store.load(a.id, smollm2.name, smollm2.spec.hash) for a in agents)


def test_runtime_reports_a_model_that_cannot_load(tmp_path):
    from semantic.runtime.errors import ModelError

    async def main():
        async with Runtime.open(str(tmp_path / "missing"), cache_dir=tmp_path / "c"):
            pass

    with pytest.raises(ModelError):
        anyio.run(main)
    assert not any(t.name == "semantic-gpu" for t in threading.enumerate())


async def test_a_reader_outliving_the_runtime_sees_its_turn_cancelled(open_runtime):
    outcome = []

    async def read(reply, started):
        try:
            async for _ in reply:
                started.set()
        except TurnCancelled as e:
            outcome.append(e)

    async with anyio.create_task_group() as readers:  # outside the runtime's block
        async with open_runtime() as rt:
            agent = await rt.agent("late", system="You are a storyteller.")
            reply, started = agent.send("Tell me a long story.", max_tokens=300), anyio.Event()
            readers.start_soon(read, reply, started)
            await started.wait()
    assert len(outcome) == 1 and reply.result.reason == "cancelled"
    assert agent.history == (Message("system", "You are a storyteller."),)


def test_an_idle_model_is_unloaded_and_comes_back(smollm2, tmp_path):
    """``model_idle_s``: the model is unloaded when idle (caches written first) and
    reloaded by the next turn, whose cache comes back from disk (one backend: loading
    the model from disk is slow)."""
    unloaded, loads = threading.Event(), []

    class Watch(logging.Handler):
        def emit(self, record):
            if " unloaded after " in record.getMessage():
                unloaded.set()
            elif "loaded;" in record.getMessage():
                loads.append(record)

    async def main():
        async with Runtime.open(smollm2, cache_dir=tmp_path, model_idle_s=0) as rt:
            agent = await rt.agent("sleepy", system="You are terse.")
            await agent.reply("Hi.", max_tokens=3)
            unloaded.clear()
            if rt.stats()["loaded"]:  # not unloaded yet: wait (the GPU thread logs once it has)
                assert await anyio.to_thread.run_sync(unloaded.wait, 30)
            before = len(loads)
            await agent.reply("Again.", max_tokens=3)  # reloads the model by name
            assert len(loads) == before + 1 and rt.model == smollm2.name
            assert agent.last_result.reused_tokens > 0  # the cache came back from disk

    logger, handler = logging.getLogger("semantic.actors"), Watch()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        anyio.run(main)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


@pytest.mark.slow
async def test_a_follow_up_hands_over_and_writes_only_its_new_blocks(open_runtime, smollm2, monkeypatch):
    """The GPU thread copies out a follow-up's cache from its first changed block on
    (not the whole cache), and the store writes no more after ~1,300 tokens of
    context than after ~300 but for where the open block ends."""
    from pathlib import Path

    from semantic.runtime.memory import agent_cache
    from semantic.runtime.cache_records import BLOCK_TOKENS

    handed = []  # (tokens, first block copied out) per hand-over
    real = agent_cache.snapshot
    monkeypatch.setattr(agent_cache, "snapshot", lambda record, first=0: handed.append((len(record.tokens), first))
                        or real(record, first))
    words = (Path(__file__).parents[2] / "bench" / "data" / "lighthouses.txt").read_text().split()
    written, whole = {}, {}
    async with open_runtime() as rt:
        store = rt._persistence.store
        for agent_id, n in (("short", 220), ("long", 1000)):
            agent = await rt.agent(agent_id)
            await agent.reply("Read this: " + " ".join(words[:n]), max_tokens=2)
            await rt.flush()
            context = handed[-1][0]
            whole[agent_id] = store.info(agent_id, smollm2.name)["bytes"]
            before = store.bytes_written
            await agent.reply("And now, one word?", max_tokens=2)
            await rt.flush()
            written[agent_id] = store.bytes_written - before
            assert handed[-1][1] >= (context - 16) // BLOCK_TOKENS, handed  # the blocks it had: not again
    assert handed[-1][1] >= 4 and whole["long"] > 3 * whole["short"]
    spec = smollm2.spec
    open_block = BLOCK_TOKENS * spec.n_full * spec.n_kv_heads * spec.kv_width * 4  # float32: the most it holds
    closed_block = spec.bytes_per_token(4) * BLOCK_TOKENS  # one more, where the follow-up went back to its start
    assert written["long"] < written["short"] + open_block + closed_block, (written, whole)


@pytest.mark.slow
async def test_a_cache_whose_blocks_left_the_disk_is_handed_over_whole(open_runtime, smollm2, caplog):
    """The writer refuses a follow-up whose earlier blocks are not on disk (here
    removed behind its back; in life, a write that failed) and the GPU actor
    hands the whole cache over instead: it lands, and loads."""
    import shutil
    from pathlib import Path

    words = (Path(__file__).parents[2] / "bench" / "data" / "lighthouses.txt").read_text().split()
    async with open_runtime() as rt:
        store = rt._persistence.store
        agent = await rt.agent("ada")
        await agent.reply("Read this: " + " ".join(words[:400]), max_tokens=2)
        await rt.flush()
        shutil.rmtree(store.agent_dir("ada", smollm2.name))
        caplog.set_level(logging.INFO, "semantic.actors")
        await agent.reply("And now, one word?", max_tokens=2)
        await rt.flush()  # the follow-up's blocks are refused as stale ...
        assert any("'ada'" in r.getMessage() and "handed over whole" in r.getMessage() for r in caplog.records)
        await rt.flush()  # ... and the whole cache, handed over when the GPU actor heard, is written
        record = store.load("ada", smollm2.name, smollm2.spec.hash)
        assert record is not None and len(record.tokens) == rt._gpu.hot.agents["ada"][0] > 256  # all of it


async def replies(rt, asks: list[tuple[str, dict]], *, together: bool, system: str | None = None) -> list[str]:
    """Fresh agents ("t0", "t1" ... together, "s0" ... one at a time) each take one of
    ``asks`` (text, sampling); their replies in order."""
    agents = [await rt.agent(f"{'t' if together else 's'}{i}", system=system) for i in range(len(asks))]
    out: list = [None] * len(asks)

    async def one(i):
        out[i] = await agents[i].reply(asks[i][0], **asks[i][1])

    if together:
        async with anyio.create_task_group() as tg:
            for i in range(len(asks)):
                tg.start_soon(one, i)
    else:
        for i in range(len(asks)):
            await one(i)
    return out


@pytest.mark.slow
async def test_8_bit_caches_batch_persist_and_live_apart_from_4_bit_ones(tmp_path):
    """``kv_bits=8``: agents at once reply as one at a time, a restart serves the
    next turn from the 8-bit files, and a 4-bit runtime does not take them."""
    import json

    from semantic.runtime.store.cache_file import CacheStore
    from semantic.runtime.cache_records import MANIFEST
    from tests.web.live import tiny_loaded

    loaded = tiny_loaded()
    asks = [(q, dict(max_tokens=12)) for q in ("Name a fruit.", "Name a colour.", "Name a city.")]

    async with Runtime.open(loaded, tmp_path, engine=EngineOptions(kv_bits=8)) as rt:
        assert await replies(rt, asks, together=True, system="Be brief.") == \
            await replies(rt, asks, together=False, system="Be brief.")
        await (await rt.agent("s0")).reply("Another?", max_tokens=4)
    store = CacheStore(tmp_path)
    manifest = json.loads((store.agent_dir("s0", "tiny@kv8") / MANIFEST).read_text())
    assert {layer["bits"] for layer in manifest["layers"]} == {8}
    async with Runtime.open(loaded, tmp_path) as rt:  # 4 bits: the 8-bit files are not its own
        async with (await rt.agent("s1")).send("And?", max_tokens=4) as reply:
            await reply.text()
        assert reply.result.reused_tokens == 0
    async with Runtime.open(loaded, tmp_path, engine=EngineOptions(kv_bits=8)) as rt:
        async with (await rt.agent("s0")).send("More?", max_tokens=4) as reply:
            await reply.text()
        assert reply.result.reused_tokens > 0
    with pytest.raises(ValueError, match="kv_bits must be 4, 8 or 16"):
        async with Runtime.open(loaded, tmp_path, engine=EngineOptions(kv_bits=3)):
            pass


async def test_a_grammar_shapes_a_reply_and_a_bad_one_is_refused_at_once(tmp_path):
    """``grammar=`` (``runtime.text.grammar``) on the in-process API: two agents at
    once, one constrained, reply as each does alone, and the constrained
    reply is JSON its schema accepts."""
    import json

    import jsonschema

    from semantic.runtime.text.grammar import json_schema
    from tests.web.live import tiny_loaded

    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    asks = [("Answer as JSON.", dict(max_tokens=40, grammar=json_schema(schema))),
            ("Answer as JSON.", dict(max_tokens=12))]

    async with Runtime.open(tiny_loaded(), tmp_path) as rt:
        together = await replies(rt, asks, together=True)
        assert together == await replies(rt, asks, together=False)
        jsonschema.validate(json.loads(together[0]), schema)
        with pytest.raises(ValueError, match="Invalid type"):
            (await rt.agent("s0")).send("x", grammar='{"grammars": [{"json_schema": {"type": "strin"}}]}')


async def test_logprobs_come_with_each_delta_and_with_the_result(tmp_path):
    from tests.web.live import tiny_loaded

    async with Runtime.open(tiny_loaded(), tmp_path) as rt:
        agent = await rt.agent("counter")
        async with agent.send("Count.", max_tokens=6, logprobs=2) as reply:
            deltas = [d async for d in reply]
        streamed = [lp for d in deltas for lp in d.logprobs]
        assert [lp.token for lp in streamed] == [t for d in deltas for t in d.tokens]
        assert tuple(streamed) == reply.result.logprobs and len(streamed) == reply.result.output_tokens
        assert all(len(lp.top) == 2 for lp in streamed)
        async with agent.send("Again.", max_tokens=3) as reply:
            assert [d.logprobs async for d in reply if d.logprobs] == []  # not asked: none computed
        assert reply.result.logprobs == ()
