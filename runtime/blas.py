"""Pick a fast BLAS for MLX on Linux before MLX is first imported.

The ``mlx[cpu]`` wheel bundles the reference BLAS (~2-5 GFLOP/s for a float32
matmul on two cores).  Loading an optimised BLAS into the global symbol scope
*before* ``mlx.core`` is imported makes MLX's ``cblas_*`` calls resolve to it
(~170 GFLOP/s with Debian's OpenBLAS) -- no LD_PRELOAD or re-exec needed.

Set ``SEMANTIC_BLAS`` to a library path to choose one, or to ``reference`` to
keep the bundled BLAS.
"""

from __future__ import annotations

import ctypes
import glob
import os
import sys
from dataclasses import dataclass

__all__ = ["BlasStatus", "activate", "kernel", "status", "INSTALL_HINT"]

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
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                _status = BlasStatus("reference", None, False, f"could not load {path}: {e}")
            else:
                name = "openblas" if "openblas" in path else path
                _status = BlasStatus(name, path, True)
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
