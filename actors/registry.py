"""The model registry: which model the GPU actor has loaded, with its engine and
its agents' caches.

It lives on the GPU actor's thread (a model is MLX state) and is driven by it:
the GPU actor asks it to ``load`` at start and on a swap, and to ``unload``
after an idle time.  Swapping is the GPU actor's job around it (drain the
batch, hand every dirty cache to persistence, then ``unload`` and ``load``), because
only the GPU actor knows what is in flight.
"""

from __future__ import annotations

import dataclasses
import gc
import logging

import mlx.core as mx

from semantic.runtime.memory.agent_cache import AgentCaches, CacheDisk
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.engine.engine import Engine
from semantic.runtime.engine.engine_options import EngineOptions
from semantic.runtime.memory.model_caches import open_caches
from semantic.runtime.model.models import LoadedModel, load
from semantic.runtime.engine.row_counts import RowCounts, key

from .lockstep import Lockstep

__all__ = ["ModelRegistry"]

log = logging.getLogger("semantic.actors")


class ModelRegistry:
    """The loaded model, its ``Engine`` and its agents' caches (GPU thread only)."""

    def __init__(self, store: CacheStore, budget_bytes: int | None, options: EngineOptions,
                 catalogue: dict[str, str | LoadedModel] | None = None, group: mx.distributed.Group | None = None,
                 row_counts: dict[str, RowCounts] | None = None):
        self.group = group  # load this rank's shard of every model (``actors.lockstep``)
        self.catalogue = catalogue or {}  # models turns may name (``runtime.model.models.catalogue``)
        self.store = store
        self.budget_bytes = budget_bytes
        self.options = options  # what each model's engine is built with
        self.loaded: LoadedModel | None = None
        self.engine: Engine | None = None
        self.caches: AgentCaches | None = None
        self.name: str | None = None  # the model asked for last; kept across an idle unload
        self.row_counts = row_counts if row_counts is not None else {}  # measured, by ``runtime.engine.row_counts.key``
        self.measured: list[tuple[str, RowCounts]] = []  # measured at a load, for persistence to keep
        self._counts = (0, 0)  # demotions and prefix drops of models unloaded: counters never go back

    def load(self, model: str | LoadedModel, disk: CacheDisk) -> None:
        """Load ``model`` (a name in the catalogue, another name, or one loaded
        already) and build its engine and its caches on ``disk``.  Raises
        ``ModelError``; on failure nothing is loaded."""
        assert self.loaded is None, "load() over a loaded model: unload() first"
        source = self.catalogue.get(model, model) if isinstance(model, str) else model
        loaded = source if isinstance(source, LoadedModel) else load(source, progress=False, group=self.group)
        if isinstance(model, str):
            loaded = dataclasses.replace(loaded, name=model)  # the name turns ask for it by (a shared one unchanged)
        shared = None if self.group is None else Lockstep(self.group).rank0_tokens
        o = self.options
        engine = Engine(loaded.model, loaded.tokenizer, prefill_chunk=o.prefill_chunk, kv_bits=o.kv_bits,
                        decode_rows=o.decode_rows, batch_prefill=o.batch_prefill, speculation=o.speculation,
                        shared_tokens=shared)
        if self.group is None:  # ranks must run the same forwards: a sharded model keeps one count
            k = key(engine)
            if k not in self.row_counts:
                self.row_counts[k] = engine.calibrate()
                self.measured.append((k, self.row_counts[k]))
            engine.use_row_counts(self.row_counts[k])
        demotions, prefix_drops = self._counts  # the counters go on from the models unloaded

        def caches_in(budget: int | None) -> AgentCaches:
            return open_caches(loaded, disk, budget, kv_bits=engine.kv_bits,
                               demotions=demotions, prefix_drops=prefix_drops)

        caches = caches_in(self.budget_bytes)
        if self.group is not None and self.budget_bytes is None:
            # Every rank must decide alike (admit, evict, preempt): all take the smallest default budget.
            caches = caches_in(_smallest(caches.budget.budget_bytes, self.group))
        self.loaded, self.caches, self.name, self.engine = loaded, caches, loaded.name, engine
        log.info("model %s loaded; KV budget %.0f MiB", loaded.name, caches.budget.budget_bytes / 2**20)

    def unload(self) -> None:
        """Drop the model, engine and caches (the caller handed the dirty ones to persistence)."""
        if self.caches is not None:
            self._counts = (self.caches.demotions, self.caches.prefix_drops)
            self.caches.drop_all()
        self.loaded = self.engine = self.caches = None
        gc.collect()
        mx.clear_cache()

    @property
    def context_length(self) -> int:
        return self.loaded.context_length if self.loaded else 0


def _smallest(n: int, group: mx.distributed.Group) -> int:
    """The smallest ``n`` over the ranks of ``group`` (in MiB: int32 on the wire)."""
    return int(mx.distributed.all_min(mx.array([n >> 20], dtype=mx.int32), group=group).item()) << 20
