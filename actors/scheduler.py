"""(GPU thread) The turns: waiting for the engine, then in it.

* ``ReadAhead``: a waiting turn's warm cache is read by the persistence actor
  (``ReadCache``) while the batch goes on; the bytes come back (``CacheRead``).
* ``Admission``: waiting turns enter the engine first come, first served, once
  their cache is in memory and their prompt fits the budget.
* ``Scheduler``: routes each engine delta straight to its turn's consumer
  and the turn's end to its agent actor, stores a finished turn's cache and
  hands it to persistence, cancels, and reserves each decoding turn's next
  token -- preempting the newest turn when the budget runs out.

None of them waits, touches a file or knows the thread: they call the
engine, the agents' caches and ``post`` (which queues a message for the event
loop), so a test can drive them on a tiny model.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

from semantic.runtime.memory import turns
from semantic.runtime.memory.agent_cache import OutOfMemory
from semantic.runtime.errors import SemanticError
from semantic.runtime.outcome import TurnResult
from semantic.runtime.engine.sequence import CANCELLED, LENGTH, Delta, Finished, FinishReason

from .errors import ContextTooLong, TurnError
from .messages import BeginTurn, CacheRead, CancelTurn, ReadCache, TurnEnded, TurnFailed

__all__ = ["Admission", "GpuTurn", "ReadAhead", "Scheduler"]

log = logging.getLogger("semantic.actors")

READ_AHEAD = 4  # waiting turns whose warm caches are read ahead (host memory held: at most this many caches)


@dataclass(eq=False)
class GpuTurn:
    """A turn the GPU thread has received: waiting for admission, then running."""

    cmd: BeginTurn
    received: float = field(default_factory=time.perf_counter)
    turn: turns.Turn | None = None
    seq_id: int | None = None  # choice 0's: the reply the agent keeps
    seq_ids: list[int] = field(default_factory=list)  # every choice's, in order (``TurnRequest.choices``)
    ended: dict[int, Finished] = field(default_factory=dict)  # choices that ended, until all have
    admitted: float | None = None
    first_token: float | None = None
    cancel_lag: int | None = None
    generated: int = 0  # output tokens so far
    preempted: Finished | None = None  # out of the engine to free memory (its cache dropped here)

    def result(self, f: Finished | None, reason: FinishReason) -> TurnResult:
        """Its result (choice 0's), with the other choices' when it asked for several."""
        now = time.perf_counter()

        def measured(f: Finished | None, reason: FinishReason) -> TurnResult:
            return TurnResult.measured(f, reason, arrived=self.received, admitted=self.admitted or now,
                                       first_token=self.first_token, ended=now, cancel_lag_steps=self.cancel_lag)

        others = tuple(measured(self.ended[s], self.ended[s].reason) for s in self.seq_ids[1:] if s in self.ended)
        return replace(measured(f, reason), choices=others)


class ReadAhead:
    """Warm caches on their way from disk, for waiting turns and forks (the hot
    set keeps which are asked for and what came back)."""

    def __init__(self, registry, post, persistence):
        self.registry, self.post, self.persistence = registry, post, persistence

    def want(self, agent_id: str) -> None:
        """Ask persistence for ``agent_id``'s cache unless it is in memory or on its way."""
        caches = self.registry.caches
        if caches.want(agent_id):
            self.post(self.persistence, ReadCache(agent_id, caches.model_id, caches.spec.hash))

    def reading(self, agent_id: str) -> bool:
        return self.registry.caches is not None and self.registry.caches.reading(agent_id)

    def arrived(self, cmd: CacheRead) -> None:
        """Keep a cache read ahead for whoever asked for it (its checkout takes it)."""
        caches = self.registry.caches
        if caches is not None and cmd.model_id == caches.model_id:  # else read for another model
            caches.arrived(cmd.agent_id, cmd.cache)

    def forget(self, agent_id: str) -> None:
        """Whoever asked left before using it: drop it (or its answer, when it comes)."""
        if self.registry.caches is not None:
            self.registry.caches.unwant(agent_id)


class Admission:
    """Waiting turns, and how one enters the engine."""

    def __init__(self, registry, reads: ReadAhead, post):
        self.registry, self.reads, self.post = registry, reads, post
        self.waiting: deque[GpuTurn] = deque()  # received, not yet admitted; preempted ones first

    def runs_here(self, t: GpuTurn) -> bool:
        """The turn runs on the loaded model (it named none, or that one)."""
        return t.preempted is not None or t.cmd.request.model in (None, self.registry.name)

    def wanted_model(self) -> str | None:
        """The model the oldest waiting turn names, when another is loaded (or none)."""
        t = next((t for t in self.waiting if t.preempted is None), None)
        return None if t is None or self.runs_here(t) else t.cmd.request.model

    def next(self, crowded: bool, preempted_only: bool = False) -> GpuTurn | None:
        """Admit waiting turns in order until one is admitted (returned) or one must
        wait (None): for its cache to arrive, or, while others run (``crowded``), for
        room.  Turns for another model are passed over: they wait for a swap."""
        here = [t for t in self.waiting if self.runs_here(t)]
        for t in here[:READ_AHEAD]:
            if t.cmd.request.use_cache or t.preempted is not None:
                self.reads.want(t.cmd.agent_id)
        for t in here:
            if preempted_only and t.preempted is None:
                return None
            if self.reads.reading(t.cmd.agent_id):
                return None  # its cache is on its way from disk; the batch goes on meanwhile
            admitted = self._resume(t, crowded) if t.preempted is not None else self._start(t, crowded)
            if admitted is False:
                return None
            self.waiting.remove(t)
            self.reads.forget(t.cmd.agent_id)  # if it failed before using it
            if admitted:
                return t
        return None

    def _start(self, t: GpuTurn, crowded: bool) -> bool | None:
        """True: in the engine; False: no room while others run; None: failed (replied)."""
        cmd, ask, reg = t.cmd, t.cmd.request, self.registry
        caches, tokenizer = reg.caches, reg.loaded.tokenizer
        try:
            if ask.prompt is not None:  # raw text: no template, no system prompt to share
                text, prefix = turns.raw_prompt(tokenizer, ask.prompt), None
            else:
                messages = [m.as_dict() for m in cmd.messages]
                text = turns.render(tokenizer, messages, ask.tools)
                prefix = turns.system_prefix(tokenizer, messages, text)
            turn = turns.begin(caches, tokenizer, cmd.agent_id, text, prefix, use_cache=ask.use_cache,
                               context_length=reg.context_length)
        except (ContextTooLong, OutOfMemory) as e:
            return False if crowded and isinstance(e, OutOfMemory) else self.fail(t, e)
        except Exception as e:
            log.exception("turn %d of %s could not start", cmd.turn_id, cmd.agent_id)
            return self.fail(t, TurnError(f"the turn could not start: {e!r}"))
        limit, n = reg.context_length, len(turn.prompt)
        # A reply that would run past the context stops at its end (reason "length").
        sampling = ask.sampling if n + ask.sampling.max_tokens <= limit else replace(ask.sampling, max_tokens=limit - n)
        try:
            t.seq_id = reg.engine.add(turn.prompt, sampling, turn.cache, turn.plan.keep,
                                      continues=ask.prompt is not None)  # raw text: the reply goes on from it
            t.seq_ids = [t.seq_id, *(reg.engine.add_choices(t.seq_id, ask.choices - 1) if ask.choices > 1 else ())]
        except Exception as e:
            caches.abandon(cmd.agent_id)
            return self.fail(t, TurnError(f"the turn could not start: {e!r}"))
        t.turn, t.admitted = turn, time.perf_counter()
        return True

    def _resume(self, t: GpuTurn, crowded: bool) -> bool | None:
        """Put a preempted turn back into the engine with its cache (hot, or read
        back from disk; recomputed if it was lost)."""
        caches, agent, covered = self.registry.caches, t.cmd.agent_id, list(t.preempted.cache_tokens)
        memory = None
        try:
            memory = caches.checkout(agent)
            caches.grow(agent, len(covered) + 1)
        except OutOfMemory as e:
            caches.putback(agent, memory)
            if crowded:
                return False
            self.discard(t)
            return self.fail(t, e)
        except Exception as e:
            log.exception("turn %d of %s could not resume", t.cmd.turn_id, agent)
            caches.abandon(agent)
            self.discard(t)
            return self.fail(t, TurnError(f"the turn could not resume: {e!r}"))
        if memory is not None and memory.tokens != covered:
            log.warning("the cache of %s changed while its turn was preempted; recomputing it", agent)
            memory = None
        self.registry.engine.resume(t.seq_id, memory and memory.cache, len(covered) if memory else 0)
        t.preempted = None
        return True

    def cancel(self, turn_id: int) -> bool:
        """End a waiting turn cancelled; False if none waits with that id."""
        for t in self.waiting:
            if t.cmd.turn_id == turn_id:
                self.waiting.remove(t)
                self.reads.forget(t.cmd.agent_id)
                self.discard(t)
                self.post(t.cmd.end, TurnEnded(turn_id, t.result(t.preempted, CANCELLED)), True)
                return True
        return False

    def close(self, error: SemanticError, cancel_started: bool = False, model: str | None = None) -> None:
        """End every waiting turn (those naming ``model``, if given) with ``error``;
        with ``cancel_started``, one that started (preempted) ends cancelled
        instead, its cache kept."""
        for t in list(self.waiting):
            if model is not None and t.cmd.request.model != model:
                continue
            self.waiting.remove(t)
            self.reads.forget(t.cmd.agent_id)
            if cancel_started and t.preempted is not None:
                self.post(t.cmd.end, TurnEnded(t.cmd.turn_id, t.result(t.preempted, CANCELLED)), True)
            else:
                self.fail(t, error)

    def discard(self, t: GpuTurn) -> None:
        """Forget a preempted turn's place in the engine."""
        if t.preempted is not None and self.registry.engine is not None:
            self.registry.engine.discard(t.seq_id)

    def fail(self, t: GpuTurn, error: SemanticError) -> None:
        self.post(t.cmd.end, TurnFailed(t.cmd.turn_id, error), True)


class Scheduler:
    """The turns in the engine, and the waiting ones (``admission``)."""

    def __init__(self, registry, post, persistence, on_hot_changed):
        self.registry, self.post = registry, post
        self.on_hot_changed = on_hot_changed
        self.reads = ReadAhead(registry, post, persistence)
        self.admission = Admission(registry, self.reads, post)
        self.turns: dict[int, GpuTurn] = {}  # admitted, by turn id
        self.by_seq: dict[int, GpuTurn] = {}  # admitted, by engine sequence id
        self.preemptions = 0
        self.generated = 0  # output tokens of every turn

    @property
    def waiting(self) -> deque[GpuTurn]:
        return self.admission.waiting

    def receive(self, cmd: BeginTurn) -> None:
        self.waiting.append(GpuTurn(cmd))

    def admit(self, preempted_only: bool = False) -> None:
        while (t := self.admission.next(bool(self.turns), preempted_only)) is not None:
            self.turns[t.cmd.turn_id] = t
            self.by_seq.update(dict.fromkeys(t.seq_ids, t))

    def step(self) -> None:
        """One engine step: a prefill chunk, then a token for every decoding turn."""
        engine = self.registry.engine
        self.route(engine.prefill_step())
        self._reserve_next_tokens()
        self.route(engine.step_once())

    def _reserve_next_tokens(self) -> None:
        """Reserve each decoding turn's next token (a new block every 256), and
        room for the drafts it may verify (else it verifies none this step).
        When the rest of the budget is held by turns in progress, the newest
        turn is preempted (its cache becomes an idle one that can go to disk;
        it resumes first when room returns); a turn alone that still cannot
        grow ends there (reason ``length``). A turn of several choices is never
        preempted (they share its prompt): one of its choices that cannot grow
        ends there too, once no other turn can make room."""
        caches, engine = self.registry.caches, self.registry.engine

        def grow(t: GpuTurn, seq_id: int, tokens: int) -> None:
            caches.grow(t.cmd.agent_id, tokens, choice=t.seq_ids.index(seq_id))

        for seq_id, (tokens, drafts) in engine.decode_lengths().items():
            if drafts and (t := self.by_seq.get(seq_id)) is not None:
                try:
                    grow(t, seq_id, tokens + drafts)
                    continue
                except OutOfMemory:
                    engine.hold_drafts(seq_id)
            while (t := self.by_seq.get(seq_id)) is not None:
                try:
                    grow(t, seq_id, tokens)
                    break
                except OutOfMemory:
                    others = [u for u in self.turns.values() if len(u.seq_ids) == 1]
                    if len(self.turns) == 1 or not others:
                        log.warning("turn %d of %s stops at %d tokens: the KV budget holds no more",
                                    t.cmd.turn_id, t.cmd.agent_id, tokens - 1)
                        self.route([engine.cancel(seq_id, LENGTH)])
                    else:
                        self._preempt(max(others, key=lambda u: u.admitted))

    def _preempt(self, t: GpuTurn) -> None:
        finished = self.registry.engine.preempt(t.seq_id)
        del self.turns[t.cmd.turn_id], self.by_seq[t.seq_id]
        reg = self.registry
        memory = turns.end(reg.caches, reg.loaded.tokenizer, t.turn, finished)
        reg.caches.hand_over(memory.agent_id)  # written behind, so that demoting it is cheap
        t.preempted = replace(finished, cache=[])  # what it covered; the cache itself is the agent's now
        self.preemptions += 1
        self.waiting.appendleft(t)
        log.info("turn %d of %s preempted at %d tokens to free KV memory", t.cmd.turn_id, t.cmd.agent_id,
                 len(finished.cache_tokens))

    def cancel(self, cmd: CancelTurn, steps: int) -> None:
        """Cancel a turn wherever it is; ``steps``: the engine steps run so far."""
        if self.admission.cancel(cmd.turn_id):
            return
        t = self.turns.get(cmd.turn_id)
        if t is None or self.registry.engine is None:
            return  # already ended: nothing to do
        t.cancel_lag = steps - cmd.at_step
        self._cancel(t)

    def _cancel(self, t: GpuTurn) -> None:
        for seq_id in [s for s in t.seq_ids if s in self.by_seq]:
            delta = self.registry.engine.cancel(seq_id)
            assert delta is not None, "an admitted turn is unknown to the engine"
            self.route([delta])

    def route(self, deltas: list[Delta]) -> None:
        for d in deltas:
            t = self.by_seq[d.seq_id]
            choice = d.choice
            t.generated += len(d.tokens)
            self.generated += len(d.tokens)
            if d.text or d.tokens:
                if t.first_token is None:
                    t.first_token = time.perf_counter()
                self.post(t.cmd.reply, d if d.finished is None else replace(d, finished=None))  # (it holds the cache)
            if d.finished is not None:
                del self.by_seq[d.seq_id]
                t.ended[d.seq_id] = d.finished
                if choice:  # its cache goes: only choice 0's is the agent's
                    self.registry.caches.release_choice(t.cmd.agent_id, choice)
                if len(t.ended) == len(t.seq_ids):
                    self._end(t, t.ended[t.seq_id])

    def _end(self, t: GpuTurn, finished: Finished) -> None:
        """Store a finished (or cancelled) turn's cache, hand it to persistence, reply."""
        del self.turns[t.cmd.turn_id]
        reg = self.registry
        try:
            memory = turns.end(reg.caches, reg.loaded.tokenizer, t.turn, finished)
        except Exception as e:
            log.exception("turn %d of %s: its cache could not be stored", t.cmd.turn_id, t.cmd.agent_id)
            reg.caches.abandon(t.cmd.agent_id)
            self.admission.fail(t, TurnError(f"the turn's cache could not be stored: {e!r}"))
            return
        reg.caches.hand_over(memory.agent_id)
        self.on_hot_changed()  # first: whoever sees the turn end sees its cache hot
        # To the agent actor, which updates the history and then tells the consumer: posted after the
        # deltas, so the consumer has every delta before the end.
        self.post(t.cmd.end, TurnEnded(t.cmd.turn_id, t.result(finished, finished.reason)), True)

    def cancel_all(self) -> None:
        """Cancel every turn in the engine (their caches are kept)."""
        if self.registry.engine is not None:
            for t in list(self.turns.values()):
                self._cancel(t)

    def fail_all(self, error: SemanticError) -> None:
        """The engine failed: every turn in it fails; the files keep their last good versions."""
        caches = self.registry.caches
        for t in self.turns.values():
            if caches is not None:
                caches.abandon(t.cmd.agent_id)
                for choice in range(1, len(t.seq_ids)):
                    caches.release_choice(t.cmd.agent_id, choice)
            self.admission.fail(t, error)
        self.turns.clear()
        self.by_seq.clear()
