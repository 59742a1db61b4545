"""Agents' working memory for one model: hot (Q4 in memory, inside a byte
budget) and warm (on disk), with least-recently-used demotion and shared
read-only prefixes.

``AgentCaches`` is the hot set: one ``AgentEntry`` per agent it knows of --
its cache in memory, whether a turn holds it, whether its file is being read
and what came back, whether it is newer than its file and which write will
make it durable -- and it is the only writer of them.  It reaches the disk
through a ``CacheDisk`` given to its constructor: ``StoreDisk`` writes
straight to a ``CacheStore`` on the caller's thread; the GPU actor's
``WriteBehind`` hands the bytes to the persistence actor, whose answer comes
back through ``written``.

One owner calls it (the actor that owns the hot set, or a test): nothing here
locks.  Every hot cache holds a reservation in a ``KVBudget``; a cache is
admitted -- loaded from disk, or grown by a turn -- only after its blocks are
reserved, freeing the least recently used idle owners until they fit: agents
are demoted to disk, shared prefixes are dropped (they only ever fill free
room, and the next cold agent with that system prompt registers it again).
A request that cannot fit even with every idle owner freed fails with
``OutOfMemory``, naming what holds the memory.

(Long on purpose: the hot set, its one record per agent and the disk
protocol it writes through change together; splitting them would expose
the record to a second writer.)
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Protocol

from .block_pool import KVBudget
from ..store.cache_codec import HostCache, snapshot
from ..store.cache_file import CacheStore
from ..cache_records import BLOCK_TOKENS, FORMAT_VERSION, BlockUpdate, CacheRecord
from ..errors import SemanticError
from ..kv import SequenceCache
from ..model.model_spec import ModelCacheSpec

__all__ = ["AgentCaches", "AgentEntry", "AgentMemory", "CacheDisk", "OutOfMemory", "SharedPrefix", "StoreDisk",
           "HOT", "WARM"]

HOT, WARM = "hot", "warm"

log = logging.getLogger("semantic.runtime")


class OutOfMemory(SemanticError):
    """A cache cannot fit in the KV budget even with every other cache demoted."""


@dataclass(eq=False)
class AgentMemory:
    """One agent's cache: ``cache`` holds the K/V of exactly ``tokens``, whose text is ``text``."""

    agent_id: str
    tokens: list[int]
    text: str
    cache: SequenceCache  # (a list of layer caches is taken as one)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    def __post_init__(self):
        if not isinstance(self.cache, SequenceCache):
            self.cache = SequenceCache(self.cache)

    @property
    def trimmable(self) -> int:
        """Tokens the cache can drop from its end (every full layer can drop all;
        a sliding layer those it holds beyond its window)."""
        return self.cache.trimmable_tokens


@dataclass(frozen=True)
class Fetched:
    """An agent's file as read for its next checkout (``cache`` None: there was none, or it was unusable)."""

    cache: HostCache | None


@dataclass(frozen=True)
class OnDisk:
    """The blocks of ``tokens`` of one cache are on disk or on their way, for as long as
    that cache lives (``lineage``: its first layer; turns trim and extend it in place)."""

    lineage: weakref.ref
    tokens: list[int]

    @classmethod
    def of(cls, memory: AgentMemory) -> OnDisk | None:
        """All of ``memory``'s cache (None: a cache of no layers, nothing to track)."""
        return cls(weakref.ref(memory.cache[0]), list(memory.tokens)) if memory.cache else None

    def blocks_of(self, memory: AgentMemory) -> int:
        """How many leading blocks of ``memory``'s cache this covers: none of a recomputed cache."""
        if not memory.cache or self.lineage() is not memory.cache[0]:
            return 0
        return _common_prefix(self.tokens, memory.tokens) // BLOCK_TOKENS


