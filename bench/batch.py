"""``semantic bench batch``: decode throughput of batched Q4 caches against
mlx-lm's own ``BatchGenerator`` over its unquantized ``BatchKVCache``.

Both sides decode greedily from the same ~1K-token contexts on the same model
weights, measured in the same process, one batch size after the other.
Prefill is done once per side and not timed here: each batch starts from
copies of the prefilled caches (ours Q4, the peer's in the model's dtype) and
only the decode steps are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime import blas
from semantic.runtime.engine import DECODE_ROWS
from semantic.runtime.models import load

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"


def contexts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different ~English contexts of ``length`` tokens (rotations of one text)."""
    base = tokenizer.encode(TEXT.read_text())
    while len(base) < length + 37 * n:
        base = base + base
    return [base[37 * i : 37 * i + length] for i in range(n)]


def ours(loaded, ctxs, batch_sizes, steps, repeats, decode_rows: int = DECODE_ROWS) -> tuple[dict, dict, float, dict]:
    """System decode tokens/s per batch size (median of repeats), TTFT-free; and the
    measured row counts the engine ran with."""
    import mlx.core as mx

    from semantic.runtime.engine import Engine, SamplingParams

    from semantic.runtime.row_counts import cached

    # The decode step itself, one token a sequence as the peer's (drafts: ``bench speculation``).
    engine = Engine(loaded.model, loaded.tokenizer, decode_rows=decode_rows, speculation=False)
    engine.use_row_counts(cached(engine))  # the row counts a server would use here
    prefilled = []
    for ctx in ctxs:  # prefill each context once
        sid = engine.add(ctx, SamplingParams(max_tokens=1))
        while not engine.idle:
            for d in engine.prefill_step() + engine.step_once():
                if d.finished and d.seq_id == sid:
                    prefilled.append(d.finished)
    full = [i for i, k in enumerate(loaded.spec.layers) if k.kind == "full"]
    live = [prefilled[0].cache[i] for i in full]  # buffers grow in steps: count only the cached tokens
    q4 = sum(x[..., : c.offset, :].nbytes for c in live for x in (*c.keys, *c.values))
    fp16 = len(prefilled[0].cache_tokens) * loaded.spec.bytes_per_token(None)
    results, per_stream = {}, {}
    for B in batch_sizes:
        runs = []
        for _ in range(repeats):
            sampling = SamplingParams(max_tokens=steps + 2)
            for f in prefilled[:B]:
                tokens = list(f.cache_tokens)
                engine.add(tokens + [tokens[-1]], sampling, f.cache.clone(), len(tokens))
            while engine.prefilling:
                engine.prefill_step()
            engine.step_once()  # warm-up step with the full batch
            start, produced = time.perf_counter(), 0
            for _ in range(steps):
                produced += sum(len(d.tokens) for d in engine.step_once())
            runs.append(produced / (time.perf_counter() - start))
            while not engine.idle:
                engine.step_once()
            mx.clear_cache()
        results[B] = statistics.median(runs)
        per_stream[B] = results[B] / B
    return results, per_stream, q4 / fp16, engine.row_counts.describe()


def peer(loaded, ctxs, batch_sizes, steps, repeats) -> dict:
    """The same workload on mlx-lm's BatchGenerator and BatchKVCache."""
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from semantic.runtime import row_plans
    from semantic.runtime.lean import lean

    model = loaded.model
    row_plans.apply(model, ())  # mlx-lm's own layers, not the row plans and lean forms ``ours`` installed
    lean(model, on=False)
    prefilled = []
    for ctx in ctxs:
        cache = make_prompt_cache(model)
        for start in range(0, len(ctx), 512):
            model(mx.array(ctx[start : start + 512])[None], cache=cache)
            mx.eval([c.state for c in cache])
        prefilled.append(cache)

    def clone(cache):
        out = []
        for c in cache:
            k = KVCache()
            k.keys = mx.contiguous(c.keys[..., : c.offset, :])
            k.values = mx.contiguous(c.values[..., : c.offset, :])
            k.offset = c.offset
            out.append(k)
        mx.eval([c.state for c in out])
        return out

    results = {}
    for B in batch_sizes:
        runs = []
        for _ in range(repeats):
            gen = BatchGenerator(model, max_tokens=steps + 2, completion_batch_size=B, prefill_batch_size=B)
            gen.insert([[ctx[-1]] for ctx in ctxs[:B]], caches=[clone(c) for c in prefilled[:B]])
            while len(gen.next_generated()) < B:  # until every row decodes
                pass
            start, produced = time.perf_counter(), 0
            for _ in range(steps):
                produced += len(gen.next_generated())
            runs.append(produced / (time.perf_counter() - start))
            gen.close()
            mx.clear_cache()
        results[B] = statistics.median(runs)
    return results


