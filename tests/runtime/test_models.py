"""Resolving and loading models."""

import mlx.core as mx
import pytest

from semantic.runtime.errors import ModelError
from semantic.runtime.model.models import resolve


def test_unknown_name(tmp_path):
    with pytest.raises(ModelError, match="unknown model 'nonsense'"):
        resolve("nonsense")


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        resolve(str(tmp_path))


def test_file_is_not_a_model(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(ModelError, match="is a file"):
        resolve(str(tmp_path / "f"))


def test_a_local_model_directory_resolves_to_itself(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve(str(tmp_path)) == tmp_path


def test_hub_repo_id_is_left_to_mlx_lm():
    assert resolve("mlx-community/Qwen2.5-0.5B-Instruct-4bit") == "mlx-community/Qwen2.5-0.5B-Instruct-4bit"


@pytest.mark.model
def test_embedded_model_runs_in_float32_on_cpu(smollm2):
    from mlx.utils import tree_flatten

    assert smollm2.spec.n_layers == 30 and smollm2.spec.n_kv_heads == 3
    if mx.default_device() == mx.cpu:
        dtypes = {p.dtype for _, p in tree_flatten(smollm2.model.parameters())}
        assert dtypes == {mx.float32}, "CPU computes in float32, weights dequantized"


@pytest.mark.model
def test_embedded_model_knows_the_capital_of_france(smollm2):
    """Teacher-forced, not generated: what greedy decoding writes hangs on near-ties (SmolLM2's
    first token here: "The" 25.4 against "L" 25.3) that the BLAS kernels' rounding decides.
    After "The capital of France is", " Paris" leads the next token by ~4.7 logits."""
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True
    )
    ids = list(prompt) + tok.encode("The capital of France is", add_special_tokens=False)
    logits = smollm2.model(mx.array(ids)[None])[0, -1]
    best, runner_up = mx.argsort(-logits)[:2].tolist()
    assert tok.decode([best]) == " Paris", [tok.decode([best]), tok.decode([runner_up])]
    assert logits[best].item() - logits[runner_up].item() > 2
