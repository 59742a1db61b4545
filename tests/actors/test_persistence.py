"""The persistence actor without a model: latest version wins, every ticket is
settled, deletes wait for earlier writes, flush and stop leave nothing pending;
a full disk keeps the last good files; the disk budget and the conversations'
TTL are kept."""

from __future__ import annotations

import errno
import os
import shutil
import time
from collections import namedtuple

import anyio
import pytest

from actors.agent import request
from actors.messages import CacheBytes, CacheWritten, Done, Flush, Forget, HistoryBytes, Stop, WriteTicket
from actors.persistence import PersistenceActor, history_path
from runtime import cache_file, disk
from runtime.cache_file import CacheStore

pytestmark = pytest.mark.anyio


class FakeGpu:
    def __init__(self):
        self.commands = []

    def submit(self, command):
        self.commands.append(command)


def actor_in(tmp_path) -> PersistenceActor:
    actor = PersistenceActor(CacheStore(tmp_path), tmp_path / "histories")
    actor.gpu = FakeGpu()
    return actor


async def test_latest_version_wins_and_every_ticket_is_settled(tmp_path):
    actor = actor_in(tmp_path)
    tickets = [WriteTicket() for _ in range(4)]
    for version, ticket in enumerate(tickets[:3], 1):  # queued before the actor runs: coalesced
        actor.mailbox.send_nowait(CacheBytes("a", "m", version, f"a{version}".encode(), ticket))
    actor.mailbox.send_nowait(CacheBytes("b", "m", 4, b"b4", tickets[3]))
    actor.mailbox.send_nowait(HistoryBytes("a", b"h1"))
    actor.mailbox.send_nowait(HistoryBytes("a", b"h2"))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    store = actor.store
    assert store.path("a", "m").read_bytes() == b"a3" and store.path("b", "m").read_bytes() == b"b4"
    assert history_path(actor.histories, "a").read_bytes() == b"h2"
    assert all(t.done.is_set() and t.ok for t in tickets)
    assert (actor.writes, actor.coalesced) == (3, 3)
    assert actor.gpu.commands == [CacheWritten("a", 3), CacheWritten("b", 4)]  # written in arrival order
    assert not list(tmp_path.rglob(".tmp-*"))


async def test_forget_deletes_after_earlier_writes_and_flush_waits(tmp_path):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        late = WriteTicket()
        actor.mailbox.send_nowait(CacheBytes("a", "m", 1, b"a1", WriteTicket()))
        actor.mailbox.send_nowait(HistoryBytes("a", b"h"))
        actor.mailbox.send_nowait(CacheBytes("b", "m", 2, b"b2", WriteTicket()))
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Forget("a", r))), Done)
        assert not actor.store.path("a", "m").exists() and not history_path(actor.histories, "a").exists()
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Flush(r))), Done)
        assert actor.store.path("b", "m").read_bytes() == b"b2"
        actor.mailbox.send_nowait(CacheBytes("c", "m", 3, b"c3", late))
        actor.mailbox.send_nowait(Stop())
    assert late.done.is_set() and late.ok  # stop writes what is pending first


# -- a full disk ---------------------------------------------------------------------------

Usage = namedtuple("Usage", "total used free")


def no_room(monkeypatch, free: int = 10 << 20) -> None:
    """The filesystem reports ``free`` bytes free (less than the margin a write must leave)."""
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(100 << 30, 100 << 30, free))


async def test_a_write_without_room_keeps_the_last_good_file(tmp_path, monkeypatch, caplog):
    actor = actor_in(tmp_path)
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        actor.mailbox.send_nowait(CacheBytes("alice", "m", 1, b"good", WriteTicket()))
        actor.mailbox.send_nowait(HistoryBytes("alice", b"h1"))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        no_room(monkeypatch)
        ticket = WriteTicket()
        actor.mailbox.send_nowait(CacheBytes("alice", "m", 2, b"newer", ticket))
        actor.mailbox.send_nowait(HistoryBytes("alice", b"h2"))
        assert isinstance(await request(lambda r: actor.mailbox.send_nowait(Flush(r))), Done)
        assert ticket.done.is_set() and not ticket.ok  # settled: the GPU actor keeps the cache dirty
        assert actor.gpu.commands[-1] == CacheWritten("alice", 2)
        assert actor.store.path("alice", "m").read_bytes() == b"good"
        assert history_path(actor.histories, "alice").read_bytes() == b"h1"
        warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
        assert len(warnings) == 2 and all("'alice'" in w and "10.0 MiB free" in w for w in warnings), warnings
        assert actor.failed == 2
        # room again: the next write that succeeds brings the refused history along
        monkeypatch.undo()
        actor.mailbox.send_nowait(CacheBytes("bo", "m", 3, b"b", WriteTicket()))
        await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
        assert history_path(actor.histories, "alice").read_bytes() == b"h2"
        actor.mailbox.send_nowait(Stop())
    assert not list(tmp_path.rglob(".tmp-*"))


