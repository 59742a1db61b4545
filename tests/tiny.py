"""Tiny random-weight models of each architecture we support.

Head dim is 64 so Q4 (group 64) caches apply; windows are tiny so sliding
layers rotate within a few tokens.
"""

from __future__ import annotations

import functools
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.model.model_spec import build_model

VOCAB = 512

TINY_CONFIGS: dict[str, dict] = {
    "llama": dict(
        model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
        vocab_size=VOCAB, tie_word_embeddings=True,
    ),
    "qwen2": dict(
        model_type="qwen2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=VOCAB,
        tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
        rms_norm_eps=1e-6, vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=2,
    ),
    "qwen3": dict(  # q/k norms
        model_type="qwen3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, rms_norm_eps=1e-6, vocab_size=VOCAB,
        tie_word_embeddings=False, max_position_embeddings=2048, rope_theta=1e6,
    ),
    "gemma3": dict(  # Gemma 3 as published: the multimodal wrapper, used for text
        model_type="gemma3", vocab_size=VOCAB, text_config=dict(
            model_type="gemma3_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, query_pre_attn_scalar=64,
            rms_norm_eps=1e-6, vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=2,
        ),
    ),
    "deepseek_v2": dict(  # MLA as mlx-lm caches it: every head's key (nope + rope) and value
        model_type="deepseek_v2", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        moe_intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=64, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, vocab_size=VOCAB, max_position_embeddings=2048,
        rope_scaling={"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 2048, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 0.0},
    ),
    "deepseek_v3": dict(  # MLA with a latent cache: one compressed latent (128 here) and its rope key
        model_type="deepseek_v3", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
        moe_intermediate_size=64, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, kv_lora_rank=128, q_lora_rank=None,
        qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64, vocab_size=VOCAB, max_position_embeddings=2048,
        topk_method="noaux_tc", n_group=1, topk_group=1,
    ),
    "qwen3_next": dict(  # hybrid: Gated DeltaNet (a recurrent state) in 3 of 4 layers, attention in the 4th
        model_type="qwen3_next", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
        num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_value_heads=2,
        linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, shared_expert_intermediate_size=128,
        mlp_only_layers=[], moe_intermediate_size=64, rms_norm_eps=1e-6, vocab_size=VOCAB,
        rope_theta=10000.0, partial_rotary_factor=0.25, max_position_embeddings=2048, full_attention_interval=4,
    ),
    "qwen3_5": dict(  # Qwen3.5 as published (a wrapper), dense: the same hybrid layout
        model_type="qwen3_5", vocab_size=VOCAB, text_config=dict(
            model_type="qwen3_5_text", hidden_size=128, num_hidden_layers=4, intermediate_size=256,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, linear_num_value_heads=2,
            linear_num_key_heads=2, linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4,
            rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=2048, full_attention_interval=4,
        ),
    ),
    "gpt_oss": dict(
        model_type="gpt_oss", hidden_size=128, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
        num_experts_per_tok=2, vocab_size=VOCAB, sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
}


def tiny_model(arch: str, seed: int = 0) -> nn.Module:
    """A deterministic random-weight model, evaluated and ready to run."""
    return tiny_from_config(TINY_CONFIGS[arch], seed)


def tiny_from_config(config: dict, seed: int = 0) -> nn.Module:
    """The model of an mlx-lm ``config`` with deterministic random weights, evaluated."""
    mx.random.seed(seed)
    model = build_model(config)
    # Default inits give near-uniform logits; widen them so greedy choices are clear.
    params = model.parameters()
    model.update(
        tree_map(lambda p: p * 4 if p.ndim == 2 else p, params)  
    )
    mx.eval(model.parameters())
    return model


@functools.cache
def embedded_tokenizer():
    """The embedded model's tokenizer and chat template (prepared once per machine)."""
    from mlx_lm.utils import load_tokenizer

    from semantic.runtime.model import embedded

    return load_tokenizer(Path(embedded.prepare(progress=False)))


def tiny_model_with_tokenizer(arch: str, seed: int = 0):
    """``tiny_model(arch)`` with the embedded model's vocabulary, and that tokenizer,
    so real prompts and chat templates run through it."""
    tok = embedded_tokenizer()
    return tiny_from_config(tiny_config(arch, len(tok.get_vocab())), seed), tok


def tiny_config(arch: str, vocab_size: int) -> dict:
    """``TINY_CONFIGS[arch]`` with another vocabulary (a wrapper's text model's too)."""
    config = dict(TINY_CONFIGS[arch], vocab_size=vocab_size)
    if "text_config" in config:
        config["text_config"] = dict(config["text_config"], vocab_size=vocab_size)
    return config
