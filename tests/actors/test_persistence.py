"""The persistence actor without a model: latest version wins, every write is
reported, reads come after the same agent's writes, deletes wait for earlier
writes, flush and stop leave nothing pending;
a full disk keeps the last good files; the disk budget and the conversations'
TTL are kept."""

from __future__ import annotations

import dataclasses
import errno
import os
import shutil
import time
from collections import namedtuple

import anyio
import pytest

from semantic.actors.agent import request
from semantic.actors.history import encode_history
from semantic.actors.messages import (
    CacheBlocks, CacheRead, CacheWritten, Done, Flush, Forget, HistoryBytes, Message, ReadCache, ReadHistory, Stop,
)
from semantic.actors.persistence import PersistenceActor, history_path
from semantic.runtime.store import disk
from semantic.runtime import files
from semantic.runtime.store.cache_codec import snapshot
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import MANIFEST
from tests.runtime import cache_writer

pytestmark = pytest.mark.anyio


class FakeGpu:
    def __init__(self):
        self.commands = []

    def submit(self, command):
        self.commands.append(command)


def blocks(agent: str, version: int) -> CacheBlocks:
    """A 16-token cache of ``agent`` whose text names the version."""
    rec = dataclasses.replace(cache_writer.record(0), agent_id=agent, model_id="m", text=f"{agent}{version}")
    return CacheBlocks(agent, "m", version, snapshot(rec))


def text_of(store: CacheStore, agent: str) -> str | None:
    rec = store.load(agent, "m", cache_writer.SPEC)
    return None if rec is None else rec.text


def actor_in(tmp_path, **collaborators) -> PersistenceActor:
    return PersistenceActor(CacheStore(tmp_path), tmp_path / "histories", gpu=FakeGpu(), **collaborators)


async def test_latest_version_wins_and_is_reported(tmp_path):
    actor = actor_in(tmp_path)
    for version in (1, 2, 3):  # queued before the actor runs: coalesced
        actor.mailbox.send_nowait(blocks("a", version))
    actor.mailbox.send_nowait(blocks("b", 4))
    actor.mailbox.send_nowait(HistoryBytes("a", b"h1"))
    actor.mailbox.send_nowait(HistoryBytes("a", b"h2"))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    store = actor.store
    assert text_of(store, "a") == "a3" and text_of(store, "b") == "b4"
    assert history_path(actor.histories, "a").read_bytes() == b"h2"
    assert (actor.writes, actor.coalesced) == (3, 3)
    assert actor.gpu.commands == [CacheWritten("a", 3), CacheWritten("b", 4)]  # written in arrival order
    assert not list(tmp_path.rglob(".tmp-*"))


def grown(version: int, tokens: int, first: int) -> CacheBlocks:
    """Version ``version`` of agent a3 at ``tokens`` tokens, from block ``first`` on."""
    rec = dataclasses.replace(cache_writer.record(3), tokens=cache_writer.token_ids(3, tokens),
                              cache=cache_writer.layers(3, tokens), model_id="m", text=f"v{version}")
    return CacheBlocks("a3", "m", version, snapshot(rec, first))


async def test_a_newer_pending_version_takes_over_the_blocks_it_left_out(tmp_path):
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(grown(1, 600, 0))  # blocks 0-2
    actor.mailbox.send_nowait(grown(2, 1100, 2))  # blocks 2-4: 0 and 1 were handed over
    actor.mailbox.send_nowait(grown(3, 1300, 4))  # blocks 4-5
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert (actor.writes, actor.coalesced) == (1, 2) and actor.gpu.commands == [CacheWritten("a3", 3)]
    back = actor.store.load("a3", "m", cache_writer.SPEC)
    assert back.text == "v3" and back.tokens == cache_writer.token_ids(3, 1300)


async def test_a_version_whose_left_out_blocks_are_not_on_disk_is_refused_as_stale(tmp_path):
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(grown(1, 600, 1))  # block 0 was never written
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert actor.gpu.commands == [CacheWritten("a3", 1, ok=False, stale=True)] and not actor.store.exists("a3", "m")


async def test_forget_deletes_after_earlier_writes_and_flush_waits(tmp_path):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.mailbox.send_nowait(blocks("a", 1))
        actor.mailbox.send_nowait(HistoryBytes("a", b"h"))
        actor.mailbox.send_nowait(blocks("b", 2))
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Forget("a", r))), Done)
        assert not actor.store.exists("a", "m") and not history_path(actor.histories, "a").exists()
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Flush(r))), Done)
        assert text_of(actor.store, "b") == "b2"
        actor.mailbox.send_nowait(blocks("c", 3))
        actor.mailbox.send_nowait(Stop())
    assert actor.gpu.commands[-1] == CacheWritten("c", 3)  # stop writes what is pending first


