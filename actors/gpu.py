"""The GPU actor: the only code that touches MLX, on one thread it starts and joins.

Two halves, one per thread:

* ``GpuActor`` lives on the event loop.  Others call ``submit`` (any command)
  and ``cancel``; both only put a typed command on a thread-safe queue, so
  they never wait, and ``cancel`` is safe even from a finaliser.  Its ``run``
  task starts the thread, waits (without blocking the loop) until it ends, and
  joins it.
* ``_Worker`` runs on that thread and owns everything MLX: the model registry
  (model, ``Engine``, the agents' hot caches and the KV budget) and reading
  cache files.  When the engine is idle it blocks on its inbox; when busy it
  drains the inbox between steps (admitting new turns, applying cancels), runs
  one ``prefill_step`` (round-robin among pending prefills, inside the engine)
  and one ``step_once`` (one token for every decoding sequence), and posts
  each delta to its turn's reply stream.

Posting back: the thread puts ``(sink, item)`` on an outbox queue and, if no
wake-up is pending, schedules ``_pump`` on the loop through an anyio
``BlockingPortal`` (``start_task_soon`` returns at once: the thread never
waits for the loop, and the loop never waits for MLX).  ``_pump`` drains the
outbox in order with ``send_nowait`` on unbounded streams, so one pump call
delivers everything posted so far, in the order it was posted, whatever order
the portal runs its tasks in.

Caches leave the thread as bytes: when a turn ends, the blocks of its cache
that are not on disk yet are copied out (``runtime.cache_file.snapshot``: the
blocks from the first one whose tokens differ from what this thread last
handed over for the same cache, plus the sliding-window rings; no hashing, no
file I/O here) and handed to the persistence actor with a ``WriteTicket``; the
cache is *dirty* until that exact version is durable (``CacheWritten``).  When ``AgentCaches`` must demote a dirty cache (to make
room), ``HotCaches.write`` waits for its ticket instead of writing itself, so
the persistence actor stays the one writer of every file.

Failure: an exception from an engine step is fatal (the batch's state is
unknown): every turn in flight and waiting fails with ``RuntimeUnhealthy``, the
engine is dropped, the runtime is marked unhealthy, and the thread keeps
serving what needs no model (flush, demote, stop) until it is stopped.  An
error while starting or ending one turn fails only that turn.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import anyio
import mlx.core as mx
from anyio.from_thread import BlockingPortal

from runtime import turns
from runtime.agent_cache import AgentMemory, OutOfMemory
from runtime.batch_cache import copy_cache
from runtime.cache_file import BLOCK_TOKENS, CacheRecord, snapshot
from runtime.engine import Delta as EngineDelta
from runtime.engine import LENGTH, Finished
from runtime.errors import SemanticError
from runtime.models import LoadedModel
from runtime.outcome import TurnResult

from .errors import ContextTooLong, RuntimeClosed, RuntimeUnhealthy, TurnError
from .messages import (
    BeginTurn,
    CacheBlocks,
    CacheWritten,
    CancelTurn,
    Delta,
    Demote,
    Done,
    DropCache,
    Failed,
    FlushCaches,
    ForkCache,
    GpuCommand,
    GpuDown,
    HotAgent,
    HotSet,
    StopGpu,
    SwapModel,
    TurnEnded,
    TurnFailed,
    WriteTicket,
)
from .registry import ModelRegistry

__all__ = ["BatchSnapshot", "GpuActor", "HotSnapshot", "SequenceInfo"]

log = logging.getLogger("semantic.actors")

_DURABLE_WAIT_S = 120.0  # a dirty cache being demoted waits this long for its write


@dataclass(frozen=True)
class _Ready:
    error: SemanticError | None  # the model failed to load


@dataclass(frozen=True)
class _Exited:
    pass


@dataclass(frozen=True)
class HotSnapshot:
    """The hot set as the GPU thread last saw it, for monitoring from the event loop."""

    model_id: str | None = None
    budget_bytes: int = 0
    used_bytes: int = 0
    agents: dict = field(default_factory=dict)  # agent id -> (tokens, bytes, last use as unix time)
    prefix_bytes: int = 0  # held by shared prefixes
    demotions: int = 0  # agents demoted to disk to make room
    prefix_drops: int = 0  # shared prefixes dropped to make room


@dataclass(frozen=True)
class SequenceInfo:
    """One turn the GPU thread holds: queued (not admitted yet), prefilling, or decoding."""

    agent_id: str
    turn_id: int
    phase: str  # "queued" | "prefill" | "decode"
    prompt_tokens: int  # 0 while queued (not rendered yet)
    tokens: int  # output tokens so far
    tokens_per_s: float | None  # its decode speed so far (None before its second token)


@dataclass(frozen=True)
class BatchSnapshot:
    """The batch as the GPU thread last saw it, for monitoring from the event loop:
    published when its composition changes and at most every ``_BATCH_EVERY_S`` while it runs."""

    sequences: tuple[SequenceInfo, ...] = ()  # admitted turns, then queued ones (the first 64)
    queue_depth: int = 0  # turns waiting for admission
    generated: int = 0  # output tokens of every turn since the actor started


_BATCH_EVERY_S = 0.25
_BATCH_QUEUED_SHOWN = 64


class GpuActor:
    """The event-loop half: a mailbox, a health flag and the thread's lifetime."""

    def __init__(
        self,
        model: str | LoadedModel,
        cache_root: Path,
        budget_bytes: int | None,
        persistence,  # MemoryObjectSendStream[PersistCommand]
        eviction=None,  # MemoryObjectSendStream[EvictCommand] | None
        *,
        engine_options: dict | None = None,
        model_idle_s: float | None = None,
    ):
        self._inbox: queue.SimpleQueue[GpuCommand] = queue.SimpleQueue()  # loop -> thread
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()  # thread -> loop: (sink | None, item, final)
        self._wake_pending = False
        self._portal: BlockingPortal | None = None
        self._accepting = False
        self.error: SemanticError | None = None  # set when the GPU actor failed
        self.hot = HotSnapshot()  # replaced (never mutated) by the GPU thread
        self.batch = BatchSnapshot()  # likewise
        self._worker = _Worker(
            self, model, ModelRegistry(cache_root, budget_bytes, engine_options or {}),
            persistence, eviction, model_idle_s,
        )

    # -- for other actors (event loop thread; none of these wait) ----------

    @property
    def healthy(self) -> bool:
        return self.error is None

    @property
    def steps(self) -> int:
        """Engine steps (one prefill chunk + one decode step) run so far."""
        return self._worker.steps

    @property
    def model_name(self) -> str | None:
        return self._worker.registry.name

    @property
    def loaded(self):
        """The loaded ``LoadedModel`` (None while unloaded); read its settings, never run it here."""
        return self._worker.registry.loaded

    def stats(self) -> dict:
        """A snapshot for tests and benchmarks (read across threads: approximate)."""
        w = self._worker
        engine = w.registry.engine
        return {
            "steps": w.steps,
            "decoding": engine.decoding if engine else 0,
            "prefilling": engine.prefilling if engine else 0,
            "turns": len(w.turns),
            "waiting": len(w.waiting),
            "loaded": w.registry.loaded is not None,
            "preemptions": w.preemptions,
            "mlx_active_bytes": mx.get_active_memory(),  # allocator counters: safe to read from any thread
            "mlx_peak_bytes": mx.get_peak_memory(),
        }

    def submit(self, command: GpuCommand) -> None:
        """Queue a command for the GPU thread.  When the actor is stopped or
        failed, a request is answered at once with the reason instead."""
        if not self._accepting or (self.error is not None and isinstance(command, (BeginTurn, ForkCache, SwapModel))):
            self._refuse(command)  # a failed actor still serves what needs no model (flush, demote, delete)
        else:
            self._inbox.put(command)

    def call_soon(self, fn) -> None:
        """Run ``fn()`` on the event loop soon; callable from any thread, never blocks."""
        try:
            self._portal.start_task_soon(fn)
        except (AttributeError, RuntimeError):  # no portal (not running): nothing left to close
            pass

    def cancel(self, turn_id: int) -> None:
        """Cancel a turn (wherever it is) before the next engine step.  Never
        blocks, safe from finalisers (``SimpleQueue.put`` is reentrant)."""
        self._inbox.put(CancelTurn(turn_id, self._worker.steps))

    # -- the actor's task ----------------------------------------------------

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        """Start the thread; report ready once the model is loaded (or raise its
        ``ModelError``); return when the thread has ended and been joined."""
        self._ready, self._exited = anyio.Event(), anyio.Event()
        self._load_error: SemanticError | None = None
        async with BlockingPortal() as portal:
            self._portal = portal
            thread = threading.Thread(target=self._worker.main, name="semantic-gpu")
            thread.start()
            try:
                await self._ready.wait()
                if self._load_error is None:
                    self._accepting = True
                    task_status.started()
                    await self._exited.wait()
            finally:
                self._accepting = False
                with anyio.CancelScope(shield=True):
                    self._inbox.put(StopGpu())
                    await anyio.to_thread.run_sync(thread.join)
                    self._pump()
                    self._refuse_leftovers()
        if self._load_error is not None:
            raise self._load_error  # outside the portal's task group, so it is not wrapped

    async def stop(self) -> None:
        """Cancel every turn, hand every dirty cache to persistence, end the thread."""
        self._accepting = False
        self._inbox.put(StopGpu())
        await self._exited.wait()

    # -- thread -> loop ------------------------------------------------------

    def _post(self, sink, item, final: bool = False) -> None:
        """(GPU thread) Queue ``item`` for ``sink`` (None: this actor) and wake the loop."""
        self._outbox.put((sink, item, final))
        if not self._wake_pending:
            self._wake_pending = True
            try:
                self._portal.start_task_soon(self._pump)
            except RuntimeError:  # the portal has closed: run() pumps once more after join
                pass

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
        if isinstance(item, _Ready):
            self._load_error = item.error
            self._ready.set()
        elif isinstance(item, GpuDown):
            self.error = item.error
        elif isinstance(item, _Exited):
            self._ready.set()
            self._exited.set()
        else:
            raise AssertionError(f"unknown GPU actor event {item!r}")

    def _refuse(self, command) -> None:
        error = self.error or RuntimeClosed("the runtime is closed")
        if isinstance(command, BeginTurn):
            _send_final(command.reply, TurnFailed(command.turn_id, error))
        elif isinstance(command, (ForkCache, DropCache, FlushCaches, SwapModel)):
            _send_final(command.reply, Failed(error))

    def _refuse_leftovers(self) -> None:
        while True:
            try:
                self._refuse(self._inbox.get_nowait())
            except queue.Empty:
                return


