"""The CPU kernels (``runtime/model/kernels``, ``attention.CPU_KERNELS``):
built with the package for the MLX it runs on; reading a packed past as
MLX's quantized matmul does -- scores and mixes within float tolerance of the
same blocks unpacked, for every width, group size, head size and scale type
the records take, sliced from a record's buffers or not contiguous at all;
and closing and opening blocks bit for bit as ``mx.quantize`` and
``mx.dequantize`` do, on groups chosen to take each branch of MLX's
rounding."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import pytest

from semantic.runtime.cache_records import SINKS
from semantic.runtime.kv import SequenceQuantizedKVCache
from semantic.runtime.model import attention

TOLERANCE = 2e-5  # relative to the largest score or mixed value: sums of 64-4,096 products in another order

kernels = attention.CPU_KERNELS


def test_the_kernels_are_built_for_this_mlx():
    """setup.py builds them with the package (``make setup`` installs a compiler):
    a missing or stale build would fall back to MLX's quantized matmul silently
    but for a log line, so CI fails instead."""
    assert kernels is not None, "runtime/model/kernels was not built: reinstall with a C++ compiler (make setup)"
    assert kernels.mlx_version == mx.__version__


def _record(tokens: int, D: int, bits: int, group_size: int, dtype) -> SequenceQuantizedKVCache:
    record = SequenceQuantizedKVCache(group_size, bits)
    keys, values = (mx.random.normal((1, 2, tokens, D), key=mx.random.key(i)).astype(dtype) * 3 for i in (1, 2))
    record.append(keys, values)
    mx.eval(record.arrays)
    return record


def _close(got: mx.array, want: mx.array) -> None:
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.abs(got - want).max().item() <= TOLERANCE * mx.abs(want).max().item()


@pytest.mark.skipif(kernels is None, reason="the kernels are not built (test_the_kernels_are_built_for_this_mlx)")
@pytest.mark.parametrize("bits, group_size, D, dtype", [(4, 64, 64, mx.float32), (4, 32, 128, mx.float16),
                                                        (4, 128, 128, mx.bfloat16), (8, 64, 64, mx.float32),
                                                        (8, 32, 64, mx.bfloat16)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
def test_packed_scores_and_mix_match_the_unpacked_blocks(bits, group_size, D, dtype, rows):
    record = _record(3 * 256 + 5, D, bits, group_size, dtype)  # buffers of 4 blocks, 3 closed: past 1-3 sliced
    past = record.packed_past(256, record.closed)
    keys, values = record.unpacked(256, record.closed, mx.float32)
    q = mx.random.normal((1, 2, rows, D), key=mx.random.key(3)).astype(dtype)
    w = mx.softmax(mx.random.normal((1, 2, rows, past.tokens), key=mx.random.key(4)), axis=-1)
    _close(kernels.packed_scores(q, *past.keys, group_size, bits), q.astype(mx.float32) @ keys.swapaxes(-1, -2))
    _close(kernels.packed_mix(w, *past.values, group_size, bits), w @ values)


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
@pytest.mark.parametrize("bits, group_size", [(4, 64), (8, 32)])
def test_a_rows_result_does_not_depend_on_the_rows_with_it(bits, group_size):
    """The kernels run rows a few a pass; a row's scores and mix are bit for
    bit the same alone (a decode step's few rows) or beside others (a
    chunk's many), as architecture.md says."""
    record = _record(3 * 256 + 5, 64, bits, group_size, mx.float32)
    past = record.packed_past(256, record.closed)
    q = mx.random.normal((1, 2, 27, 64), key=mx.random.key(7))
    w = mx.softmax(mx.random.normal((1, 2, 27, past.tokens), key=mx.random.key(8)), axis=-1)
    scores = kernels.packed_scores(q, *past.keys, group_size, bits)
    mixed = kernels.packed_mix(w, *past.values, group_size, bits)
    for a, b in [(0, 1), (0, 3), (5, 7), (9, 11), (18, 27)]:
        assert mx.array_equal(kernels.packed_scores(q[:, :, a:b], *past.keys, group_size, bits), scores[:, :, a:b])
        assert mx.array_equal(kernels.packed_mix(w[:, :, a:b], *past.values, group_size, bits), mixed[:, :, a:b])


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
def test_kernels_read_inputs_that_are_not_contiguous():
    record = _record(2 * 256 + 1, 64, 4, 64, mx.float32)
    past = record.packed_past(256, 512)
    q = mx.random.normal((1, 5, 2, 64), key=mx.random.key(5)).swapaxes(1, 2)  # (1, 2, 5, 64), heads interleaved
    w = mx.random.uniform(shape=(1, 256, 5, 2), key=mx.random.key(6)).transpose(0, 3, 2, 1)
    kw, ks, kb = past.keys
    reversed_heads = tuple(t[:, ::-1] for t in (kw, ks, kb))
    keys, values = record.unpacked(256, 512, mx.float32)
    _close(kernels.packed_scores(q, *reversed_heads, 64, 4), q @ keys[:, ::-1].swapaxes(-1, -2))
    _close(kernels.packed_mix(w, *past.values, 64, 4), w @ values)


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
def test_kernels_refuse_what_they_do_not_read():
    record = _record(2 * 256 + 1, 64, 4, 64, mx.float32)
    past = record.packed_past(256, 512)
    q = mx.zeros((1, 2, 1, 64))
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        kernels.packed_scores(q, *past.keys, 64, 3)
    with pytest.raises(ValueError, match="group size"):
        kernels.packed_mix(mx.zeros((1, 2, 1, 256)), *past.values, 16, 4)
    with pytest.raises(ValueError, match="queries"):
        kernels.packed_scores(q[0], *past.keys, 64, 4)
    with pytest.raises(ValueError, match="a scale and bias a group"):
        kernels.packed_scores(q, past.keys[0], past.keys[1][..., :1], past.keys[2], 64, 4)
    with pytest.raises(ValueError, match="uint32"):
        kernels.packed_mix(mx.zeros((1, 2, 1, 256)), past.values[1], *past.values[1:], 64, 4)


def _awkward(shape: tuple, seed: int) -> mx.array:
    """Floats (1, H, B, D) whose groups, along either axis, take every branch of
    MLX's affine rounding: outlier channels, a constant group, an all-zero
    group, a channel and a token below zero throughout (the edge is the
    minimum), a token of zeros."""
    x = mx.random.normal(shape, key=mx.random.key(seed)) * mx.where(mx.arange(shape[-1]) % 7 == 0, 20.0, 1.0)
    x[..., 64:128, 5] = 0.0
    x[..., :64, 6] = 3.25
    x[..., 9] = -mx.abs(x[..., 9]) - 5
    x[..., 10, :] = 0.0
    x[..., 11, :] = -mx.abs(x[..., 11, :]) - 5
    return x


def _reference_close(keys, values, group_size, bits, first):
    """``close_block``'s rows from ``mx.quantize`` itself: keys by channel (the
    first block's sinks counted as the token after them), values by token."""
    by_channel = keys.swapaxes(-1, -2)
    if first:
        by_channel = mx.concatenate([mx.repeat(by_channel[..., SINKS : SINKS + 1], SINKS, axis=-1),
                                     by_channel[..., SINKS:]], axis=-1)
    B = keys.shape[2]
    k = [t.reshape(*t.shape[:2], B, -1) for t in mx.quantize(by_channel, group_size=group_size, bits=bits)]
    v = list(mx.quantize(values, group_size=group_size, bits=bits))
    return [t.astype(mx.float16) if t.dtype == mx.float32 else t for t in (*k, *v)]


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size, D, DV", [(32, 96, 96), (64, 64, 64), (64, 128, 64), (128, 128, 128)])
@pytest.mark.parametrize("first", [False, True])
def test_close_block_makes_the_bits_mx_quantize_makes(bits, group_size, D, DV, first):
    """Keys and values of one head size or of two (MLA's)."""
    keys, values = _awkward((1, 3, 256, D), bits + D), _awkward((1, 3, 256, DV), group_size)
    got = kernels.close_block(keys, values, group_size, bits, SINKS if first else 0)
    want = _reference_close(keys, values, group_size, bits, first)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype and mx.array_equal(g, w).item()


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_open_blocks_gives_the_floats_mx_dequantize_gives(bits, group_size):
    """Three blocks sliced from a record's buffers (heads not next to each other),
    their first rows replaced and rows after them, as a working copy is made."""
    record = SequenceQuantizedKVCache(group_size, bits)
    keys, values = _awkward((1, 2, 4 * 256 + 3, 128), bits), _awkward((1, 2, 4 * 256 + 3, 128), group_size)
    record.append(keys, values)
    rows = tuple(t[..., 256:1024, :] for t in record.packed)
    sinks, tail = (keys[..., 1000:1004, :], values[..., 1:5, :]), (keys[..., 7:12, :], values[..., 900:905, :])
    got_k, got_v = kernels.open_blocks(*rows, *sinks, *tail, 768 + 5 + 11, group_size, bits, 256)
    assert got_k.shape == got_v.shape == (1, 2, 784, 128)
    for got, first, after in zip((got_k, got_v), sinks, tail):
        assert mx.array_equal(got[..., :4, :], first).item() and mx.array_equal(got[..., 768:773, :], after).item()
    plain_k, plain_v = kernels.open_blocks(*rows, *(keys[..., :0, :],) * 2, *(keys[..., :0, :],) * 2, 768,
                                           group_size, bits, 256)
    assert mx.array_equal(got_k[..., 4:768, :], plain_k[..., 4:, :]).item()
    assert mx.array_equal(got_v[..., 4:768, :], plain_v[..., 4:, :]).item()
    got_k, got_v = plain_k, plain_v
    for b in range(3):
        block = tuple(t[..., 256 * b : 256 * (b + 1), :] for t in rows)
        w, scales, biases = (t.reshape(1, 2, 128, -1) for t in block[:3])
        want_k = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                               bits=bits).swapaxes(-1, -2)
        w, scales, biases = block[3:]
        want_v = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                               bits=bits)
        assert mx.array_equal(got_k[..., 256 * b : 256 * (b + 1), :], want_k).item()
        assert mx.array_equal(got_v[..., 256 * b : 256 * (b + 1), :], want_v).item()


