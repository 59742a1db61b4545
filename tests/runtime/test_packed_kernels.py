"""The CPU attention kernels (``runtime/model/kernels``, ``attention.CPU_KERNELS``):
built with the package for the MLX it runs on, and reading a packed past as
MLX's quantized matmul does -- scores and mixes within float tolerance of the
same blocks unpacked, for every width, group size, head size and scale type
the records take, sliced from a record's buffers or not contiguous at all."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import pytest

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
