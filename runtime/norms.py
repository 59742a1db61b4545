"""RMSNorm on the CPU in three MLX ops instead of eleven, bitwise as MLX's.

``mx.fast.rms_norm`` has no CPU kernel: there it runs its fallback, eleven
ops (square, sum, the mean's multiply, add, rsqrt, the multiplies and their
broadcasts), and each op costs microseconds of scheduling whatever its size;
a decode step of a 30-layer model runs 61 norms. The fallback's own formula,
compiled, is a square, a sum and one fused kernel of the rest, bitwise the
same for float32 (tests check it against ``nn.RMSNorm``); other dtypes keep
the fallback.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

__all__ = ["lean_norms"]


def lean_norms(model: nn.Module, lean: bool = True) -> nn.Module:
    """Make every ``nn.RMSNorm`` of ``model`` take the compiled way on the CPU
    (``lean=False``: back to its own). In place and idempotent; each norm
    becomes an instance of a subclass of ``nn.RMSNorm``, its weight and eps
    unchanged, so the model's parameters and mlx itself are as they were."""
    for _, module in model.named_modules():
        if type(module) is (nn.RMSNorm if lean else _LeanRMSNorm):
            module.__class__ = _LeanRMSNorm if lean else nn.RMSNorm
    return model


class _LeanRMSNorm(nn.RMSNorm):
    def __call__(self, x: mx.array) -> mx.array:
        if mx.default_device() != mx.cpu or x.dtype != mx.float32 or self.weight.dtype != mx.float32:
            return super().__call__(x)
        inverse_size = mx.array(1.0 / x.shape[-1], mx.float32)  # as mx.mean's normalizer
        return _rms_norm(x, self.weight, mx.array(self.eps, mx.float32), inverse_size)


@functools.partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array, inverse_size: mx.array) -> mx.array:
    """``mx.fast.rms_norm``'s fallback for float32: ``x * rsqrt(mean(x**2) + eps)``, then times the weight."""
    return x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inverse_size + eps) * weight