async def test_a_read_comes_after_the_agents_queued_writes_and_beside_the_others(tmp_path):
    actor = actor_in(tmp_path)
    for agent, version in (("x", 1), ("y", 2), ("a", 3), ("z", 4)):
        actor.mailbox.send_nowait(blocks(agent, version))
    actor.mailbox.send_nowait(ReadCache("a", "m", cache_writer.SPEC))  # a's write moves up; x, y, z wait
    actor.mailbox.send_nowait(ReadCache("nobody", "m", cache_writer.SPEC))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    written = [c.agent_id for c in actor.gpu.commands if isinstance(c, CacheWritten)]
    reads = {c.agent_id: c for c in actor.gpu.commands if isinstance(c, CacheRead)}
    assert written[0] == "a" and sorted(written) == ["a", "x", "y", "z"]
    assert reads["a"].cache.record.text == "a3" and reads["nobody"].cache is None
    assert reads["a"].cache.build().text == "a3"  # host bytes become the caches on the MLX side


async def test_a_read_of_an_unusable_cache_quarantines_it_and_says_none(tmp_path, caplog):
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(blocks("a", 1))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    (actor.store.agent_dir("a", "m") / MANIFEST).write_text("{not json")
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(ReadCache("a", "m", cache_writer.SPEC))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert actor.gpu.commands == [CacheRead("a", "m", None)]
    assert list((tmp_path / CacheStore.QUARANTINE).iterdir()) and not actor.store.exists("a", "m")
    assert sum("starts cold" in r.getMessage() for r in caplog.records) == 1


def history_bytes(agent: str, text: str) -> HistoryBytes:
    return HistoryBytes(agent, encode_history(agent, (Message("user", text),)))


async def read_history(actor: PersistenceActor, agent: str):
    answer = await request(lambda r: actor.mailbox.send_nowait(ReadHistory(agent, r)))
    assert isinstance(answer, Done), answer
    return answer.value


async def test_a_history_read_comes_after_its_queued_write_and_a_bad_file_is_moved_aside(tmp_path, caplog):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.mailbox.send_nowait(history_bytes("a", "one"))
        actor.mailbox.send_nowait(history_bytes("a", "two"))
        assert await read_history(actor, "a") == (Message("user", "two"),)
        assert await read_history(actor, "nobody") is None
        history_path(actor.histories, "bad").write_text("{not json")
        assert await read_history(actor, "bad") is None
        assert [p.name.split(".bad-")[0] for p in actor.histories.glob("bad.json.bad-*")] == ["bad.json"]
        assert sum("unreadable" in r.getMessage() for r in caplog.records) == 1
        actor.mailbox.send_nowait(Stop())


async def test_a_history_that_could_not_be_written_reads_as_its_newest_version(tmp_path, monkeypatch):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.mailbox.send_nowait(history_bytes("a", "old"))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        no_room(monkeypatch)
        actor.mailbox.send_nowait(history_bytes("a", "new"))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        assert actor.failed == 1
        assert await read_history(actor, "a") == (Message("user", "new"),)
        actor.mailbox.send_nowait(Stop())


# -- a full disk ---------------------------------------------------------------------------

Usage = namedtuple("Usage", "total used free")


