"""Full attention layers: a 4-bit (or 8-bit) quantized cache of record
(``SequenceQuantizedKVCache``), and the same record attended over through a
float working copy (``DequantizingKVCache``) -- on the CPU, where MLX's
quantized matmul is slow, for attention sinks (GPT-OSS), which the quantized
SDPA refuses, and for MLA, whose mlx-lm attention takes no quantized triples.

Scales and biases are always 16-bit, so Q4 with group 64 costs 0.5 + 4/64
bytes an element (0.28 of fp16): float16 when the model computes in float32
(``mx.quantized_matmul`` takes float32 queries with float16 scales directly,
as fast as with float32 scales, so nothing is cast on the quantized path),
else the model's own half type (bfloat16 queries with float16 scales would
promote the attention output, and so the whole model, to float32).
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import QuantizedKVCache, _BaseCache, create_attention_mask

from ..cache_records import DEQUANTIZING, PARTS, QNAMES, QUANTIZED
from .layer import Trimmed
from .quantize import Triple, check_format, grown, quantize, quantize_unpack, unpack

__all__ = ["DequantizingKVCache", "SequenceQuantizedKVCache"]


class SequenceQuantizedKVCache(Trimmed, QuantizedKVCache):
    """mlx-lm's single-sequence ``QuantizedKVCache`` with 16-bit scales and biases
    (float16 for a float32 model). Buffers grow in steps of ``step`` positions.
    ``bits`` routes mlx-lm's attention to ``quantized_scaled_dot_product_attention``."""

    KINDS = (QUANTIZED,)
    float_keys = attends_new = False

    def __init__(self, group_size: int = 64, bits: int = 4):
        check_format(group_size, bits)
        super().__init__(group_size=group_size, bits=bits)

    def update_and_fetch(self, keys, values):
        self.append(quantize(keys, self.group_size, self.bits), quantize(values, self.group_size, self.bits))
        return self.keys_and_values()

    def append(self, keys: Triple, values: Triple) -> None:
        """Store quantized triples of shape (B, H, S, ...) after the cached tokens."""
        prev, S = self.offset, keys[0].shape[2]
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            capacity = (prev + S + self.step - 1) // self.step * self.step
            old_k = self.keys or (None,) * 3
            old_v = self.values or (None,) * 3
            self.keys = tuple(grown(o, prev, capacity, n) for o, n in zip(old_k, keys))
            self.values = tuple(grown(o, prev, capacity, n) for o, n in zip(old_v, values))
        self.offset += S
        for dst, src in zip((*self.keys, *self.values), (*keys, *values)):
            dst[..., prev : self.offset, :] = src

    def size(self):  # the parent inherits _BaseCache's constant 0
        return self.offset

    @property
    def nbytes(self):  # the parent raises on an empty cache
        return 0 if self.keys is None else super().nbytes

    @property
    def trimmable_tokens(self) -> int:
        return self.offset

    def view(self, float_attention: bool):
        return DequantizingKVCache(quantized=self) if float_attention else self

    @property
    def arrays(self):
        return self.state

    def describe(self):
        entry = {"kind": QUANTIZED, "offset": self.offset, "bits": self.bits, "group_size": self.group_size}
        return entry, dict(zip(QNAMES, (*self.keys, *self.values))) if self.offset else {}, {}

    @classmethod
    def rebuild(cls, entry, arrays):
        q = cls(entry["group_size"], entry["bits"])
        if entry["offset"]:
            q.keys = tuple(arrays[f"k_{p}"] for p in PARTS)
            q.values = tuple(arrays[f"v_{p}"] for p in PARTS)
            q.offset = entry["offset"]
        return q


