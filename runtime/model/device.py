"""What this machine computes with: device, MLX version, BLAS, the CPU
attention kernels, measured speed."""

from __future__ import annotations

import os
import time

import mlx.core as mx

from . import attention, blas

__all__ = ["describe", "matmul_gflops"]


def matmul_gflops(n: int = 1024, repeats: int = 5) -> float:
    """Measured float32 matmul throughput (median of ``repeats``)."""
    a = mx.random.normal((n, n))
    b = mx.random.normal((n, n))
    mx.eval(a, b, a @ b)  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        mx.eval(a @ b)
        times.append(time.perf_counter() - start)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e9


def describe() -> dict:
    status = blas.status()
    device = mx.default_device()
    info = mx.device_info() if hasattr(mx, "device_info") else {}
    return {
        "device": "gpu" if device == mx.gpu else "cpu",
        "device_name": info.get("device_name") or info.get("architecture") or str(device),
        "memory_bytes": info.get("memory_size") or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "mlx_version": mx.__version__,
        "blas": status.name,
        "blas_library": status.library,
        "blas_kernel": blas.kernel(),
        "blas_fast": status.fast,
        "blas_note": status.note,
        "cpu_kernels": attention.CPU_KERNELS is not None,  # runtime/model/kernels, built for this MLX
    }
