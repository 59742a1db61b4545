"""The GPU thread's loop: it owns everything MLX, through the model registry
(model, ``Engine``, the agents' hot caches and the KV budget), and opens no
file but a model's weights when it loads one by name.

When the engine is idle the loop blocks on its inbox; when busy it drains the
inbox between steps (turns arrive, cancels, caches read or written, cache
requests), admits what can run, and runs one engine step (a prefill chunk
and a decode step).  The work is done by its parts: ``Scheduler`` (turns),
``WriteBehind`` (caches to disk), ``CacheCommands`` (fork, drop, demote) and
``Publisher`` (snapshots for other threads); the loop adds the model's life
(load, swap, idle unload), stop and failure.  A swap is asked for
(``SwapModel``) or needed: the oldest waiting turn names another model.

Sharded (``actors.lockstep``): on rank 0 every input -- a command, or one
of the loop's own ticks -- is broadcast before the thread acts on it
(``_act``); the other ranks' threads ``follow``, acting on the same inputs.

Failure: an exception from an engine step is fatal (the batch's state is
unknown): every turn in flight and waiting fails with ``RuntimeUnhealthy``, the
engine is dropped, the runtime is marked unhealthy, and the thread keeps
serving what needs no model (flush, drop, stop) until it is stopped.  An
error while starting or ending one turn fails only that turn.
"""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import mlx.core as mx

from semantic.runtime.errors import SemanticError

from .cache_commands import CacheCommands
from .errors import RuntimeClosed, RuntimeUnhealthy, TurnError
from .messages import (
    BeginTurn, CacheRead, CacheWritten, CancelTurn, Demote, Done, DropCache, Failed, FlushCaches, ForkCache, GpuDown,
    KeepRowCounts, StopGpu, SwapModel,
)
from .scheduler import Scheduler
from .snapshots import Publisher
from .write_behind import WriteBehind

__all__ = ["IDLE", "PROGRESS", "STEP", "Exited", "Failure", "GpuThread", "Ready"]

log = logging.getLogger("semantic.actors")

PROGRESS, STEP, IDLE = "progress", "step", "idle"  # the thread's own ticks (see ``GpuThread._apply``)


@dataclass(frozen=True)
class Failure:
    """Rank 0's engine failed: every rank drops its batch (``GpuThread._fatal``)."""

    error: str


@dataclass(frozen=True)
class Ready:
    error: SemanticError | None  # the model failed to load


@dataclass(frozen=True)
class Exited:
    pass