def no_room(monkeypatch, free: int = 10 << 20) -> None:
    """The filesystem reports ``free`` bytes free (less than the margin a write must leave)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 << 30, 100 << 30, free))


async def test_a_write_without_room_keeps_the_last_good_file(tmp_path, monkeypatch, caplog):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.mailbox.send_nowait(blocks("alice", 1))
        actor.mailbox.send_nowait(HistoryBytes("alice", b"h1"))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        no_room(monkeypatch)
        actor.mailbox.send_nowait(blocks("alice", 2))
        actor.mailbox.send_nowait(HistoryBytes("alice", b"h2"))
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Flush(r))), Done)
        assert actor.gpu.commands[-1] == CacheWritten("alice", 2, ok=False)  # the GPU actor keeps the cache dirty
        assert text_of(actor.store, "alice") == "alice1"
        assert history_path(actor.histories, "alice").read_bytes() == b"h1"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2 and all("'alice'" in w and "10.0 MiB free" in w for w in warnings), warnings
        assert actor.failed == 2
        # room again: the next write that succeeds brings the refused history along
        monkeypatch.undo()
        actor.mailbox.send_nowait(blocks("bo", 3))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        assert history_path(actor.histories, "alice").read_bytes() == b"h2"
        actor.mailbox.send_nowait(Stop())
    assert not list(tmp_path.rglob(".tmp-*"))


async def test_a_write_that_fails_midway_removes_its_temp_file(tmp_path, monkeypatch, caplog):
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(blocks("alice", 1))
    actor.mailbox.send_nowait(Stop())
    await actor.run()

    def disk_full(fd):
        assert list(tmp_path.rglob(".tmp-*")), "the temp file holds the bytes when the disk fills"
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_fsync", disk_full)
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(blocks("alice", 2))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert actor.gpu.commands == [CacheWritten("alice", 2, ok=False)]
    assert text_of(actor.store, "alice") == "alice1"
    assert not list(tmp_path.rglob(".tmp-*"))
    assert any("'alice'" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)


# -- the disk budget and the conversations' TTL -------------------------------------------

DAY = 86400.0


def aged(path, data: bytes, days: float) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    when = time.time() - days * DAY
    os.utime(path, (when, when))


async def test_at_start_over_the_budget_the_least_recently_used_caches_go(tmp_path):
    actor = actor_in(tmp_path)
    for agent, days in (("a", 3), ("b", 2), ("c", 1)):
        aged(actor.store.legacy_path(agent, "m"), b"x" * 1000, days)
        aged(history_path(actor.histories, agent), b"h" * 10, 9)
    actor.disk_budget = 2000  # 3030 bytes: pruned to 90% of the budget, 1800
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert [p.stem for p in sorted(actor.store.legacy_path("x", "m").parent.glob("*"))] == ["c"]
    assert len(list(actor.histories.iterdir())) == 3  # named agents' histories always stay
    assert actor.pruned == 2 and actor.store.disk_bytes() <= 1800


async def test_writes_over_the_budget_prune_at_once(tmp_path):
    actor = actor_in(tmp_path)
    measure = CacheStore(tmp_path / "measure")
    measure.write(blocks("x", 0).update)
    size = measure.disk_bytes()  # each agent's cache: the same size
    shutil.rmtree(tmp_path / "measure")
    actor.disk_budget = int(2.5 * size)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for i, agent in enumerate("abcd"):
            actor.mailbox.send_nowait(blocks(agent, i))
            await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
            assert actor.store.disk_bytes() <= actor.disk_budget
        actor.mailbox.send_nowait(Stop())
    left = sorted(e["agent"] for e in actor.store.entries())
    assert left == ["c", "d"] and actor.pruned == 2


async def test_pruning_leaves_a_cache_being_read_alone(tmp_path):
    """The least recently written cache is being read for a turn when writes take
    the directory over its budget: pruning removes others, and the read gets it."""
    import threading

    actor = actor_in(tmp_path)
    measure = CacheStore(tmp_path / "measure")
    measure.write(blocks("x", 0).update)
    size = measure.disk_bytes()
    shutil.rmtree(tmp_path / "measure")
    actor.disk_budget = int(2.5 * size)
    reading, release = threading.Event(), threading.Event()
    real = actor.store.read

    def slow_read(*args):
        reading.set()
        release.wait(10)
        return real(*args)

    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for i, agent in enumerate("ab"):
            actor.mailbox.send_nowait(blocks(agent, i))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        actor.store.read = slow_read
        actor.mailbox.send_nowait(ReadCache("a", "m", cache_writer.SPEC))
        with anyio.fail_after(10):
            while not reading.is_set():
                await anyio.sleep(0.01)
        for i, agent in enumerate("cd", 2):  # over the budget: "a" would go first
            actor.mailbox.send_nowait(blocks(agent, i))
            await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        release.set()
        actor.mailbox.send_nowait(Stop())
    read = [c for c in actor.gpu.commands if isinstance(c, CacheRead)]
    assert len(read) == 1 and read[0].cache is not None and read[0].cache.record.text == "a0"
    assert "a" in {e["agent"] for e in actor.store.entries()} and actor.pruned >= 1


def test_file_work_runs_at_a_lower_cpu_priority_than_compute():
    """The persistence actor's worker threads yield the CPU to decoding (Linux gives
    each thread its own niceness)."""
    import os
    import sys
    import threading

    from semantic.actors.persistence import _in_background

    if not sys.platform.startswith("linux"):
        pytest.skip("per-thread niceness is Linux's")
    here = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen = []
    thread = threading.Thread(target=lambda: seen.append(
        _in_background(os.getpriority, os.PRIO_PROCESS, threading.get_native_id())))
    thread.start()
    thread.join()
    assert seen[0] >= 10 and seen[0] >= here
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == here  # the caller's thread is untouched


async def test_a_write_that_cannot_be_made_room_for_is_written_anyway_without_spinning(tmp_path):
    """Every cache is protected (it is hot): pruning cannot make room, so the
    write goes ahead over the budget (and says so) instead of pruning forever."""
    actor = actor_in(tmp_path, hot=lambda: {"a", "b"})
    actor.disk_budget = 1000  # less than one cache
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        with anyio.fail_after(10):
            for i, agent in enumerate("ab"):
                actor.mailbox.send_nowait(blocks(agent, i))
                await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
                assert actor.gpu.commands[-1] == CacheWritten(agent, i)
        actor.mailbox.send_nowait(Stop())
    assert sorted(e["agent"] for e in actor.store.entries()) == ["a", "b"] and actor.pruned == 0


async def test_old_conversations_go_whole_but_not_named_live_or_pending_ones(tmp_path):
    told = []
    actor = actor_in(tmp_path, live=lambda: {"conv-live"}, on_pruned=told.append)
    for agent in ("conv-old", "conv-live", "conv-pending", "named"):
        aged(actor.store.legacy_path(agent, "m"), b"c", 10)
        aged(history_path(actor.histories, agent), b"h", 10)
    aged(actor.store.legacy_path("conv-young", "m"), b"c", 1)
    actor.conversation_ttl_s = 7 * DAY
    actor.mailbox.send_nowait(HistoryBytes("conv-pending", b"h2"))  # a write about to replace its files
    actor.mailbox.send_nowait(Stop())
    with anyio.fail_after(10):  # conv-live is past its TTL: the actor must not spin on it
        await actor.run()
    assert told == [["conv-old"]]
    assert not actor.store.legacy_path("conv-old", "m").exists() and not history_path(actor.histories, "conv-old").exists()
    for agent in ("conv-live", "conv-pending", "named"):
        assert actor.store.legacy_path(agent, "m").exists() and history_path(actor.histories, agent).exists(), agent
    assert history_path(actor.histories, "conv-pending").read_bytes() == b"h2"
    assert actor.store.legacy_path("conv-young", "m").exists()


async def test_an_idle_actor_checks_the_ttl_now_and_then_without_spinning(tmp_path, monkeypatch):
    actor = actor_in(tmp_path, live=lambda: {"conv-kept"})  # expired but live: it must not make the actor spin
    actor.conversation_ttl_s, actor.prune_interval_s = 7 * DAY, 0.1
    aged(history_path(actor.histories, "conv-kept"), b"h", 30)
    scans = counted_scans(monkeypatch)
    with anyio.fail_after(10):  # an actor that spins never gets to Stop
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            await anyio.sleep(0.3)
            aged(history_path(actor.histories, "conv-old"), b"h", 8)  # expires while the actor idles
            while history_path(actor.histories, "conv-old").exists():
                await anyio.sleep(0.05)
            await anyio.sleep(0.3)
            actor.mailbox.send_nowait(Stop())
    assert history_path(actor.histories, "conv-kept").exists()
    assert 3 <= len(scans) <= 20, len(scans)  # about one per 0.1 s


async def test_an_idle_actor_with_no_conversations_sleeps(tmp_path, monkeypatch):
    actor = actor_in(tmp_path)
    actor.disk_budget, actor.conversation_ttl_s, actor.prune_interval_s = 1 << 30, 7 * DAY, 0.05
    aged(history_path(actor.histories, "named"), b"h", 30)
    scans = counted_scans(monkeypatch)
    with anyio.fail_after(10):
        async with anyio.create_task_group() as tg:
            await tg.start(actor.run)
            await anyio.sleep(0.4)
            assert len(scans) == 1  # at start; nothing can expire, nothing was written
            actor.mailbox.send_nowait(HistoryBytes("named", b"h2"))
            await anyio.sleep(0.4)
            actor.mailbox.send_nowait(Stop())
    assert len(scans) == 2  # one more within the interval after the write


def counted_scans(monkeypatch) -> list:
    """One entry per pruning pass the actor makes."""
    scans, plan = [], disk.plan
    monkeypatch.setattr(disk, "plan", lambda *a, **kw: scans.append(1) or plan(*a, **kw))
    return scans


async def test_a_models_row_counts_are_measured_once_and_kept_by_persistence(tmp_path, monkeypatch):
    """The GPU thread measures a model's decode row counts at its first load; persistence
    writes them under the cache home; the next start reads them instead of measuring."""
    from semantic.actors import Runtime
    from semantic.runtime.engine.engine import Engine
    from tests.web.live import tiny_loaded

    monkeypatch.setenv("SEMANTIC_HOME", str(tmp_path / "home"))
    calls = []
    measure = Engine.calibrate
    monkeypatch.setattr(Engine, "calibrate", lambda self, *a, **k: calls.append(1) or measure(self, *a, **k))
    loaded = tiny_loaded()
    async with Runtime.open(loaded, tmp_path / "agents") as rt:
        first = rt.row_counts
    (kept,) = (tmp_path / "home" / "row-counts").iterdir()
    assert len(calls) == 1 and first["counts"] in first["classes"]
    async with Runtime.open(loaded, tmp_path / "agents") as rt:
        assert rt.row_counts == first and len(calls) == 1
