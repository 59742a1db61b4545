"""``semantic bench compare``: ours (``semantic serve``) against the peer
(``mlx_lm.server``), side by side, measured in one run over HTTP.

Both servers run on loopback with the same model, weights, precision and BLAS
(``bench.servers``); one client (``bench.client``) talks to both: greedy,
streaming OpenAI chat completions, the same prompts and max tokens, requests
alternating A B A B (the order swaps from one step to the next).  Workloads
(``bench.workloads`` runs them):

* **multi-turn** -- one agent, 6 turns of ~200 new tokens each: TTFT,
  end-to-end, tokens out and decode time per token (median over runs, each
  run a fresh agent);
* **restart** -- turns 1-3, both servers restarted, turn 4: its TTFT;
* **many agents** -- N agents (4, 16, 64), each a history of ``history``
  tokens, then one follow-up each, round-robin: p50/p95 TTFT.  Agents are
  added as N grows (the N = 16 round includes the first 4 agents' second
  follow-ups).  The peer keeps at most ``--prompt-cache-size`` (default 10)
  caches in memory, so beyond 10 agents a round-robin follow-up finds its
  history gone and prefills it all again;
* **concurrency** -- 1, 2, 4, 8 fresh clients at once, ``context``-token
  prompts, ``tokens`` output tokens: system and per-stream tokens/s (a
  round where a reply on either side ends short runs again on other
  prompts);
* **memory** -- each server's resident memory (VmRSS of its process tree)
  after the many-agents workload, its growth per history token, our cache
  files' bytes per token, and the peer once more with ``--kv-bits 4`` (a
  smaller many-agents run: its RSS is bounded by its LRU size).
* **long-context** -- one agent a context at 8K-64K tokens on the model
  with its context stretched (``bench.long_context``): cold, follow-up and
  after-restart TTFT, decode time per token, peak RSS, bytes on disk, and
  four agents at once. A cold 32K prefill takes many minutes on 2 cores, so
  it runs only when named (``--only long-context``).

Output: one JSON document, a Markdown table of ours/peer ratios and PNG plots
in ``--out`` (default ``docs/benchmarks``); ``--json`` prints the document.
``--only`` picks workloads (``memory`` brings ``many-agents`` with it); without
it every workload but long-context runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import sys
import tempfile
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from . import long_context, report
from .servers import Server, ours_spec, peer_dir, peer_spec
from .workloads import Bench, Plan, Texts

OURS, PEER = report.OURS, report.PEER


class Log:
    def __init__(self, quiet: bool = False):
        self.t0 = time.perf_counter()
        self.quiet = quiet

    def __call__(self, msg: str) -> None:
        if not self.quiet:
            m, s = divmod(int(time.perf_counter() - self.t0), 60)
            print(f"[{m:02d}:{s:02d}] {msg}", file=sys.stderr, flush=True)


def disk_usage(root: Path) -> tuple[int, int]:
    """(bytes, tokens) of the agents' caches under ``root`` (from their manifests)."""
    from semantic.runtime.store.cache_file import CacheStore

    entries = CacheStore(root).entries()
    return sum(e["bytes"] for e in entries), sum(e["tokens"] for e in entries)


def machine() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    versions = {}
    for pkg in ("mlx", "mlx-lm", "semantic"):
        try:
            versions[pkg] = version(pkg)
        except PackageNotFoundError:
            versions[pkg] = None
    from semantic.runtime.model import blas

    status = blas.status()
    return {"system": f"{platform.system()} {platform.machine()}", "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": mem, "python": platform.python_version(), **versions, "blas": status.name,
            "loadavg_start": [round(x, 2) for x in os.getloadavg()]}


WORKLOADS = ("multi-turn", "restart", "many-agents", "concurrency", "memory", "long-context")
DEFAULT = set(WORKLOADS) - {"long-context"}


