"""``semantic bench sharded``: our engine's decode with the model sharded over
``--ranks`` processes (``mlx.launch``, ring backend, on this machine) against
the same engine in one process, side by side in one run.

Both decode greedily from the same contexts at batch 1 and 4; only the decode
steps are timed (median of repeats).  The sharded run also reports the bytes
its ranks exchanged per token: measured on the loopback interface (Linux
``/proc/net/dev``, the whole machine's: keep it otherwise idle) and computed
from the model's shapes (two all-reduces of the hidden state per layer, over
every slot of the fixed-width decode forward; a ring all-reduce sends
2 (n - 1) / n of the data from each rank).  On one machine this measures the
cost of sharding, not a speed-up: the ranks share its cores and memory.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCHES = (1, 4)


def decode(loaded, batches, context: int, steps: int, repeats: int) -> tuple[dict[int, float], dict[int, float]]:
    """Median ms per decode step at each batch size (the engine's fixed-width forward),
    and the loopback bytes sent per timed step."""
    import mlx.core as mx

    from semantic.bench.batch import contexts
    from semantic.runtime.engine.engine import Engine, SamplingParams

    engine = Engine(loaded.model, loaded.tokenizer)
    prefilled = []
    for ctx in contexts(loaded.tokenizer, max(batches), context):
        engine.add(ctx, SamplingParams(max_tokens=1))
        while not engine.idle:
            prefilled += [d.finished for d in engine.prefill_step() + engine.step_once() if d.finished]
    ms, sent = {}, {}
    for batch in batches:
        runs, moved = [], []
        for _ in range(repeats):
            for f in prefilled[:batch]:
                tokens = list(f.cache_tokens)
                engine.add(tokens + [tokens[-1]], SamplingParams(max_tokens=steps + 2), f.cache.clone(),
                           len(tokens))
            while engine.prefilling:
                engine.prefill_step()
            engine.step_once()  # warm-up
            start, before = time.perf_counter(), loopback_bytes()
            for _ in range(steps):
                engine.step_once()
            runs.append((time.perf_counter() - start) * 1000 / steps)
            moved.append((loopback_bytes() - before) / steps)
            while not engine.idle:
                engine.step_once()
            mx.clear_cache()
        ms[batch], sent[batch] = statistics.median(runs), statistics.median(moved)
    return ms, sent


def loopback_bytes() -> int:
    """Bytes sent over the loopback interface so far (Linux)."""
    for line in Path("/proc/net/dev").read_text().splitlines():
        if line.strip().startswith("lo:"):
            return int(line.split(":", 1)[1].split()[8])
    return 0


def worker(args: argparse.Namespace) -> int:
    """(Under mlx.launch) Every rank decodes its shard; rank 0 prints the result."""
    import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
    import mlx.core as mx

    from semantic.runtime.model.models import load

    group = mx.distributed.init()
    loaded = load(args.model, progress=False, group=group)
    ms, sent = decode(loaded, BATCHES, args.context, args.steps, args.repeats)
    if group.rank() == 0:
        print("RESULT", json.dumps({"ms_per_step": ms, "loopback_bytes_per_step": sent}), flush=True)
    return 0


def run(args: argparse.Namespace) -> int:
    if args.worker:
        return worker(args)
    import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

    from semantic.runtime.engine.engine import DECODE_ROWS
    from semantic.runtime.model.models import load

    steps, repeats = (8, 1) if args.quick else (24, 3)
    loaded = load(args.model)
    single, _ = decode(loaded, BATCHES, args.context, steps, repeats)
    hidden = loaded.model.args.hidden_size
    layers = loaded.spec.n_layers
    rows = DECODE_ROWS  # the engine's decode forward has this many token slots, whatever the batch
    del loaded

    launch = Path(sys.executable).with_name("mlx.launch")
    threads = max(1, (os.cpu_count() or 1) // args.ranks)  # ranks on one machine share its cores
    env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads)}
    cmd = [str(launch), "--backend", "ring", "-n", str(args.ranks), "--python", sys.executable,
           "--cwd", str(Path(__file__).resolve().parents[1]), "-m", "semantic.cli.main", "bench", "sharded", "--worker",
           "--model", args.model, "--context", str(args.context), "--steps", str(steps), "--repeats", str(repeats)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    found = re.search(r"RESULT (.*)", out.stdout)
    if found is None:
        print(out.stdout[-3000:], out.stderr[-3000:], file=sys.stderr)
        return 1
    sharded = json.loads(found.group(1))
    ms = {int(b): v for b, v in sharded["ms_per_step"].items()}
    sent = {int(b): v for b, v in sharded["loopback_bytes_per_step"].items()}
    n = args.ranks
    all_reduce = 2 * layers * hidden * 4 * rows  # float32 hidden states, two all-reduces per layer
    result = {
        "model": args.model, "ranks": n, "context_tokens": args.context, "decode_steps": steps, "repeats": repeats,
        "blas_threads_per_rank": threads,
        "single_ms_per_step": {b: round(v, 1) for b, v in single.items()},
        "sharded_ms_per_step": {b: round(v, 1) for b, v in ms.items()},
        "sharded_vs_single": {b: round(ms[b] / single[b], 2) for b in BATCHES},
        "single_tps": {b: round(b * 1000 / single[b], 2) for b in BATCHES},
        "sharded_tps": {b: round(b * 1000 / ms[b], 2) for b in BATCHES},
        "all_reduce_bytes_per_step": all_reduce,
        "ring_bytes_sent_per_step": 2 * (n - 1) * all_reduce,  # each of n ranks sends 2 (n - 1) / n of it
        "loopback_bytes_per_step": {b: round(sent[b]) for b in BATCHES},
        "loopback_bytes_per_token": {b: round(sent[b] / b) for b in BATCHES},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"decode, {args.context}-token contexts, {steps} steps, median of {repeats}; "
          f"{n} ranks on this machine ({threads} BLAS thread(s) each) vs one process")
    print(f"{'batch':>5} {'one process ms/step':>20} {'sharded ms/step':>16} {'ratio':>6} {'sharded tok/s':>14}"
          f" {'loopback B/step':>16} {'B/token':>11}")
    for b in BATCHES:
        print(f"{b:>5} {single[b]:>20.1f} {ms[b]:>16.1f} {ms[b] / single[b]:>6.2f} {result['sharded_tps'][b]:>14.2f}"
              f" {round(sent[b]):>16,} {result['loopback_bytes_per_token'][b]:>11,}")
    print(f"all-reduce payload per decode step: {all_reduce:,} B (2 per layer x {layers} layers x {hidden} floats x "
          f"{rows} slots); a ring sends {result['ring_bytes_sent_per_step']:,} B over its links per step")
    return 0
