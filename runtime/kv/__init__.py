"""A sequence's KV cache: one ``LayerCache`` per layer, of one kind per module,
held as a ``SequenceCache``.

* ``layer``: what every kind answers (``LayerCache``), and one sequence's
  caches as one object (``SequenceCache``);
* ``kinds``: the kinds by manifest tag (``BY_KIND``), which a kind's class
  joins with ``register``, and a new sequence's caches made of them
  (``make_sequence_cache``);
* ``quantize``: MLX's affine quantization with 16-bit scales, its exact
  unpacking, and a closed block's layout (keys per channel, values per token);
* ``quantized``: full attention, blocks quantized as they fill
  (``SequenceQuantizedKVCache``);
* ``working_copy``: what a running sequence attends over: a float working
  copy of its first blocks and its open one, the rest packed
  (``DequantizingKVCache``);
* ``window``: sliding-window attention (``WindowKVCache``);
* ``state``: recurrent layers (``StateCache``).

A new kind is a module here whose class ``register``s itself; importing it
here makes it known. Batching them in one forward is ``runtime.engine.batch_cache``'s job.
"""

from __future__ import annotations

from .kinds import BY_KIND, make_sequence_cache, register, unregister
from .layer import LayerCache, SequenceCache
from .quantized import SequenceQuantizedKVCache
from .state import StateCache
from .window import WindowKVCache
from .working_copy import (CPU_FLOAT_HEAD, CPU_UNPACKED_ROWS, DequantizingKVCache, device_float_head, float_head,
                           unpacked_rows)

__all__ = [
    "BY_KIND",
    "CPU_FLOAT_HEAD",
    "CPU_UNPACKED_ROWS",
    "DequantizingKVCache",
    "LayerCache",
    "SequenceCache",
    "SequenceQuantizedKVCache",
    "StateCache",
    "WindowKVCache",
    "device_float_head",
    "float_head",
    "make_sequence_cache",
    "register",
    "unpacked_rows",
    "unregister",
]
