"""RMSNorm compiled (``runtime.norms``): bitwise ``nn.RMSNorm`` in float32 at
any row count, other dtypes left to MLX, and installed on a model without
touching its parameters."""

import runtime  # noqa: F401  (fast BLAS before mlx)

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from runtime.norms import lean_norms
from tests.tiny import VOCAB, tiny_model


@pytest.mark.parametrize("dims, eps", [(576, 1e-5), (64, 1e-6), (1000, 1e-3)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_lean_norm_is_bitwise_rms_norm(dims, eps, dtype):
    norm = nn.RMSNorm(dims, eps=eps)
    norm.weight = (mx.random.normal((dims,), key=mx.random.key(dims)) + 1).astype(dtype)
    lean = lean_norms(nn.Sequential(nn.RMSNorm(dims, eps=eps))).layers[0]
    lean.weight = norm.weight
    for rows in (1, 3, 8, 300):
        x = (mx.random.normal((1, rows, dims), key=mx.random.key(rows)) * 4).astype(dtype)
        got, want = lean(x), norm(x)
        assert got.dtype == want.dtype and mx.array_equal(got, want).item(), rows


def test_a_model_keeps_its_parameters_and_computes_the_same():
    model = tiny_model("llama")
    prompt = mx.array([[1, 5, 9, 200, VOCAB - 1]])
    before, want = tree_flatten(model.parameters()), model(prompt)
    norms = [m for _, m in model.named_modules() if isinstance(m, nn.RMSNorm)]
    assert lean_norms(lean_norms(model)) is model and all(type(m) is not nn.RMSNorm for m in norms)
    after = tree_flatten(model.parameters())
    assert [k for k, _ in after] == [k for k, _ in before] and all(a is b for (_, a), (_, b) in zip(after, before))
    assert mx.array_equal(model(prompt), want).item()
    lean_norms(model, lean=False)
    assert all(type(m) is nn.RMSNorm for m in norms)
