"""The persistence actor: writes agents' caches and histories behind the turns.

It is the one writer of every cache and history file, so writes of one file
happen in the order they were made and an older version never lands after a
newer one, and the one reader of caches and histories for the runtime: the
GPU thread never opens a file.  It receives bytes (the GPU actor copies out the blocks of a cache
that are new since what it last handed over, ``CacheBlocks``; agent actors
encode their histories) and writes them on a worker thread, one agent at a
time, so no turn waits on the disk: ``CacheStore.write`` hashes the blocks,
writes those not on disk and then the manifest; histories go through
``write_atomic``.

* **Coalescing**: pending writes are keyed by file; a newer version replaces
  a pending older one in place (latest wins), taking over the older one's
  blocks that it left out; the GPU actor hears of the newer one only.
* **Stale blocks**: a cache version whose left-out blocks are not on disk
  (an earlier write failed, or the files went) is not written; ``CacheWritten``
  says so (``stale``) and the GPU actor hands over the whole cache.
* **Bounded delay**: pending files are written first come, first served, so a
  turn's cache is durable at most (files pending before it) x (one write)
  after the turn ends.  ``Flush`` answers when nothing is pending.
* **Clean**: after writing a cache it tells the GPU actor (``CacheWritten``),
  which marks that version clean -- free to demote without writing.
* **Reads** (``ReadCache``, ``ReadHistory``): a warm cache is read and checked
  into host memory on a worker thread, beside the writes (a turn's load never
  waits for other agents' writes), but after any write or delete of the same
  file queued before it, which it moves to the front of the line; the bytes
  go to the GPU actor (``CacheRead``).  An unusable cache is quarantined
  here, an unreadable history moved aside.  A history whose write failed
  is answered from the bytes waiting to be written again.
* **Imports** (``ImportArchive``): an agent's archive is unpacked in line
  with the writes (``actors.archive.import_agent``: checked whole, then moved
  into place), after a prune that made room for the archive's size under the
  disk budget, or refused (``NoRoom``) when pruning cannot; the bytes it
  placed are counted like a write's.
* **Shutdown**: ``Stop`` writes everything pending, then ends.  A write in
  progress is never abandoned: worker threads are not cancellable, and every
  write is a temp file renamed into place.
* **No room**: a file is written only if its filesystem keeps ``FREE_MARGIN``
  free after it; otherwise (or when the write fails, e.g. ENOSPC) the last
  good file stays, one log line names the agent, and a cache's write
  is reported with ``ok=False`` (the GPU actor keeps that cache dirty in memory
  and hands it over again, if it is still there); a history is tried again
  after the next write that succeeds.
* **Bounded disk** (``runtime.store.disk``): at start, then at most once every
  ``prune_interval_s`` after writes or when a conversation's TTL ends (an
  idle actor sleeps until then), and at once when the next write would take
  the directory over ``disk_budget`` (before it, so it never holds more), it removes anonymous conversations unused for
  ``conversation_ttl_s`` and then the least recently written cache files
  down to 90% of the budget.  Pruning runs between writes, never beside one,
  and leaves alone every file of an agent with a write pending, the files of
  a conversation live in the runtime (``live``: the TTL waits for its actor
  to retire), the cache files of agents whose caches are in memory
  (``hot``) and those being read.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import partial
from pathlib import Path

import anyio

from semantic.runtime.store import disk
from semantic.runtime.engine import row_counts
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import StaleBlocks, merged
from semantic.runtime.store.disk import NoRoom, history_path
from semantic.runtime.errors import SemanticError
from semantic.runtime.files import tree_bytes, write_atomic

from . import archive
from .history import parse_history, read_history
from .messages import (
    CacheBlocks, CacheRead, CacheWritten, Done, Failed, Flush, Forget, HistoryBytes, ImportArchive, KeepRowCounts,
    PersistCommand, ReadCache, ReadHistory, Stop,
)

__all__ = ["PersistenceActor", "history_path"]

log = logging.getLogger("semantic.actors")

PRUNE_TO = 0.9  # over the disk budget, prune down to this fraction of it (so not after every write)


class PersistenceActor:
    def __init__(self, store: CacheStore, histories: Path, *, gpu=None,
                 live: Callable[[], Iterable[str]] = lambda: (), hot: Callable[[], Iterable[str]] = lambda: (),
                 on_pruned: Callable[[list[str]], None] = lambda agent_ids: None, channel=None,
                 disk_budget: int | None = None, conversation_ttl_s: float | None = None,
                 prune_interval_s: float = 60.0, row_counts_home: Path | None = None):
        """``gpu``: the ``GpuActor``, told when a cache version is durable; ``live``:
        the agents whose files pruning leaves alone; ``hot``: the agents whose
        caches are in memory; ``on_pruned``: told (on the event loop) of
        conversations removed whole; ``channel``: the (send, receive) ends of
        this actor's mailbox, when others need the send end before this actor
        exists (default: a new one)."""
        self.store = store
        self.histories = histories
        self.disk_budget = disk_budget  # bytes the cache directory may hold (None: no cap)
        self.conversation_ttl_s = conversation_ttl_s  # anonymous conversations unused this long go (None: never)
        self.prune_interval_s = prune_interval_s
        self.gpu = gpu
        self.row_counts_home = row_counts_home  # where measured decode row counts are kept (None: the cache home)
        self.live, self.hot, self.on_pruned = live, hot, on_pruned
        self.mailbox, self._inbox = channel or anyio.create_memory_object_stream[PersistCommand](math.inf)
        # Owned by run(): file key -> the latest bytes for it, oldest first.
        self._pending: OrderedDict[tuple, CacheBlocks | HistoryBytes] = OrderedDict()
        self._writing: tuple | None = None  # the key being written or deleted
        self._pruning = False
        self._reading: dict[str, int] = {}  # agent id -> reads in progress
        self._settled = anyio.Event()  # set (and replaced) when a write, delete or prune ends
        self._flushes: list = []
        self._unwritten: dict[str, HistoryBytes] = {}  # histories whose write failed: retried after a success
        self.writes = 0  # caches and histories written (for tests and benchmarks)
        self.bytes_written = 0  # bytes those writes put on disk
        self.coalesced = 0  # versions replaced before they were written
        self.failed = 0  # writes refused for lack of space or failed
        self.pruned = 0  # files removed by pruning
        self._disk_bytes = 0  # the directory's total when last counted, plus what writes added since
        self._last_prune = -math.inf  # anyio.current_time() of the last prune
        self._next_prune = -math.inf  # due at start
        self._over_anyway = False  # the last prune could not get under the budget

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with self.mailbox:  # once this actor ends, sending to it raises ClosedResourceError
            async with self._inbox, anyio.create_task_group() as self._readers:
                await self._serve()

    async def _serve(self) -> None:
        stopping = False
        while True:
            stopping = self._take_all() or stopping
            if self._prune_due():
                self._pruning = True
                await self._prune()
                self._settle()
                continue
            if self._pending:
                await self._write_one()
                self._settle()
                continue
            for reply in self._flushes:
                _answer(reply, Done())
            self._flushes.clear()
            if stopping:
                return
            with anyio.move_on_after(self._until_prune()):  # idle: wake when a conversation's TTL ends
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
        if isinstance(message, CacheBlocks):
            key = ("cache", message.agent_id, message.model_id)
            self._queue(key, message)
        elif isinstance(message, ReadCache):
            self._read_soon(message.agent_id, "cache",
                            partial(self.store.read, message.agent_id, message.model_id, message.spec_hash),
                            partial(self._cache_read, message))
        elif isinstance(message, ReadHistory):
            self._read_soon(message.agent_id, "history", partial(self._history, message.agent_id),
                            partial(self._history_read, message))
        elif isinstance(message, HistoryBytes):
            self._unwritten.pop(message.agent_id, None)
            self._queue(("history", message.agent_id), message)
        elif isinstance(message, Forget):  # in line: it must not overtake writes queued before it
            self._pending[("forget", message.agent_id, id(message))] = message
        elif isinstance(message, ImportArchive):  # in line, like a write: pruning makes room for it first
            self._pending[("import", message.agent_id, id(message))] = message
        elif isinstance(message, Flush):
            self._flushes.append(message.reply)
        elif isinstance(message, KeepRowCounts):  # a file of its own, outside the cache directory
            self._readers.start_soon(self._keep_row_counts, message)
        elif isinstance(message, Stop):
            return True
        else:
            raise AssertionError(f"unknown persistence message {message!r}")
        return False

    def _queue(self, key: tuple, item: CacheBlocks | HistoryBytes) -> None:
        old = self._pending.get(key)
        if old is not None:
            self.coalesced += 1
            if isinstance(old, CacheBlocks):
                item = replace(item, update=merged(old.update, item.update))
        self._pending[key] = item  # replacing keeps the file's place in line

    def _settle(self) -> None:
        self._writing, self._pruning = None, False
        self._settled.set()
        self._settled = anyio.Event()

    def _read_soon(self, agent_id: str, kind: str, read, deliver) -> None:
        """Run ``read()`` on a worker thread after the writes and deletes of the
        agent's ``kind`` of file queued before it (moved to the front of the line),
        then ``deliver`` its value (or exception) on the loop."""
        ahead = [k for k in self._pending if self._holds_up(k, agent_id, kind)]
        for key in reversed(ahead):
            self._pending.move_to_end(key, last=False)  # first in line, in their order
        self._readers.start_soon(self._read, agent_id, kind, read, deliver)

    @staticmethod
    def _holds_up(key: tuple | None, agent_id: str, kind: str) -> bool:
        return key is not None and key[0] in (kind, "forget") and key[1] == agent_id

    async def _read(self, agent_id: str, kind: str, read, deliver) -> None:
        while self._pruning or any(self._holds_up(k, agent_id, kind) for k in (self._writing, *self._pending)):
            await self._settled.wait()
        self._reading[agent_id] = self._reading.get(agent_id, 0) + 1  # pruning leaves its files alone
        try:
            value = await anyio.to_thread.run_sync(_in_background, read)
        except Exception as e:
            value = e
        finally:
            self._reading[agent_id] -= 1
            if not self._reading[agent_id]:
                del self._reading[agent_id]
        deliver(value)

    def _cache_read(self, message: ReadCache, cache) -> None:
        if isinstance(cache, Exception):  # an invalid id (never admitted), or a bug
            log.error("could not read the cache of agent %r: %r; it starts cold", message.agent_id, cache)
            cache = None
        if self.gpu is not None:
            self.gpu.submit(CacheRead(message.agent_id, message.model_id, cache))

    def _history(self, agent_id: str):
        """(worker thread) The history; one whose write failed is the bytes waiting to be written again."""
        unwritten = self._unwritten.get(agent_id)
        return parse_history(unwritten.data, agent_id) if unwritten is not None \
            else read_history(self.histories, agent_id)

    @staticmethod
    def _history_read(message: ReadHistory, history) -> None:
        if isinstance(history, Exception):
            _answer(message.reply, Failed(SemanticError(f"cannot read the history of agent {message.agent_id!r}: "
                                                        f"{history}")))
        else:
            _answer(message.reply, Done(history))

    async def _write_one(self) -> None:
        key, item = self._pending.popitem(last=False)
        self._writing = key
        if isinstance(item, Forget):
            await self._forget(item)
            return
        if isinstance(item, ImportArchive):
            await self._import(item)
            return
        ok, stale = True, False
        what = f"cache of agent {item.agent_id!r} for {item.model_id}" if isinstance(item, CacheBlocks) \
            else f"history of agent {item.agent_id!r}"
        try:
            self._disk_bytes += await anyio.to_thread.run_sync(_in_background, self._write, item)
            self.writes += 1
            self._retry_histories()
        except StaleBlocks as e:
            ok = False
            stale = True
            log.info("not writing the %s: %s; it will be handed over whole", what, e)
        except NoRoom as e:
            ok = False
            self.failed += 1
            log.warning("not writing the %s: %s on the cache directory's filesystem; the last good file stays, "
                        "the new version stays in memory", what, e.strerror)
        except OSError as e:
            ok = False
            self.failed += 1
            log.error("could not write the %s: %s; the last good file stays", what, e)
        if not ok and isinstance(item, HistoryBytes):
            self._unwritten[item.agent_id] = item
        self._next_prune = min(self._next_prune, self._last_prune + self.prune_interval_s)
        if isinstance(item, CacheBlocks) and self.gpu is not None:
            self.gpu.submit(CacheWritten(item.agent_id, item.version, ok, stale))

    async def _keep_row_counts(self, message: KeepRowCounts) -> None:
        try:
            await anyio.to_thread.run_sync(_in_background, row_counts.keep, message.key, message.counts,
                                           self.row_counts_home)
        except OSError as e:
            log.warning("could not keep the decode row counts measured (measured again at the next start): %s", e)

    def _retry_histories(self) -> None:
        """A write succeeded, so there may be room again: queue the histories that failed."""
        for agent_id, item in self._unwritten.items():
            self._pending.setdefault(("history", agent_id), item)
        self._unwritten.clear()

    def _write(self, item: CacheBlocks | HistoryBytes) -> int:
        """(worker thread) Write one cache or history if its filesystem has room; return
        how much the directory grew."""
        if isinstance(item, CacheBlocks):
            path = self.store.agent_dir(item.agent_id, item.model_id)
            size = item.update.nbytes
        else:
            path = history_path(self.histories, item.agent_id)
            size = len(item.data)
        old = tree_bytes(path)
        disk.check_room(self.store.root, size)
        if isinstance(item, CacheBlocks):
            self.bytes_written += self.store.write(item.update)
        else:
            self.histories.mkdir(parents=True, exist_ok=True)
            write_atomic(path, item.data)
            self.bytes_written += len(item.data)
        return tree_bytes(path) - old

    # -- bounded disk --

    def _prune_due(self) -> bool:
        if self.disk_budget is None and self.conversation_ttl_s is None:
            return False
        return (self._over() and not self._over_anyway) or anyio.current_time() >= self._next_prune

    def _incoming(self) -> int:
        """Bytes the next write brings (checked before it, not after: the directory
        never holds more than the budget)."""
        item = next(iter(self._pending.values()), None)
        if isinstance(item, CacheBlocks):
            return item.update.nbytes
        if isinstance(item, ImportArchive):
            return item.size  # what its files can take at most: an archive holds no sparse members
        return len(item.data) if isinstance(item, HistoryBytes) else 0

    def _over(self) -> bool:
        return self.disk_budget is not None and self._disk_bytes + self._incoming() > self.disk_budget

    def _until_prune(self) -> float:
        if self.disk_budget is None and self.conversation_ttl_s is None:
            return math.inf
        return max(0.0, self._next_prune - anyio.current_time())

    async def _prune(self) -> None:
        """Apply the disk budget and the conversations' TTL (``runtime.store.disk.plan``)."""
        protected = frozenset({*(k[1] for k in self._pending), *self._unwritten, *self._reading})
        live = frozenset(self.live())
        budget = self.disk_budget
        try:
            plan, removed = await anyio.to_thread.run_sync(
                _in_background, self._prune_files, protected, live, frozenset(self.hot()), self._incoming())
        except OSError as e:
            log.error("could not prune the cache directory %s: %s", self.store.root, e)
            plan, removed = None, []
        now = anyio.current_time()
        self._last_prune = now
        self._next_prune = now + self.prune_interval_s
        if plan is None:
            self._over_anyway = True  # not again before the interval
            return
        # Until a write, only a conversation's TTL can end: wake for the first (never sooner than the interval).
        if plan.next_expiry is None:
            self._next_prune = math.inf
        else:
            self._next_prune = now + max(self.prune_interval_s, plan.next_expiry - time.time())
        self.pruned += len(removed)
        self._disk_bytes = plan.total - sum(f.bytes for f in removed)
        if removed:
            log.info("pruned %d file(s), %s, from %s (%d conversation(s) unused for too long); it holds %s now",
                     len(removed), disk.human_bytes(sum(f.bytes for f in removed)), self.store.root,
                     len(plan.agents_removed), disk.human_bytes(self._disk_bytes))
        over = self._over()  # still: the rest is protected; write anyway until the next prune is due
        if over and not self._over_anyway:
            log.warning("the cache directory %s holds %s, over its disk budget of %s: the rest is histories, "
                        "files of agents in use and files pruning never removes", self.store.root,
                        disk.human_bytes(self._disk_bytes), disk.human_bytes(budget))
        self._over_anyway = over
        if plan.agents_removed:
            try:
                self.on_pruned(plan.agents_removed)
            except Exception:  # a listener's bug must not stop the writer
                log.exception("a listener for pruned conversations failed")

    def _prune_files(self, protected: frozenset[str], live: frozenset[str], hot: frozenset[str],
                     incoming: int) -> tuple[disk.Plan, list[disk.DiskFile]]:
        """(worker thread) Scan the directory, plan (leaving room for ``incoming`` bytes), remove."""
        files, _ = disk.scan(self.store.root, self.histories)
        budget = target = None
        if self.disk_budget is not None:
            budget, target = self.disk_budget - incoming, int(self.disk_budget * PRUNE_TO) - incoming
        plan = disk.plan(files, budget=budget, target=target,
                         conversation_ttl=self.conversation_ttl_s, protected=protected, live=live, hot=hot)
        return plan, disk.apply(plan)

    async def _import(self, message: ImportArchive) -> None:
        """Unpack an archive into the directory (``actors.archive.import_agent``),
        after the prune that made room for it; refused (``NoRoom``) if it could
        still take the directory over its budget."""
        budget = self.disk_budget
        if budget is not None and self._disk_bytes + message.size > budget:
            _answer(message.reply, Failed(NoRoom(errno.ENOSPC, (
                f"the archive ({disk.human_bytes(message.size)}) does not fit in the disk budget of "
                f"{disk.human_bytes(budget)}, which holds {disk.human_bytes(self._disk_bytes)} that pruning "
                "cannot remove"))))
            return
        try:
            summary = await anyio.to_thread.run_sync(_in_background, partial(
                archive.import_agent, self.store.root, message.archive, agent_id=message.agent_id))
        except (SemanticError, OSError) as e:
            _answer(message.reply, Failed(e))
            return
        self._disk_bytes += summary.bytes
        self._next_prune = min(self._next_prune, self._last_prune + self.prune_interval_s)
        _answer(message.reply, Done(summary))

    async def _forget(self, message: Forget) -> None:
        """Drop the agent's pending writes and delete its files (every model's cache, its history)."""
        agent_id = message.agent_id
        self._unwritten.pop(agent_id, None)
        for key in [k for k in self._pending if k[1] == agent_id and k[0] != "forget"]:
            del self._pending[key]
        try:
            await anyio.to_thread.run_sync(_in_background, disk.remove_agent, self.store, self.histories, agent_id)
        except OSError as e:
            _answer(message.reply, Failed(SemanticError(f"could not delete the files of agent {agent_id}: {e}")))
        else:
            _answer(message.reply, Done())


_BACKGROUND_NICENESS = 10
_backgrounded = threading.local()


def _in_background(fn, *args):
    """(worker thread) Run ``fn(*args)`` at a lower CPU priority than the GPU thread's
    compute, so hashing and copying files never slow decoding where cores are few
    (Linux, where a thread has its own niceness; elsewhere as is)."""
    if not getattr(_backgrounded, "done", False):
        _backgrounded.done = True
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICENESS)
        except (AttributeError, OSError):  # no per-thread priority here
            pass
    return fn(*args)


def _answer(reply, item) -> None:
    try:
        reply.send_nowait(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    reply.close()
