"""The CPU forms of ``runtime.lean``: RMSNorm bitwise ``nn.RMSNorm`` in
float32 at any row count, each SwiGLU MLP class's own call within float
tolerance, other dtypes left to MLX, and installed and removed on a model
without touching its parameters."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import importlib

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from semantic.runtime import lean as lean_module
from semantic.runtime.lean import lean
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model


@pytest.mark.parametrize("dims, eps", [(576, 1e-5), (64, 1e-6), (1000, 1e-3)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_lean_norm_is_bitwise_rms_norm(dims, eps, dtype):
    norm = nn.RMSNorm(dims, eps=eps)
    norm.weight = (mx.random.normal((dims,), key=mx.random.key(dims)) + 1).astype(dtype)
    lean_norm = lean(nn.Sequential(nn.RMSNorm(dims, eps=eps))).layers[0]
    lean_norm.weight = norm.weight
    for rows in (1, 3, 8, 300):
        x = (mx.random.normal((1, rows, dims), key=mx.random.key(rows)) * 4).astype(dtype)
        got, want = lean_norm(x), norm(x)
        assert got.dtype == want.dtype and mx.array_equal(got, want).item(), rows


class _Args:  # what the MLP classes read of their config
    hidden_size, intermediate_size, mlp_bias = 64, 176, False


@pytest.mark.parametrize("module, name", sorted(lean_module._SWIGLU_MLPS))
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_each_lean_mlp_computes_what_its_class_computes(module, name, dtype):
    cls = getattr(importlib.import_module(module), name)
    try:
        mlp = cls(_Args())
    except TypeError:  # (dim, hidden_dim)
        mlp = cls(_Args.hidden_size, _Args.intermediate_size)
    mlp.set_dtype(dtype)
    x = (mx.random.normal((1, 37, _Args.hidden_size), key=mx.random.key(3)) * 3).astype(dtype)
    want = mlp(x)
    lean(mlp)
    assert type(mlp) is not cls and isinstance(mlp, cls)
    got = mlp(x)
    assert got.dtype == want.dtype
    if dtype == mx.float32:
        assert mx.allclose(got, want, rtol=1e-5, atol=1e-6).item()
    else:
        assert mx.array_equal(got, want).item()  # not float32: the class's own call
    lean(mlp, on=False)
    assert type(mlp) is cls


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_a_model_keeps_its_parameters_and_computes_within_tolerance(family):
    model = tiny_model(family)
    prompt = mx.array([[1, 5, 9, 200, VOCAB - 1]])
    before, want = tree_flatten(model.parameters()), model(prompt)
    own = {name: type(m) for name, m in model.named_modules()}
    assert lean(lean(model)) is model
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert mx.allclose(model(prompt), want, rtol=1e-4, atol=1e-4).item()
    lean(model, on=False)
    assert {name: type(m) for name, m in model.named_modules()} == own
    assert mx.array_equal(model(prompt), want).item()


def test_the_llama_family_takes_both_forms():
    model = lean(tiny_model("llama"))
    kinds = {m.own for _, m in model.named_modules() if isinstance(m, lean_module._Lean)}
    assert nn.RMSNorm in kinds and any(k.__name__ == "MLP" for k in kinds)
