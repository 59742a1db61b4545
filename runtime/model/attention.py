"""Attention over float keys and values on the CPU, with a softmax MLX runs fast.

MLX's CPU ``exp`` runs one element at a time, so softmax was most of
attention there (a 1K-token prefill of SmolLM2 spent half its time in it).
Here scores are scaled by log2(e) with the queries and the softmax takes
``runtime.model.fastmath.exp2``, vectorised. Masked scores give 0, and so does a
score more than ~125 below its row's maximum (never a subnormal weight: the
matmul with the values would take Intel CPUs' slow path for them).

Every step is elementwise or reduces one row of one sequence, so a score's
value depends on its own row alone: ``attend_each`` runs the exp once over
the scores of every sequence of a decode step with ``LONG`` keys or more (a
shorter one takes MLX's softmax, which costs fewer ops), and a sequence's
result is bitwise what it is alone.

A long sequence attends over part of its past **packed** (``PackedPast``: closed
blocks as ``runtime.kv.quantize.close_block`` lays them out, read without a
float copy) beside its float keys: one softmax over both, on every device.
On the CPU the packed blocks are read by ``runtime/model/kernels`` (compiled
with the package; ``CPU_KERNELS``), elsewhere, or where they were not built,
by MLX's quantized matmul, whose CPU version reads these layouts one element
at a time. A prompt chunk of many rows on the CPU reads that past unpacked for
the chunk instead (``UnpackedPast``): float matmuls.
"""

from __future__ import annotations

import itertools
import logging
from typing import NamedTuple, Optional, Union

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from .fastmath import LOG2E, exp2

__all__ = ["CPU_KERNELS", "PackedPast", "UnpackedPast", "attend", "attend_each", "cpu_kernels"]

log = logging.getLogger(__name__)


def _load_cpu_kernels():
    """``runtime/model/kernels`` as setup.py built it, or None (and why, logged once)."""
    try:
        from . import _packed
    except ImportError as error:
        log.warning("the CPU kernels are not built (%s): a long past is read by MLX's quantized matmul and "
                    "blocks are closed by MLX's ops; reinstall the package (pip install -e .) with a C++ "
                    "compiler", error)
        return None
    if _packed.mlx_version != mx.__version__:
        log.warning("the CPU kernels were built for MLX %s, not this %s: a long past is read by MLX's "
                    "quantized matmul and blocks are closed by MLX's ops; reinstall the package "
                    "(pip install -e .)", _packed.mlx_version,
                    mx.__version__)
        return None
    return _packed


CPU_KERNELS = _load_cpu_kernels()


def cpu_kernels():
    """The CPU kernels where attention runs on the CPU and they are built, else None."""
    return CPU_KERNELS if mx.default_device() == mx.cpu else None


class PackedPast(NamedTuple):
    """Closed blocks a sequence attends over packed: ``keys`` (packed, scales,
    biases), each (1, KVH, blocks, D, block * bits / 32 or / group) -- a
    block's keys by channel, grouped along its tokens; ``values`` each (1,
    KVH, tokens, D * bits / 32 or / group) -- by token, grouped along
    channels. Every key precedes the rows that attend: no mask applies."""

    keys: tuple[mx.array, mx.array, mx.array]
    values: tuple[mx.array, mx.array, mx.array]
    group_size: int
    bits: int

    @property
    def tokens(self) -> int:
        return self.values[0].shape[2]

    def scores(self, queries: mx.array) -> mx.array:
        """``queries`` (1, KVH, R, D) against every packed key: (1, KVH, R, tokens)."""
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.packed_scores(queries, *self.keys, self.group_size, self.bits)
        kw, ks, kb = self.keys
        by_block = mx.quantized_matmul(queries[:, :, None], kw, ks, kb, transpose=False,
                                       group_size=self.group_size, bits=self.bits)  # (1, KVH, blocks, R, block)
        return by_block.swapaxes(2, 3).reshape(*queries.shape[:3], -1)

    def mix(self, weights: mx.array) -> mx.array:
        """``weights`` (1, KVH, R, tokens) times the values: (1, KVH, R, D)."""
        kernels = cpu_kernels()
        if kernels is not None:
            return kernels.packed_mix(weights, *self.values, self.group_size, self.bits)
        return mx.quantized_matmul(weights, *self.values, transpose=False, group_size=self.group_size,
                                   bits=self.bits)


class UnpackedPast(NamedTuple):
    """The blocks a ``PackedPast`` holds, unpacked in float32 for one prompt
    chunk's attention and dropped after it: ``keys`` and ``values`` (1, KVH,
    tokens, D), attended like a ``PackedPast`` with float matmuls."""

    keys: mx.array
    values: mx.array

    @property
    def tokens(self) -> int:
        return self.keys.shape[2]

    def scores(self, queries: mx.array) -> mx.array:
        return queries @ self.keys.swapaxes(-1, -2)

    def mix(self, weights: mx.array) -> mx.array:
        return weights @ self.values

Past = Union[PackedPast, UnpackedPast]

BLOCK = 128  # the most query rows of a prompt chunk attended at once (masked keys skipped)
SCORES_BYTES = 4 << 20  # about what a block's scores take over long keys (``_block_rows``)
MIN_BLOCK = 4  # the fewest rows a block, however many keys
LONG = 1024  # keys from which a decode step's exp is ours (below: MLX's softmax, fewer ops; measured here)


