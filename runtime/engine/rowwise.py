"""Attention per sequence inside a batched forward: the other half of batch
invariance (``runtime.engine.batch_cache`` explains the whole).

``rowwise(model)`` lets every attention module of an mlx-lm model, when its
cache is a ``BatchQuantizedKVCache`` (a decode step: a token slot a
sequence, or more for its drafts) or a ``PrefillBatch`` (several sequences'
prompt chunks), attend for each slot or chunk over its sequence's own cache,
with the shapes it has when the sequence is alone -- a draft's slot as a
decode step of that token. Two ways, with the same result by construction:

* **standard layout** (Llama, Qwen 2/3, Gemma 3, GPT-OSS): projections and
  q/k norms run over all rows at once -- at row counts whose rows agree
  (``runtime.engine.row_counts``) -- and RoPE, the cache write and the attention
  per sequence (RoPE of a decode step over all slots, with per-slot
  positions); on the CPU the attention is ``runtime.model.attention``'s, for a
  prompt chunk alone too;
* **other attention classes**, and linear attention (Qwen3-Next's recurrent
  layers): the module itself runs once per sequence, on its own rows.
"""

from __future__ import annotations

import functools
import itertools
from typing import Callable

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention

from ..model.attention import attend, attend_each
from .batch_cache import BatchQuantizedKVCache, ChunkMasks, PrefillBatch
from ..model.rotary import rotate

__all__ = ["rowwise"]

# mlx-lm attention classes whose __call__ is o_proj(SDPA(rope(norm(q_proj x)),
# rope(norm(k_proj x)), v_proj x)) with norms optional and sinks optional;
# tests check the fast path against each module's own call.
_STANDARD = {
    ("mlx_lm.models.llama", "Attention"),
    ("mlx_lm.models.qwen2", "Attention"),
    ("mlx_lm.models.qwen3", "Attention"),
    ("mlx_lm.models.gemma3_text", "Attention"),
    ("mlx_lm.models.gpt_oss", "AttentionBlock"),
}


_MIXERS = ("self_attn", "linear_attn")  # a layer's modules that read its cache: attention, linear attention


def rowwise(model: nn.Module) -> nn.Module:
    """Let every attention module of ``model`` attend per sequence when given a
    ``BatchQuantizedKVCache``; with any other cache it runs as before.

    In place and idempotent. Each module becomes an instance of a subclass of
    its own mlx-lm class: parameters, names and attributes are unchanged, and
    mlx-lm itself is not modified. Raises ``ValueError`` for a layer with
    neither ``self_attn`` nor ``linear_attn``.
    """
    for i, layer in enumerate(model.layers):
        mixers = [layer[name] for name in _MIXERS if isinstance(layer, dict) and isinstance(layer.get(name), nn.Module)]
        if not mixers:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has no self_attn or linear_attn module to batch "
                             "around")
        for mixer in mixers:
            if not isinstance(mixer, _Rowwise):
                mixer.__class__ = _rowwise_class(type(mixer))
    return model


class _Rowwise:
    """Marks attention classes that ``rowwise`` derived."""


@functools.cache
def _rowwise_class(cls: type) -> type:
    standard = (cls.__module__, cls.__name__) in _STANDARD

    def __call__(self, x, mask=None, cache=None):
        if isinstance(cache, PrefillBatch):
            masks = [mask.of(c, n) if isinstance(mask, ChunkMasks) else mask
                     for c, n in zip(cache.caches, cache.lengths)]
            if standard:
                return _standard_chunks(self, x, cache, masks)
            return _per_chunk(functools.partial(cls.__call__, self), x, cache, masks)
        if not isinstance(cache, BatchQuantizedKVCache):
            if standard and _in_float(self, x, [cache]):  # a prefill chunk on the CPU
                return _standard_chunks(self, x, PrefillBatch([cache], [x.shape[1]]), [mask])
            return _by_piece(functools.partial(cls.__call__, self), x, mask, cache)
        if sum(cache.widths) > x.shape[1]:
            raise ValueError(f"{sum(cache.widths)} token slots used in a forward of {x.shape[1]}")
        if standard:
            return _standard(self, x, cache)
        return _per_sequence(functools.partial(cls.__call__, self), x, cache)

    return type(cls.__name__, (_Rowwise, cls), {"__call__": __call__, "__module__": cls.__module__})


