"""``semantic doctor``: is this machine ready, and is it fast?"""

from __future__ import annotations

import json

from rich.console import Console

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.model import blas, embedded
from semantic.runtime.model.device import describe, matmul_gflops
from semantic.runtime.paths import cache_home

SLOW_GFLOPS = 20.0


def doctor(as_json: bool) -> int:
    report = describe()
    report["matmul_gflops"] = round(matmul_gflops(), 1)
    report["cache_dir"] = str(cache_home())
    report["model_ready"] = embedded.is_ready()
    report["model_dir"] = str(embedded.embedded_dir())
    report["row_counts"] = _row_counts() if report["model_ready"] else None
    if as_json:
        print(json.dumps(report))
        return 0
    out = Console(highlight=False)
    ok, bad = "[green]ok[/]", "[red]!![/]"
    out.print(f"device       {report['device']} ({report['device_name']})")
    out.print(f"mlx          {report['mlx_version']}")
    fast = report["matmul_gflops"] >= SLOW_GFLOPS
    out.print(f"blas         {report['blas']} {report['blas_library'] or ''} ({report['blas_kernel']} kernels) "
              f"{ok if report['blas_fast'] else bad}")
    out.print(f"matmul       {report['matmul_gflops']} GFLOP/s float32 {ok if fast else bad}")
    out.print("kernels      the 4-bit cache's CPU kernels: " + (f"built {ok}" if report["cpu_kernels"] else
              "[yellow]not built (MLX's quantized matmul and ops, slower); reinstall with a C++ compiler[/]"))
    if not fast or not report["blas_fast"]:
        note = report["blas_note"] or "slow BLAS"
        out.print(f"             [yellow]{note}; the fast path needs OpenBLAS: {blas.INSTALL_HINT}[/]")
    elif report["blas_note"]:
        out.print(f"             {report['blas_note']}")
    out.print(f"cache dir    {report['cache_dir']}")
    state = ok if report["model_ready"] else "[yellow]not prepared yet (prepared on first use, or `semantic prepare`)[/]"
    out.print(f"model        {embedded.NAME} {report['model_dir']} {state}")
    if rows := report["row_counts"]:
        classes = " | ".join("-".join(map(str, (c[0], c[-1]))) if len(c) > 1 else str(c[0]) for c in rows["classes"])
        out.print(f"decode rows  {', '.join(map(str, rows['counts']))} of 1-{len(rows['ms'])} "
                  f"(rows agree within: {classes}; measured in {rows['seconds']} s)")
        ways = {"tiles": "column tiles, each no larger than {} row(s)", "pieces": "pieces of at most {} row(s)",
                "floor": "padded to at least {} rows"}
        for plan in rows["plans"]:  # how a weight shape's matmul takes its rows (``runtime.engine.row_plans``)
            out.print(f"             {plan['shape']}: {ways[plan['way']].format(plan['rows'])}")
        batched = rows.get("prefill_from")
        out.print("prefill      " + ("one agent's prompt chunk a forward" if batched is None else
                                     f"agents' prompt chunks of {batched}+ tokens share forwards"))
    return 0


def _row_counts() -> dict:
    """The decode row counts the server uses on the embedded model (measured once, then kept)."""
    from semantic.runtime.engine.engine import Engine
    from semantic.runtime.model.models import load
    from semantic.runtime.engine.row_counts import cached

    loaded = load(progress=False)
    return cached(Engine(loaded.model, loaded.tokenizer)).describe()
