"""Batched quantized KV caches: many agents' Q4 caches in one forward pass, each
row computed exactly as it would be alone.

mlx-lm batches full-precision caches (``BatchKVCache``, left padded) and
quantizes single sequences (``QuantizedKVCache``), but does not batch quantized
caches. Here a batch never pads a cache: every agent keeps its own
per-sequence caches and they are batched *around* attention.

**Batch invariance by construction.** A row's numbers must not depend on its
neighbours, on any machine. Two things make them depend in a padded batch:

* attention over padded keys: where a row's keys sit in the padded tensor
  decides how softmax lanes and the BLAS k-loop group its sums (~1e-6 on the
  logits, enough to flip a 135M model's greedy token after Q4 rounding);
* a matmul's shape: BLAS picks its kernel by M (OpenBLAS: ``gemv`` at M = 1, a
  small-matrix kernel below M*N*K = 1e6 on SkylakeX, other blockings from
  M = 13 on Haswell and Zen), and each kernel sums in its own order.

So a forward is one row of token slots whose count is one of those measured
to give the same rows (``runtime.row_counts``), and each layer gets a
``BatchQuantizedKVCache``: the caches of the sequences in the forward, one
slot each. ``runtime.rowwise`` makes attention run per sequence over its own
cache, with the same shapes as when the sequence is alone; everything else
runs over all slots at once.

Per-sequence caches:

* full attention: ``SequenceQuantizedKVCache`` (mlx-lm's ``QuantizedKVCache`` with
  16-bit scales), the cache of record; ``bits`` routes mlx-lm's attention to
  ``quantized_scaled_dot_product_attention`` (Metal);
* ``DequantizingKVCache``: the same Q4 record seen through a float working copy
  (no ``bits``: ``mx.fast.scaled_dot_product_attention``), for the CPU, where
  MLX's quantized matmul is slow, and for attention sinks (GPT-OSS), which the
  quantized SDPA refuses; in a decode forward the batch quantizes every
  slot's new token at once and holds the Q4 rows for the records
  (``BatchQuantizedKVCache.attend_new``, ``flush``);
* sliding window: ``WindowKVCache`` (full precision, bounded by its window and
  ``WINDOW_SPARE`` tokens more, so a diverging turn can trim it as a full layer);
* recurrent (linear attention): ``StateCache``, a fixed-size state that the
  layer itself runs once per sequence (``runtime.rowwise``).

Scales and biases are always 16-bit, so Q4 with group 64 costs 0.5 + 4/64
bytes an element (0.28 of fp16): float16 when the model computes in float32
(``mx.quantized_matmul`` takes float32 queries with float16 scales directly,
as fast as with float32 scales, so nothing is cast on the quantized path),
else the model's own half type (bfloat16 queries with float16 scales would
promote the attention output, and so the whole model, to float32).
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    QuantizedKVCache,
    RotatingKVCache,
    _BaseCache,
    create_attention_mask,
    make_prompt_cache,
)
from mlx_lm.models.base import create_causal_mask

from .model_spec import STATE_CHECKPOINTS, WINDOW_SPARE, ModelCacheSpec

__all__ = [
    "BatchQuantizedKVCache",
    "ChunkMasks",
    "PrefillBatch",
    "DequantizingKVCache",
    "SequenceQuantizedKVCache",
    "StateCache",
    "WindowKVCache",
    "attention_view",
    "cache_arrays",
    "checkpoints",
    "copy_cache",
    "make_sequence_cache",
    "rewind",
    "trimmable_tokens",
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


def _unpack(q: Triple, group_size: int, bits: int, dtype: mx.Dtype) -> mx.array:
    """``mx.dequantize`` as plain elementwise ops, bit for bit the same on the CPU
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


def _grown(buffer: Optional[mx.array], live: int, capacity: int, like: mx.array) -> mx.array:
    """``buffer[..., :live, :]`` followed by zeros up to ``capacity`` positions (axis 2)."""
    B, H, _, D = like.shape
    tail = mx.zeros((B, H, capacity - (0 if buffer is None else live), D), dtype=like.dtype)
    return tail if buffer is None else mx.concatenate([buffer[..., :live, :], tail], axis=2)