def _per_sequence(attention: Callable, x: mx.array, batch: BatchQuantizedKVCache) -> mx.array:
    """``attention(x, mask, cache)`` once per slot of ``x`` (1, slots, D) with
    its sequence's cache, in slot order; zeros for the padding slots. A
    recurrent state verifying drafts keeps what it was after each of the
    step's slots (``StateCache.trail``: drafts it rejects are cut back to
    one)."""
    outs, at = [], 0
    for c, width in zip(batch.caches, batch.widths):
        trail = []
        for _ in range(width):
            outs.append(attention(x[:, at : at + 1], _mask(c), c))
            at += 1
            if width > 1 and c.recurrent:
                trail.append(list(c.cache))
        if c.recurrent:
            c.trail = trail
    return _pad_slots(mx.concatenate(outs, axis=1), x.shape[1], axis=1)


def _standard(attn: nn.Module, x: mx.array, batch: BatchQuantizedKVCache) -> mx.array:
    """A standard-layout attention module over every slot: the slots become the
    batch (slots, heads, 1, head_dim) for everything but the cache write and the
    attention, which run per sequence."""
    _, slots, _ = x.shape
    caches = batch.slot_caches
    positions = batch.positions + [0] * (slots - len(caches))
    q, k, v = _project(attn, x, (slots, 1))
    q, k = rotate(attn.rope, q, positions), rotate(attn.rope, k, positions)
    scale = _scale(attn)
    if batch.in_float:  # working copies: one quantization for every slot (``attend_new``)
        fetched = batch.attend_new(k, v)
    else:  # slot by slot: a sequence's later slots see its earlier ones' tokens
        fetched = [_fetch(c, k[i : i + 1], v[i : i + 1]) for i, c in enumerate(caches)]
    if _in_float(attn, x, caches):
        out = attend_each(q[: len(caches)], fetched, scale)
    else:
        out = mx.concatenate([_attend(attn, q[i : i + 1], f, c, _mask(c)) for i, (c, f) in
                              enumerate(zip(caches, fetched))])
    out = _pad_slots(out, slots, axis=0)  # (slots, heads, 1, head_dim)
    return attn.o_proj(out.transpose(2, 0, 1, 3).reshape(1, slots, -1))


def _per_chunk(attention: Callable, x: mx.array, batch: PrefillBatch, masks: list) -> mx.array:
    """``attention(x, mask, cache)`` once per sequence on its own chunk of ``x`` (1, rows, D)."""
    outs = [_by_piece(attention, chunk, mask, c) for chunk, mask, c in zip(batch.chunks(x, axis=1), masks, batch.caches)]
    return mx.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]


def _by_piece(attention: Callable, x: mx.array, mask, cache) -> mx.array:
    """``attention(x, mask, cache)`` on a chunk ``x`` (1, rows, D) of one
    sequence, once a piece of it that attends alike (``_pieces``)."""
    sizes = _pieces(cache, x.shape[1])
    if len(sizes) == 1:
        return attention(x, mask, cache)
    outs = [attention(x[:, at : at + n], _piece_mask(mask, at, n, x.shape[1]), cache) for at, n in sizes]
    return mx.concatenate(outs, axis=1)


def _pieces(cache, rows: int) -> list[tuple[int, int]]:
    """(first row, rows) of each piece of a chunk that attends over the same
    keys: one, but where a quantized cache's block ends inside the chunk
    (``kv.quantized``: a token sees the blocks before its own closed)."""
    sizes = cache.pieces(rows) if hasattr(cache, "pieces") else [rows]
    return list(zip(itertools.accumulate(sizes[:-1], initial=0), sizes))


def _piece_mask(mask, at: int, n: int, rows: int):
    """A chunk's ``mask`` for its rows [at, at + n): they see the keys up to the last of them."""
    if mask is None or isinstance(mask, str):
        return mask
    return mask[..., at : at + n, : mask.shape[-1] - rows + at + n]


