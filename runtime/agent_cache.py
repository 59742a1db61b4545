"""Agents' working memory for one model: hot (Q4 in memory, inside a byte
budget) and warm (on disk), with least-recently-used demotion and shared
read-only prefixes.

One owner calls it (the actor that owns the hot set, or a test): nothing here
locks.  Every hot cache holds a reservation in a ``KVBudget``; a cache is
admitted -- loaded from disk, or grown by a turn -- only after its blocks are
reserved, freeing the least recently used idle owners until they fit: agents
are demoted to disk, shared prefixes are dropped (they only ever fill free
room, and the next cold agent with that system prompt registers it again).
A request that cannot fit even with every idle owner freed fails with
``OutOfMemory``, naming what holds the memory.
"""

from __future__ import annotations

import itertools
import re
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .block_pool import KVBudget, default_budget
from .cache_codec import HostCache
from .cache_file import CacheStore, model_key
from .cache_records import FORMAT_VERSION, CacheRecord
from .errors import SemanticError
from .kv import SequenceCache
from .model_spec import ModelCacheSpec

__all__ = ["AgentMemory", "AgentCaches", "OutOfMemory", "SharedPrefix", "HOT", "WARM", "cache_model_id", "open_caches"]

HOT, WARM = "hot", "warm"


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
    dirty: bool = True  # newer than its file on disk

    def __post_init__(self):
        if not isinstance(self.cache, SequenceCache):
            self.cache = SequenceCache(self.cache)

    @property
    def owner(self) -> str:  # its budget owner
        return self.agent_id

    @property
    def trimmable(self) -> int:
        """Tokens the cache can drop from its end (every full layer can drop all;
        a sliding layer those it holds beyond its window)."""
        return self.cache.trimmable_tokens


@dataclass(eq=False)
class SharedPrefix:
    owner: tuple[str, int]  # its budget owner, ("prefix", n): never an agent id
    tokens: list[int]
    text: str
    cache: SequenceCache  # read-only: users get copies
    updated: float = field(default_factory=time.time)  # last registered or used
    dirty = False  # it has no file: dropping it loses nothing the next cold agent cannot redo


