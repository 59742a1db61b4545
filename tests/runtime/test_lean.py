"""The CPU forms of ``runtime.model.lean``: RMSNorm bitwise ``nn.RMSNorm`` in
float32 at any row count, each SwiGLU MLP class's own call within float
tolerance, float32 weights stored transposed with the same values, other
dtypes left to MLX, and installed and removed on a model without changing
its parameters' names, shapes or values."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import importlib

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

from semantic.runtime.model import lean as lean_module
from semantic.runtime.model.lean import lean
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
    assert [k for k, _ in after] == [k for k, _ in before]
    assert all(a.shape == b.shape and mx.array_equal(a, b).item() for (_, a), (_, b) in zip(after, before))
    assert mx.allclose(model(prompt), want, rtol=1e-4, atol=1e-4).item()
    lean(model, on=False)
    assert {name: type(m) for name, m in model.named_modules()} == own
    assert all(np.asarray(a).flags.c_contiguous for _, a in tree_flatten(model.parameters()))  # as mlx-lm keeps them
    assert mx.array_equal(model(prompt), want).item()


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_float32_weights_lie_transposed_and_give_the_same_products(family):
    """Every float32 linear and embedding weight is a view of its transpose made
    contiguous (the layout OpenBLAS packs fastest); the forward is the same
    within float32 rounding (bitwise under some kernel sets, which no guarantee
    rests on: alone and batched run the same layout)."""
    model = tiny_model(family)
    prompt = mx.array([[1, 5, 9, 200, VOCAB - 1]])
    want = model(prompt)
    weights = [m for _, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
    assert weights
    for m in weights:
        lean_module._lay_out(m, True)
    for m in weights:
        w = np.asarray(m.weight)
        assert w.flags.f_contiguous and (1 in w.shape or not w.flags.c_contiguous), type(m)
    # float32 rounding at the logits' scale: the kernels of one layout may sum in another order
    # (2e-5 on logits of 10-20 under OpenBLAS's SkylakeX kernels)
    assert mx.allclose(model(prompt), want, rtol=0, atol=1e-5 * mx.abs(want).max().item()).item()
    for m in weights:
        lean_module._lay_out(m, False)
        assert np.asarray(m.weight).flags.c_contiguous
    assert mx.array_equal(model(prompt), want).item()


def test_weights_of_other_dtypes_keep_their_layout():
    layer = nn.Linear(64, 32)
    layer.set_dtype(mx.bfloat16)
    weight = layer.weight
    lean(layer)
    assert layer.weight is weight


def test_the_llama_family_takes_both_forms():
    model = lean(tiny_model("llama"))
    kinds = {m.own for _, m in model.named_modules() if isinstance(m, lean_module._Lean)}
    assert nn.RMSNorm in kinds and any(k.__name__ == "MLP" for k in kinds)
