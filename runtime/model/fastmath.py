"""``exp`` the way MLX's CPU runs fast, and what is built from it.

MLX's CPU build computes ``exp`` one element at a time, each through a libm
``fmaf`` call: tens of times a multiply's cost (docs/benchmarks.md, "CPU
attention and batched prefill"). Softmax was most of attention there, and
the SiLU of a SwiGLU MLP a fifth of a prompt chunk's forward. Here ``2**y``
is built from elementwise ops that MLX runs vectorised -- an integer part
put into the exponent bits and a degree-5 polynomial for the rest -- within
2.6e-7 of the exact value (``exp2``); ``swiglu`` builds the sigmoid from it.
"""

from __future__ import annotations

import functools

import mlx.core as mx

__all__ = ["LOG2E", "exp2", "swiglu"]

LOG2E = 1.4426950408889634
_ROUND = 12582912.0  # 1.5 * 2**23: y + _ROUND rounds y to an integer, held in the low mantissa bits
_ROUND_BITS = 0x4B400000  # the bits of _ROUND
# 2**f for f in [-1/2, 1/2], lowest power first: a Chebyshev fit, relative error < 2.6e-7 in float32.
_POLY = (1.0000001192092896, 0.6931471824645996, 0.2402210682630539, 0.05550327152013779,
         0.009676037356257439, 0.0013400432653725147)
_compiled = functools.partial(mx.compile, shapeless=True)


@_compiled
def _split(x: mx.array, shift: mx.array) -> tuple[mx.array, mx.array]:
    """For y = x - shift: y rounded (as ``y + _ROUND``) and 2**(the rest) by the polynomial."""
    y = x - shift
    y = mx.where(y < -126.0, -126.0, y)  # as mx.maximum, and vectorised where it is not
    t = y + _ROUND
    f = y - (t - _ROUND)
    p = f * _POLY[-1] + _POLY[-2]
    for c in _POLY[-3::-1]:
        p = p * f + c
    return t, p


@_compiled
def _scaled_bits(p_bits: mx.array, t_bits: mx.array) -> mx.array:
    """The bits of p * 2**i: i (held in ``t``'s low bits) added to p's
    exponent; 0 from i = -126 down (p * 2**-126 may be subnormal)."""
    i = t_bits - _ROUND_BITS
    return mx.where(i > -126, p_bits + (i << 23), 0)


def exp2(x: mx.array, shift: mx.array | float = 0.0) -> mx.array:
    """``2**(x - shift)`` elementwise for float32 ``x <= shift`` (``shift``
    broadcast against ``x``); 0 below about -125.5. Never subnormal: Intel
    CPUs compute with subnormal numbers two orders of magnitude slower, and a
    masked softmax weight of 2**-126 times a value is one (what it cost a
    prompt chunk's attention: docs/benchmarks.md, "no subnormal attention
    weights")."""
    t, p = _split(x, mx.array(shift, x.dtype) if isinstance(shift, float) else shift)
    return mx.view(_scaled_bits(mx.view(p, mx.int32), mx.view(t, mx.int32)), mx.float32)


# Each of these is its own kernel: MLX's compiled CPU loop stops being vectorised
# when the gate is both compared and multiplied in one (docs/benchmarks.md, "SwiGLU and short rests").
@_compiled
def _down_exponent(gate: mx.array) -> mx.array:
    return mx.abs(gate) * -LOG2E


@_compiled
def _sigmoid(gate: mx.array, e: mx.array) -> mx.array:
    """1 / (1 + e**-g) from e = e**-|g|, which never overflows."""
    return mx.where(gate >= 0, 1.0, e) / (1.0 + e)


@_compiled
def _product(gate: mx.array, up: mx.array, sigmoid: mx.array) -> mx.array:
    return gate * sigmoid * up


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` for float32 arrays, as close to the exact value as
    MLX's own (tests: within 1.2e-6 for gate >= -20, 5e-6 below, ~0 under -87)."""
    return _product(gate, up, _sigmoid(gate, exp2(_down_exponent(gate))))
