"""RoPE from per-forward tables (``runtime.model.rotary``): bitwise what
``mx.fast.rope`` computes on the CPU, for prompt chunks and for decode steps
with a position per slot, one table shared by a forward's layers, and the
module's own call where the tables do not serve."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE

from semantic.runtime.model import rotary
from semantic.runtime.model.rotary import rotate

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _ropes():
    return [nn.RoPE(64, traditional=True, base=100000.0), nn.RoPE(64, traditional=False, base=10000.0),
            nn.RoPE(64, traditional=False, base=1e6, scale=0.25),
            Llama3RoPE(64, 8192, False, 500000.0, scaling_config=LLAMA3)]


def _same(a: mx.array, b: mx.array) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and mx.array_equal(a, b).item()


@pytest.mark.parametrize("rope", _ropes(), ids=["traditional", "halves", "scaled", "llama3"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_a_chunk_and_a_decode_step_are_bitwise_mlx_rope(rope, dtype):
    chunk = (mx.random.normal((1, 9, 37, 64), key=mx.random.key(1)) * 3).astype(dtype)
    for offset in (0, 5, 4093):
        assert _same(rotate(rope, chunk, offset), rope(chunk, offset=offset))
    step = (mx.random.normal((5, 3, 64, 1), key=mx.random.key(2)) * 3).astype(dtype).swapaxes(2, 3)  # strided, as q/k
    positions = [0, 1, 300, 77777, 0]  # one per slot, padding slots at 0
    assert _same(rotate(rope, step, positions), rope(step, offset=mx.array(positions)))


def test_the_layers_of_a_forward_share_one_table():
    rope, x = nn.RoPE(64, base=10000.0), mx.random.normal((4, 9, 1, 64))
    rotary._tables.cache_clear()
    for _ in range(30):  # one forward's layers: each rotates its queries and its keys
        rotate(rope, x, [10, 11, 12, 0])
        rotate(rope, x[:, :3], [10, 11, 12, 0])
    assert rotary._tables.cache_info().misses == 2  # queries' heads, keys' heads


@pytest.mark.parametrize("rope", [SuScaledRoPE(64, max_position_embeddings=4096, original_max_position_embeddings=1024,
                                               short_factor=[1.0] * 32, long_factor=[2.0] * 32),
                                  nn.RoPE(32, base=10000.0)], ids=["other-class", "partial"])
def test_other_ropes_take_their_own_call(rope):
    x = mx.random.normal((2, 4, 1, 64))
    rotary._tables.cache_clear()
    assert _same(rotate(rope, x, [3, 9]), rope(x, offset=mx.array([3, 9])))
    assert _same(rotate(rope, x[:1], 7), rope(x[:1], offset=7))
    assert rotary._tables.cache_info().misses == 0
