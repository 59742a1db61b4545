"""A loaded model's agent caches: whose they are on disk (``cache_model_id``:
the model, its KV bits and its shard), which shard layouts are kept under a
root (``cache_layouts``), the KV budget a running turn is priced in
(``kv_budget``), and the hot set opened on them (``open_caches``)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .agent_cache import AgentCaches, CacheDisk
from .block_pool import KVBudget, default_budget
from ..store.cache_file import CacheStore, model_key

__all__ = ["cache_layouts", "cache_model_id", "kv_budget", "open_caches", "shard_suffix"]


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


def kv_budget(loaded, budget_bytes: int, kv_bits: int = 4) -> KVBudget:
    """The KV budget of ``loaded``'s agents in ``budget_bytes``, as
    ``open_caches`` counts it: a running turn with its float working copy
    (``kv.DequantizingKVCache``, as far as ``kv.device_float_head`` says)."""
    from ..kv import device_float_head

    return KVBudget(loaded.spec, budget_bytes, bits=kv_bits, sliding_dtype_bytes=loaded.dtype.size,
                    working_dtype_bytes=loaded.dtype.size, working_head=device_float_head(loaded.model))


def open_caches(loaded, root: CacheDisk | CacheStore | os.PathLike | str | None = None, budget_bytes: int | None = None,
                kv_bits: int = 4, **options) -> AgentCaches:
    """The agent caches of a loaded model (``runtime.model.models.LoadedModel``) on ``root``:
    a ``CacheDisk``, or a ``CacheStore`` or its directory (default: the user's cache
    directory) to reach straight; in ``budget_bytes`` of hot memory (default:
    device memory less the weights less headroom).
    Running turns attend through a float copy of their full layers' first
    blocks and open block (``kv.DequantizingKVCache``, as far as
    ``kv.device_float_head`` says), which their reservations include.
    ``kv_bits``: the cache's quantization (4, 8 or 16), as the engine's.
    ``options``: the rest of ``AgentCaches``'s keywords."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from ..model.device import describe
    from ..paths import agents_dir

    if budget_bytes is None:
        weights = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        memory = mx.device_info().get("max_recommended_working_set_size") or describe()["memory_bytes"]
        budget_bytes = default_budget(loaded.spec, weights, memory, bits=kv_bits, sliding_dtype_bytes=loaded.dtype.size)
    budget = kv_budget(loaded, budget_bytes, kv_bits)
    if root is None or isinstance(root, (str, os.PathLike)):
        root = CacheStore(root or agents_dir())
    return AgentCaches(root, cache_model_id(loaded.name, kv_bits, loaded.spec.shard), loaded.spec, budget, **options)
