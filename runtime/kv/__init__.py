"""A sequence's KV cache: one ``LayerCache`` per layer, of one kind per module,
held as a ``SequenceCache``.

* ``layer``: what every kind answers (``LayerCache``), and one sequence's
  caches as one object (``SequenceCache``);
* ``quantize``: MLX's affine quantization with 16-bit scales, its exact
  unpacking, and a closed block's layout (keys per channel, values per token);
* ``quantized``: full attention, blocks quantized as they fill
  (``SequenceQuantizedKVCache``), attended over through a float working copy
  of its first blocks and its open one and the rest packed
  (``DequantizingKVCache``);
* ``window``: sliding-window attention (``WindowKVCache``);
* ``state``: recurrent layers (``StateCache``).

Batching them in one forward is ``runtime.batch_cache``'s job.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache, make_prompt_cache

from .layer import LayerCache, SequenceCache
from .quantized import CPU_FLOAT_HEAD, DequantizingKVCache, SequenceQuantizedKVCache, device_float_head
from .state import StateCache
from .window import WindowKVCache

__all__ = [
    "BY_KIND",
    "CPU_FLOAT_HEAD",
    "DequantizingKVCache",
    "LayerCache",
    "SequenceCache",
    "SequenceQuantizedKVCache",
    "StateCache",
    "WindowKVCache",
    "device_float_head",
    "make_sequence_cache",
]

# The class that reads each manifest kind (``LayerCache.rebuild``).
BY_KIND: dict[str, type[LayerCache]] = {
    kind: cls
    for cls in (SequenceQuantizedKVCache, WindowKVCache, StateCache)
    for kind in cls.KINDS
}


def make_sequence_cache(model: nn.Module, bits: int = 4, group_size: int = 64) -> SequenceCache:
    """Empty caches for one sequence, one of ours for each of mlx-lm's:
    ``SequenceQuantizedKVCache`` for full layers, ``WindowKVCache`` for sliding
    layers, ``StateCache`` for recurrent ones. Raises ``ValueError`` for other
    cache kinds."""
    caches = SequenceCache()
    for c in make_prompt_cache(model):  # mlx-lm's kinds, in the order that tells them apart
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise ValueError("sliding layers that keep leading tokens cannot be batched")
            caches.append(WindowKVCache(c.max_size))
        elif type(c) is ArraysCache:
            caches.append(StateCache(len(c.cache)))
        elif isinstance(c, KVCache):
            caches.append(SequenceQuantizedKVCache(group_size, bits))
        else:
            raise ValueError(f"unsupported cache type {type(c).__name__}")
    return caches