class GpuThread:
    """Every field is touched only on the GPU thread (``steps`` and the parts'
    counters are read elsewhere for stats only)."""

    def __init__(self, actor, model, registry, persistence, eviction, model_idle_s, lockstep=None):
        self.model = model  # what to load first
        self.lockstep = lockstep  # a sharded model's ranks (``actors.lockstep.Lockstep``), else None
        self.registry = registry
        self.model_idle_s = model_idle_s
        self.inbox = actor.inbox
        self.post = post = actor.post  # post(sink, item, final): to the event loop, never waits
        self.persistence = persistence
        self.publisher = Publisher(post, eviction)
        self.write_behind = WriteBehind(registry.store, lambda blocks: post(persistence, blocks))
        self.scheduler = Scheduler(registry, post, persistence, self._hot_changed)
        self.cache_commands = CacheCommands(registry, self.scheduler.reads, self._hot_changed)
        self.swap: SwapModel | None = None
        self.failed: RuntimeUnhealthy | None = None
        self.stopping = False
        self.steps = 0
        self.acting_since: float | None = None  # monotonic time the input being acted on began (a watchdog reads it)

    def main(self) -> None:
        try:
            try:
                self._load(self.model)
            except BaseException as e:  # ModelError, or anything else loading raised
                error = e if isinstance(e, SemanticError) else SemanticError(f"could not load the model: {e!r}")
                self.post(None, Ready(error))
                return
            self.post(None, Ready(None))
            while not self.stopping:
                try:
                    self._serve()
                except Exception as e:  # an engine step, or a bug in this loop
                    self._act(Failure(f"{type(e).__name__}: {e}"), cause=e)
        finally:
            self._close()
            mx.clear_streams()  # a thread that used MLX must end its streams, or the process aborts at exit
            self.post(None, Exited())

    def _load(self, model) -> None:
        self.registry.load(model, disk=self.write_behind)
        for key, counts in self.registry.measured:  # for the next start: persistence writes them
            self.post(self.persistence, KeepRowCounts(key, counts))
        self.registry.measured.clear()
        self._hot_changed()

    def _hand_over_dirty(self) -> int:
        """Start writing every dirty hot cache (no waiting: persistence holds the bytes)."""
        return self.registry.caches.flush() if self.registry.caches is not None else 0

    def _hot_changed(self) -> None:
        self.publisher.hot(self.registry.caches)

    def follow(self) -> None:
        """(A rank other than 0 of a sharded model) Act on rank 0's inputs until it stops."""
        try:
            self._load(self.model)
            while not self.stopping:
                event = self.lockstep.receive(self._read_own)
                try:
                    self._apply(event)
                except Exception as e:
                    # Rank 0 failed on the same input (then its Failure comes next), or this rank alone did.
                    if not isinstance(nxt := self.lockstep.receive(lambda agent: None), Failure):
                        raise SemanticError(f"rank {self.lockstep.rank} failed where rank 0 did not: {e!r}") from e
                    self._apply(nxt, cause=e)
        finally:
            self._close()

    def _close(self) -> None:
        """Hand the dirty caches over (to be written) and drop the model."""
        try:
            self._hand_over_dirty()
        except Exception:
            log.exception("could not hand the hot caches to persistence at shutdown")
        self.registry.loaded = self.registry.engine = self.registry.caches = None
        mx.synchronize()

    def _read_own(self, agent_id: str):
        """(A follower) This rank's shard of an agent's warm cache, from its own files."""
        caches = self.registry.caches
        return None if caches is None else self.registry.store.read(agent_id, caches.model_id, caches.spec.hash)

    def _act(self, event, cause: Exception | None = None) -> None:
        """Act on one input; on rank 0 of a sharded model, broadcast it first."""
        self.acting_since = time.monotonic()
        try:
            if self.lockstep is not None:
                event = self.lockstep.send(event)
            self._apply(event, cause)
        finally:
            self.acting_since = None

    def _apply(self, event, cause: Exception | None = None) -> None:
        if event == STEP:
            self.scheduler.step()
            self.steps += 1
            self._progress()
        elif event == PROGRESS:
            self._progress()
        elif event == IDLE:
            self._idle_unload()
        elif isinstance(event, Failure):
            self._fatal(cause or SemanticError(event.error))
        else:
            self._handle(event)

    def _serve(self) -> None:
        s = self.scheduler
        while not self.stopping:
            self._drain(block=self._idle())
            if not self.stopping and not self._idle():
                self._act(STEP)
            self.publisher.batch(s.turns, s.waiting, s.generated)

    def _idle(self) -> bool:
        engine = self.registry.engine
        return self.failed is not None or engine is None or engine.idle

    def _drain(self, block: bool) -> None:
        if block:
            timeout = self.model_idle_s if self.registry.loaded is not None and not self.scheduler.waiting else None
            try:
                command = self.inbox.get(timeout=timeout)
            except queue.Empty:
                self._act(IDLE)
            else:
                self._act(command)
        while not self.stopping:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._act(command)
        if not self.stopping:  # a follower stops at StopGpu: nothing may be broadcast after it
            self._act(PROGRESS)

    def _handle(self, cmd) -> None:
        s, caches = self.scheduler, self.cache_commands
        if isinstance(cmd, BeginTurn):
            s.receive(cmd)
        elif isinstance(cmd, CancelTurn):
            s.cancel(cmd, self.steps)
        elif isinstance(cmd, CacheWritten):
            if self.registry.caches is not None and \
                    self.registry.caches.written(cmd.agent_id, cmd.version, cmd.ok, cmd.stale):
                self._hot_changed()
        elif isinstance(cmd, CacheRead):
            s.reads.arrived(cmd)
        elif isinstance(cmd, Demote):
            caches.demote(cmd.agent_ids)
        elif isinstance(cmd, ForkCache):
            caches.forks.append(cmd)
        elif isinstance(cmd, DropCache):
            self._answer(cmd.reply, caches.drop, cmd.agent_id, needs_model=False)
        elif isinstance(cmd, FlushCaches):
            self._answer(cmd.reply, self._hand_over_dirty, needs_model=False)
        elif isinstance(cmd, SwapModel):
            if self.swap is not None:
                self.post(cmd.reply, Failed(TurnError("a model swap is already in progress")), True)
            else:
                self.swap = cmd
        elif isinstance(cmd, StopGpu):
            self._stop()
        else:
            raise AssertionError(f"unknown GPU command {cmd!r}")

    def _answer(self, reply, fn, *args, needs_model: bool = True) -> None:
        """Run a request's handler and reply Done(value) or Failed(error)."""
        if self.failed is not None and needs_model:
            self.post(reply, Failed(self.failed), True)
            return
        try:
            value = fn(*args)
        except SemanticError as e:
            self.post(reply, Failed(e), True)
        except Exception as e:
            log.exception("GPU actor request %s failed", fn.__name__)
            self.post(reply, Failed(TurnError(f"{fn.__name__.strip('_')} failed: {e!r}")), True)
        else:
            self.post(reply, Done(value), True)

    def _reply(self, cmd, answer) -> None:
        """Answer a request (a swap the thread started itself has no one to answer)."""
        if cmd.reply is not None:
            self.post(cmd.reply, answer, True)

    def _progress(self) -> None:
        """Run forks and admit waiting turns, or run a pending model swap once the batch drained."""
        s, forks = self.scheduler, self.cache_commands
        if self.failed is not None:
            for cmd in [*forks.ready_forks(every=True), *([self.swap] if self.swap else [])]:
                self._reply(cmd, Failed(self.failed))
            self.swap = None
            s.admission.close(self.failed)
            return
        if self.swap is None and (wanted := s.admission.wanted_model()) is not None:
            self.swap = SwapModel(wanted, None)  # the oldest waiting turn runs on another model
        if self.swap is not None:
            if s.turns or any(t.preempted for t in s.waiting):
                s.admit(preempted_only=True)
                return  # draining: new turns and forks wait for the new model
            self._swap()
        if not self._loaded_for(s.waiting or forks.forks):
            return
        for cmd in forks.ready_forks() if self.registry.loaded is not None else ():
            self._answer(cmd.reply, forks.fork, cmd.source, cmd.target)
        s.admit()

    def _loaded_for(self, work) -> bool:
        """Load the model back (after an idle unload) if there is ``work``; False when that
        failed (the work failed with it)."""
        if not work or self.registry.loaded is not None:
            return True
        try:
            self._load(self.registry.name)
        except SemanticError as e:
            self.scheduler.admission.close(e)
            for cmd in self.cache_commands.ready_forks(every=True):
                self.post(cmd.reply, Failed(e), True)
            return False
        return True

    def _swap(self) -> None:
        cmd, self.swap = self.swap, None
        previous = self.registry.name  # by name: holding the old weights would double peak memory
        try:
            self._hand_over_dirty()
            self.registry.unload()
            self._load(cmd.model)
        except SemanticError as e:
            if self.registry.loaded is None and previous is not None:
                self._load(previous)
            if cmd.reply is None:
                self.scheduler.admission.close(e, model=cmd.model)  # the turns that wanted it
            self._reply(cmd, Failed(e))
        else:
            self._reply(cmd, Done(self.registry.name))

    def _idle_unload(self) -> None:
        s = self.scheduler
        if self.registry.loaded is None or s.turns or s.waiting or self.swap is not None:
            return
        self._hand_over_dirty()
        self.registry.unload()
        log.info("model %s unloaded after %g s idle", self.registry.name, self.model_idle_s)

    def _stop(self) -> None:
        """Cancel every turn (their caches are kept), fail waiting ones, hand over dirty caches."""
        closed = RuntimeClosed("the runtime shut down before this turn started")
        self.scheduler.cancel_all()
        self.scheduler.admission.close(closed, cancel_started=True)
        for cmd in [*([self.swap] if self.swap else []), *self.cache_commands.ready_forks(every=True)]:
            self._reply(cmd, Failed(closed))
        self.swap = None
        self.stopping = True

    def _fatal(self, error: Exception) -> None:
        log.error("the GPU actor failed; failing every turn in flight", exc_info=error)
        self.failed = failed = RuntimeUnhealthy(
            f"the GPU actor failed ({type(error).__name__}: {error}); every turn in flight failed. "
            "Close the runtime and open a new one."
        )
        self.post(None, GpuDown(failed))  # first: whoever sees a turn fail sees the runtime unhealthy
        self.scheduler.fail_all(failed)
        self.registry.engine = None  # its batch is in an unknown state; checked-in caches are fine
        self._progress()
