"""``runtime.model.fastmath``: 2**y and SwiGLU against float64, at the edges, and
SwiGLU row by row."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import numpy as np
from mlx_lm.models.activations import swiglu as mlx_swiglu

from semantic.runtime.model.fastmath import exp2, swiglu


def test_exp2_is_within_three_tenths_of_a_millionth():
    y = np.concatenate([np.linspace(-125, 0, 400_001), -np.logspace(-12, 0, 1001), [0.0, -0.5, 0.5 - 1]])
    got = np.array(exp2(mx.array(y.astype(np.float32)))).astype(np.float64)
    want = 2.0 ** y.astype(np.float32).astype(np.float64)
    assert np.max(np.abs(got - want) / want) < 3e-7
    below = np.array(exp2(mx.array([-125.6, -126.0, -127.0, -300.0, -np.inf], mx.float32)))
    assert np.all(below == 0)  # negligible beside a softmax row's 1, and never subnormal (slow on Intel CPUs)
    edge = np.array(exp2(mx.array(np.linspace(-127, -124, 30_001, dtype=np.float32))))
    assert np.all((edge == 0) | (edge >= np.finfo(np.float32).tiny))


def test_swiglu_is_as_close_to_exact_as_mlx_own():
    gate = np.concatenate([np.linspace(-100, 100, 200_001), np.linspace(-1e-3, 1e-3, 2001)]).astype(np.float32)
    up = np.random.default_rng(0).normal(size=gate.shape).astype(np.float32)
    g, u = gate.astype(np.float64), up.astype(np.float64)
    want = g / (1 + np.exp(-g)) * u
    ours = np.array(swiglu(mx.array(gate), mx.array(up))).astype(np.float64)
    theirs = np.array(mlx_swiglu(mx.array(gate), mx.array(up))).astype(np.float64)
    # e**g for g far below 0 is off by float32's rounding of g * log2(e), in MLX's exp too (3.9e-6);
    # below -87.3 it is under float32's normal range, and both give ~0 (ours 0 from -86.9: ``exp2``).
    for low, high, bound in ((-20, 101, 1.2e-6), (-86.9, -20, 5e-6)):
        within = (g >= low) & (g < high) & (want != 0)
        for got in (ours, theirs):
            assert np.max(np.abs(got - want)[within] / np.abs(want)[within]) < bound, (low, high)
    assert np.all(np.abs(ours[g < -86.9]) < 1e-30) and np.all(np.abs(theirs[g < -87]) < 1e-30)


def test_swiglu_at_the_edges():
    gate = mx.array([-1e4, -200.0, -88.0, 0.0, 88.0, 200.0, 1e4, np.inf], mx.float32)
    got = np.array(swiglu(gate, mx.ones_like(gate)))
    assert np.all(np.abs(got[:4]) < 1e-30)
    assert np.array_equal(got[4:], np.array([88.0, 200.0, 1e4, np.inf], np.float32))


def test_swiglu_of_a_row_depends_on_that_row_alone():
    gate, up = (mx.random.normal((300, 1536), key=mx.random.key(i)) * 4 for i in (1, 2))
    whole = swiglu(gate, up)
    for a, b in ((0, 1), (5, 6), (7, 300)):
        assert mx.array_equal(swiglu(gate[a:b], up[a:b]), whole[a:b]).item()