class AgentCaches:
    """Hot and warm caches of every agent for one model."""

    def __init__(self, store: CacheStore, model_id: str, spec: ModelCacheSpec, budget: KVBudget, *,
                 on_load: Callable[[AgentMemory], None] = lambda memory: None, demotions: int = 0,
                 prefix_drops: int = 0):
        """``on_load``: told of each cache loaded from its blocks (all on disk);
        ``demotions``, ``prefix_drops``: where the counters start (they never go back)."""
        self.store = store
        self.model_id = model_id
        self.spec = spec
        self.budget = budget
        self._hot: OrderedDict[str, AgentMemory] = OrderedDict()  # least recently used first
        self._busy: set[str] = set()  # checked out for a turn: never demoted
        self._prefixes: dict[tuple[str, int], SharedPrefix] = {}  # by owner
        self._prefix_ids = itertools.count()
        self.on_load = on_load
        self.demotions = demotions  # agents demoted to disk
        self.prefix_drops = prefix_drops  # shared prefixes dropped to make room

    # -- queries

    def tier(self, agent_id: str) -> str | None:
        if agent_id in self._hot or agent_id in self._busy:
            return HOT
        return WARM if self.store.exists(agent_id, self.model_id) else None

    def hot_agents(self) -> list[str]:
        return list(self._hot)

    def peek(self, agent_id: str) -> AgentMemory | None:
        """The agent's hot (checked-in) cache, without touching its recency."""
        return self._hot.get(agent_id)

    def hot_memories(self) -> list[AgentMemory]:
        """Checked-in hot caches, least recently used first."""
        return list(self._hot.values())

    def busy(self, agent_id: str) -> bool:
        return agent_id in self._busy

    @property
    def hot_bytes(self) -> int:
        return self.budget.used_bytes

    # -- a turn's life: checkout, then checkin (or abandon)

    def checkout(self, agent_id: str) -> AgentMemory | None:
        """Take an agent's cache for a turn: hot, else read from disk (warm),
        else None (cold).  A warm cache's blocks are reserved before its MLX
        arrays are made.  Raises OutOfMemory when it can never fit."""
        self._busy.add(agent_id)
        if (memory := self._hot.pop(agent_id, None)) is not None:
            return memory
        try:
            host = self.read(agent_id)
            if host is None:  # none on disk, or unusable (quarantined): start cold
                return None
            self._admit(agent_id, len(host.tokens))
            record = host.build()
        except BaseException:
            self.abandon(agent_id)
            raise
        memory = AgentMemory(agent_id, record.tokens, record.text, record.cache, record.created, record.updated, False)
        if record.format_version == FORMAT_VERSION:
            self.on_load(memory)
        return memory

    def read(self, agent_id: str) -> HostCache | None:
        """The agent's warm cache from disk, in host memory (None: none, or unusable)."""
        return self.store.read(agent_id, self.model_id, self.spec.hash)

    def grow(self, agent_id: str, tokens: int, choice: int = 0) -> None:
        """Reserve room for a running turn's cache to grow to ``tokens``, with its
        float working copy if the engine keeps one (freeing idle owners).
        ``choice``: that of a turn's other replies (1, 2, ...: each a cache of
        its own until it ends, ``release_choice``)."""
        assert agent_id in self._busy, "grow() is for a checked-out cache"
        self._admit(("choice", agent_id, choice) if choice else agent_id, tokens, running=True)

    def release_choice(self, agent_id: str, choice: int) -> None:
        """A turn's other reply ``choice`` ended: its cache is gone."""
        self._release(("choice", agent_id, choice))

    def checkin(self, memory: AgentMemory) -> None:
        """Return an agent's cache after its turn; it becomes the most recently used."""
        self._busy.discard(memory.agent_id)
        self._release(memory.agent_id)  # shrink the turn's reservation to what is held
        self._admit(memory.agent_id, len(memory.tokens))
        memory.updated = time.time()
        self._hot[memory.agent_id] = memory

    def putback(self, agent_id: str, memory: AgentMemory | None) -> None:
        """Undo a checkout that did not run: the agent keeps the cache it had (if any)."""
        if memory is None:
            self.abandon(agent_id)
        else:
            self._busy.discard(agent_id)
            self._release(agent_id)
            self._admit(agent_id, len(memory.tokens))  # it held this much before: it fits
            self._hot[agent_id] = memory  # its ``updated`` is unchanged: it was not used

    def abandon(self, agent_id: str) -> None:
        """A turn failed without a cache to return: forget the hot copy (disk keeps the last good one)."""
        self._busy.discard(agent_id)
        self._release(agent_id)

    def idle_owners(self) -> list[AgentMemory | SharedPrefix]:
        """Hot caches no turn holds, and shared prefixes: least recently used first
        (what admission frees first)."""
        return sorted([*self._hot.values(), *self._prefixes.values()], key=lambda o: o.updated)

    def prefixes(self) -> list[SharedPrefix]:
        return list(self._prefixes.values())

    # -- tiers

    def demote(self, owner) -> None:
        """Free an idle owner's blocks: an agent goes hot -> warm (written if
        dirty); a shared prefix is dropped."""
        if owner in self._prefixes:
            del self._prefixes[owner]
            self._release(owner)
            self.prefix_drops += 1
            return
        memory = self._hot.pop(owner)
        if memory.dirty:
            self.write(memory)
        self._release(owner)
        self.demotions += 1

    def write(self, memory: AgentMemory) -> None:
        record = CacheRecord(
            memory.agent_id, self.model_id, self.spec.hash, list(memory.tokens), memory.text,
            memory.created, memory.updated, memory.cache,
        )
        self.store.save(record)
        memory.dirty = False

    def flush(self) -> int:
        """Write every dirty hot cache; return how many were written."""
        dirty = [m for m in self._hot.values() if m.dirty]
        for memory in dirty:
            self.write(memory)
        return len(dirty)

    def drop_all(self) -> None:
        """Forget every hot cache and shared prefix (their memory goes with them).
        Call only when none is dirty and no turn holds one."""
        assert not self._busy, "drop_all() with turns in progress: their caches would be lost"
        for owner in [*self._hot, *self._prefixes]:
            self._release(owner)
        self._hot.clear()
        self._prefixes.clear()

    def delete(self, agent_id: str) -> None:
        """Forget the agent's cache: the hot copy and its files for this model."""
        self.forget(agent_id)
        self.store.delete(agent_id, self.model_id)

    def forget(self, agent_id: str) -> None:
        """Forget the hot copy only (its files stay)."""
        if agent_id in self._hot:
            del self._hot[agent_id]
        self._release(agent_id)

    def _release(self, owner: str) -> None:
        if owner in self.budget:
            self.budget.release(owner)

    def _admit(self, agent_id: str, tokens: int, running: bool = False) -> None:
        need = _mib(self.budget.bytes_for(tokens, running))
        if not self.budget.fits(tokens, running):
            raise OutOfMemory(
                f"{tokens} tokens of KV cache need {need}; the whole KV budget is {_mib(self.budget.budget_bytes)}"
            )
        while not self.budget.reserve(agent_id, tokens, running):
            victims = [o for o in self.idle_owners() if o is not self._hot.get(agent_id)]
            if not victims:
                held = ", ".join(f"{a} {_mib(self.budget.bytes_of(a))}" for a in self._busy if a in self.budget)
                raise OutOfMemory(
                    f"no room for {tokens} tokens of KV cache ({need}) for {agent_id}: the KV budget of "
                    f"{_mib(self.budget.budget_bytes)} is held by {len(self._busy)} turn(s) in progress "
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
        be cut there (a wrapped sliding window) or there is no free room.
        """
        if any(p.text == text for p in self._prefixes.values()):
            return True
        copy = cache.clone()
        if copy.offset - len(tokens) > copy.trimmable_tokens:
            return False
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


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


def cache_model_id(model_name: str, kv_bits: int = 4, shard: tuple[int, int] | None = None) -> str:
    """Whose caches these are: the model's name, the KV bits when not the default
    4 (caches of one model at 8 bits live apart from its 4-bit ones) and, for a
    tensor-parallel shard, its rank and the group size (each rank keeps its own KV heads)."""
    model_id = model_name if kv_bits == 4 else f"{model_name}@kv{kv_bits}"
    return model_id if shard is None else model_id + shard_suffix(*shard)


def shard_suffix(rank: int, ranks: int) -> str:
    """What ``cache_model_id`` adds for rank ``rank`` of a model sharded over ``ranks``."""
    return f"@rank{rank}of{ranks}"


def cache_layouts(root: Path, model_name: str, kv_bits: int = 4) -> set[int]:
    """Over how many ranks ``model_name``'s caches under ``root`` were kept (1: one
    process): a layout reads only its own (``cache_model_id``)."""
    found = {1} if (root / model_key(cache_model_id(model_name, kv_bits))).is_dir() else set()
    for d in root.glob("*rank0of*"):
        if (m := re.search(r"rank0of(\d+)-[0-9a-f]{8}$", d.name)) and \
                d.name == model_key(cache_model_id(model_name, kv_bits, (0, int(m[1])))):
            found.add(int(m[1]))
    return found


def open_caches(loaded, root=None, budget_bytes: int | None = None, working_copy: bool = False,
                cls: type[AgentCaches] = AgentCaches, kv_bits: int = 4, **options) -> AgentCaches:
    """The agent caches (a ``cls``) of a loaded model (``runtime.models.LoadedModel``)
    in ``root``, a directory or a ``CacheStore`` (default: the user's cache directory), in ``budget_bytes`` of hot
    memory (default: device memory less the weights less headroom).
    ``working_copy``: running turns attend through a float copy of their full
    layers (``Engine.float_attention``), which their reservations include;
    sink models always do.  ``kv_bits``: the cache's quantization (4 or 8), as the engine's.
    ``options``: the rest of ``cls``'s constructor's keywords."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from .device import describe
    from .paths import agents_dir

    if budget_bytes is None:
        weights = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        memory = mx.device_info().get("max_recommended_working_set_size") or describe()["memory_bytes"]
        budget_bytes = default_budget(loaded.spec, weights, memory, bits=kv_bits, sliding_dtype_bytes=loaded.dtype.size)
    working = loaded.dtype.size if working_copy or loaded.spec.attends_in_float else 0
    budget = KVBudget(loaded.spec, budget_bytes, bits=kv_bits, sliding_dtype_bytes=loaded.dtype.size,
                      working_dtype_bytes=working)
    store = root if isinstance(root, CacheStore) else CacheStore(root or agents_dir())
    return cls(store, cache_model_id(loaded.name, kv_bits, loaded.spec.shard), loaded.spec, budget, **options)