def prefill_peak(loaded, tokens: int, chunks=(128, 512, None)) -> dict:
    """Peak MLX memory above the model while prefilling ``tokens`` tokens, per
    chunk size (None = in one piece).  The engine's adaptive cap is lifted so
    the chunk size alone decides."""
    import mlx.core as mx

    from semantic.runtime.engine import Engine, SamplingParams

    prompt = contexts(loaded.tokenizer, 1, tokens)[0]
    out = {}
    for chunk in chunks:
        engine = Engine(loaded.model, loaded.tokenizer, max_chunk=chunk or tokens, attention_budget=1 << 40)
        mx.clear_cache()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        engine.add(prompt, SamplingParams(max_tokens=1))
        while engine.prefilling:  # the prefill only: its last token is left to a decode step
            engine.prefill_step()
        out[chunk or tokens] = mx.get_peak_memory() - base
    return out


def run(args: argparse.Namespace) -> int:
    loaded = load(args.model)
    sizes = [1, 2, 4, 8]
    steps = 16 if args.quick else 48
    repeats = 1 if args.quick else 3
    ctxs = contexts(loaded.tokenizer, max(sizes), args.context)
    rows = getattr(args, "decode_rows", None) or DECODE_ROWS
    ours_tps, ours_stream, ratio, counts = ours(loaded, ctxs, sizes, steps, repeats, rows)
    peer_tps = peer(loaded, ctxs, sizes, steps, repeats)
    peak = prefill_peak(loaded, 4096, (512, None) if args.quick else (128, 512, None))
    result = {
        "model": args.model,
        "context_tokens": args.context,
        "decode_rows": rows,
        "row_counts": counts,
        "blas_kernel": blas.kernel(),
        "decode_steps": steps,
        "repeats": repeats,
        "batch_sizes": sizes,
        "system_tps": {B: round(v, 2) for B, v in ours_tps.items()},
        "per_stream_tps": {B: round(v, 2) for B, v in ours_stream.items()},
        "baseline_system_tps": {B: round(v, 2) for B, v in peer_tps.items()},
        "ratio_vs_baseline": {B: round(ours_tps[B] / peer_tps[B], 3) for B in sizes},
        "scaling_b4_vs_b1": round(ours_tps[4] / ours_tps[1], 3),
        "kv_bytes_ratio": round(ratio, 4),
        "prefill_peak_bytes": peak,  # keyed by chunk size; 4096 = one piece
    }
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Batched decode, {args.context}-token contexts, {steps} steps, median of {repeats}, "
                        f"decode rows {', '.join(map(str, counts['counts']))} of 1-{rows} "
                        f"({result['blas_kernel']})")
    for col in ("batch", "ours tok/s", "per stream", "mlx-lm BatchKVCache tok/s", "ours / mlx-lm"):
        table.add_column(col, justify="right")
    for B in sizes:
        table.add_row(
            str(B), f"{ours_tps[B]:.1f}", f"{ours_stream[B]:.1f}", f"{peer_tps[B]:.1f}", f"{ours_tps[B] / peer_tps[B]:.2f}x"
        )
    console = Console()
    console.print(table)
    console.print(f"batch 4 / batch 1 (ours): {result['scaling_b4_vs_b1']}x")
    console.print(f"KV bytes, Q4 / fp16: {result['kv_bytes_ratio']}")
    console.print(
        "prefill peak memory above the model, 4096-token prompt: "
        + ", ".join(f"{c}-token chunks {b / 2**20:.0f} MiB" for c, b in peak.items())
    )
    return 0
