"""Quantizing keys and values: MLX's affine quantization with 16-bit scales
and biases, its exact unpacking as plain elementwise ops, the layout of a
closed block (keys per channel, values per token) and the buffers caches
grow in."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx

from ..cache_records import SINKS
from ..model.attention import cpu_kernels

__all__ = ["BITS", "SINKS", "Packed", "Triple", "check_format", "close_block", "grown", "open_blocks", "quantize",
           "scale_dtype", "unpack"]

Triple = tuple[mx.array, mx.array, mx.array]  # (packed uint32 weights, scales, biases)
Packed = tuple[mx.array, mx.array, mx.array, mx.array, mx.array, mx.array]  # keys' triple, then values'
BITS = (4, 8, 16)  # 16: nothing quantized, K/V kept as the model computes them


def check_format(group_size: int, bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"KV cache bits must be 4, 8 or 16, not {bits}")
    if group_size not in (32, 64, 128):
        raise ValueError(f"KV cache group size must be 32, 64 or 128, not {group_size}")


def scale_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """Storage dtype of scales and biases for keys of ``dtype``."""
    return dtype if dtype in (mx.float16, mx.bfloat16) else mx.float16


def quantize(x: mx.array, group_size: int, bits: int) -> Triple:
    w, scales, biases = mx.quantize(x, group_size=group_size, bits=bits)
    dt = scale_dtype(x.dtype)
    return w, scales.astype(dt), biases.astype(dt)


def unpack(q: Triple, group_size: int, bits: int, dtype: mx.Dtype) -> mx.array:
    """``mx.dequantize`` as plain elementwise ops, bit for bit the same on the CPU
    (tests check it), along the last axis."""
    w, scales, biases = q
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    n = w.shape[-1] * 32 // bits
    codes = ((w[..., None] >> shifts) & ((1 << bits) - 1)).reshape(*w.shape[:-1], n // group_size, group_size)
    x = codes.astype(dtype) * scales.astype(dtype)[..., None] + biases.astype(dtype)[..., None]
    return x.reshape(*w.shape[:-1], n)


def _kernels(dtype: mx.Dtype):
    """The CPU kernels where they close and open these blocks: float32 on the CPU."""
    return cpu_kernels() if dtype == mx.float32 else None


def close_block(keys: mx.array, values: mx.array, group_size: int, bits: int, first: bool) -> Packed:
    """A full block's keys and values (1, H, B, D) quantized: keys per channel,
    in groups of ``group_size`` tokens (a key channel's outliers stay in its
    own scale), values per token in groups of ``group_size`` channels. The
    ``first`` block's sink tokens are left out of their groups' ranges (their
    floats are kept beside). Each tensor comes as B token rows (1, H, B,
    width) of the block's bytes, so blocks are cut along axis 2 alike. On
    the CPU the kernels make the same bits in one pass (tests check it)."""
    kernels = _kernels(keys.dtype)
    if kernels is not None and values.dtype == mx.float32:
        return tuple(kernels.close_block(keys, values, group_size, bits, SINKS if first else 0))
    B = keys.shape[2]
    by_channel = keys.swapaxes(-1, -2)  # (1, H, D, B): quantized along the tokens
    if first:
        by_channel = mx.concatenate([mx.repeat(by_channel[..., SINKS : SINKS + 1], SINKS, axis=-1),
                                     by_channel[..., SINKS:]], axis=-1)
    k = quantize(by_channel, group_size, bits)
    v = quantize(values, group_size, bits)
    return (*(t.reshape(*t.shape[:2], B, -1) for t in k), *v)


def open_blocks(packed: Packed, group_size: int, bits: int, dtype: mx.Dtype, block: int,
                sinks: Optional[tuple[mx.array, mx.array]] = None, tail: Optional[tuple[mx.array, mx.array]] = None,
                rows: Optional[int] = None) -> tuple[mx.array, mx.array]:
    """Keys and values (1, H, T, D) of whole blocks of ``close_block`` rows (T a
    multiple of ``block``), bit for bit ``mx.dequantize``, their first rows
    replaced by ``sinks``' floats if given; then the ``tail`` rows (1, H, N, D)
    if given, in ``rows`` rows in all: a working copy made in one buffer,
    whose rows after the tail are room, not to be read before they are
    written. Keys are unpacked straight into token order: the packed words
    (an eighth of the floats at 4 bits) are what is transposed, not the
    floats. On the CPU the kernels write it all in one pass, to the same bits."""
    kw, ks, kb, *v = packed
    _, H, T, _ = kw.shape
    none = tuple(mx.zeros((1, H, 0, t.shape[-1] * 32 // bits), dtype) for t in (kw, v[0]))
    sinks, tail = sinks or none, tail or none
    rows = rows or T + tail[0].shape[2]
    kernels = _kernels(dtype)
    if kernels is not None:
        return tuple(kernels.open_blocks(*packed, *sinks, *tail, rows, group_size, bits, block))
    D = ks.shape[-1] * group_size  # a token row of key scales: D channels x block / group_size, over block rows
    w, scales, biases = (t.reshape(1, H, T // block, D, -1).swapaxes(-1, -2) for t in (kw, ks, kb))  # (.., W, D)
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)[:, None]
    codes = ((w[..., None, :] >> shifts) & ((1 << bits) - 1)).reshape(1, H, T // block, -1, group_size, D)
    keys = codes.astype(dtype) * scales.astype(dtype)[..., None, :] + biases.astype(dtype)[..., None, :]
    out = keys.reshape(1, H, T, D), unpack(v, group_size, bits, dtype)
    room = rows - T - tail[0].shape[2]
    if rows == T and not sinks[0].shape[2]:
        return out
    return tuple(mx.concatenate([s, x[..., s.shape[2]:, :], t, mx.zeros((1, H, room, x.shape[3]), dtype)], axis=2)
                 for x, s, t in zip(out, sinks, tail))


def grown(buffer: Optional[mx.array], live: int, capacity: int, like: mx.array) -> mx.array:
    """``buffer[..., :live, :]`` followed by zeros up to ``capacity`` positions (axis 2)."""
    B, H, _, D = like.shape
    tail = mx.zeros((B, H, capacity - (0 if buffer is None else live), D), dtype=like.dtype)
    return tail if buffer is None else mx.concatenate([buffer[..., :live, :], tail], axis=2)
