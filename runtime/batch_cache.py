"""Batched quantized KV caches: many agents' Q4 caches decoded together.

mlx-lm batches full-precision caches (``BatchKVCache``) and quantizes single
sequences (``QuantizedKVCache``) but does not batch quantized caches. The
classes here fill that gap through mlx-lm's own cache protocol: models call
``update_and_fetch`` and ``make_mask`` and read ``offset``; a ``bits``
attribute routes ``mlx_lm.models.base.scaled_dot_product_attention`` to
``quantized_scaled_dot_product_attention``.

Layer kinds:

* full attention: ``BatchQuantizedKVCache`` (Q4/Q8 triples, left padded);
* full attention with attention sinks (GPT-OSS): ``DequantizingBatchKVCache``,
  which stores the same triples but has no ``bits`` and hands the model
  transient dequantized K/V, because the quantized SDPA refuses sinks;
* sliding window: ``BatchSlidingKVCache``, mlx-lm's ``BatchRotatingKVCache``
  (full precision, as the window bounds it) with one mask bug fixed.

Single sequences (prefill alone, an agent's cache between turns) use
``SequenceQuantizedKVCache`` / ``DequantizingKVCache`` and mlx-lm's
``RotatingKVCache``; ``merge_caches`` and ``extract_cache`` move rows between
the two forms without dequantizing.

Scales and biases are always 16-bit, so Q4 with group 64 costs 0.5 + 4/64
bytes an element (0.28 of fp16): float16 when the model computes in float32
(``mx.quantized_matmul`` takes float32 queries with float16 scales directly,
as fast as with float32 scales, so nothing is cast on the quantized path),
else the model's own half type (bfloat16 queries with float16 scales would
promote the attention output, and so the whole model, to float32).
"""

from __future__ import annotations

import copy
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import (
    BatchRotatingKVCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
    make_prompt_cache,
)

from .model_spec import FULL, ModelCacheSpec

__all__ = [
    "BatchQuantizedKVCache",
    "BatchSlidingKVCache",
    "copy_cache",
    "DequantizingBatchKVCache",
    "DequantizingKVCache",
    "SequenceQuantizedKVCache",
    "extend_caches",
    "extract_cache",
    "filter_caches",
    "make_batch_cache",
    "make_sequence_cache",
    "merge_caches",
    "prefill_view",
]

Triple = tuple[mx.array, mx.array, mx.array]  # (packed uint32 weights, scales, biases)


