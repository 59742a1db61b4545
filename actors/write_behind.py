"""(GPU thread) Hot caches leave for disk as bytes, behind the turns.

When a turn ends, the blocks of its cache that are not on disk yet are copied
out (``runtime.cache_codec.snapshot``: the blocks from the first one whose
tokens differ from what was last handed over for the same cache, plus the
sliding-window rings; no hashing, no file I/O here) and posted to the
persistence actor (``CacheBlocks``).  The cache is *dirty* until that exact
version is durable (``CacheWritten``).  A dirty cache that must leave memory
(demoted to make room) is handed over if it was not already and dropped: the
persistence actor holds its bytes until they are written, and reads an agent
only after its queued writes, so nothing here waits for the disk.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass

from semantic.runtime.agent_cache import AgentMemory
from semantic.runtime.cache_codec import snapshot
from semantic.runtime.cache_records import BLOCK_TOKENS, CacheRecord

from .messages import CacheBlocks, CacheWritten

__all__ = ["WriteBehind"]

log = logging.getLogger("semantic.actors")


@dataclass(frozen=True)
class _Pushed:
    """The latest version of an agent's cache handed to persistence."""

    version: int
    memory: weakref.ref  # the AgentMemory it encodes: clean once written, if still hot


@dataclass(frozen=True)
class _Sent:
    """What was last handed over of an agent's cache: the blocks of ``tokens``
    are on disk or on their way, for as long as ``lineage`` lives."""

    lineage: weakref.ref  # the cache's first layer object: turns trim and extend it in place
    tokens: list[int]


class WriteBehind:
    def __init__(self, send: Callable[[CacheBlocks], None], on_clean: Callable[[], None]):
        self.send = send  # posts to the persistence actor
        self.on_clean = on_clean  # a hot cache became clean (the hot set changed)
        self.caches = None  # the loaded model's ``HotCaches`` (``attach``)
        self.pushed: dict[str, _Pushed] = {}
        self.sent: dict[str, _Sent] = {}
        self.versions = itertools.count(1)

    def attach(self, caches) -> None:
        """Serve a newly loaded model's caches (built with ``hand_over`` and ``loaded``)."""
        self.caches = caches

    def push(self, memory: AgentMemory) -> bool:
        """Copy out a hot cache's new blocks and post them to persistence."""
        caches = self.caches
        record = CacheRecord(
            memory.agent_id, caches.model_id, caches.spec.hash, list(memory.tokens), memory.text,
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
        self.pushed[memory.agent_id] = _Pushed(version, weakref.ref(memory))
        self.send(CacheBlocks(memory.agent_id, record.model_id, version, update))
        return True

    def _handed_over(self, memory: AgentMemory) -> int:
        """How many leading blocks of ``memory``'s cache were handed over already:
        those of the same cache (not a recomputed one) whose tokens are unchanged."""
        s = self.sent.get(memory.agent_id)
        if s is None or not memory.cache or s.lineage() is not memory.cache[0]:
            return 0
        return _common_prefix(s.tokens, memory.tokens) // BLOCK_TOKENS

    def loaded(self, memory: AgentMemory) -> None:
        """``AgentCaches.on_load``: a cache just made from its blocks is all on disk."""
        self.sent[memory.agent_id] = _Sent(weakref.ref(memory.cache[0]), list(memory.tokens))

    def written(self, cmd: CacheWritten) -> None:
        p = self.pushed.get(cmd.agent_id)
        if p is None or p.version != cmd.version:
            return  # an older version, superseded
        del self.pushed[cmd.agent_id]
        memory, caches = p.memory(), self.caches
        hot = memory is not None and caches is not None and caches.peek(cmd.agent_id) is memory
        if not cmd.ok:
            self.sent.pop(cmd.agent_id, None)  # what it carried may not be on disk
            if cmd.stale and hot:
                self.push(memory)  # whole, this time
            elif not hot:  # demoted: the file keeps the last good version, the next turn resumes from it
                log.warning("the newest cache of %s could not be written and has left memory; its file keeps "
                            "the last good version", cmd.agent_id)
        elif hot:
            memory.dirty = False
            self.on_clean()

    def hand_over(self, memory: AgentMemory) -> None:
        """``HotCaches.write``: a dirty cache leaves memory; persistence holds its bytes until written."""
        p = self.pushed.get(memory.agent_id)
        if p is None or p.memory() is not memory:
            self.push(memory)

    def hand_over_dirty(self) -> int:
        """Hand every dirty hot cache not handed over yet to persistence (no waiting)."""
        n = 0
        for memory in self.caches.hot_memories() if self.caches is not None else ():
            p = self.pushed.get(memory.agent_id)
            if memory.dirty and (p is None or p.memory() is not memory):
                n += self.push(memory)
        return n

    def forget(self, agent_id: str) -> None:
        """The agent's cache is gone (deleted, or replaced by a fork): nothing of it was handed over."""
        self.pushed.pop(agent_id, None)
        self.sent.pop(agent_id, None)


def _common_prefix(a: list[int], b: list[int]) -> int:
    if b[: len(a)] == a:  # the usual case: the cache only grew
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
