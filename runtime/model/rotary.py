"""Rotary position embeddings on the CPU at a few ops a call, bitwise as MLX's.

``mx.fast.rope`` has no CPU kernel: there it runs its fallback, ~30 ops a
call (positions, frequencies, cos, sin, the rotation), and each op costs
microseconds of scheduling whatever its size, so in a decode step of a small
model RoPE is a third of the ops. Every layer rotates by the same positions,
so here the cosines and sines are computed once per forward (``_tables``, the
fallback's own formula) and a call is ``x*C + (x@P)*S``, with ``P`` the signed
permutation that takes each rotated pair (x1, x2) to (-x2, x1). That matmul
is exact (one nonzero term an output), ``a + (-b)`` is ``a - b`` and addition
commutes, so the result is bitwise the fallback's (tests check it).
"""

from __future__ import annotations

import functools
import math

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.rope_utils import Llama3RoPE

__all__ = ["rotate"]


def rotate(rope: nn.Module, x: mx.array, offset) -> mx.array:
    """``rope(x, offset=offset)`` for ``x`` (B, heads, T, head_dim) and
    ``offset`` an int or a list of B ints: the tables' way on the CPU for
    mlx's ``RoPE`` and mlx-lm's ``Llama3RoPE`` over the whole head, the
    module's own call otherwise."""
    config = _config(rope, x)
    if config is None:
        return rope(x, offset=offset if isinstance(offset, int) else mx.array(offset))
    positions = (offset,) if isinstance(offset, int) else tuple(offset)
    cos, sin = _tables(config, positions, x.shape[1], x.shape[2], x.dtype)
    return x * cos + (x @ _swap(config[0], config[1], x.dtype)) * sin


def _config(rope: nn.Module, x: mx.array):
    """What the tables depend on (dims, traditional, base, scale, freqs), or None where they do not serve."""
    if mx.default_device() != mx.cpu or type(rope) not in (nn.RoPE, Llama3RoPE) or rope.dims != x.shape[-1]:
        return None
    if type(rope) is nn.RoPE:
        return rope.dims, rope.traditional, rope.base, rope.scale, None
    return rope.dims, rope.traditional, None, 1.0, tuple(rope._freqs.tolist())


@functools.lru_cache(maxsize=16)  # a forward's layers share an entry for queries and one for keys
def _tables(config, positions: tuple[int, ...], heads: int, tokens: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Cosines and sines for ``tokens`` positions from each of ``positions``
    (one a sequence), (len(positions), heads, tokens, dims) as the rotated
    array is (no broadcast a call), each angle's twice where its pair sits;
    computed as ``mx.fast.rope``'s fallback does."""
    dims, traditional, base, scale, freqs = config
    half = dims // 2
    offsets = mx.array(positions).reshape(-1, 1, 1)
    at = (mx.arange(tokens, dtype=mx.float32) + offsets) * mx.array(scale, mx.float32)
    if freqs is None:
        inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * mx.array(math.log(base) / half, mx.float32))
    else:
        inv_freqs = mx.reciprocal(mx.array(freqs, mx.float32))
    theta = at[..., None] * inv_freqs
    cos, sin = mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)
    shape = (len(positions), heads, tokens, dims)
    if traditional:  # pairs (2i, 2i+1)
        return tuple(mx.broadcast_to(mx.repeat(t, 2, axis=-1), shape) for t in (cos, sin))
    return tuple(mx.broadcast_to(mx.concatenate([t, t], axis=-1), shape) for t in (cos, sin))


@functools.lru_cache(maxsize=8)
def _swap(dims: int, traditional: bool, dtype: mx.Dtype) -> mx.array:
    """P (dims, dims): ``x @ P`` puts -x2 where x1 is and x1 where x2 is, for each rotated pair."""
    half = dims // 2
    first = mx.arange(0, dims, 2) if traditional else mx.arange(half)
    second = first + (1 if traditional else half)
    p = mx.zeros((dims, dims), dtype)
    p[second, first] = -1  # output x1's place takes -x2
    p[first, second] = 1  # output x2's place takes x1
    mx.eval(p)
    return p