class SequenceQuantizedKVCache(QuantizedKVCache):
    """mlx-lm's single-sequence ``QuantizedKVCache`` with 16-bit scales and biases
    (float16 for a float32 model). Buffers grow in steps of ``step`` positions."""

    def __init__(self, group_size: int = 64, bits: int = 4):
        _check(group_size, bits)
        super().__init__(group_size=group_size, bits=bits)

    def update_and_fetch(self, keys, values):
        self.append(_quantize(keys, self.group_size, self.bits), _quantize(values, self.group_size, self.bits))
        return self.keys_and_values()

    def append(self, keys: Triple, values: Triple) -> None:
        """Store quantized triples of shape (B, H, S, ...) after the cached tokens."""
        prev, S = self.offset, keys[0].shape[2]
        if self.keys is None or prev + S > self.keys[0].shape[2]:
            capacity = (prev + S + self.step - 1) // self.step * self.step
            old_k = self.keys or (None,) * 3
            old_v = self.values or (None,) * 3
            self.keys = tuple(_grown(o, prev, capacity, n) for o, n in zip(old_k, keys))
            self.values = tuple(_grown(o, prev, capacity, n) for o, n in zip(old_v, values))
        self.offset += S
        for dst, src in zip((*self.keys, *self.values), (*keys, *values)):
            dst[..., prev : self.offset, :] = src

    def size(self):  # the parent inherits _BaseCache's constant 0
        return self.offset

    @property
    def nbytes(self):  # the parent raises on an empty cache
        return 0 if self.keys is None else super().nbytes


class DequantizingKVCache(_BaseCache):
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
        *qk, new_k = _quantize_unpack(keys, q.group_size, q.bits)
        *qv, new_v = _quantize_unpack(values, q.group_size, q.bits)
        q.append(tuple(qk), tuple(qv))
        capacity = q.keys[0].shape[2]
        if self._float is None:  # first use: the whole record at once
            self._float = tuple(_unpack(t, q.group_size, q.bits, keys.dtype) for t in (q.keys, q.values))
        else:
            fk, fv = self._float
            if fk.shape[2] != capacity:  # the record grew
                fk, fv = _grown(fk, prev, capacity, new_k), _grown(fv, prev, capacity, new_v)
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
                _unpack(t, q.group_size, q.bits, new_k.dtype) for t in (q.keys, q.values))
        fk, fv = self._float
        if fk is None or fk.shape[2] < prev + n:
            capacity = (prev + n + q.step - 1) // q.step * q.step
            fk, fv = _grown(fk, prev, capacity, new_k), _grown(fv, prev, capacity, new_v)
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


