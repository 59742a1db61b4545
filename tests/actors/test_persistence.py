"""The persistence actor without a model: latest version wins, every ticket is
settled, deletes wait for earlier writes, flush and stop leave nothing pending."""

from __future__ import annotations

import anyio
import pytest

from actors.agent import request
from actors.messages import CacheBytes, CacheWritten, Done, Flush, Forget, HistoryBytes, Stop, WriteTicket
from actors.persistence import PersistenceActor, history_path
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
