"""The persistence actor: writes agents' caches and histories behind the turns.

It is the one writer of every cache and history file, so writes of one file
happen in the order they were made and an older version never lands after a
newer one.  It receives bytes (the GPU actor encodes caches on its own thread;
agent actors encode their histories) and writes them with
``write_atomic`` on a worker thread, one file at a time, so no turn waits on
the disk.

* **Coalescing**: pending writes are keyed by file; a newer version replaces
  a pending older one in place (latest wins), and the older one's ticket is
  settled when the newer is written.
* **Bounded delay**: pending files are written first come, first served, so a
  turn's cache is durable at most (files pending before it) x (one write)
  after the turn ends.  ``Flush`` answers when nothing is pending.
* **Clean**: after writing a cache it tells the GPU actor (``CacheWritten``),
  which marks that version clean -- free to demote without writing.
* **Shutdown**: ``Stop`` writes everything pending, then ends.  A write in
  progress is never abandoned: worker threads are not cancellable, and every
  write is a temp file renamed into place.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from pathlib import Path

import anyio

from runtime.cache_file import CacheStore, write_atomic
from runtime.errors import SemanticError

from .messages import CacheBytes, CacheWritten, Done, Failed, Flush, Forget, HistoryBytes, PersistCommand, Stop, WriteTicket

__all__ = ["PersistenceActor", "history_path"]

log = logging.getLogger("semantic.actors")


def history_path(histories: Path, agent_id: str) -> Path:
    """Where an agent's history lives (``agent_id`` already validated)."""
    return histories / f"{agent_id}.json"


class PersistenceActor:
    def __init__(self, store: CacheStore, histories: Path):
        self.store = store
        self.histories = histories
        self.gpu = None  # the GpuActor, told when a cache version is durable (set by the runtime)
        self.mailbox, self._inbox = anyio.create_memory_object_stream[PersistCommand](math.inf)
        # Owned by run(): file key -> the latest bytes for it, oldest first.
        self._pending: OrderedDict[tuple, CacheBytes | HistoryBytes] = OrderedDict()
        self._superseded: dict[tuple, list[WriteTicket]] = {}
        self._flushes: list = []
        self.writes = 0  # files written (for tests and benchmarks)
        self.coalesced = 0  # versions replaced before they were written

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with self.mailbox:  # once this actor ends, sending to it raises ClosedResourceError
            async with self._inbox:
                await self._serve()

    async def _serve(self) -> None:
        stopping = False
        while True:
            stopping = self._take_all() or stopping
            if self._pending:
                await self._write_one()
                continue
            for reply in self._flushes:
                _answer(reply, Done())
            self._flushes.clear()
            if stopping:
                return
            try:
                stopping = self._note(await self._inbox.receive())
            except anyio.EndOfStream:
                stopping = True

    def _take_all(self) -> bool:
        """Take every message already in the mailbox; True once told to stop."""
        stopping = False
        while True:
            try:
                message = self._inbox.receive_nowait()
            except anyio.WouldBlock:
                return stopping
            except anyio.EndOfStream:
                return True
            stopping = self._note(message) or stopping

    def _note(self, message: PersistCommand) -> bool:
        if isinstance(message, CacheBytes):
            key = ("cache", message.agent_id, message.model_id)
            self._queue(key, message)
        elif isinstance(message, HistoryBytes):
            self._queue(("history", message.agent_id), message)
        elif isinstance(message, Forget):  # in line: it must not overtake writes queued before it
            self._pending[("forget", message.agent_id, id(message))] = message
        elif isinstance(message, Flush):
            self._flushes.append(message.reply)
        elif isinstance(message, Stop):
            return True
        else:
            raise AssertionError(f"unknown persistence message {message!r}")
        return False

    def _queue(self, key: tuple, item: CacheBytes | HistoryBytes) -> None:
        old = self._pending.get(key)
        if old is not None:
            self.coalesced += 1
            if isinstance(old, CacheBytes):
                self._superseded.setdefault(key, []).append(old.ticket)
        self._pending[key] = item  # replacing keeps the file's place in line

    async def _write_one(self) -> None:
        key, item = self._pending.popitem(last=False)
        if isinstance(item, Forget):
            await self._forget(item)
            return
        ok = True
        try:
            if isinstance(item, CacheBytes):
                await anyio.to_thread.run_sync(self.store.write_encoded, item.agent_id, item.model_id, item.data)
            else:
                await anyio.to_thread.run_sync(self._write_history, item.agent_id, item.data)
            self.writes += 1
        except OSError as e:
            ok = False
            log.error("could not write %s of agent %s: %s", key[0], item.agent_id, e)
        if isinstance(item, CacheBytes):
            for ticket in (*self._superseded.pop(key, ()), item.ticket):
                ticket.ok = ok
                ticket.done.set()
            if self.gpu is not None:
                self.gpu.submit(CacheWritten(item.agent_id, item.version))

    def _write_history(self, agent_id: str, data: bytes) -> None:
        self.histories.mkdir(parents=True, exist_ok=True)
        write_atomic(history_path(self.histories, agent_id), data)

    async def _forget(self, message: Forget) -> None:
        """Drop the agent's pending writes and delete its files (every model's cache, its history)."""
        agent_id = message.agent_id
        for key in [k for k in self._pending if k[1] == agent_id and k[0] != "forget"]:
            item = self._pending.pop(key)
            for ticket in (*self._superseded.pop(key, ()), *([item.ticket] if isinstance(item, CacheBytes) else ())):
                ticket.done.set()  # ok stays False: that version will never be on disk

        def delete() -> None:
            self.store.delete(agent_id)
            history_path(self.histories, agent_id).unlink(missing_ok=True)

        try:
            await anyio.to_thread.run_sync(delete)
        except OSError as e:
            _answer(message.reply, Failed(SemanticError(f"could not delete the files of agent {agent_id}: {e}")))
        else:
            _answer(message.reply, Done())


def _answer(reply, item) -> None:
    try:
        reply.send_nowait(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    reply.close()