class DequantizingKVCache(Trimmed, _BaseCache):
    """A Q4 cache of record (``quantized``) attended over through a float working copy.

    It has no ``bits``, so mlx-lm runs ``mx.fast.scaled_dot_product_attention``
    (which takes sinks) on the floats this returns. The copy is made on first use
    (``_unpack`` of the record, bit for bit ``mx.dequantize``) and extended by
    each update's new tokens as they are written, so it always holds exactly
    dequantize(record) and a decode step unpacks one token, not the context. It
    lives as long as this object; the record is what is stored and copied.
    In a decode forward the copy runs ahead of the record by ``unwritten``
    tokens, whose Q4 rows the forward's ``BatchQuantizedKVCache`` holds.
    """

    KINDS = (DEQUANTIZING,)
    float_keys = attends_new = True

    def __init__(self, group_size: int = 64, bits: int = 4, quantized: Optional[QuantizedKVCache] = None):
        self.quantized = quantized if quantized is not None else SequenceQuantizedKVCache(group_size, bits)
        self._float: Optional[tuple[mx.array, mx.array]] = None  # same positions as the record
        self.unwritten = 0  # decoded tokens after the record's, whose Q4 rows a ``BatchQuantizedKVCache`` holds

    @property
    def offset(self) -> int:
        return self.quantized.offset + self.unwritten

    @property
    def group_size(self) -> int:
        return self.quantized.group_size

    @property
    def kv_bits(self) -> int:
        return self.quantized.bits

    def update_and_fetch(self, keys, values):
        if self.unwritten:
            raise RuntimeError("a decoded token's Q4 rows are not in the record yet (BatchQuantizedKVCache.flush)")
        q, prev = self.quantized, self.quantized.offset
        *qk, new_k = quantize_unpack(keys, q.group_size, q.bits)
        *qv, new_v = quantize_unpack(values, q.group_size, q.bits)
        q.append(tuple(qk), tuple(qv))
        capacity = q.keys[0].shape[2]
        if self._float is None:  # first use: the whole record at once
            self._float = tuple(unpack(t, q.group_size, q.bits, keys.dtype) for t in (q.keys, q.values))
        else:
            fk, fv = self._float
            if fk.shape[2] != capacity:  # the record grew
                fk, fv = grown(fk, prev, capacity, new_k), grown(fv, prev, capacity, new_v)
            fk[..., prev : q.offset, :] = new_k
            fv[..., prev : q.offset, :] = new_v
            self._float = (fk, fv)
        fk, fv = self._float
        return fk[..., : q.offset, :], fv[..., : q.offset, :]

    def attend_new(self, new_k: mx.array, new_v: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Add decoded tokens (1, H, n, D) to the working copy only, given as the
        unpack of their Q4 rows (which their ``BatchQuantizedKVCache`` writes
        to the record later); return what each attends over: the keys and
        values up to and including it."""
        q, prev, n = self.quantized, self.offset, new_k.shape[2]
        if self._float is None:  # first use: the whole record at once
            self._float = (None, None) if q.keys is None else tuple(
                unpack(t, q.group_size, q.bits, new_k.dtype) for t in (q.keys, q.values))
        fk, fv = self._float
        if fk is None or fk.shape[2] < prev + n:
            capacity = (prev + n + q.step - 1) // q.step * q.step
            fk, fv = grown(fk, prev, capacity, new_k), grown(fv, prev, capacity, new_v)
        fk[..., prev : prev + n, :] = new_k
        fv[..., prev : prev + n, :] = new_v
        self._float = (fk, fv)
        self.unwritten += n
        return [(fk[..., : prev + j + 1, :], fv[..., : prev + j + 1, :]) for j in range(n)]

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self):
        return self.quantized.state

    @state.setter
    def state(self, v):
        self.quantized = SequenceQuantizedKVCache.from_state(v)
        self._float, self.unwritten = None, 0

    def is_trimmable(self):
        return True

    def trim(self, n):  # the copy keeps its positions; live length follows the record
        return self.quantized.trim(n)

    def size(self):
        return self.offset

    def empty(self):
        return self.quantized.empty()

    @property
    def nbytes(self):
        q = self.quantized
        return 0 if q.keys is None else q.nbytes

    @property
    def trimmable_tokens(self) -> int:
        return self.offset

    def view(self, float_attention: bool):
        return DequantizingKVCache(quantized=self.quantized)  # a fresh working copy

    @property
    def arrays(self):
        return self.state, self._float

    def describe(self):
        entry, blocks, rings = self.quantized.describe()
        return {**entry, "kind": DEQUANTIZING}, blocks, rings

    @classmethod
    def rebuild(cls, entry, arrays):
        return cls(quantized=SequenceQuantizedKVCache.rebuild(entry, arrays))
