"""Pick a fast BLAS for MLX on Linux before MLX is first imported.

The ``mlx[cpu]`` wheel bundles the reference BLAS (~2-5 GFLOP/s for a float32
matmul on two cores).  Loading an optimised BLAS into the global symbol scope
*before* ``mlx.core`` is imported makes MLX's ``cblas_*`` calls resolve to it
(~170 GFLOP/s with Debian's OpenBLAS) -- no LD_PRELOAD or re-exec needed.

Set ``SEMANTIC_BLAS`` to a library path to choose one, or to ``reference`` to
keep the bundled BLAS.

OpenBLAS picks its kernels by CPU model, and a release that does not know a
CPU may fall back to its SSE3 (Prescott) kernels: Debian's 0.3.21 does on
newer Xeons with AVX-512, where a float32 matmul then runs several times
slower (docs/benchmarks.md, "The Xeon's own kernels").  When OpenBLAS would
do that, this names the kernels the CPU's features allow, as newer OpenBLAS
releases do for CPUs they do not know.  ``OPENBLAS_CORETYPE``, when set, is
left alone.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import os
import platform
import subprocess
import sys
from dataclasses import dataclass

__all__ = ["BlasStatus", "activate", "best_kernel", "cpu_info", "kernel", "status", "INSTALL_HINT"]

INSTALL_HINT = "sudo apt-get install libopenblas0-pthread"

_CANDIDATES = (
    "/usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/*-linux-gnu/openblas-openmp/libblas.so.3",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas*.so.0",
    "/usr/lib/libopenblas.so.0",
)


@dataclass(frozen=True)
class BlasStatus:
    name: str  # "openblas", "accelerate", "reference" or a library path
    library: str | None  # the library loaded, if any
    fast: bool
    note: str = ""


_status: BlasStatus | None = None


def _find_library() -> str | None:
    for pattern in _CANDIDATES:
        for path in sorted(glob.glob(pattern)):
            return path
    return None


# OpenBLAS's x86 kernel sets that use no AVX: what it falls back to on a CPU it does not know.
_SSE_KERNELS = frozenset({"Katmai", "Coppermine", "Northwood", "Prescott", "Banias", "Atom", "Core2",
                          "Penryn", "Dunnington", "Nehalem", "Athlon", "Opteron", "Opteron_SSE3",
                          "Barcelona", "Nano", "Bobcat"})
_AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})


def best_kernel(flags: set[str]) -> str | None:
    """The OpenBLAS kernel set a CPU with these ``/proc/cpuinfo`` flags can run best:
    the ladder OpenBLAS itself climbs for CPUs it does not know."""
    if _AVX512 <= flags:
        return "Cooperlake" if "avx512_bf16" in flags else "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    return "Sandybridge" if "avx" in flags else None


@functools.cache
def cpu_info() -> dict[str, str]:
    """The first CPU's vendor, family, model, name and flags in ``/proc/cpuinfo``
    ({} where there is none)."""
    first: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                name, _, value = line.partition(":")
                if name.strip() in ("vendor_id", "cpu family", "model", "model name", "flags"):
                    first.setdefault(name.strip(), value.strip())
    except OSError:
        pass
    return first


def _cpu_flags() -> set[str]:
    return set(cpu_info().get("flags", "").split())


def _kernel_picked_by(path: str) -> str | None:
    """The kernel set OpenBLAS at ``path`` picks on its own, asked in a child process:
    it picks once, when loaded, so this process must not load it before choosing."""
    probe = ("import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).openblas_get_corename; "
             "f.restype = ctypes.c_char_p; print(f().decode())")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    try:
        out = subprocess.run([sys.executable, "-I", "-S", "-c", probe, path], env=env,
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _choose_kernel(path: str) -> str:
    """Name better kernels in ``OPENBLAS_CORETYPE`` where OpenBLAS would fall back to
    SSE ones on an AVX CPU; return a note saying so, or ""."""
    if "OPENBLAS_CORETYPE" in os.environ or platform.machine() not in ("x86_64", "AMD64"):
        return ""
    best = best_kernel(_cpu_flags())
    if best is None:
        return ""
    picked = _kernel_picked_by(path)
    if picked not in _SSE_KERNELS:
        return ""
    os.environ["OPENBLAS_CORETYPE"] = best  # children (servers, peers) inherit it
    return f"OpenBLAS would pick its {picked} kernels on this CPU; using {best} (OPENBLAS_CORETYPE overrides)"


def activate() -> BlasStatus:
    """Load an optimised BLAS once, if this platform needs and has one."""
    global _status
    if _status is not None:
        return _status
    choice = os.environ.get("SEMANTIC_BLAS", "")
    if sys.platform == "darwin":
        _status = BlasStatus("accelerate", None, True)
    elif choice == "reference":
        _status = BlasStatus("reference", None, False, "SEMANTIC_BLAS=reference")
    elif "mlx.core" in sys.modules:
        # Too late: MLX already resolved its BLAS symbols.
        _status = BlasStatus(
            "unknown", None, False, "mlx was imported before runtime; import runtime first"
        )
    else:
        path = choice or _find_library()
        if path is None:
            _status = BlasStatus(
                "reference", None, False, f"no OpenBLAS found; install it: {INSTALL_HINT}"
            )
        else:
            name = "openblas" if "openblas" in path else path
            note = _choose_kernel(path) if name == "openblas" else ""
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                _status = BlasStatus("reference", None, False, f"could not load {path}: {e}")
            else:
                _status = BlasStatus(name, path, True, note)
    return _status


def status() -> BlasStatus:
    return activate()


def kernel() -> str:
    """The kernel set OpenBLAS picked for this CPU (``OPENBLAS_CORETYPE`` overrides
    it), e.g. ``Haswell``; else the BLAS's name.  Kernels sum in different orders."""
    s = status()
    try:
        corename = ctypes.CDLL(s.library).openblas_get_corename
    except (OSError, TypeError, AttributeError):
        return s.name
    corename.restype = ctypes.c_char_p
    return corename().decode()
