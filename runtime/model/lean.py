"""CPU forms of the mlx-lm modules MLX runs slowly there: RMSNorm, the
SwiGLU MLP, and the weights of linear layers and embeddings.

* **RMSNorm.** ``mx.fast.rms_norm`` has no CPU kernel: there it runs its
  fallback, eleven ops (square, sum, the mean's multiply, add, rsqrt, the
  multiplies and their broadcasts), and each op costs microseconds of
  scheduling whatever its size; a decode step of a 30-layer model runs 61
  norms. The fallback's own formula, compiled, is a square, a sum and one
  fused kernel of the rest, **bitwise** the same for float32.
* **SwiGLU.** ``silu(gate) * up`` takes MLX's one-element-at-a-time ``exp``:
  a fifth of a prompt chunk's forward. ``runtime.model.fastmath.swiglu`` is as
  close to the exact value as MLX's own (not bitwise), and elementwise, so a
  row's result still depends on that row alone.
* **Weights.** ``x @ w.T`` hands OpenBLAS a weight to read transposed, and
  its packing of a transposed weight is the slower one: about a fifth of a
  decode step. Each float32 ``nn.Linear`` and ``nn.Embedding`` weight is
  stored transposed (``w`` is a view of a contiguous ``w.T``), so the same
  expression reads it as it lies (what it gains: docs/benchmarks.md,
  "Weights laid out for the BLAS"). The products were bitwise the same
  under the kernel sets tried (the tests hold them within float32
  rounding), and nothing rests on it: a sequence alone and batched runs the
  same layout.

Float32 on the CPU only; anything else takes the module's own call (and
keeps its weights as they are). Tests check each form against the module it
replaces.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from .fastmath import swiglu

__all__ = ["lean"]

# mlx-lm MLP classes whose __call__ is exactly down_proj(swiglu(gate_proj(x), up_proj(x))).
_SWIGLU_MLPS = {
    ("mlx_lm.models.llama", "MLP"),
    ("mlx_lm.models.qwen2", "MLP"),
    ("mlx_lm.models.qwen3", "MLP"),
    ("mlx_lm.models.qwen3_moe", "MLP"),
    ("mlx_lm.models.qwen3_next", "Qwen3NextMLP"),
    ("mlx_lm.models.deepseek_v2", "DeepseekV2MLP"),
    ("mlx_lm.models.deepseek_v3", "DeepseekV3MLP"),
}


def lean(model: nn.Module, on: bool = True) -> nn.Module:
    """Give every ``nn.RMSNorm``, SwiGLU MLP, linear layer and embedding of
    ``model`` its CPU form (``on=False``: back to their own). In place and
    idempotent: a norm or MLP becomes an instance of a subclass of its own
    class, a weight is stored transposed; the parameters' names, shapes and
    values and the modules' attributes stay, so the model and mlx-lm itself
    are as they were."""
    for _, module in model.named_modules():
        cls = type(module)
        if issubclass(cls, _Lean):
            if not on:
                module.__class__ = cls.own
        elif on and (cls is nn.RMSNorm or (cls.__module__, cls.__name__) in _SWIGLU_MLPS):
            module.__class__ = _lean_class(cls)
        if isinstance(module, (nn.Linear, nn.Embedding)):
            _lay_out(module, on)
    return model


def _lay_out(module: nn.Module, transposed: bool) -> None:
    """Store a float32 weight on the CPU transposed (as a view of ``w.T``
    made contiguous), or back as mlx-lm stores it."""
    if module.__dict__.get("_transposed", False) == transposed:
        return
    weight = module["weight"]
    if transposed and not _on_cpu(weight):
        return
    module["weight"] = mx.contiguous(weight.T).T if transposed else mx.contiguous(weight)
    mx.eval(module["weight"])  # (now: the weight it replaces is freed, and no forward pays for the copy)
    object.__setattr__(module, "_transposed", transposed)


class _Lean:
    """Marks the classes ``lean`` derived; ``own``: the class each derives from."""

    own: type


@functools.cache
def _lean_class(cls: type) -> type:
    call = _norm_call if cls is nn.RMSNorm else _mlp_call
    return type(cls.__name__, (_Lean, cls), {"__call__": call, "__module__": cls.__module__, "own": cls})


def _on_cpu(*arrays: mx.array) -> bool:
    return mx.default_device() == mx.cpu and all(a.dtype == mx.float32 for a in arrays)


def _norm_call(self, x: mx.array) -> mx.array:
    if not _on_cpu(x, self.weight):
        return self.own.__call__(self, x)
    inverse_size = mx.array(1.0 / x.shape[-1], mx.float32)  # as mx.mean's normalizer
    return _rms_norm(x, self.weight, mx.array(self.eps, mx.float32), inverse_size)


def _mlp_call(self, x: mx.array) -> mx.array:
    if not _on_cpu(x):
        return self.own.__call__(self, x)
    return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@functools.partial(mx.compile, shapeless=True)
def _rms_norm(x: mx.array, weight: mx.array, eps: mx.array, inverse_size: mx.array) -> mx.array:
    """``mx.fast.rms_norm``'s fallback for float32: ``x * rsqrt(mean(x**2) + eps)``, then times the weight."""
    return x * mx.rsqrt(mx.sum(mx.square(x), axis=-1, keepdims=True) * inverse_size + eps) * weight