def _standard_chunks(attn: nn.Module, x: mx.array, batch: PrefillBatch, masks: list) -> mx.array:
    """A standard-layout attention module over prompt chunks ``x`` (1, rows, D):
    the projections over every row at once, then per chunk the rotation from
    its sequence's offset, the cache write and the attention -- as mlx-lm's
    own call runs one chunk, but for the attention (``runtime.model.attention`` on
    the CPU), which runs a piece of the chunk at a time (``_pieces``)."""
    rows = x.shape[1]
    parts = zip(*(batch.chunks(t, axis=2) for t in _project(attn, x, (1, rows))))
    outs = []
    for (q, k, v), c, mask in zip(parts, batch.caches, masks):
        q, k = rotate(attn.rope, q, c.offset), rotate(attn.rope, k, c.offset)
        for at, n in _pieces(c, q.shape[2]):
            piece = slice(at, at + n)
            fetched = _fetch(c, k[:, :, piece], v[:, :, piece])
            m = _piece_mask(mask, at, n, q.shape[2])
            if _in_float(attn, x, [c]):
                keys, values, packed = fetched
                outs.append(attend(q[:, :, piece], keys, values, _scale(attn), m, packed))
            else:
                outs.append(_attend(attn, q[:, :, piece], fetched, c, m))
    out = mx.concatenate(outs, axis=2) if len(outs) > 1 else outs[0]  # (1, heads, rows, head_dim)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, rows, -1))


def _fetch(cache, keys: mx.array, values: mx.array) -> tuple:
    """Write a sequence's new keys and values; what its queries attend over:
    float keys and values, and its ``PackedPast`` (or None)."""
    if hasattr(cache, "update_and_fetch_past"):
        return cache.update_and_fetch_past(keys, values)
    return (*cache.update_and_fetch(keys, values), None)


def _attend(attn: nn.Module, queries: mx.array, fetched: tuple, cache, mask) -> mx.array:
    """One sequence's attention off the CPU's float path: ``runtime.model.attention``
    where part of its past is packed, else mlx-lm's."""
    keys, values, packed = fetched
    if packed is not None:
        assert attn.get("sinks") is None, "attention sinks need every key in float (Engine.float_head)"
        return attend(queries, keys, values, _scale(attn), mask, packed)
    return scaled_dot_product_attention(queries, keys, values, cache, scale=_scale(attn), mask=mask,
                                        sinks=attn.get("sinks"))


def _project(attn: nn.Module, x: mx.array, shape: tuple[int, int]) -> tuple[mx.array, mx.array, mx.array]:
    """Queries, keys and values of ``x`` seen as ``shape`` (sequences, tokens):
    each (sequences, heads, tokens, head_dim), normed, not yet rotated."""
    heads = getattr(attn, "n_heads", None) or attn.num_attention_heads
    kv_heads = getattr(attn, "n_kv_heads", None) or attn.num_key_value_heads
    q = attn.q_proj(x).reshape(*shape, heads, -1)
    k = attn.k_proj(x).reshape(*shape, kv_heads, -1)
    v = attn.v_proj(x).reshape(*shape, kv_heads, -1)
    if "q_norm" in attn:
        q, k = attn.q_norm(q), attn.k_norm(k)
    return tuple(t.transpose(0, 2, 1, 3) for t in (q, k, v))


def _scale(attn: nn.Module) -> float:
    return getattr(attn, "scale", None) or attn.sm_scale


def _in_float(attn: nn.Module, x: mx.array, caches) -> bool:
    """Whether ``runtime.model.attention`` serves these caches: float32 keys and
    values (a working copy, a window) on the CPU, where MLX's own softmax is
    slow, and no attention sinks."""
    return (mx.default_device() == mx.cpu and x.dtype == mx.float32 and attn.get("sinks") is None
            and all(getattr(c, "float_keys", False) for c in caches))  # (mlx-lm's own: no)


def _mask(cache):
    """What the model would pass for one new token over ``cache`` alone."""
    return cache.make_mask(1, return_array=False, window_size=None)


def _pad_slots(out: mx.array, slots: int, axis: int) -> mx.array:
    """``out`` followed by zeros up to ``slots`` along ``axis``: the padding slots."""
    n = out.shape[axis]
    if n == slots:
        return out
    shape = list(out.shape)
    shape[axis] = slots - n
    return mx.concatenate([out, mx.zeros(shape, out.dtype)], axis=axis)