def measure(args: argparse.Namespace, plan: Plan, log: Log, workdir: Path) -> dict:
    want = set(DEFAULT)
    if getattr(args, "only", None):
        want = {w.strip() for w in args.only.split(",")}
        if unknown := want - set(WORKLOADS):
            from semantic.runtime.errors import SemanticError

            raise SemanticError(f"--only: unknown workload(s) {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
        if "memory" in want:
            want.add("many-agents")  # memory is measured after the many-agents workload
    log(f"preparing the peer's model directory (the float32 weights we compute with) for {args.model}")
    model_dir = peer_dir(args.model, workdir / "peer-model")
    texts = Texts(Path(model_dir) / "tokenizer.json")
    ours_cache = workdir / "semantic-cache"
    stand_in = model_dir if getattr(args, "stand_in", False) else None
    specs = {OURS: ours_spec(args.model, ours_cache, stand_in=stand_in, decode_rows=getattr(args, "decode_rows", None)),
             PEER: peer_spec(model_dir, workdir / "peer")}
    servers = {side: Server(spec, workdir / f"{side}.log") for side, spec in specs.items()}
    raw: dict = {}
    extra: dict = {}
    bench = None
    if "long-context" in want:
        t = time.perf_counter()
        raw["long_context"] = long_context.measure(plan, model_dir, texts, log, workdir)
        extra["long_context_s"] = time.perf_counter() - t
        want.discard("long-context")
    if not want:  # (the servers that ran: the long-context pair, on the stretched model)
        extra["start_s"], extra["servers"] = {}, raw["long_context"]["servers"]
        return {"raw": raw, "extra": extra}
    try:
        for side, s in servers.items():
            log(f"starting {s.spec.name}")
            s.start()
        bench = Bench(servers, plan, texts, log)
        for side in servers:
            bench.warm_up(side)
        log("both servers are up and warm")
        memory: dict = {}
        if "multi-turn" in want:
            t = time.perf_counter()
            raw["multi_turn"] = bench.multi_turn()
            extra["multi_turn_s"] = time.perf_counter() - t
        if "restart" in want:
            t = time.perf_counter()
            raw["restart"] = bench.restart()
            extra["restart_s"] = time.perf_counter() - t
        if "many-agents" in want:
            t = time.perf_counter()
            before = {side: s.memory() for side, s in servers.items()}
            raw["many_agents"], tokens = bench.many_agents([OURS, PEER], plan.agents)
            after = {side: s.memory() for side, s in servers.items()}
            extra["many_agents_s"] = time.perf_counter() - t
            memory = {side: {"before": before[side], "after": after[side], "history_tokens": tokens[side],
                             "agents": max(plan.agents)} for side in servers}
        if "concurrency" in want:
            t = time.perf_counter()
            raw["concurrency"] = bench.concurrency()
            extra["concurrency_s"] = time.perf_counter() - t
        for s in servers.values():
            s.stop()
        if memory:
            disk, disk_tokens = disk_usage(ours_cache)
            memory[OURS].update(disk_bytes=disk, disk_tokens=disk_tokens)
        if "memory" in want:
            t = time.perf_counter()
            kv4 = Server(peer_spec(model_dir, workdir / "peer-kv4", kv_bits=4), workdir / "peer_kv4.log")
            log(f"memory: starting {kv4.spec.name} for a {plan.kv4_agents}-agent run")
            kv4.start()
            servers["peer_kv4"] = kv4
            bench.servers = servers
            bench.warm_up("peer_kv4")
            before = kv4.memory()
            _, kv4_tokens = bench.many_agents(["peer_kv4"], (plan.kv4_agents,), tag="kv",
                                              follow_ups=False)
            memory["peer_kv4"] = {"before": before, "after": kv4.memory(),
                                  "history_tokens": kv4_tokens["peer_kv4"], "agents": plan.kv4_agents}
            extra["memory_kv4_s"] = time.perf_counter() - t
        if memory:
            raw["memory"] = memory
    finally:
        if bench is not None:
            bench.close()
        for s in servers.values():
            s.stop()
    extra["start_s"] = {side: [round(x, 2) for x in s.starts] for side, s in servers.items()}
    extra["servers"] = {side: {"name": s.spec.name, **s.spec.settings} for side, s in servers.items()}
    return {"raw": raw, "extra": extra}


def run(args: argparse.Namespace) -> int:
    plan = Plan.quick() if args.quick else Plan.full()
    if getattr(args, "long_contexts", None):
        plan.long_contexts = tuple(args.long_contexts)
    log = Log()
    out = Path(args.out)
    date = datetime.now(timezone.utc)
    only, rows = getattr(args, "only", None), getattr(args, "decode_rows", None)
    command = ("semantic bench compare" + (f" --model {args.model}" if args.model != "smollm2" else "")
               + (" --quick" if args.quick else "") + (f" --only {only}" if only else "")
               + (f" --decode-rows {rows}" if rows else "")
               + (f" --long-contexts {','.join(map(str, plan.long_contexts))}" if getattr(args, "long_contexts", None)
                  else "") + (" --json" if args.json else ""))
    previous = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    began = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory(prefix="semantic-bench-compare-") as tmp:
            info = machine()
            result = measure(args, plan, log, Path(tmp))
    finally:
        signal.signal(signal.SIGTERM, previous)
    summary = report.summarize(result["raw"])
    goals = report.targets(summary)
    extra = result["extra"]
    lru = extra["servers"][PEER].get("prompt_cache_size")
    info["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    doc = {
        "benchmark": "semantic bench compare",
        "date": date.isoformat(timespec="seconds"),
        "command": command,
        "quick": bool(args.quick),
        "model": args.model,
        "machine": info,
        "servers": extra["servers"],
        "plan": asdict(plan),
        "workloads": summary,
        "targets": goals,
        "notes": {
            "ratio": "ours / peer of the figure: below 1 is better for times and bytes, above 1 for tokens/s",
            "peer_prompt_cache_size": lru,
            "server_start_s": extra["start_s"],
            "workload_s": {k[:-2]: round(v, 1) for k, v in extra.items() if k.endswith("_s") and
                           isinstance(v, float)},
            "stand_in": bool(getattr(args, "stand_in", False)),
        },
        "elapsed_s": round(time.perf_counter() - began, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    stem = "compare-long-context" if only == "long-context" else "compare"  # (its own run: kept beside the rest)
    (out / f"{stem}.json").write_text(json.dumps(doc, indent=1) + "\n")
    table = report.markdown_table(summary, goals)
    (out / f"{stem}.md").write_text(
        f"`{command}` -- {doc['date'][:10]}, {info['cpu']}, {info['cores']} cores, "
        f"{info['memory_gib']} GiB; {doc['elapsed_s'] / 60:.1f} minutes.\n\n{table}")
    from .plots import write_plots

    labels = {OURS: extra["servers"][OURS]["name"]}
    plots = write_plots(summary, out, labels, lru)
    doc["files"] = [p.name for p in [out / f"{stem}.json", out / f"{stem}.md", *plots]]
    log(f"wrote {', '.join(doc['files'])} to {out}")
    if args.json:
        print(json.dumps(doc))
        return 0
    print(table)
    for name, g in goals.items():
        print(f"{g['what']}: ours/peer {g['ratio']} (goal {g['goal']}): {'met' if g['met'] else 'MISSED'}")
    return 0