def _check(group_size: int, bits: int) -> None:
    if bits not in (4, 8):
        raise ValueError(f"KV cache bits must be 4 or 8, not {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"KV cache group size must be 32, 64 or 128, not {group_size}")


def _scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Storage dtype of scales and biases for keys of ``dtype``."""
    return dtype if dtype in (mx.float16, mx.bfloat16) else mx.float16


def _quantize(x: mx.array, group_size: int, bits: int) -> Triple:
    w, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    dt = _scale_dtype(x.dtype)
    return w, scales.astype(dt), biases.astype(dt)


def _dequantize(q: Triple, group_size: int, bits: int, dtype: mx.Dtype) -> mx.array:
    w, scales, biases = q
    # Casting scales first: mx.dequantize(float16 scales, dtype=float32) is 3-9x slower on CPU.
    return mx.dequantize(w, scales.astype(dtype), biases.astype(dtype), group_size=group_size, bits=bits)


def _unpack(q: Triple, group_size: int, bits: int, dtype: mx.Dtype) -> mx.array:
    """``_dequantize`` as plain elementwise ops, bit for bit the same on the CPU
    (tests check it).  ``mx.dequantize`` costs ~0.15 ms a call on the CPU
    whatever the size, which for one decoded token per layer is most of a step."""
    w, scales, biases = q
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    n = w.shape[-1] * 32 // bits
    codes = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], n // group_size, group_size)
    x = codes.astype(dtype) * scales.astype(dtype)[..., None] + biases.astype(dtype)[..., None]
    return x.reshape(*w.shape[:-1], n)


@mx.compile
def _quantize_unpack(x: mx.array, group_size: int, bits: int) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``_quantize(x)`` and its ``_unpack``, compiled: one fused kernel instead of
    a dozen small ops, per layer and decode step."""
    q = _quantize(x, group_size, bits)
    return (*q, _unpack(q, group_size, bits, x.dtype))


def _zeros(B: int, H: int, L: int, D: int, group_size: int, bits: int, dtype: mx.Dtype) -> Triple:
    return (
        mx.zeros((B, H, L, D * bits // 32), dtype=mx.uint32),
        mx.zeros((B, H, L, D // group_size), dtype=dtype),
        mx.zeros((B, H, L, D // group_size), dtype=dtype),
    )


def _head_dim(q: Triple, bits: int) -> int:
    return q[0].shape[-1] * 32 // bits


class SequenceQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's single-sequence ``QuantizedKVCache`` with 16-bit scales and biases
    (float16 for a float32 model, as in the batch).

    The parent allocates its first buffer in the model's dtype and keeps the
    buffer's dtype when it grows, so starting from zero-length 16-bit buffers
    is enough. A sequence prefilled here merges into a batch bit for bit.
    """

    def __init__(self, group_size: int = 64, bits: int = 4):
        _check(group_size, bits)
        super().__init__(group_size=group_size, bits=bits)

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            B, H, _, Dk = keys.shape
            dt = _scale_dtype(keys.dtype)
            self.keys = _zeros(B, H, 0, Dk, self.group_size, self.bits, dt)
            self.values = _zeros(B, H, 0, values.shape[-1], self.group_size, self.bits, dt)
        return super().update_and_fetch(keys, values)

    def size(self):  # the parent inherits _BaseCache's constant 0
        return self.offset

    @property
    def nbytes(self):  # the parent raises on an empty cache
        return 0 if self.keys is None else super().nbytes


class DequantizingKVCache(_BaseCache):
    """A single-sequence Q4 cache for models with attention sinks.

    Stores a ``SequenceQuantizedKVCache`` (``self.quantized``) but has no
    ``bits`` attribute, so mlx-lm calls ``mx.fast.scaled_dot_product_attention``
    (which supports sinks) with the transient dequantized K/V this returns.
    """

    def __init__(self, group_size: int = 64, bits: int = 4, quantized: Optional[QuantizedKVCache] = None):
        self.quantized = quantized if quantized is not None else SequenceQuantizedKVCache(group_size, bits)

    @property
    def offset(self) -> int:
        return self.quantized.offset

    @property
    def group_size(self) -> int:
        return self.quantized.group_size

    @property
    def kv_bits(self) -> int:
        return self.quantized.bits

    def update_and_fetch(self, keys, values):
        k, v = self.quantized.update_and_fetch(keys, values)
        return (
            _dequantize(k, self.group_size, self.kv_bits, keys.dtype),
            _dequantize(v, self.group_size, self.kv_bits, keys.dtype),
        )

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @property
    def state(self):
        return self.quantized.state

    @state.setter
    def state(self, v):
        self.quantized = SequenceQuantizedKVCache.from_state(v)

    def is_trimmable(self):
        return True

    def trim(self, n):
        return self.quantized.trim(n)

    def size(self):
        return self.offset

    def empty(self):
        return self.quantized.empty()

    @property
    def nbytes(self):
        q = self.quantized
        return 0 if q.keys is None else q.nbytes


class _QuantizedRows(_BaseCache):
    """Left-padded rows of quantized K/V; the two public subclasses differ in
    what ``update_and_fetch`` returns.

    Like mlx-lm's ``BatchKVCache`` the rows are right aligned at ``_idx`` and
    ``left_padding`` says how many leading positions of each row are unused.
    Three agents with 3, 1 and 4 cached tokens merge and decode one token:

        position        0  1  2  3 | 4
        row 0           .  a  a  a | a    left_padding 1, offset 3 -> 4
        row 1           .  .  .  b | b    left_padding 3, offset 1 -> 2
        row 2           c  c  c  c | c    left_padding 0, offset 4 -> 5
                                  _idx 4 -> 5

    ``offset`` (per row, an ``mx.array``) is the row's own token count, the
    RoPE position of its next token. Each position holds a quantized triple
    per head: ``keys = (weights uint32 (B, H, capacity, D*bits/32), scales
    16-bit (B, H, capacity, D/group), biases (same))``; capacity
    grows in steps of ``step`` and only ``[..., :_idx, :]`` is live.
    """

    step = 256

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 4):
        _check(group_size, bits)
        self.keys: Optional[Triple] = None
        self.values: Optional[Triple] = None
        self.left_padding = mx.array(list(left_padding), dtype=mx.int32)
        self.offset = mx.array([-l for l in left_padding], dtype=mx.int32)
        self._idx = 0
        self.group_size = group_size
        self.kv_bits = bits

    def _store(self, qk: Triple, qv: Triple) -> None:
        """Append quantized keys and values (triples of shape (B, H, S, ...)) to every row."""
        B, H, S, _ = qk[0].shape
        prev = self._idx
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            n = (self.step + S - 1) // self.step * self.step
            dt = qk[1].dtype if self.keys is None else self.keys[1].dtype
            new_k = _zeros(B, H, n, _head_dim(qk, self.kv_bits), self.group_size, self.kv_bits, dt)
            new_v = _zeros(B, H, n, _head_dim(qv, self.kv_bits), self.group_size, self.kv_bits, dt)
            if self.keys is None:
                self.keys, self.values = new_k, new_v
            else:
                # Drop the unused tail so live positions stay contiguous.
                old_k = tuple(x[..., :prev, :] for x in self.keys)
                old_v = tuple(x[..., :prev, :] for x in self.values)
                self.keys = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_k, new_k))
                self.values = tuple(mx.concatenate([a, b], axis=2) for a, b in zip(old_v, new_v))
        self.offset = self.offset + S
        self._idx += S
        for dst, src in zip(self.keys, qk):
            dst[..., prev : self._idx, :] = src
        for dst, src in zip(self.values, qv):
            dst[..., prev : self._idx, :] = src

    def _live(self) -> tuple[Triple, Triple]:
        return (
            tuple(x[..., : self._idx, :] for x in self.keys),
            tuple(x[..., : self._idx, :] for x in self.values),
        )

    def make_mask(self, N: int, return_array: bool = False, window_size: Optional[int] = None, **kwargs):
        # Always an array: rows differ in padding. Shape (B, 1, N, _idx + N).
        return create_causal_mask(N, offset=self._idx, window_size=window_size, left_padding=self.left_padding)

    @property
    def state(self):
        return self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.kv_bits

    @state.setter
    def state(self, v):
        self.keys, self.values, self.offset, self.left_padding, self._idx, self.group_size, self.kv_bits = v

    def is_trimmable(self):
        return True

    def trim(self, n: int) -> int:
        """Drop the last ``n`` positions of every row; returns how many went."""
        n = min(self._idx, n)
        self._idx -= n
        self.offset = self.offset - n
        return n

    def size(self):
        return self._idx

    def empty(self):
        return self.keys is None

    @property
    def nbytes(self):
        if self.keys is None:
            return 0
        return sum(x.nbytes for x in (*self.keys, *self.values))

    @property
    def batch_size(self) -> int:
        return self.offset.shape[0]

    def filter(self, batch_indices) -> None:
        """Keep only the given rows (in that order) and drop padding they all share."""
        idx = mx.array(batch_indices, dtype=mx.int32)
        if self.keys is not None:
            self.keys = tuple(x[idx] for x in self.keys)
            self.values = tuple(x[idx] for x in self.values)
        self.offset = self.offset[idx]
        self.left_padding = self.left_padding[idx]
        shift = min(self.left_padding.tolist(), default=0)
        if shift > 0:
            if self.keys is not None:
                self.keys = tuple(x[..., shift:, :] for x in self.keys)
                self.values = tuple(x[..., shift:, :] for x in self.values)
            self._idx -= shift
            self.left_padding = self.left_padding - shift

    def extend(self, other: "_QuantizedRows") -> None:
        """Append the rows of ``other`` (same class, bits and group size) after ours."""
        if type(other) is not type(self) or (other.group_size, other.kv_bits) != (self.group_size, self.kv_bits):
            raise ValueError("can only extend with a cache of the same class, bits and group size")
        if self.keys is None and other.keys is None:
            self.left_padding = mx.concatenate([self.left_padding, other.left_padding])
            self.offset = mx.concatenate([self.offset, other.offset])
            self._idx = max(self._idx, other._idx)
            return
        ref_k, ref_v = (self.keys, self.values) if self.keys is not None else (other.keys, other.values)
        max_idx = max(self._idx, other._idx)
        capacity = max(c.keys[0].shape[2] for c in (self, other) if c.keys is not None)

        # Right-align both at max_idx and give them the same capacity.
        def pad(c):
            k, v = c.keys, c.values
            if k is None:
                k = tuple(mx.zeros((c.batch_size, x.shape[1], 0, x.shape[3]), dtype=x.dtype) for x in ref_k)
                v = tuple(mx.zeros((c.batch_size, x.shape[1], 0, x.shape[3]), dtype=x.dtype) for x in ref_v)
            left = max_idx - c._idx
            right = capacity - k[0].shape[2] - left

            def one(x):
                r = right
                if r < 0:  # only unused capacity lies past max_idx
                    x, r = x[..., :r, :], 0
                return mx.pad(x, [(0, 0), (0, 0), (left, r), (0, 0)]) if left or r else x

            return tuple(map(one, k)), tuple(map(one, v)), c.offset, c.left_padding + left

        (k1, v1, o1, p1), (k2, v2, o2, p2) = pad(self), pad(other)
        # astype: mixed scale dtypes would promote to float32.
        self.keys = tuple(mx.concatenate([a, b.astype(a.dtype)]) for a, b in zip(k1, k2))
        self.values = tuple(mx.concatenate([a, b.astype(a.dtype)]) for a, b in zip(v1, v2))
        self.offset = mx.concatenate([o1, o2])
        self.left_padding = mx.concatenate([p1, p2])
        self._idx = max_idx

    def _extract_quantized(self, idx: int) -> SequenceQuantizedKVCache:
        cache = SequenceQuantizedKVCache(self.group_size, self.kv_bits)
        if self.keys is None:
            return cache
        pad = self.left_padding[idx].item()
        cache.keys = tuple(mx.contiguous(x[idx : idx + 1, :, pad : self._idx]) for x in self.keys)
        cache.values = tuple(mx.contiguous(x[idx : idx + 1, :, pad : self._idx]) for x in self.values)
        cache.offset = self._idx - pad
        mx.eval(cache.keys, cache.values)
        return cache

    @classmethod
    def _merge_quantized(cls, caches: Sequence[Optional[QuantizedKVCache]], group_size: int, bits: int):
        rows = [c for c in caches if c is not None]
        if rows:
            group_size, bits = rows[0].group_size, rows[0].bits
        if any((c.group_size, c.bits) != (group_size, bits) for c in rows):
            raise ValueError("cannot merge caches with different bits or group sizes")
        # QuantizedKVCache.size() is the base class's 0, so lengths come from offset.
        lengths = [0 if c is None or c.keys is None else c.offset for c in caches]
        T = max(lengths, default=0)
        padding = [T - n for n in lengths]
        cache = cls(padding, group_size, bits)
        if T == 0:
            return cache
        ref = next(c for c in rows if c.offset > 0)
        B, H = len(caches), ref.keys[0].shape[1]
        dt = _scale_dtype(ref.keys[1].dtype)
        keys = _zeros(B, H, T, _head_dim(ref.keys, bits), group_size, bits, dt)
        values = _zeros(B, H, T, _head_dim(ref.values, bits), group_size, bits, dt)
        for i, (p, n, c) in enumerate(zip(padding, lengths, caches)):
            if n == 0:
                continue
            # Copies the triples as they are (float32 scales become float16): no dequantization.
            for dst, src in zip(keys, c.keys):
                dst[i : i + 1, :, p:T] = src[..., :n, :]
            for dst, src in zip(values, c.values):
                dst[i : i + 1, :, p:T] = src[..., :n, :]
        cache.keys, cache.values = keys, values
        cache.offset = cache.offset + T
        cache._idx = T
        return cache


class BatchQuantizedKVCache(_QuantizedRows):
    """A batch of quantized full-attention caches, rows left padded (see ``_QuantizedRows``).

    ``update_and_fetch`` returns quantized triples and ``bits`` is set, so mlx-lm
    runs ``quantized_scaled_dot_product_attention`` on them.
    """

    @property
    def bits(self) -> int:
        return self.kv_bits

    def update_and_fetch(self, keys, values):
        self._store(_quantize(keys, self.group_size, self.kv_bits), _quantize(values, self.group_size, self.kv_bits))
        return self._live()

    def extract(self, idx: int) -> SequenceQuantizedKVCache:
        """Row ``idx`` as a standalone, evaluated mlx-lm ``QuantizedKVCache`` of exactly its tokens."""
        return self._extract_quantized(idx)

    @classmethod
    def merge(
        cls, caches: Sequence[Optional[QuantizedKVCache]], group_size: int = 64, bits: int = 4
    ) -> "BatchQuantizedKVCache":
        """Batch single-sequence ``QuantizedKVCache``s (``None`` = an empty row) by copying
        their quantized triples, left padded. ``group_size``/``bits`` apply only when no
        cache is given; raises ``ValueError`` if the caches disagree on them."""
        return cls._merge_quantized(caches, group_size, bits)


class DequantizingBatchKVCache(_QuantizedRows):
    """Stores rows like ``BatchQuantizedKVCache`` but has no ``bits``: attention runs
    in floating point (``mx.fast.scaled_dot_product_attention``) over a dequantized
    working copy of the rows.

    Used where the quantized SDPA cannot or should not run:

    * attention sinks (GPT-OSS), which the quantized SDPA refuses;
    * the CPU, where ``mx.quantized_matmul`` is slow: at 8 rows x 1K tokens
      (SmolLM2 shapes) quantized SDPA takes 2.1x the float SDPA.

    The working copy is kept while rows stay put and extended by each step's
    dequantized new tokens, so a step dequantizes one token per row, not the
    whole context; ``filter`` and ``extend`` drop it and the next step rebuilds
    it once.  It holds exactly ``dequantize(Q4)`` (``_unpack``: the new
    tokens' triples as they are written, unpacked with elementwise ops), so
    outputs equal the quantized path's up to float summation order, and the Q4
    rows stay the cache of record (``extract`` copies them).
    """

    def __init__(self, left_padding: Sequence[int], group_size: int = 64, bits: int = 4):
        super().__init__(left_padding, group_size, bits)
        self._float: Optional[tuple[mx.array, mx.array]] = None  # same layout as the rows
        self._sinks_rows = False  # rows came from (and extract to) DequantizingKVCache

    def update_and_fetch(self, keys, values):
        prev = self._idx
        *qk, new_k = _quantize_unpack(keys, self.group_size, self.kv_bits)
        *qv, new_v = _quantize_unpack(values, self.group_size, self.kv_bits)
        self._store(qk, qv)
        capacity, dtype = self.keys[0].shape[2], keys.dtype
        if self._float is None:
            deq = lambda q: _unpack(q, self.group_size, self.kv_bits, dtype)
            self._float = (deq(self.keys), deq(self.values))
        else:
            fk, fv = self._float
            if fk.shape[2] != capacity:  # the rows grew: grow the copy alike
                grow = lambda x: mx.concatenate(
                    [x[..., :prev, :], mx.zeros((*x.shape[:2], capacity - prev, x.shape[3]), x.dtype)], axis=2
                )
                fk, fv = grow(fk), grow(fv)
            fk[..., prev : self._idx, :] = new_k
            fv[..., prev : self._idx, :] = new_v
            self._float = (fk, fv)
        fk, fv = self._float
        return fk[..., : self._idx, :], fv[..., : self._idx, :]

    def filter(self, batch_indices) -> None:
        self._float = None
        super().filter(batch_indices)

    def extend(self, other: "_QuantizedRows") -> None:
        self._float = None
        super().extend(other)

    def extract(self, idx: int) -> DequantizingKVCache | SequenceQuantizedKVCache:
        """Row ``idx`` as a standalone, evaluated cache of the kind it was merged from."""
        q = self._extract_quantized(idx)
        return DequantizingKVCache(quantized=q) if self._sinks_rows else q

    @classmethod
    def merge(
        cls,
        caches: Sequence[Optional[DequantizingKVCache | QuantizedKVCache]],
        group_size: int = 64,
        bits: int = 4,
    ) -> "DequantizingBatchKVCache":
        """As ``BatchQuantizedKVCache.merge``; takes ``DequantizingKVCache`` or ``QuantizedKVCache`` rows."""
        rows = [c.quantized if isinstance(c, DequantizingKVCache) else c for c in caches]
        cache = cls._merge_quantized(rows, group_size, bits)
        cache._sinks_rows = any(isinstance(c, DequantizingKVCache) for c in caches)
        return cache


class BatchSlidingKVCache(BatchRotatingKVCache):
    """mlx-lm's ``BatchRotatingKVCache`` (full precision, bounded by its window) with
    the mask of a multi-token chunk after the ring has rotated fixed.

    ``_update_concat`` first unrolls the ring, which sets ``_idx`` to ``max_size``,
    then drops one slot; mlx-lm's ``make_mask`` computes that drop from the rolled
    ``_idx`` instead and so hides each row's oldest real token from the chunk.
    """

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N == 1 or not self.rotated:
            return super().make_mask(N, window_size=window_size, return_array=return_array)
        # Rotated means the ring is full: offset max_size - 1 and exactly one slot dropped.
        return create_causal_mask(
            N, self.max_size - 1, window_size=window_size or self.max_size, left_padding=self.left_padding - 1
        )


# Per-model helpers: lists of per-layer caches, in layer order.


def make_sequence_cache(model: nn.Module, bits: int = 4, group_size: int = 64) -> list:
    """Empty single-sequence caches to prefill one sequence alone: ``SequenceQuantizedKVCache``
    for full layers (``DequantizingKVCache`` if the model has attention sinks), mlx-lm's
    ``RotatingKVCache`` for sliding layers. Raises ``ValueError`` for other cache kinds."""
    full = DequantizingKVCache if ModelCacheSpec.from_model(model).attention_sinks else SequenceQuantizedKVCache
    caches = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise ValueError("sliding layers that keep leading tokens cannot be batched")
            caches.append(c)
        elif isinstance(c, KVCache):
            caches.append(full(group_size, bits))
        else:
            raise ValueError(f"unsupported cache type {type(c).__name__}")
    return caches


def make_batch_cache(
    model: nn.Module,
    spec: Optional[ModelCacheSpec] = None,
    bits: int = 4,
    group_size: int = 64,
    *,
    left_padding: Sequence[int] = (0,),
) -> list:
    """Empty batch caches for a left-padded batch (one row by default): quantized for
    full layers (dequantizing if the model has sinks), ``BatchSlidingKVCache`` for sliding.
    Raises ``ValueError`` for unsupported bits or group size."""
    spec = spec if spec is not None else ModelCacheSpec.from_model(model)
    full = DequantizingBatchKVCache if spec.attention_sinks else BatchQuantizedKVCache
    pads = list(left_padding)
    return [
        full(pads, group_size, bits) if k.kind == FULL else BatchSlidingKVCache(k.window, pads) for k in spec.layers
    ]


def merge_caches(sequences: Sequence[Sequence], float_attention: bool = False) -> list:
    """Batch per-sequence cache lists (one per row, from ``make_sequence_cache`` or
    ``extract_cache``) into per-layer batch caches. Quantized layers are copied, not
    dequantized; ``float_attention`` makes full layers attend over a dequantized
    working copy (``DequantizingBatchKVCache``: the fast path on CPU). Raises
    ``ValueError`` if a layer mixes cache kinds."""
    if not sequences:
        raise ValueError("nothing to merge")
    merged = []
    for layer in zip(*sequences):
        kinds = {type(c) for c in layer}
        if all(isinstance(c, RotatingKVCache) for c in layer):
            if any(c.keep for c in layer):
                raise ValueError("sliding layers that keep leading tokens cannot be batched")
            merged.append(BatchSlidingKVCache.merge(list(layer)))
        elif all(isinstance(c, DequantizingKVCache) for c in layer):
            merged.append(DequantizingBatchKVCache.merge(layer))
        elif all(isinstance(c, QuantizedKVCache) for c in layer):
            merged.append((DequantizingBatchKVCache if float_attention else BatchQuantizedKVCache).merge(layer))
        else:
            raise ValueError(f"cannot merge a layer of {sorted(k.__name__ for k in kinds)}")
    return merged


def extract_cache(batch: Sequence, i: int) -> list:
    """Row ``i`` of per-layer batch caches as evaluated single-sequence caches holding
    exactly its tokens (a sliding layer keeps its last ``window`` of them)."""
    caches = [c.extract(i) for c in batch]
    mx.eval([(c.keys, c.values) for c in caches if isinstance(c, RotatingKVCache)])
    return caches


def filter_caches(batch: Sequence, rows: Sequence[int]) -> None:
    """Keep only ``rows`` (batch indices, in the order given) of every layer's batch cache, in place."""
    idx = rows if isinstance(rows, mx.array) else mx.array(list(rows), dtype=mx.int32)
    for c in batch:
        c.filter(idx)


def extend_caches(batch: Sequence, other: Sequence) -> None:
    """Append the rows of ``other`` (per-layer batch caches of the same model) to ``batch``, in place."""
    if len(batch) != len(other):
        raise ValueError("caches are for models with different numbers of layers")
    for c, o in zip(batch, other):
        c.extend(o)


def prefill_view(cache: Sequence) -> list:
    """The same per-sequence caches, seen through ``DequantizingKVCache`` for prefill.

    A prefill chunk attends over the whole cache: on CPU, ``mx.quantized_matmul``
    runs at ~2 GFLOP/s while dequantizing K/V and running the float SDPA uses
    the BLAS (~50x faster).  Writes go to the wrapped Q4 cache, so storage and
    the later merge into a decode batch are unchanged.
    """
    return [DequantizingKVCache(quantized=c) if isinstance(c, QuantizedKVCache) else c for c in cache]


def copy_cache(cache: Sequence) -> list:
    """An independent copy of per-sequence caches, cheap: MLX arrays are values,
    so fresh array objects share the data until either side writes."""

    def fresh(c):
        c = copy.copy(c)
        for name, value in vars(c).items():
            if isinstance(value, _BaseCache):
                setattr(c, name, fresh(value))
            elif isinstance(value, (mx.array, tuple)):
                setattr(c, name, tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, value))
        return c

    return [fresh(c) for c in cache]