def _send_final(sink, item) -> None:
    try:
        sink.send_nowait(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError):
        pass
    sink.close()


@dataclass(eq=False)
class _Turn:
    """A turn the GPU thread has received: waiting for admission, then running."""

    cmd: BeginTurn
    received: float = field(default_factory=time.perf_counter)
    turn: turns.Turn | None = None
    seq_id: int | None = None
    admitted: float | None = None
    first_token: float | None = None
    cancel_lag: int | None = None
    generated: int = 0  # output tokens so far
    preempted: Finished | None = None  # out of the engine to free memory (its cache dropped here)


@dataclass(frozen=True)
class _Pushed:
    """The latest version of an agent's cache handed to persistence."""

    version: int
    memory: weakref.ref  # the AgentMemory it encodes: clean once written, if still hot
    ticket: WriteTicket


@dataclass(frozen=True)
class _Sent:
    """What this thread last handed over of an agent's cache: the blocks of
    ``tokens`` are on disk or on their way, for as long as ``lineage`` lives."""

    lineage: weakref.ref  # the cache's first layer object: turns trim and extend it in place
    tokens: list[int]


class _Worker:
    """The GPU thread's state and loop.  Every field is touched only on that thread
    (``steps`` and the registry's counts are read elsewhere for stats only)."""

    def __init__(self, actor: GpuActor, model, registry: ModelRegistry, persistence, eviction, model_idle_s):
        self.actor = actor
        self.model = model  # what to load first
        self.registry = registry
        self.persistence = persistence
        self.eviction = eviction
        self.model_idle_s = model_idle_s
        self.inbox = actor._inbox
        self.turns: dict[int, _Turn] = {}  # admitted, by turn id
        self.by_seq: dict[int, _Turn] = {}  # admitted, by engine sequence id
        self.waiting: deque[_Turn] = deque()  # received, not yet admitted
        self.swap: SwapModel | None = None
        self.failed: RuntimeUnhealthy | None = None
        self.stopping = False
        self.pushed: dict[str, _Pushed] = {}
        self.sent: dict[str, _Sent] = {}
        self.versions = itertools.count(1)
        self.steps = 0
        self.preemptions = 0
        self.generated = 0  # output tokens of every turn
        self._batch_key: tuple = ()
        self._batch_at = 0.0

    # -- life ----------------------------------------------------------------

    def main(self) -> None:
        try:
            try:
                self._load(self.model)
            except BaseException as e:  # ModelError, or anything else loading raised
                error = e if isinstance(e, SemanticError) else SemanticError(f"could not load the model: {e!r}")
                self.actor._post(None, _Ready(error))
                return
            self.actor._post(None, _Ready(None))
            while not self.stopping:
                try:
                    self._serve()
                except Exception as e:  # an engine step, or a bug in this loop
                    self._fatal(e)
        finally:
            try:
                self._hand_over_dirty()
            except Exception:
                log.exception("could not hand the hot caches to persistence at shutdown")
            self.registry.loaded = self.registry.engine = self.registry.caches = None
            mx.synchronize()
            mx.clear_streams()  # a thread that used MLX must end its streams, or the process aborts at exit
            self.actor._post(None, _Exited())

    def _load(self, model) -> None:
        self.registry.load(model)
        self.registry.caches.write_through = self._write_through
        self.registry.caches.on_load = self._loaded
        self._report_hot()

    def _serve(self) -> None:
        while not self.stopping:
            self._drain(block=self._idle())
            if not self.stopping and not self._idle():
                self._step()
                self._progress()
            self._publish_batch()

    def _idle(self) -> bool:
        engine = self.registry.engine
        return self.failed is not None or engine is None or engine.idle

    def _drain(self, block: bool) -> None:
        if block:
            timeout = self.model_idle_s if self.registry.loaded is not None and not self.waiting else None
            try:
                self._handle(self.inbox.get(timeout=timeout))
            except queue.Empty:
                self._idle_unload()
        while not self.stopping:
            try:
                command = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._handle(command)
        self._progress()

    def _step(self) -> None:
        engine = self.registry.engine
        self._route(engine.prefill_step())
        self._reserve_next_tokens()
        self._route(engine.step_once())
        self.steps += 1

    def _reserve_next_tokens(self) -> None:
        """Reserve each decoding turn's next token (a new block every 256).  When
        the rest of the budget is held by turns in progress, the newest turn is
        preempted (its cache becomes an idle one that can go to disk; it resumes
        first when room returns); a turn alone that still cannot grow ends there
        (reason ``length``)."""
        caches, engine = self.registry.caches, self.registry.engine
        for seq_id, tokens in engine.decode_lengths().items():
            while (t := self.by_seq.get(seq_id)) is not None:
                try:
                    caches.grow(t.cmd.agent_id, tokens)
                    break
                except OutOfMemory:
                    if len(self.turns) == 1:
                        log.warning("turn %d of %s stops at %d tokens: the KV budget holds no more",
                                    t.cmd.turn_id, t.cmd.agent_id, tokens - 1)
                        self._route([engine.cancel(seq_id, LENGTH)])
                    else:
                        self._preempt(max(self.turns.values(), key=lambda u: u.admitted))

    def _preempt(self, t: _Turn) -> None:
        finished = self.registry.engine.preempt(t.seq_id)
        del self.turns[t.cmd.turn_id], self.by_seq[t.seq_id]
        reg = self.registry
        memory = turns.end(reg.caches, reg.loaded.tokenizer, t.turn, finished)
        self._push(memory)  # written behind, so that demoting it is cheap
        t.preempted = replace(finished, cache=[])  # what it covered; the cache itself is the agent's now
        self.preemptions += 1
        self.waiting.appendleft(t)
        log.info("turn %d of %s preempted at %d tokens to free KV memory", t.cmd.turn_id, t.cmd.agent_id,
                 len(finished.cache_tokens))

    # -- commands ----------------------------------------------------------------

    def _handle(self, cmd: GpuCommand) -> None:
        if isinstance(cmd, BeginTurn):
            self.waiting.append(_Turn(cmd))
        elif isinstance(cmd, CancelTurn):
            self._cancel(cmd)
        elif isinstance(cmd, CacheWritten):
            self._written(cmd)
        elif isinstance(cmd, Demote):
            self._demote(cmd.agent_ids)
        elif isinstance(cmd, ForkCache):
            self._answer(cmd.reply, self._fork, cmd.source, cmd.target)
        elif isinstance(cmd, DropCache):
            self._answer(cmd.reply, self._drop, cmd.agent_id)
        elif isinstance(cmd, FlushCaches):
            self._answer(cmd.reply, self._hand_over_dirty)
        elif isinstance(cmd, SwapModel):
            if self.swap is not None:
                self._reply(cmd.reply, Failed(TurnError("a model swap is already in progress")))
            else:
                self.swap = cmd
        elif isinstance(cmd, StopGpu):
            self._stop()
        else:
            raise AssertionError(f"unknown GPU command {cmd!r}")

    def _answer(self, reply, fn, *args) -> None:
        """Run a request's handler and reply Done(value) or Failed(error)."""
        if self.failed is not None and fn not in (self._hand_over_dirty, self._drop):  # these need no model
            self._reply(reply, Failed(self.failed))
            return
        try:
            value = fn(*args)
        except SemanticError as e:
            self._reply(reply, Failed(e))
        except Exception as e:
            log.exception("GPU actor request %s failed", fn.__name__)
            self._reply(reply, Failed(TurnError(f"{fn.__name__.strip('_')} failed: {e!r}")))
        else:
            self._reply(reply, Done(value))

    def _progress(self) -> None:
        """Admit waiting turns, or run a pending model swap once the batch drained."""
        if self.failed is not None:
            while self.waiting:
                self._fail(self.waiting.popleft(), self.failed)
            if self.swap is not None:
                self._reply(self.swap.reply, Failed(self.failed))
                self.swap = None
            return
        if self.swap is not None:
            if self.turns or any(t.preempted for t in self.waiting):
                self._admit_waiting(preempted_only=True)
                return  # draining: new turns wait for the new model
            self._swap()
        if self.waiting and self.registry.loaded is None:
            try:
                self._load(self.registry.name)  # back after an idle unload
            except SemanticError as e:
                while self.waiting:
                    self._fail(self.waiting.popleft(), e)
                return
        self._admit_waiting()

    def _admit_waiting(self, preempted_only: bool = False) -> None:
        while self.waiting and (not preempted_only or self.waiting[0].preempted):
            if not self._begin(self.waiting[0]):
                return  # no room yet: it waits for a turn to end (first come, first served)
            self.waiting.popleft()

    def _begin(self, t: _Turn) -> bool:
        """Admit a turn into the engine.  False: no room now; a failure replies and counts as done."""
        if t.preempted is not None:
            return self._resume(t)
        cmd, reg = t.cmd, self.registry
        caches, tokenizer = reg.caches, reg.loaded.tokenizer
        assert not caches.busy(cmd.agent_id), "two turns of one agent at once: the agent actor serialises them"
        try:
            messages = [m.as_dict() for m in cmd.messages]
            text = turns.render(tokenizer, messages, cmd.tools)
            prefix = turns.system_prefix(tokenizer, messages, text)
            turn = turns.begin(caches, tokenizer, cmd.agent_id, text, prefix, use_cache=cmd.use_cache,
                               context_length=reg.context_length)
        except ContextTooLong as e:
            self._fail(t, e)
            return True
        except OutOfMemory as e:
            if self.turns:
                return False
            self._fail(t, e)
            return True
        except Exception as e:
            log.exception("turn %d of %s could not start", cmd.turn_id, cmd.agent_id)
            self._fail(t, TurnError(f"the turn could not start: {e!r}"))
            return True
        limit, n = reg.context_length, len(turn.prompt)
        # A reply that would run past the context stops at its end (reason "length").
        sampling = cmd.sampling if n + cmd.sampling.max_tokens <= limit else replace(cmd.sampling, max_tokens=limit - n)
        try:
            t.seq_id = reg.engine.add(turn.prompt, sampling, turn.cache, turn.plan.keep)
        except Exception as e:
            caches.abandon(cmd.agent_id)
            self._fail(t, TurnError(f"the turn could not start: {e!r}"))
            return True
        t.turn, t.admitted = turn, time.perf_counter()
        self.turns[cmd.turn_id] = t
        self.by_seq[t.seq_id] = t
        return True

    def _resume(self, t: _Turn) -> bool:
        """Put a preempted turn back into the engine with its cache (hot, or read
        back from disk; recomputed if it was lost)."""
        caches, agent, covered = self.registry.caches, t.cmd.agent_id, list(t.preempted.cache_tokens)
        memory = None
        try:
            memory = caches.checkout(agent)
            caches.grow(agent, len(covered) + 1)
        except OutOfMemory as e:
            caches.putback(agent, memory)
            if self.turns:
                return False
            self._drop_preempted(t)
            self._fail(t, e)
            return True
        except Exception as e:
            log.exception("turn %d of %s could not resume", t.cmd.turn_id, agent)
            caches.abandon(agent)
            self._drop_preempted(t)
            self._fail(t, TurnError(f"the turn could not resume: {e!r}"))
            return True
        if memory is not None and memory.tokens != covered:
            log.warning("the cache of %s changed while its turn was preempted; recomputing it", agent)
            memory = None
        self.registry.engine.resume(t.seq_id, memory and memory.cache, len(covered) if memory else 0)
        t.preempted = None
        self.turns[t.cmd.turn_id] = t
        self.by_seq[t.seq_id] = t
        return True

    def _drop_preempted(self, t: _Turn) -> None:
        if self.registry.engine is not None:
            self.registry.engine.discard(t.seq_id)

    def _cancel(self, cmd: CancelTurn) -> None:
        for t in self.waiting:
            if t.cmd.turn_id == cmd.turn_id:
                self.waiting.remove(t)
                self._drop_preempted(t)
                self._reply(t.cmd.reply, TurnEnded(cmd.turn_id, _result(t, t.preempted, "cancelled")))
                return
        t = self.turns.get(cmd.turn_id)
        if t is None or self.registry.engine is None:
            return  # already ended: nothing to do
        t.cancel_lag = self.steps - cmd.at_step
        delta = self.registry.engine.cancel(t.seq_id)
        assert delta is not None, "an admitted turn is unknown to the engine"
        self._route([delta])

    def _route(self, deltas: list[EngineDelta]) -> None:
        for d in deltas:
            t = self.by_seq[d.seq_id]
            t.generated += len(d.tokens)
            self.generated += len(d.tokens)
            if d.text or d.tokens:
                if t.first_token is None:
                    t.first_token = time.perf_counter()
                self.actor._post(t.cmd.reply, Delta(d.text, d.tokens))
            if d.finished is not None:
                self._end(t, d.finished)

    def _end(self, t: _Turn, finished: Finished) -> None:
        """Store a finished (or cancelled) turn's cache, hand it to persistence, reply."""
        del self.turns[t.cmd.turn_id], self.by_seq[t.seq_id]
        reg = self.registry
        try:
            memory = turns.end(reg.caches, reg.loaded.tokenizer, t.turn, finished)
        except Exception as e:
            log.exception("turn %d of %s: its cache could not be stored", t.cmd.turn_id, t.cmd.agent_id)
            reg.caches.abandon(t.cmd.agent_id)
            self._fail(t, TurnError(f"the turn's cache could not be stored: {e!r}"))
            return
        self._push(memory)
        self._report_hot()  # first: whoever sees the turn end sees its cache hot
        self._reply(t.cmd.reply, TurnEnded(t.cmd.turn_id, _result(t, finished, finished.reason)))

    def _fail(self, t: _Turn, error: SemanticError) -> None:
        self._reply(t.cmd.reply, TurnFailed(t.cmd.turn_id, error))

    def _reply(self, sink, item) -> None:
        self.actor._post(sink, item, final=True)

    # -- caches: persistence, eviction, fork, delete --------------------------------

    def _push(self, memory: AgentMemory) -> bool:
        """Copy out a hot cache's new blocks and hand them to the persistence actor (write-behind)."""
        reg = self.registry
        record = CacheRecord(
            memory.agent_id, reg.caches.model_id, reg.caches.spec.hash, list(memory.tokens), memory.text,
            memory.created, memory.updated, memory.cache,
        )
        try:
            update = snapshot(record, self._handed_over(memory))
        except Exception:
            log.exception("could not copy out the cache of %s; it stays dirty", memory.agent_id)
            return False
        for agent_id in [a for a, s in self.sent.items() if s.lineage() is None]:  # caches gone from memory
            del self.sent[agent_id]
        self.sent[memory.agent_id] = _Sent(weakref.ref(memory.cache[0]), record.tokens)
        version = next(self.versions)
        ticket = WriteTicket()
        self.pushed[memory.agent_id] = _Pushed(version, weakref.ref(memory), ticket)
        self.actor._post(self.persistence, CacheBlocks(memory.agent_id, record.model_id, version, update, ticket))
        return True

    def _handed_over(self, memory: AgentMemory) -> int:
        """How many leading blocks of ``memory``'s cache were handed over already:
        those of the same cache (not a recomputed one) whose tokens are unchanged."""
        s = self.sent.get(memory.agent_id)
        if s is None or not memory.cache or s.lineage() is not memory.cache[0]:
            return 0
        return _common_prefix(s.tokens, memory.tokens) // BLOCK_TOKENS

    def _loaded(self, memory: AgentMemory) -> None:
        """``AgentCaches.on_load``: a cache just read from its blocks is all on disk."""
        self.sent[memory.agent_id] = _Sent(weakref.ref(memory.cache[0]), list(memory.tokens))

    def _written(self, cmd: CacheWritten) -> None:
        p = self.pushed.get(cmd.agent_id)
        if p is None or p.version != cmd.version:
            return  # an older version, superseded
        del self.pushed[cmd.agent_id]
        memory, caches = p.memory(), self.registry.caches
        hot = memory is not None and caches is not None and caches.peek(cmd.agent_id) is memory
        if not p.ticket.ok:
            self.sent.pop(cmd.agent_id, None)  # what it carried may not be on disk
            if p.ticket.stale and hot:
                self._push(memory)  # whole, this time
        elif hot:
            memory.dirty = False
            self._report_hot()

    def _write_through(self, memory: AgentMemory) -> None:
        """``HotCaches.write``: make ``memory`` durable through persistence (blocks this
        thread until its write is done; only demotion of a dirty cache gets here)."""
        p = self.pushed.get(memory.agent_id)
        if (p is None or p.memory() is not memory) and self._push(memory):
            p = self.pushed[memory.agent_id]
        if p is not None and p.memory() is memory and p.ticket.done.wait(_DURABLE_WAIT_S) and p.ticket.ok:
            memory.dirty = False
            return
        # The disk is full or failing (persistence said why): the memory is needed, so this
        # version goes; the file keeps the last good one and the next turn resumes from it.
        log.warning("the newest cache of %s could not be written; it leaves memory unwritten "
                    "(its file keeps the last good version)", memory.agent_id)

    def _hand_over_dirty(self) -> int:
        """Hand every dirty hot cache not handed over yet to persistence (no waiting)."""
        caches, n = self.registry.caches, 0
        if caches is None:
            return 0
        for memory in caches.hot_memories():
            p = self.pushed.get(memory.agent_id)
            if memory.dirty and (p is None or p.memory() is not memory):
                n += self._push(memory)
        return n

    def _make_durable(self) -> None:
        """Block until every hot cache is on disk (before a model goes away)."""
        caches = self.registry.caches
        for memory in caches.hot_memories() if caches else ():
            if memory.dirty:
                self._write_through(memory)

    def _demote(self, agent_ids) -> None:
        caches = self.registry.caches
        if caches is None:
            return
        idle = {o.owner: o for o in caches.idle_owners()}
        for owner in agent_ids:
            if owner in idle and not idle[owner].dirty:
                caches.demote(owner)
        self._report_hot()

    def _report_hot(self) -> None:
        caches = self.registry.caches
        if caches is None:
            return
        # Published for readers on other threads (one assignment, never mutated after).
        self.actor.hot = HotSnapshot(caches.model_id, caches.budget.budget_bytes, caches.hot_bytes, {
            m.agent_id: (len(m.tokens), caches.budget.bytes_of(m.agent_id), m.updated) for m in caches.hot_memories()
        }, sum(caches.budget.bytes_of(p.owner) for p in caches.prefixes()), caches.demotions, caches.prefix_drops)
        if self.eviction is None:
            return
        agents = tuple(  # shared prefixes too: never dirty (no file), so dropping one is free
            HotAgent(o.owner, caches.budget.bytes_of(o.owner), not o.dirty)
            for o in caches.idle_owners()
        )
        self.actor._post(self.eviction, HotSet(caches.budget.budget_bytes, caches.hot_bytes, agents))

    def _publish_batch(self) -> None:
        """Publish the batch for readers on other threads (one assignment, never mutated
        after): at once when turns come or go, else at most every ``_BATCH_EVERY_S``."""
        key = (tuple(self.turns), len(self.waiting))
        now = time.perf_counter()
        if key == self._batch_key and (not self.turns or now - self._batch_at < _BATCH_EVERY_S):
            return
        self._batch_key, self._batch_at = key, now
        running = tuple(
            SequenceInfo(t.cmd.agent_id, t.cmd.turn_id, "prefill" if t.first_token is None else "decode",
                         len(t.turn.prompt) if t.turn is not None else 0, t.generated,
                         (t.generated - 1) / (now - t.first_token)
                         if t.first_token is not None and t.generated > 1 and now > t.first_token else None)
            for t in self.turns.values())
        queued = tuple(SequenceInfo(t.cmd.agent_id, t.cmd.turn_id, "queued", 0, t.generated, None)
                       for t in itertools.islice(self.waiting, _BATCH_QUEUED_SHOWN))
        self.actor.batch = BatchSnapshot(running + queued, len(self.waiting), self.generated)

    def _fork(self, source: str, target: str) -> bool:
        """Copy ``source``'s cache to ``target`` (sharing arrays until either grows).
        True if there was a cache to copy."""
        if self.registry.loaded is None:
            self._load(self.registry.name)  # back after an idle unload
        caches = self.registry.caches
        if caches.tier(target) is not None:  # a stale cache under the new id
            self.pushed.pop(target, None)
            self.sent.pop(target, None)
            caches.delete(target)
        memory = caches.checkout(source)
        if memory is None:
            caches.abandon(source)
            return False
        copy = AgentMemory(target, list(memory.tokens), memory.text, copy_cache(memory.cache), memory.created)
        caches.checkin(memory)
        caches.checkin(copy)
        self._push(copy)
        self._report_hot()
        return True

    def _drop(self, agent_id: str) -> None:
        """Forget an agent's hot cache (the agent is deleted; the persistence actor's
        ``Forget`` deletes its files, after the writes queued before it)."""
        self.pushed.pop(agent_id, None)
        self.sent.pop(agent_id, None)
        caches = self.registry.caches
        if caches is not None:
            assert not caches.busy(agent_id), "delete during a turn: the agent actor serialises them"
            caches.delete(agent_id)
            self._report_hot()

    # -- model lifecycle ------------------------------------------------------------

    def _swap(self) -> None:
        cmd, self.swap = self.swap, None
        previous = self.registry.name  # by name: holding the old weights would double peak memory
        try:
            self._make_durable()
            self.registry.unload()
            self._load(cmd.model)
        except SemanticError as e:
            if self.registry.loaded is None and previous is not None:
                self._load(previous)
            self._reply(cmd.reply, Failed(e))
        else:
            self._reply(cmd.reply, Done(self.registry.name))

    def _idle_unload(self) -> None:
        if self.registry.loaded is None or self.turns or self.waiting or self.swap is not None:
            return
        self._make_durable()
        self.registry.unload()
        log.info("model %s unloaded after %g s idle", self.registry.name, self.model_idle_s)

    def _stop(self) -> None:
        """Cancel every turn (their caches are kept), fail waiting ones, hand over dirty caches."""
        engine = self.registry.engine
        for t in list(self.turns.values()):
            delta = engine.cancel(t.seq_id) if engine is not None else None
            if delta is not None:
                self._route([delta])
        closed = RuntimeClosed("the runtime shut down before this turn started")
        while self.waiting:
            t = self.waiting.popleft()
            if t.preempted is not None:  # it started: it ends cancelled, its cache kept
                self._reply(t.cmd.reply, TurnEnded(t.cmd.turn_id, _result(t, t.preempted, "cancelled")))
            else:
                self._fail(t, closed)
        if self.swap is not None:
            self._reply(self.swap.reply, Failed(closed))
            self.swap = None
        self.stopping = True

    def _fatal(self, error: Exception) -> None:
        log.error("the GPU actor failed; failing every turn in flight", exc_info=error)
        self.failed = failed = RuntimeUnhealthy(
            f"the GPU actor failed ({type(error).__name__}: {error}); every turn in flight failed. "
            "Close the runtime and open a new one."
        )
        self.actor._post(None, GpuDown(failed))  # first: whoever sees a turn fail sees the runtime unhealthy
        caches = self.registry.caches
        for t in self.turns.values():
            if caches is not None:
                caches.abandon(t.cmd.agent_id)  # the file keeps its last good version
            self._fail(t, failed)
        self.turns.clear()
        self.by_seq.clear()
        self.registry.engine = None  # its batch is in an unknown state; checked-in caches are fine
        self._progress()


def _result(t: _Turn, f: Finished | None, reason: str) -> TurnResult:
    now = time.perf_counter()
    return TurnResult.measured(f, reason, arrived=t.received, admitted=t.admitted or now, first_token=t.first_token,
                               ended=now, cancel_lag_steps=t.cancel_lag)


def _common_prefix(a: list[int], b: list[int]) -> int:
    if b[: len(a)] == a:  # the usual case: the cache only grew
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
