"""The kinds of layer cache there are, by the tag a manifest entry names
(``BY_KIND``): what cache files are written and read through, and what a new
sequence's caches are made of (``make_sequence_cache``). A kind joins by
``register``ing its class, in its own module; nothing else names it."""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from .layer import LayerCache, SequenceCache

__all__ = ["BY_KIND", "make_sequence_cache", "register", "unregister"]

# The class that reads each manifest kind (``LayerCache.rebuild``), in the order registered.
BY_KIND: dict[str, type[LayerCache]] = {}


def register(cls: type[LayerCache]) -> type[LayerCache]:
    """Make ``cls`` a kind: manifest entries of its ``KINDS`` are checked and read
    through it, and ``make_sequence_cache`` offers it each of mlx-lm's caches.
    Returns ``cls`` (a class decorator). Raises ``ValueError`` for a tag another
    kind holds."""
    taken = [kind for kind in cls.KINDS if BY_KIND.get(kind, cls) is not cls]
    if taken:
        raise ValueError(f"manifest kinds {taken} are already another kind's")
    BY_KIND.update(dict.fromkeys(cls.KINDS, cls))
    return cls


def unregister(cls: type[LayerCache]) -> None:
    """Forget a kind ``register`` made (a test's own)."""
    for kind in cls.KINDS:
        if BY_KIND.get(kind) is cls:
            del BY_KIND[kind]


def make_sequence_cache(model: nn.Module, bits: int = 4, group_size: int = 64) -> SequenceCache:
    """Empty caches for one sequence, one of ours for each of mlx-lm's: the
    first kind whose ``replacing`` takes it (``SequenceQuantizedKVCache`` for
    full layers, ``WindowKVCache`` for sliding layers, ``StateCache`` for
    recurrent ones). Raises ``ValueError`` for a cache no kind takes."""
    kinds = list(dict.fromkeys(BY_KIND.values()))
    caches = SequenceCache()
    for c in make_prompt_cache(model):
        made = next((made for kind in kinds if (made := kind.replacing(c, bits, group_size)) is not None), None)
        if made is None:
            raise ValueError(f"unsupported cache type {type(c).__name__}")
        caches.append(made)
    return caches
