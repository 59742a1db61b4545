"""What the GPU thread publishes for readers on other threads: immutable
snapshots of the hot set and the batch (each replaced by one assignment,
never mutated after), and the idle hot caches for the eviction actor."""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

from semantic.runtime.outcome import decode_rate

from .messages import HotAgent, HotSet

__all__ = ["BatchSnapshot", "HotSnapshot", "Publisher", "SequenceInfo"]


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


class Publisher:
    """(GPU thread) Publishes snapshots (``latest_hot``, ``latest_batch``: replaced,
    never mutated, so the event loop reads them without a lock; the
    ``GpuActor``'s ``hot`` and ``batch``) and posts the idle hot caches to the
    eviction actor."""

    def __init__(self, post, eviction):
        self.latest_hot = HotSnapshot()
        self.latest_batch = BatchSnapshot()
        self.post = post  # post(sink, item): queue a message for the event loop
        self.eviction = eviction
        self._batch_key: tuple = ()
        self._batch_at = 0.0

    def hot(self, caches) -> None:
        if caches is None:
            return
        budget = caches.budget
        self.latest_hot = HotSnapshot(caches.model_id, budget.budget_bytes, caches.hot_bytes, {
            m.agent_id: (len(m.tokens), budget.bytes_of(m.agent_id), m.updated) for m in caches.hot_memories()
        }, sum(budget.bytes_of(p.owner) for p in caches.prefixes()), caches.demotions, caches.prefix_drops)
        if self.eviction is None:
            return
        agents = tuple(  # shared prefixes too: never dirty (no file), so dropping one is free
            HotAgent(o.owner, budget.bytes_of(o.owner), not o.dirty) for o in caches.idle_owners()
        )
        self.post(self.eviction, HotSet(budget.budget_bytes, caches.hot_bytes, agents))

    def batch(self, running: dict, waiting, generated: int) -> None:
        """At once when turns come or go, else at most every ``_BATCH_EVERY_S``.
        ``running``: turn id -> ``GpuTurn``; ``waiting``: the waiting ``GpuTurn``s, in order."""
        key = (tuple(running), len(waiting))
        now = time.perf_counter()
        if key == self._batch_key and (not running or now - self._batch_at < _BATCH_EVERY_S):
            return
        self._batch_key, self._batch_at = key, now
        sequences = tuple(
            SequenceInfo(t.cmd.agent_id, t.cmd.turn_id, "prefill" if t.first_token is None else "decode",
                         len(t.turn.prompt) if t.turn is not None else 0, t.generated,
                         None if t.first_token is None else decode_rate(t.generated, now - t.first_token))
            for t in running.values())
        queued = tuple(SequenceInfo(t.cmd.agent_id, t.cmd.turn_id, "queued", 0, t.generated, None)
                       for t in itertools.islice(waiting, _BATCH_QUEUED_SHOWN))
        self.latest_batch = BatchSnapshot(sequences + queued, len(waiting), generated)