class WindowKVCache(_BaseCache):
    """A sliding-window layer's cache that a turn can cut back.

    Attention sees what mlx-lm's ``RotatingKVCache(window)`` gives it: a chunk
    of S new tokens attends over the ``window - 1`` tokens before it and
    itself (the model's window mask does the rest), one token over the last
    ``window``.  But a ring overwrites what leaves the window, so once it has
    wrapped nothing can be trimmed, and a turn whose text diverges from the
    cached one (a re-rendered reply, a stop string cut, an edited message)
    would start cold.  This one keeps the tokens in order and ``spare`` more
    than the window: up to ``spare`` tokens can always be trimmed.  Full
    precision, like mlx-lm's ring.
    """

    step = 256

    def __init__(self, window: int, spare: int = WINDOW_SPARE):
        if window < 1 or spare < 0:
            raise ValueError(f"a window of {window} tokens and {spare} spare cannot hold a sliding layer")
        self.window, self.spare = window, spare
        self.keys: Optional[mx.array] = None  # buffer positions [start, live) hold the last tokens, oldest first
        self.values: Optional[mx.array] = None
        self.offset = 0  # tokens seen
        self.start = self.live = 0

    @property
    def held(self) -> int:
        return self.live - self.start

    def update_and_fetch(self, keys, values):
        S, context = keys.shape[2], min(self.held, self.window - 1)
        if self.keys is None or self.live + S > self.keys.shape[2]:  # a new buffer, without what was dropped
            held, capacity = self.held, (self.held + S + self.step - 1) // self.step * self.step
            old = (None, None) if self.keys is None else (self.keys[..., self.start :, :],
                                                           self.values[..., self.start :, :])
            self.keys, self.values = (_grown(o, held, capacity, x) for o, x in zip(old, (keys, values)))
            self.start, self.live = 0, held
        self.keys[..., self.live : self.live + S, :] = keys
        self.values[..., self.live : self.live + S, :] = values
        self.live += S
        self.offset += S
        first = self.live - S - context
        fetched = self.keys[..., first : self.live, :], self.values[..., first : self.live, :]
        self.start = max(self.start, self.live - (self.window - 1 + self.spare))  # no trim reaches further back
        return fetched

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N == 1:
            return None  # one token sees exactly the window it is given
        window_size = window_size or self.window
        offset = min(self.window - 1, self.offset)
        if offset + N > window_size or return_array:
            return create_causal_mask(N, offset, window_size=window_size)
        return "causal"

    @property
    def trimmable_tokens(self) -> int:
        """Tokens ``trim`` can drop: all while none was dropped, else those held beyond the window."""
        return self.offset if self.held == self.offset else max(0, self.held - (self.window - 1))

    def is_trimmable(self):
        return self.trimmable_tokens > 0

    def trim(self, n):
        n = min(n, self.trimmable_tokens)
        self.live -= n
        self.offset -= n
        return n

    def size(self):
        return min(self.offset, self.window)

    def empty(self):
        return self.keys is None

    @property
    def state(self):
        return self.keys[..., self.start : self.live, :], self.values[..., self.start : self.live, :]

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class StateCache(ArraysCache):
    """A recurrent layer's state (linear attention: Qwen3-Next's and Qwen3.5's
    Gated DeltaNet) for one sequence: mlx-lm's ``ArraysCache``, counting the
    tokens it has seen (the layer calls ``advance``). A fixed size whatever the
    context, full precision.

    A state cannot be cut back, so it keeps checkpoints instead: the engine
    ``mark``s it when a turn starts (the cached conversation so far) and when
    the turn's prompt is in (before the reply); the last ``STATE_CHECKPOINTS``
    are kept. A turn that diverges from the cached text goes back (``rewind``) to
    the latest checkpoint at or before the divergence -- the reply re-rendered
    differently, the last message edited -- instead of starting cold. The
    arrays are values: a checkpoint holds references, no copy."""

    def __init__(self, size: int):
        super().__init__(size)
        self.offset = 0
        self.checkpoints: list[tuple[int, list]] = []  # (tokens seen, the state then), oldest first
        self.trail: list[list] = []  # the state after each slot of a decode step with drafts, until ``cut``

    def advance(self, N):
        super().advance(N)
        self.offset += N

    def mark(self) -> None:
        if self.offset and (not self.checkpoints or self.checkpoints[-1][0] != self.offset):
            self.checkpoints = [*self.checkpoints, (self.offset, list(self.cache))][-STATE_CHECKPOINTS:]

    def rewind(self, tokens: int) -> None:
        """Go back to the checkpoint at ``tokens`` (or stay, if already there)."""
        if self.offset == tokens:
            return
        state = dict(self.checkpoints).get(tokens)
        if state is None:
            raise ValueError(f"no checkpoint at {tokens} tokens to go back to")
        self.offset, self.cache = tokens, list(state)
        self.checkpoints = [c for c in self.checkpoints if c[0] <= tokens]

    def cut(self, n: int) -> None:
        """Go back ``n`` tokens within the last decode step (drafts rejected:
        ``runtime.speculation``), to the state after its slot before them;
        the step's trail is forgotten either way."""
        if not 0 <= n < max(len(self.trail), 1):
            raise ValueError(f"the last step ran {len(self.trail)} tokens here: {n} cannot be cut")
        if n:
            self.cache, self.offset = list(self.trail[-1 - n]), self.offset - n
        self.trail = []

    def make_mask(self, N: int, **kwargs):
        return None  # one sequence, no padding: nothing to mask

    def is_trimmable(self):
        return False

    def trim(self, n):
        return 0

    @property
    def arrays(self) -> list:
        """The state's arrays, and its checkpoints'."""
        held = [*self.cache, *(x for _, state in self.checkpoints for x in state)]
        return [x for x in held if x is not None]

    @property
    def nbytes(self):
        return sum(x.nbytes for x in {id(x): x for x in self.arrays}.values())