async def test_a_write_that_fails_midway_removes_its_temp_file(tmp_path, monkeypatch, caplog):
    actor = actor_in(tmp_path)
    actor.mailbox.send_nowait(CacheBytes("alice", "m", 1, b"good", WriteTicket()))
    actor.mailbox.send_nowait(Stop())
    await actor.run()

    def disk_full(fd):
        assert list(tmp_path.rglob(".tmp-*")), "the temp file holds the bytes when the disk fills"
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(cache_file, "_fsync", disk_full)
    actor = actor_in(tmp_path)
    ticket = WriteTicket()
    actor.mailbox.send_nowait(CacheBytes("alice", "m", 2, b"x" * 100_000, ticket))
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert ticket.done.is_set() and not ticket.ok
    assert actor.store.path("alice", "m").read_bytes() == b"good"
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
        aged(actor.store.path(agent, "m"), b"x" * 1000, days)
        aged(history_path(actor.histories, agent), b"h" * 10, 9)
    actor.disk_budget = 2000  # 3030 bytes: pruned to 90% of the budget, 1800
    actor.mailbox.send_nowait(Stop())
    await actor.run()
    assert [p.stem for p in sorted(actor.store.path("x", "m").parent.glob("*"))] == ["c"]
    assert len(list(actor.histories.iterdir())) == 3  # named agents' histories always stay
    assert actor.pruned == 2 and actor.store.disk_bytes() <= 1800


async def test_writes_over_the_budget_prune_at_once(tmp_path):
    actor = actor_in(tmp_path)
    actor.disk_budget = 1000
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        for i, agent in enumerate("abcd"):
            actor.mailbox.send_nowait(CacheBytes(agent, "m", i, b"x" * 400, WriteTicket()))
            await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
            assert actor.store.disk_bytes() <= 1000
        actor.mailbox.send_nowait(Stop())
    left = sorted(p.stem for p in actor.store.path("x", "m").parent.glob("*"))
    assert left == ["c", "d"] and actor.pruned == 2


async def test_a_write_that_cannot_be_made_room_for_is_written_anyway_without_spinning(tmp_path):
    """Every file is protected (its cache is hot): pruning cannot make room, so the
    write goes ahead over the budget (and says so) instead of pruning forever."""
    actor = actor_in(tmp_path)
    actor.disk_budget = 1000
    actor.hot = lambda: {"a", "b"}
    async with anyio.create_task_group() as tg:
        await tg.start(actor.run)
        with anyio.fail_after(10):
            for i, agent in enumerate("ab"):
                ticket = WriteTicket()
                actor.mailbox.send_nowait(CacheBytes(agent, "m", i, b"x" * 600, ticket))
                await request(lambda r: actor.mailbox.send_nowait(Flush(r)))
                assert ticket.ok
        actor.mailbox.send_nowait(Stop())
    assert actor.store.disk_bytes() == 1200 and actor.pruned == 0


async def test_old_conversations_go_whole_but_not_named_live_or_pending_ones(tmp_path):
    actor = actor_in(tmp_path)
    for agent in ("conv-old", "conv-live", "conv-pending", "named"):
        aged(actor.store.path(agent, "m"), b"c", 10)
        aged(history_path(actor.histories, agent), b"h", 10)
    aged(actor.store.path("conv-young", "m"), b"c", 1)
    actor.conversation_ttl_s = 7 * DAY
    actor.live = lambda: {"conv-live"}
    told = []
    actor.on_pruned = told.append
    actor.mailbox.send_nowait(HistoryBytes("conv-pending", b"h2"))  # a write about to replace its files
    actor.mailbox.send_nowait(Stop())
    with anyio.fail_after(10):  # conv-live is past its TTL: the actor must not spin on it
        await actor.run()
    assert told == [["conv-old"]]
    assert not actor.store.path("conv-old", "m").exists() and not history_path(actor.histories, "conv-old").exists()
    for agent in ("conv-live", "conv-pending", "named"):
        assert actor.store.path(agent, "m").exists() and history_path(actor.histories, agent).exists(), agent
    assert history_path(actor.histories, "conv-pending").read_bytes() == b"h2"
    assert actor.store.path("conv-young", "m").exists()


async def test_an_idle_actor_checks_the_ttl_now_and_then_without_spinning(tmp_path, monkeypatch):
    actor = actor_in(tmp_path)
    actor.conversation_ttl_s, actor.prune_interval_s = 7 * DAY, 0.1
    aged(history_path(actor.histories, "conv-kept"), b"h", 30)
    actor.live = lambda: {"conv-kept"}  # expired but live: it must not make the actor spin
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