@dataclass(eq=False)
class AgentEntry:
    """One agent's cache as its hot set knows it (only ``AgentCaches`` changes it)."""

    agent_id: str
    memory: AgentMemory | None = None  # in memory, idle (a turn that holds it has it)
    busy: bool = False  # checked out for a turn: never demoted
    dirty: bool = False  # its cache (idle or checked out) is newer than what is durable on disk
    pending: int | None = None  # the write on its way that holds that cache (``CacheDisk.write``'s number)
    on_disk: OnDisk | None = None  # what of the cache needs no writing again
    reading: bool = False  # its file is being read for a turn
    fetched: Fetched | None = None  # its file as read, until a checkout takes it

    @property
    def owner(self) -> str:  # its budget owner
        return self.agent_id

    @property
    def updated(self) -> float:
        return self.memory.updated if self.memory is not None else 0.0

    @property
    def idle(self) -> bool:
        return self.memory is not None and not self.busy

    @property
    def empty(self) -> bool:
        """Nothing left to know: no cache, no turn, no read or write on its way."""
        return self.memory is None and not self.busy and not self.reading and self.fetched is None \
            and self.pending is None


@dataclass(eq=False)
class SharedPrefix:
    owner: tuple[str, int]  # its budget owner, ("prefix", n): never an agent id
    tokens: list[int]
    text: str
    cache: SequenceCache  # read-only: users get copies
    updated: float = field(default_factory=time.time)  # last registered or used
    dirty = False  # it has no file: dropping it loses nothing the next cold agent cannot redo


class CacheDisk(Protocol):
    """Where a hot set's caches come from and go to."""

    def exists(self, agent_id: str, model_id: str) -> bool:
        """A file of the agent's cache is there."""

    def read(self, agent_id: str, model_id: str, spec_hash: str) -> HostCache | None:
        """The agent's cache for a checkout that found none read ahead (None: start cold)."""

    def write(self, update: BlockUpdate) -> int | None:
        """Take a version of a cache.  None: it is durable now; else the number of the
        write, whose end the owner reports to ``AgentCaches.written``."""

    def delete(self, agent_id: str, model_id: str) -> None:
        """The agent is deleted: its files go."""


@dataclass(frozen=True)
class StoreDisk:
    """Straight to a ``CacheStore``, on the caller's thread (tests, benchmarks)."""

    store: CacheStore

    def exists(self, agent_id: str, model_id: str) -> bool:
        return self.store.exists(agent_id, model_id)

    def read(self, agent_id: str, model_id: str, spec_hash: str) -> HostCache | None:
        return self.store.read(agent_id, model_id, spec_hash)

    def write(self, update: BlockUpdate) -> None:
        self.store.write(update)

    def delete(self, agent_id: str, model_id: str) -> None:
        self.store.delete(agent_id, model_id)