class BatchQuantizedKVCache:
    """One layer's caches of the sequences decoded together in a forward.

    The forward's input is one row of token slots (a measured count); a
    sequence takes ``widths[i]`` consecutive slots (one, or more when it
    verifies drafted tokens: ``runtime.speculation``), each its next token
    after the one before, and slots after the last sequence are padding.
    Three agents in a forward of 6 slots, ``b`` verifying two drafts:

        slot      0  1  2  3  4  5
        cache     a  b  b  b  c  .      slot 5 is padding: computed, then ignored

    Attention modules made ``runtime.rowwise.rowwise`` attend per slot when
    given this cache, over its sequence's cache up to and including that
    slot's token -- what a decode step of that token alone attends over. The
    model's own mask is not used (``make_mask`` gives None): each sequence's
    cache makes its own.
    """

    ROWS = 32  # decode steps whose new Q4 rows are held before they go to the records

    def __init__(self, caches: Sequence):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        self.caches = list(caches)
        self.widths = [1] * len(self.caches)  # this step's slots a sequence (``Engine._launch`` sets them)
        # Every sequence attends over a float working copy: ``attend_new`` serves this layer.
        self.in_float = all(isinstance(c, DequantizingKVCache) for c in self.caches)
        # Held steps: the Q4 triple of every slot, keys' heads then values' (slots, 2H, 1, ...), and the
        # slots of each sequence that go to its record (fewer than its width once drafts are cut).
        self._rows: list[tuple[tuple[mx.array, ...], list[int], list[int]]] = []

    def make_mask(self, *args, **kwargs):
        return None

    @property
    def slot_caches(self) -> list:
        """Each used slot's sequence cache, in slot order."""
        return [c for c, w in zip(self.caches, self.widths) for _ in range(w)]

    @property
    def positions(self) -> list[int]:
        """Each used slot's position in its sequence (before this step writes)."""
        return [c.offset + j for c, w in zip(self.caches, self.widths) for j in range(w)]

    def attend_new(self, keys: mx.array, values: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Quantize every slot's new token at once (``keys``, ``values``: (slots,
        H, 1, D)), add each to its sequence's working copy in slot order and
        hold the Q4 rows for the records; return what each slot attends over.

        One quantization a layer and step for the whole forward, keys and
        values together, kept as it comes out (no write), where writing each
        record costs a dozen MLX ops a sequence; the records get up to ``ROWS``
        steps at once (``flush``). Quantization is per group of a row, so a
        row's Q4 codes do not depend on the other slots nor on the values
        beside the keys.
        """
        assert not self.full, "a full batch is flushed before its next step (Engine._launch)"
        c, heads = self.caches[0].quantized, keys.shape[1]
        *q, new = _quantize_unpack(mx.concatenate([keys, values], axis=1), c.group_size, c.bits)  # one for both
        self._rows.append((tuple(q), list(self.widths), list(self.widths)))
        slots = keys.shape[0]
        if max(self.widths) == 1:  # a slot a sequence: one split
            new_k, new_v = mx.split(new[:, :heads], slots), mx.split(new[:, heads:], slots)
            return [c.attend_new(k, v)[0] for c, k, v in zip(self.caches, new_k, new_v)]
        fetched, at = [], 0
        for c, w in zip(self.caches, self.widths):  # a sequence's slots are its tokens in order
            fetched += c.attend_new(new[at : at + w, :heads].swapaxes(0, 2), new[at : at + w, heads:].swapaxes(0, 2))
            at += w
        return fetched

    @property
    def held(self) -> int:
        """Steps whose Q4 rows wait here for the records."""
        return len(self._rows)

    @property
    def full(self) -> bool:
        return self.held == self.ROWS

    def drop_last(self) -> None:
        """Forget the last step's rows: its sequences' working copies drop its tokens too
        (a decode step computed ahead and then dropped, ``runtime.engine``)."""
        assert self._rows, "no step held to drop"
        _, _, kept = self._rows.pop()
        for c, n in zip(self.caches, kept):
            c.unwritten -= n

    def cut(self, i: int, n: int) -> None:
        """Drop the last ``n`` tokens sequence ``i`` wrote in the last step held
        (drafts it rejected): its working copy and its record never get them."""
        _, _, kept = self._rows[-1]
        assert 0 <= n <= kept[i], "only the last step's own tokens can be cut"
        kept[i] -= n
        self.caches[i].unwritten -= n

    def flush(self) -> None:
        """Write the held Q4 rows to each sequence's record (before anyone reads
        a record, and when ``ROWS`` steps are held)."""
        if not self._rows:
            return
        heads = self._rows[0][0][0].shape[1] // 2
        if all(max(widths) == 1 == min(kept) for _, widths, kept in self._rows):  # a slot a sequence: one gather
            steps = [mx.concatenate(parts, axis=2) for parts in zip(*(q for q, _, _ in self._rows))]
            rows = [tuple(t[i : i + 1] for t in steps) for i in range(len(self.caches))]
        else:
            rows = [[] for _ in self.caches]
            for q, widths, kept in self._rows:
                starts = itertools.accumulate([0, *widths[:-1]])
                for i, (at, n) in enumerate(zip(starts, kept)):
                    if n:  # a sequence's slots are its tokens in order: along the token axis
                        rows[i].append(tuple(t[at : at + n].swapaxes(0, 2) for t in q))
            rows = [tuple(mx.concatenate(parts, axis=2) for parts in zip(*r)) if r else None for r in rows]
        for c, r in zip(self.caches, rows):
            if r is not None:
                c.quantized.append(tuple(t[:, :heads] for t in r), tuple(t[:, heads:] for t in r))
        for i, c in enumerate(self.caches):
            c.unwritten -= sum(kept[i] for _, _, kept in self._rows)
        self._rows = []

    @property
    def arrays(self) -> list:
        """What a step evaluates besides the sequences' caches, so graphs never grow."""
        return [t for q, _, _ in self._rows for t in q]


