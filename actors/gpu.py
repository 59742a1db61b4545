"""The GPU actor: the only code that touches MLX, on one thread it starts and joins.

Two halves, one per thread:

* ``GpuActor`` lives on the event loop.  Others call ``submit`` (any command)
  and ``cancel``; both only put a typed command on a thread-safe queue, so
  they never wait, and ``cancel`` is safe even from a finaliser.  Its ``run``
  task starts the thread, waits (without blocking the loop) until it ends, and
  joins it.
* ``GpuThread`` (``actors.gpu_thread``) runs on that thread: the model, the
  engine and the agents' hot caches, and nothing else -- between model loads
  it opens no file and never waits for the loop or the disk (a load by name
  reads the weights; its decode row counts come from the runtime, which read
  them at start, and a new measurement goes to persistence to keep).

Posting back: the thread puts ``(sink, item)`` on an outbox queue and, if no
wake-up is pending, schedules ``_pump`` on the loop with the loop's own
thread-safe callback (trio's ``TrioToken.run_sync_soon``, asyncio's
``call_soon_threadsafe``), which queues it and returns: the thread never
waits for the loop.  (anyio's ``BlockingPortal.start_task_soon`` waits until
the loop has taken the task, a visible share of a lone agent's decode step:
docs/benchmarks.md, "Figures that were in the code's comments".)
``_pump`` drains the outbox in order with ``send_nowait`` on unbounded
streams, so one pump call delivers everything posted so far, in the order it
was posted.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

import anyio
import mlx.core as mx
import sniffio

from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.engine.engine_options import EngineOptions
from semantic.runtime.errors import SemanticError
from semantic.runtime.model.models import LoadedModel

from .errors import RuntimeClosed
from .gpu_thread import Exited, GpuThread, Ready
from .lockstep import Lockstep, watch
from .messages import (
    BeginTurn, CacheBlocks, CancelTurn, DropCache, Failed, FlushCaches, ForkCache, GpuCommand, GpuDown, StopGpu, SwapModel,
    TurnFailed,
)
from .registry import ModelRegistry
from .snapshots import BatchSnapshot, HotSnapshot, SequenceInfo

__all__ = ["BatchSnapshot", "GpuActor", "HotSnapshot", "SequenceInfo", "follow"]

log = logging.getLogger("semantic.actors")


class GpuActor:
    """The event-loop half: a mailbox, a health flag and the thread's lifetime."""

    def __init__(
        self,
        model: str | LoadedModel,
        store: CacheStore,
        budget_bytes: int | None,
        persistence,  # MemoryObjectSendStream[PersistCommand]
        eviction=None,  # MemoryObjectSendStream[EvictCommand] | None
        *,
        options: EngineOptions = EngineOptions(),
        model_idle_s: float | None = None,
        catalogue: dict[str, str | LoadedModel] | None = None,
        group: mx.distributed.Group | None = None,
        rank_timeout_s: float = 120.0,
        row_counts: dict | None = None,
    ):
        self.inbox: queue.SimpleQueue[GpuCommand] = queue.SimpleQueue()  # loop -> thread
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # thread -> loop: (sink | None, item, final)
        self._wake_pending = False
        self._call_soon: Callable[[Callable[[], object]], object] | None = None  # the loop's, while it runs
        self._accepting = False
        self.error: SemanticError | None = None  # set when the GPU actor failed
        self.rank_timeout_s = rank_timeout_s  # sharded: how long one GPU input may wait for the other ranks
        self._thread = GpuThread(
            self, model, ModelRegistry(store, budget_bytes, options, catalogue, group, row_counts),
            persistence, eviction, model_idle_s, lockstep=None if group is None else Lockstep(group),
        )

    @property
    def hot(self) -> HotSnapshot:
        """The hot caches, as the GPU thread last published them (a snapshot)."""
        return self._thread.publisher.latest_hot

    @property
    def batch(self) -> BatchSnapshot:
        """The running batch, as the GPU thread last published it (a snapshot)."""
        return self._thread.publisher.latest_batch

    # -- for other actors (event loop thread; none of these wait) ----------

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def steps(self) -> int:
        """Engine steps (one prefill chunk + one decode step) run so far."""
        return self._thread.steps

    @property
    def catalogue(self) -> dict[str, str | LoadedModel]:
        """The models turns may ask for by name (never changed after start)."""
        return self._thread.registry.catalogue

    @property
    def model_name(self) -> str | None:
        return self._thread.registry.name

    @property
    def loaded(self):
        """The loaded ``LoadedModel`` (None while unloaded); read its settings, never run it here."""
        return self._thread.registry.loaded

    @property
    def row_counts(self):
        """The loaded engine's ``RowCounts`` (None while unloaded); immutable, read across threads."""
        engine = self._thread.registry.engine
        return None if engine is None else engine.row_counts

    @property
    def speculation(self) -> bool | None:
        """Whether the loaded engine verifies drafts (None while unloaded)."""
        engine = self._thread.registry.engine
        return None if engine is None else engine.speculation

    def stats(self) -> dict:
        """A snapshot for tests and benchmarks (read across threads: approximate)."""
        t, s = self._thread, self._thread.scheduler
        engine = t.registry.engine
        return {
            "steps": t.steps,
            "decoding": engine.decoding if engine else 0,
            "prefilling": engine.prefilling if engine else 0,
            "turns": len(s.turns),
            "waiting": len(s.waiting),
            "loaded": t.registry.loaded is not None,
            "preemptions": s.preemptions,
            "mlx_active_bytes": mx.get_active_memory(),  # allocator counters: safe to read from any thread
            "mlx_peak_bytes": mx.get_peak_memory(),
        }

    def submit(self, command: GpuCommand) -> None:
        """Queue a command for the GPU thread.  When the actor is stopped or
        failed, a request is answered at once with the reason instead."""
        if not self._accepting or (self.error is not None and isinstance(command, (BeginTurn, ForkCache, SwapModel))):
            self._refuse(command)  # a failed actor still serves what needs no model (flush, demote, delete)
        else:
            self.inbox.put(command)

    def call_soon(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on the event loop soon; callable from any thread, never blocks."""
        if self._call_soon is None:  # never ran: nothing to deliver to
            return
        try:
            self._call_soon(fn)
        except RuntimeError:  # its loop has ended: nothing left to deliver to
            pass

    def cancel(self, turn_id: int) -> None:
        """Cancel a turn (wherever it is) before the next engine step.  Never
        blocks, safe from finalisers (``SimpleQueue.put`` is reentrant)."""
        self.inbox.put(CancelTurn(turn_id, self._thread.steps))

    # -- the actor's task ----------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Start the thread; report ready once the model is loaded (or raise its
        ``ModelError``); return when the thread has ended and been joined."""
        self._ready, self._exited = anyio.Event(), anyio.Event()
        self._load_error: SemanticError | None = None
        self._call_soon = _loop_call_soon()
        thread = threading.Thread(target=self._thread.main, name="semantic-gpu")
        thread.start()
        if self._thread.lockstep is not None:
            watch(self._thread, self.rank_timeout_s)
        try:
            await self._ready.wait()
            if self._load_error is None:
                self._accepting = True
                task_status.started()
                await self._exited.wait()
        finally:
            self._accepting = False
            with anyio.CancelScope(shield=True):
                self.inbox.put(StopGpu())
                await anyio.to_thread.run_sync(thread.join)
                self._pump()
                self._refuse_leftovers()
        if self._load_error is not None:
            raise self._load_error

    async def stop(self) -> None:
        """Cancel every turn, hand every dirty cache to persistence, end the thread."""
        self._accepting = False
        self.inbox.put(StopGpu())
        await self._exited.wait()

    # -- thread -> loop ------------------------------------------------------

    def post(self, sink, item, final: bool = False) -> None:
        """(GPU thread) Queue ``item`` for ``sink`` (None: this actor) and wake the loop."""
        self._outbox.put((sink, item, final))
        if not self._wake_pending:
            self._wake_pending = True
            self.call_soon(self._pump)  # once the loop has ended, run() pumps once more after join

    def _pump(self) -> None:
        """(Event loop) Deliver everything posted so far, in order."""
        self._wake_pending = False  # before draining: a later post schedules another pump
        while True:
            try:
                sink, item, final = self._outbox.get_nowait()
            except queue.Empty:
                return
            if sink is None:
                self._own(item)
                continue
            try:
                sink.send_nowait(item)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                pass  # the requester is gone (a consumer that stopped, a stopped actor)
            except anyio.WouldBlock:
                log.error("dropped %s: a reply stream is full (reply streams must be unbounded)", type(item).__name__)
            if final:
                sink.close()

    def _own(self, item) -> None:
        if isinstance(item, Ready):
            self._load_error = item.error
            self._ready.set()
        elif isinstance(item, GpuDown):
            self.error = item.error
        elif isinstance(item, Exited):
            self._ready.set()
            self._exited.set()
        else:  # a callback must not raise: trio would end the whole run
            log.error("unknown GPU actor event %r", item)

    def _refuse(self, command) -> None:
        error = self.error or RuntimeClosed("the runtime is closed")
        if isinstance(command, BeginTurn):
            _send_final(command.end, TurnFailed(command.turn_id, error))
        elif isinstance(command, (ForkCache, DropCache, FlushCaches, SwapModel)):
            _send_final(command.reply, Failed(error))

    def _refuse_leftovers(self) -> None:
        while True:
            try:
                self._refuse(self.inbox.get_nowait())
            except queue.Empty:
                return


def _loop_call_soon() -> Callable[[Callable[[], object]], object]:
    """The running event loop's way to run a callback from any thread without
    waiting for the loop; raises ``RuntimeError`` once the loop has ended."""
    if sniffio.current_async_library() == "trio":
        import trio

        return trio.lowlevel.current_trio_token().run_sync_soon
    return asyncio.get_running_loop().call_soon_threadsafe


def _send_final(sink, item) -> None:
    try:
        sink.send_nowait(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    sink.close()


class _Follower:
    """What a follower's ``GpuThread`` takes for its actor: no inbox, no event loop."""

    inbox = None
    hot = batch = None

    def __init__(self, store: CacheStore):
        self.store = store

    def post(self, sink, item, final: bool = False) -> None:
        if isinstance(item, CacheBlocks):  # this rank's shard: written now, in order
            try:
                self.store.write(item.update)
            except (OSError, SemanticError, ValueError) as e:  # the agent then starts cold on every rank
                log.warning("could not write this rank's shard of %s's cache: %s", item.agent_id, e)


def follow(group: mx.distributed.Group, model, catalogue: dict, store: CacheStore, budget_bytes: int | None,
           options: EngineOptions) -> None:
    """(Ranks other than 0) Serve rank 0's GPU inputs until it stops; raises when
    this rank cannot keep up with rank 0 (its process should then end)."""
    registry = ModelRegistry(store, budget_bytes, options, catalogue, group=group)
    GpuThread(_Follower(store), model, registry, persistence=None, eviction=None, model_idle_s=None,
              lockstep=Lockstep(group)).follow()