class AgentCaches:
    """Hot and warm caches of every agent for one model."""

    def __init__(self, disk: CacheDisk | CacheStore, model_id: str, spec: ModelCacheSpec, budget: KVBudget, *,
                 demotions: int = 0, prefix_drops: int = 0):
        """``disk``: a ``CacheStore`` is reached straight (``StoreDisk``).
        ``demotions``, ``prefix_drops``: where the counters start (they never go back)."""
        self.disk = StoreDisk(disk) if isinstance(disk, CacheStore) else disk
        self.model_id = model_id
        self.spec = spec
        self.budget = budget
        self._entries: OrderedDict[str, AgentEntry] = OrderedDict()  # least recently used cache first
        self._prefixes: dict[tuple[str, int], SharedPrefix] = {}  # by owner
        self._prefix_ids = itertools.count()
        self.demotions = demotions  # agents demoted to disk
        self.prefix_drops = prefix_drops  # shared prefixes dropped to make room

    # -- queries

    def tier(self, agent_id: str) -> str | None:
        if (e := self._entries.get(agent_id)) is not None and (e.memory is not None or e.busy):
            return HOT
        return WARM if self.disk.exists(agent_id, self.model_id) else None

    def hot_agents(self) -> list[str]:
        return [e.agent_id for e in self._entries.values() if e.idle]

    def peek(self, agent_id: str) -> AgentMemory | None:
        """The agent's hot (checked-in) cache, without touching its recency."""
        e = self._entries.get(agent_id)
        return e.memory if e is not None and e.idle else None

    def hot_memories(self) -> list[AgentMemory]:
        """Checked-in hot caches, least recently used first."""
        return [e.memory for e in self._entries.values() if e.idle]

    def entry(self, agent_id: str) -> AgentEntry | None:
        """What the hot set knows of the agent's cache, to read (None: nothing)."""
        return self._entries.get(agent_id)

    def busy(self, agent_id: str) -> bool:
        return (e := self._entries.get(agent_id)) is not None and e.busy

    @property
    def hot_bytes(self) -> int:
        return self.budget.used_bytes

    # -- a turn's life: checkout, then checkin (or abandon)

    def checkout(self, agent_id: str) -> AgentMemory | None:
        """Take an agent's cache for a turn: hot, else read from disk (warm; read
        ahead, or now), else None (cold).  A warm cache's blocks are reserved
        before its MLX arrays are made.  Raises OutOfMemory when it can never fit."""
        e = self._entry(agent_id)
        assert not e.busy, "two turns of one agent at once: the agent actor serialises them"
        e.busy = True
        if (memory := e.memory) is not None:
            e.memory = None
            return memory
        fetched, e.fetched, e.reading = e.fetched, None, False
        try:
            host = fetched.cache if fetched is not None else self.disk.read(agent_id, self.model_id, self.spec.hash)
            if host is None:  # none on disk, or unusable (quarantined): start cold
                return None
            self._admit(agent_id, len(host.tokens))
            record = host.build()
        except BaseException:
            self.abandon(agent_id)
            raise
        memory = AgentMemory(agent_id, record.tokens, record.text, record.cache, record.created, record.updated)
        e.dirty = False
        if record.format_version == FORMAT_VERSION:  # made from its blocks: all on disk
            e.on_disk = OnDisk.of(memory)
        return memory

    def grow(self, agent_id: str, tokens: int, choice: int = 0) -> None:
        """Reserve room for a running turn's cache to grow to ``tokens``, with its
        float working copy if the engine keeps one (freeing idle owners).
        ``choice``: that of a turn's other replies (1, 2, ...: each a cache of
        its own until it ends, ``release_choice``)."""
        assert self.busy(agent_id), "grow() is for a checked-out cache"
        self._admit(("choice", agent_id, choice) if choice else agent_id, tokens, running=True)

    def release_choice(self, agent_id: str, choice: int) -> None:
        """A turn's other reply ``choice`` ended: its cache is gone."""
        self._release(("choice", agent_id, choice))

    def checkin(self, memory: AgentMemory) -> None:
        """Return an agent's cache after its turn; it becomes the most recently used,
        newer than its file (``hand_over`` starts writing it)."""
        e = self._entry(memory.agent_id)
        self._release(memory.agent_id)  # shrink the turn's reservation to what is held
        self._admit(memory.agent_id, len(memory.tokens))
        memory.updated = time.time()
        e.memory, e.busy, e.dirty, e.pending = memory, False, True, None
        self._entries.move_to_end(memory.agent_id)

    def putback(self, agent_id: str, memory: AgentMemory | None) -> None:
        """Undo a checkout that did not run: the agent keeps the cache it had (if any)."""
        if memory is None:
            self.abandon(agent_id)
            return
        e = self._entries[agent_id]
        self._release(agent_id)
        self._admit(agent_id, len(memory.tokens))  # it held this much before: it fits
        e.memory, e.busy = memory, False  # its ``updated`` is unchanged: it was not used
        self._entries.move_to_end(agent_id)

    def abandon(self, agent_id: str) -> None:
        """A turn failed without a cache to return: forget the hot copy (disk keeps the last good one)."""
        if (e := self._entries.get(agent_id)) is not None:
            e.busy, e.dirty = False, False
            self._tidy(e)
        self._release(agent_id)

    def idle_owners(self) -> list[AgentEntry | SharedPrefix]:
        """Hot caches no turn holds, and shared prefixes: least recently used first
        (what admission frees first)."""
        idle = [e for e in self._entries.values() if e.idle]
        return sorted([*idle, *self._prefixes.values()], key=lambda o: o.updated)

    def prefixes(self) -> list[SharedPrefix]:
        return list(self._prefixes.values())

    # -- reading ahead (the owner reads a waiting turn's file while others run)

    def want(self, agent_id: str) -> bool:
        """Should the agent's file be read ahead (no cache in memory, none read or on
        its way)?  If so it is marked on its way: the owner reads it, then ``arrived``."""
        e = self._entries.get(agent_id)
        if e is not None and (e.memory is not None or e.busy or e.reading or e.fetched is not None):
            return False
        self._entry(agent_id).reading = True
        return True

    def reading(self, agent_id: str) -> bool:
        return (e := self._entries.get(agent_id)) is not None and e.reading

    def arrived(self, agent_id: str, cache: HostCache | None) -> None:
        """The file asked for was read: kept for the agent's next checkout (unless nobody waits any more)."""
        if (e := self._entries.get(agent_id)) is not None and e.reading:
            e.reading, e.fetched = False, Fetched(cache)

    def unwant(self, agent_id: str) -> None:
        """Whoever asked left before using it: drop it (or its answer, when it comes)."""
        if (e := self._entries.get(agent_id)) is not None:
            e.reading, e.fetched = False, None
            self._tidy(e)

    # -- writing

    def hand_over(self, agent_id: str) -> bool:
        """Start writing the agent's idle cache if it is newer than its file and no
        write of it is on its way.  True if a write began (or ended)."""
        e = self._entries.get(agent_id)
        if e is None or not e.idle or not e.dirty or e.pending is not None:
            return False
        memory = e.memory
        record = CacheRecord(memory.agent_id, self.model_id, self.spec.hash, list(memory.tokens), memory.text,
                             memory.created, memory.updated, memory.cache)
        try:
            update = snapshot(record, e.on_disk.blocks_of(memory) if e.on_disk is not None else 0)
        except Exception:
            log.exception("could not copy out the cache of %s; it stays dirty", agent_id)
            return False
        e.pending = self.disk.write(update)
        e.on_disk = OnDisk.of(memory)
        e.dirty = e.pending is not None
        return True

    def written(self, agent_id: str, number: int, ok: bool, stale: bool = False) -> bool:
        """The disk's write ``number`` ended: ``ok``, durable; else not (``stale``: refused
        because the blocks before it are not on disk: the cache is written whole
        again).  True when a cache became clean."""
        e = self._entries.get(agent_id)
        if e is None or e.pending != number:
            return False  # superseded by a newer version, or the agent was deleted
        e.pending = None
        if ok:
            e.dirty = False
        else:
            e.on_disk = None  # what it carried may not be on disk
            if e.idle and stale:
                self.hand_over(agent_id)  # whole, this time
            elif e.memory is None and not e.busy:  # demoted: the next turn resumes from the file
                log.warning("the newest cache of %s could not be written and has left memory; its file keeps "
                            "the last good version", agent_id)
        self._tidy(e)
        return ok

    def flush(self) -> int:
        """Start writing every dirty idle cache no write holds yet; return how many."""
        return sum(self.hand_over(e.agent_id) for e in list(self._entries.values()))

    # -- tiers

    def demote(self, owner) -> None:
        """Free an idle owner's blocks: an agent goes hot -> warm (its write
        begins if it is dirty); a shared prefix is dropped."""
        if owner in self._prefixes:
            del self._prefixes[owner]
            self._release(owner)
            self.prefix_drops += 1
            return
        e = self._entries[owner]
        assert e.idle, "demote() is for an idle cache"
        self.hand_over(owner)
        e.memory, e.dirty, e.on_disk = None, False, None
        self._tidy(e)
        self._release(owner)
        self.demotions += 1

    def drop_all(self) -> None:
        """Forget every hot cache and shared prefix (their memory goes with them).
        Call only when none is dirty and no turn holds one."""
        assert not any(e.busy for e in self._entries.values()), \
            "drop_all() with turns in progress: their caches would be lost"
        for owner in [*self._entries, *self._prefixes]:
            self._release(owner)
        self._entries.clear()
        self._prefixes.clear()

    def delete(self, agent_id: str) -> None:
        """Forget all of the agent's cache: the hot copy, its reads and writes on
        their way (their answers are ignored), and its files for this model."""
        self._entries.pop(agent_id, None)
        self._release(agent_id)
        self.disk.delete(agent_id, self.model_id)

    def _entry(self, agent_id: str) -> AgentEntry:
        if (e := self._entries.get(agent_id)) is None:
            e = self._entries[agent_id] = AgentEntry(agent_id)
        return e

    def _tidy(self, e: AgentEntry) -> None:
        """Forget an entry with nothing left to know (the hot set stays as small as what it holds)."""
        if e.empty and self._entries.get(e.agent_id) is e:
            del self._entries[e.agent_id]

    def _release(self, owner: str) -> None:
        if owner in self.budget:
            self.budget.release(owner)

    def _admit(self, owner, tokens: int, running: bool = False) -> None:
        need = _mib(self.budget.bytes_for(tokens, running))
        if not self.budget.fits(tokens, running):
            raise OutOfMemory(
                f"{tokens} tokens of KV cache need {need}; the whole KV budget is {_mib(self.budget.budget_bytes)}"
            )
        while not self.budget.reserve(owner, tokens, running):
            victims = self.idle_owners()
            if not victims:
                busy = [e.agent_id for e in self._entries.values() if e.busy]
                held = ", ".join(f"{a} {_mib(self.budget.bytes_of(a))}" for a in busy if a in self.budget)
                raise OutOfMemory(
                    f"no room for {tokens} tokens of KV cache ({need}) for {owner}: the KV budget of "
                    f"{_mib(self.budget.budget_bytes)} is held by {len(busy)} turn(s) in progress "
                    f"({held}); retry when they finish"
                )
            self.demote(victims[0].owner)

    # -- shared prefixes (e.g. a system prompt many agents start with)

    def shared_prefix(self, text: str) -> SharedPrefix | None:
        """The longest registered prefix of ``text``, if any."""
        best = None
        for prefix in self._prefixes.values():
            if text.startswith(prefix.text) and (best is None or len(prefix.text) > len(best.text)):
                best = prefix
        return best

    def share_prefix(self, text: str, tokens: list[int], cache: SequenceCache) -> bool:
        """Register the first ``len(tokens)`` tokens of ``cache`` (a copy) as a shared prefix.

        It only takes free room (it never demotes anyone) and is the first
        thing freed when room is needed.  Returns False when the cache cannot
        go back there (a wrapped sliding window, inside a closed block) or
        there is no free room.
        """
        if any(p.text == text for p in self._prefixes.values()):
            return True
        if not all(c.can_rewind(len(tokens)) for c in cache):
            return False
        copy = cache.clone()
        copy.rewind(len(tokens))
        owner = ("prefix", next(self._prefix_ids))
        if not self.budget.reserve(owner, len(tokens)):
            return False
        self._prefixes[owner] = SharedPrefix(owner, list(tokens), text, copy)
        return True

    def from_prefix(self, agent_id: str, prefix: SharedPrefix) -> AgentMemory:
        """A new agent's memory that starts as a copy of a shared prefix."""
        prefix.updated = time.time()
        return AgentMemory(agent_id, list(prefix.tokens), prefix.text, prefix.cache.clone())


def _common_prefix(a: list[int], b: list[int]) -> int:
    if b[: len(a)] == a:  # the usual case: the cache only grew
        return len(a)
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"