@pytest.mark.skipif(kernels is None, reason="the kernels are not built")
def test_block_kernels_refuse_what_they_do_not_make():
    x = mx.zeros((1, 2, 256, 64))
    with pytest.raises(ValueError, match="float32"):
        kernels.close_block(x.astype(mx.bfloat16), x, 64, 4, 0)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        kernels.close_block(x, x, 64, 2, 0)
    with pytest.raises(ValueError, match="whole groups"):
        kernels.close_block(x[..., :100, :], x[..., :100, :], 64, 4, 0)
    with pytest.raises(ValueError, match="sinks"):
        kernels.close_block(x, x, 32, 4, 32)
    rows, none = kernels.close_block(x, x, 64, 4, 0), (x[..., :0, :],) * 2
    with pytest.raises(ValueError, match="whole blocks"):
        kernels.open_blocks(*rows, *none, *none, 256, 64, 4, 512)
    with pytest.raises(ValueError, match="a scale and a bias a group"):
        kernels.open_blocks(*rows[:2], rows[1], *rows[3:], *none, *none, 256, 32, 4, 256)
    with pytest.raises(ValueError, match="room for them"):
        kernels.open_blocks(*rows, *none, x[..., :3, :], x[..., :3, :], 258, 64, 4, 256)
    with pytest.raises(ValueError, match="float32 rows"):
        kernels.open_blocks(*rows, x[..., :4, :32], x[..., :4, :32], *none, 256, 64, 4, 256)