@dataclass(frozen=True)
class ChunkMasks:
    """What a model asked a ``PrefillBatch`` for (``make_mask``'s keyword
    arguments): each chunk's attention gets its own cache's mask, asked as the
    model asks when the chunk runs alone."""

    kwargs: dict

    def of(self, cache, rows: int):
        return cache.make_mask(rows, **self.kwargs)


class PrefillBatch:
    """One layer's caches of the sequences whose prompt chunks run together in a
    forward: the forward's token rows are sequence 0's chunk (``lengths[0]``
    rows), then sequence 1's, and so on. Attention modules made
    ``runtime.rowwise.rowwise`` attend per chunk over its own cache, as when
    the chunk runs alone; everything else runs over all rows at once."""

    def __init__(self, caches: Sequence, lengths: Sequence[int]):
        if not caches or len(caches) != len(lengths) or min(lengths) < 1:
            raise ValueError("a prefill batch needs one chunk of at least one token per cache")
        self.caches, self.lengths = list(caches), list(lengths)

    def make_mask(self, N: int, **kwargs) -> "ChunkMasks":
        return ChunkMasks(kwargs)

    def chunks(self, x: mx.array, axis: int) -> list[mx.array]:
        """``x`` cut along ``axis`` (its token rows) into the chunks."""
        return mx.split(x, list(itertools.accumulate(self.lengths[:-1])), axis=axis) if len(self.lengths) > 1 else [x]


# Per-model helpers: lists of per-layer caches, in layer order.