def attend(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask=None,
           past: Optional[Past] = None) -> mx.array:
    """``softmax(q k^T * scale + mask) v`` for one sequence: ``queries`` (1, H,
    S, D), the last S of ``keys`` and ``values`` (1, KVH, L, D); ``mask`` as
    mlx-lm passes it (None, ``"causal"``, a boolean array, or one added to
    the scores).

    The queries run a block of rows at a time (``_block_rows``), so the
    scores in memory stay a block's size (under ``"causal"`` a block skips
    the keys after its last row); the query heads that share a key head are
    the rows of one matmul. A block's size follows the chunk's own shape,
    so a sequence's result never depends on others'. ``past``: more keys
    and values, before all of ``keys`` (the mask is ``keys``' alone), packed
    or unpacked."""
    S, L = queries.shape[2], keys.shape[2]
    causal = isinstance(mask, str)  # mlx-lm's "causal": a row sees no key after its own position
    if causal:
        mask = create_causal_mask(S, L - S)
    outs = []
    rows = _block_rows(queries.shape[1], L + (0 if past is None else past.tokens))
    for a in range(0, S, rows):
        b = min(S, a + rows)
        seen = L - S + b if causal else L
        block = None if mask is None else mask[..., a:b, :seen]
        outs.append(_attend_block(queries[:, :, a:b], keys[:, :, :seen], values[:, :, :seen], scale, block, past))
    return mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]


def _block_rows(heads: int, keys: int) -> int:
    """Query rows attended at once: ``BLOCK``, fewer over long keys, so that a
    block's scores (``heads`` x rows x ``keys`` floats) stay near
    ``SCORES_BYTES``. Each op of a block reads and writes all its scores:
    once they and the keys and values outgrow the CPU's cache (or glibc's
    32 MB, above which every new array faults in its pages), a chunk over
    thousands of keys slows down; fewer rows over shorter keys cost more ops
    than they save (``docs/benchmarks.md``, "long prompts' attention")."""
    return max(MIN_BLOCK, min(BLOCK, SCORES_BYTES // (4 * heads * keys)))


def _attend_block(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask,
                  past: Optional[Past] = None) -> mx.array:
    _, heads, S, D = queries.shape
    kv_heads, L = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scaled = (queries * (scale * LOG2E)).reshape(1, kv_heads, group * S, D)
    scores = scaled @ keys.swapaxes(-1, -2)
    if mask is not None:
        by_query = scores.reshape(1, kv_heads, group, S, L)
        by_query = mx.where(mask, by_query, -mx.inf) if mask.dtype == mx.bool_ else by_query + mask * LOG2E
        scores = by_query.reshape(1, kv_heads, group * S, L)
    if past is not None:
        return _with_past(scaled, scores, values, past).reshape(1, heads, S, D).astype(queries.dtype)
    weights = exp2(scores, scores.max(axis=-1, keepdims=True))
    return ((weights @ values) / weights.sum(axis=-1, keepdims=True)).reshape(1, heads, S, D)


def _with_past(scaled: mx.array, scores: mx.array, values: mx.array, past: Past) -> mx.array:
    """Attention of ``scaled`` queries (1, KVH, R, D; times log2(e)) over the
    float keys whose ``scores`` they have and over ``past``: one softmax,
    in float32."""
    scaled, scores = scaled.astype(mx.float32), scores.astype(mx.float32)
    far = past.scores(scaled)
    top = mx.maximum(scores.max(axis=-1, keepdims=True), far.max(axis=-1, keepdims=True))
    near_w, far_w = exp2(scores, top), exp2(far, top)
    total = near_w.sum(axis=-1, keepdims=True) + far_w.sum(axis=-1, keepdims=True)
    return (near_w @ values.astype(mx.float32) + past.mix(far_w)) / total


def attend_each(queries: mx.array, fetched: list[tuple], scale: float) -> mx.array:
    """One new token's attention for each sequence over its own keys and values
    (one token sees them all: no mask): ``queries`` (n, H, 1, D), ``fetched[i]``
    sequence ``i``'s (keys, values), (1, KVH, L_i, D), then its ``PackedPast``
    past where it has one (attended alone). Returns (n, H, 1, D).

    The query heads that share a key head are the rows of one matmul, as in
    ``attend``. A sequence with fewer than ``LONG`` keys takes MLX's softmax,
    the others a max and a sum over their own rows each and one exp over all
    their scores. The scaling and reshaping run once for the whole step: a
    decode step is thousands of small operations, each costing the thread
    that dispatches them a few microseconds."""
    n, heads, _, D = queries.shape
    kv_heads = fetched[0][0].shape[1]
    group = heads // kv_heads
    by_key_head = queries.reshape(n, kv_heads, group, D)
    scaled = by_key_head * scale
    short = mx.split(scaled, n) if n > 1 else [scaled]
    outs: list = [None] * n
    long = []
    for i, (keys, values, *packed) in enumerate(fetched):
        if packed and packed[0] is not None:
            q = by_key_head[i : i + 1] * (scale * LOG2E)
            outs[i] = _with_past(q, q @ keys.swapaxes(-1, -2), values, packed[0]).astype(queries.dtype)
        elif keys.shape[2] < LONG:
            outs[i] = mx.softmax(short[i] @ keys.swapaxes(-1, -2), axis=-1, precise=True) @ values
        else:
            scores = (by_key_head[i : i + 1] * (scale * LOG2E)) @ keys.swapaxes(-1, -2)
            long.append((i, (scores - scores.max(axis=-1, keepdims=True)).reshape(-1)))
    if len(long) > 1:
        at = list(itertools.accumulate(s.size for _, s in long[:-1]))
        weights = mx.split(exp2(mx.concatenate([s for _, s in long])), at)
    else:
        weights = [exp2(s) for _, s in long]
    for (i, _), w in zip(long, weights):
        keys, values = fetched[i][:2]
        w = w.reshape(1, kv_heads, group, keys.shape[2])
        outs[i] = (w @ values) / w.sum(axis=-1, keepdims=True)
    return (mx.concatenate(outs) if n > 1 else outs[0]).reshape(n, heads, 1, D)
