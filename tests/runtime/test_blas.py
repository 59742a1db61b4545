"""Which OpenBLAS kernels MLX's matmuls run on (``runtime.model.blas``)."""

import os
import subprocess
import sys

import pytest

from semantic.runtime.model import blas

AVX512 = {"avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}


@pytest.mark.parametrize("flags, kernel", [
    (AVX512 | {"avx512_bf16", "amx_tile"}, "Cooperlake"),
    (AVX512, "SkylakeX"),
    (AVX512 - {"avx512vl"}, "Haswell"),  # OpenBLAS's AVX-512 kernels need all five
    ({"avx", "avx2", "fma"}, "Haswell"),
    ({"avx"}, "Sandybridge"),
    ({"sse3", "ssse3"}, None),
])
def test_the_best_kernel_follows_the_cpus_features(flags, kernel):
    assert blas.best_kernel(flags) == kernel


@pytest.fixture
def unset_coretype(monkeypatch):
    # A copy of the environment for the test: ``delenv`` of an unset variable records nothing to
    # restore, so the kernels a test chose stayed set for the session, and every later child
    # process on a CPU without AVX-512 died of an illegal instruction.
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"})
    monkeypatch.setattr(blas.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(blas, "_cpu_flags", lambda: AVX512 | {"avx512_bf16"})


def test_an_sse_fallback_on_an_avx512_cpu_is_replaced(unset_coretype, monkeypatch):
    monkeypatch.setattr(blas, "_kernel_picked_by", lambda path: "Prescott")
    note = blas._choose_kernel("libopenblas.so.0")
    assert os.environ["OPENBLAS_CORETYPE"] == "Cooperlake"
    assert "Prescott" in note and "Cooperlake" in note


def test_a_kernel_openblas_picked_for_the_cpu_is_kept(unset_coretype, monkeypatch):
    monkeypatch.setattr(blas, "_kernel_picked_by", lambda path: "Zen")
    assert blas._choose_kernel("libopenblas.so.0") == ""
    assert "OPENBLAS_CORETYPE" not in os.environ


def test_openblas_coretype_set_by_the_user_is_kept(monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Prescott")
    monkeypatch.setattr(blas, "_kernel_picked_by", lambda path: pytest.fail("asked OpenBLAS"))
    assert blas._choose_kernel("libopenblas.so.0") == ""
    assert os.environ["OPENBLAS_CORETYPE"] == "Prescott"


def kernel_in_a_fresh_process(env: dict) -> tuple[str, str, str]:
    """The kernel set a fresh process runs, what its BLAS status notes, and its
    ``OPENBLAS_CORETYPE`` after loading it."""
    code = ("import os; from semantic.runtime.model import blas; print(blas.kernel()); print(blas.status().note); "
            "print(os.environ.get('OPENBLAS_CORETYPE', ''))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=env, check=True)
    kernel, note, coretype = out.stdout.split("\n")[:3]
    return kernel, note, coretype


@pytest.mark.skipif(blas.status().name != "openblas", reason="needs OpenBLAS")
def test_a_fresh_process_runs_avx_kernels_on_an_avx_cpu():
    """On this machine, whatever OpenBLAS release and CPU it is: never SSE kernels where AVX
    ones run (the case this guards: Debian's 0.3.21 on a Xeon it does not know)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_CORETYPE"}
    picked, note, coretype = kernel_in_a_fresh_process(env)
    if blas.best_kernel(blas._cpu_flags()) is not None:
        assert picked not in blas._SSE_KERNELS, picked
    if coretype:  # chosen here, not by OpenBLAS: the note `semantic doctor` shows says so
        assert coretype == picked and f"using {picked}" in note, note
    else:
        assert note == ""
    assert kernel_in_a_fresh_process({**env, "OPENBLAS_CORETYPE": "Nehalem"}) == ("Nehalem", "", "Nehalem")