def make_sequence_cache(model: nn.Module, bits: int = 4, group_size: int = 64) -> list:
    """Empty single-sequence caches: ``SequenceQuantizedKVCache`` for full layers
    (``DequantizingKVCache`` if the model has attention sinks, or MLA, whose
    mlx-lm attention takes no quantized triples), ``WindowKVCache`` for sliding
    layers, ``StateCache`` for recurrent ones. Raises ``ValueError`` for other cache kinds."""
    full = DequantizingKVCache if ModelCacheSpec.from_model(model).attends_in_float else SequenceQuantizedKVCache
    caches = []
    for c in make_prompt_cache(model):
        if isinstance(c, RotatingKVCache):
            if c.keep:
                raise ValueError("sliding layers that keep leading tokens cannot be batched")
            caches.append(WindowKVCache(c.max_size))
        elif type(c) is ArraysCache:
            caches.append(StateCache(len(c.cache)))
        elif isinstance(c, KVCache):
            caches.append(full(group_size, bits))
        else:
            raise ValueError(f"unsupported cache type {type(c).__name__}")
    return caches


def attention_view(cache: Sequence, float_attention: bool) -> list:
    """A sequence's caches as the engine attends over them: full layers through a
    fresh float working copy (``DequantizingKVCache`` over the same Q4 record) when
    ``float_attention`` or when they are sink caches, else as they are.

    Writes go to the records, so ``cache`` itself is what a finished sequence
    hands back; the working copies go with the view.
    """

    def view(c):
        if isinstance(c, DequantizingKVCache):
            return DequantizingKVCache(quantized=c.quantized)
        if float_attention and isinstance(c, QuantizedKVCache):
            return DequantizingKVCache(quantized=c)
        return c

    return [view(c) for c in cache]


def cache_arrays(cache: Sequence) -> list:
    """Every array per-layer caches hold: what a step evaluates so graphs never grow."""
    def arrays(c):
        if isinstance(c, DequantizingKVCache):
            return c.state, c._float
        if isinstance(c, StateCache):
            return c.arrays
        return (c.keys, c.values) if isinstance(c, WindowKVCache) else c.state

    return [arrays(c) for c in cache]


def trimmable_tokens(cache: Sequence) -> int:
    """Tokens every layer of a sequence's caches can drop from its end."""
    return min((c.trimmable_tokens if isinstance(c, WindowKVCache) else c.offset if c.is_trimmable() else 0)
               for c in cache) if cache else 0


def checkpoints(cache: Sequence) -> list[int]:
    """Where a sequence's caches can go back to besides trimming: the recurrent
    layers' checkpoints that every other layer can be cut back to."""
    states = [c for c in cache if isinstance(c, StateCache)]
    if not states:
        return []
    common = set.intersection(*({at for at, _ in c.checkpoints} for c in states))
    others = [c for c in cache if not isinstance(c, StateCache)]
    reach = others[0].offset - trimmable_tokens(others) if others else 0
    return sorted(at for at in common if at >= reach)


def rewind(cache: Sequence, tokens: int) -> None:
    """Cut a sequence's caches back to their first ``tokens`` tokens: trim, or
    go back to the recurrent layers' checkpoint there (``checkpoints``)."""
    for c in cache:
        if isinstance(c, StateCache):
            c.rewind(tokens)
            continue
        c.trim(c.offset - tokens)
        if c.offset != tokens:
            raise ValueError(f"a {type(c).__name__} cannot be cut back to {tokens} tokens")


def copy_cache(cache: Sequence) -> list:
    """An independent copy of per-sequence caches, cheap: MLX arrays are values,
    so fresh array objects share the data until either side writes."""

    def fresh(c):
        c = copy.copy(c)
        for name, value in vars(c).items():
            if isinstance(value, _BaseCache):
                setattr(c, name, fresh(value))
            elif isinstance(value, (mx.array, tuple, list)):
                setattr(c, name, tree_map(lambda x: x[...] if isinstance(x, mx.array) else x, value))
        return c

    return [fresh(c) for c in cache]
