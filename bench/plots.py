"""PNG plots of ``semantic bench compare``: one figure per workload, axes
labelled with units, ours against mlx_lm.server (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

__all__ = ["write_plots"]

OURS, PEER = "semantic", "peer"
COLORS = {OURS: "#1f77b4", PEER: "#ff7f0e", "peer_kv4": "#d62728"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _keys(d: dict) -> list[int]:
    return sorted(int(k) for k in d)


def _get(d: dict, k: int):
    return d.get(k, d.get(str(k)))


def _finish(fig, path: Path, title: str) -> Path:
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _two_panels(s: dict, labels: dict, path: Path, panels: tuple, xlabel: str, title: str,
                integer_xticks: bool = False) -> Path:
    """Ours against the peer as lines, one panel per (key, y-axis label)."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, (key, ylabel) in zip(axes, panels):
        for side in (OURS, PEER):
            xs = _keys(s[side][key])
            ax.plot(xs, [_get(s[side][key], x) for x in xs], marker="o", label=labels[side],
                    color=COLORS[side])
        if integer_xticks:
            ax.set_xticks(xs, [str(x) for x in xs])
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend()
    return _finish(fig, path, title)


def plot_multi_turn(s: dict, labels: dict, path: Path) -> Path:
    runs = f"median of {s.get('runs')} runs"
    return _two_panels(s, labels, path, (("ttft_ms", f"time to first token (ms, {runs})"),
                                         ("e2e_ms", f"end-to-end (ms, {runs})")),
                       "turn (each adds ~200 tokens)", "Multi-turn: one agent, one turn after another")


def plot_many_agents(s: dict, labels: dict, path: Path, lru: int | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side in (OURS, PEER):
        ns = _keys(s[side]["p50_ttft_ms"])
        ax.plot(ns, [_get(s[side]["p50_ttft_ms"], n) for n in ns], marker="o", color=COLORS[side],
                label=f"{labels[side]} p50")
        ax.plot(ns, [_get(s[side]["p95_ttft_ms"], n) for n in ns], marker="^", linestyle="--",
                color=COLORS[side], label=f"{labels[side]} p95")
    if lru:
        ax.axvline(lru, color="grey", linestyle=":", label=f"peer's prompt-cache size ({lru} entries)")
    ax.set_xscale("log", base=2)
    ns = _keys(s[OURS]["p50_ttft_ms"])
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.minorticks_off()
    ax.set_yscale("log")
    ax.set_xlabel("agents N (each with a history, then one follow-up each, round-robin)")
    ax.set_ylabel("follow-up time to first token (ms, log scale)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    return _finish(fig, path, "Many agents: follow-up TTFT")


def plot_restart(s: dict, labels: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.38
    keys = [("turn3_ttft_ms", "turn 3 (before the restart)"),
            ("turn4_no_restart_ttft_ms", "turn 4, no restart\n(multi-turn workload)"),
            ("turn4_ttft_ms", "turn 4 (after the restart)")]
    keys = [(k, g) for k, g in keys if s[OURS].get(k) is not None]
    groups = [g for _, g in keys]
    for i, side in enumerate((OURS, PEER)):
        vals = [s[side].get(k) or 0 for k, _ in keys]
        xs = [g + (i - 0.5) * width for g in range(len(groups))]
        bars = ax.bar(xs, vals, width, label=labels[side], color=COLORS[side])
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylim(top=ax.get_ylim()[1] * 1.1)
    ax.set_ylabel(f"time to first token (ms, median of {s.get('runs')})")
    ax.grid(alpha=0.3, axis="y")
    ax.legend()
    return _finish(fig, path, "Restart between turn 3 and turn 4")


def plot_concurrency(s: dict, labels: dict, path: Path) -> Path:
    return _two_panels(s, labels, path, (("system_tps", "system throughput (generated tokens/s)"),
                                         ("per_stream_tps", "per stream (generated tokens/s)")),
                       "clients at once", "Concurrency: clients sending at once", integer_xticks=True)


def plot_memory(s: dict, labels: dict, path: Path) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sides = [k for k in (OURS, PEER, "peer_kv4") if k in s and s[k].get("rss_bytes")]
    names = [f"{labels.get(k, k)}\n({s[k].get('agents')} agents)" for k in sides]
    vals = [s[k]["rss_bytes"] / 2**20 for k in sides]
    bars = ax.bar(names, vals, color=[COLORS[k] for k in sides])
    ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_ylabel("resident memory after many agents (MiB)")
    ax.grid(alpha=0.3, axis="y")
    return _finish(fig, path, "Memory: server process RSS")


def write_plots(summary: dict, out: Path, labels: dict | None = None, lru: int | None = None) -> list[Path]:
    """One PNG per workload present in ``summary``; returns the paths written."""
    labels = {OURS: "semantic", PEER: "mlx_lm.server", "peer_kv4": "mlx_lm.server --kv-bits 4", **(labels or {})}
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if "multi_turn" in summary:
        written.append(plot_multi_turn(summary["multi_turn"], labels, out / "compare-multi-turn.png"))
    if "many_agents" in summary:
        written.append(plot_many_agents(summary["many_agents"], labels, out / "compare-many-agents.png", lru))
    if "restart" in summary:
        written.append(plot_restart(summary["restart"], labels, out / "compare-restart.png"))
    if "concurrency" in summary:
        written.append(plot_concurrency(summary["concurrency"], labels, out / "compare-concurrency.png"))
    if "memory" in summary:
        written.append(plot_memory(summary["memory"], labels, out / "compare-memory.png"))
    return written
