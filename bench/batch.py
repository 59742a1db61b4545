"""``semantic bench batch``: decode throughput of batched Q4 caches against
mlx-lm's own ``BatchGenerator`` over its unquantized ``BatchKVCache``.

Both sides decode greedily from the same ~1K-token contexts on the same model
weights, measured in the same process, one batch size after the other, the
two sides taking turns run by run (``measure``). Prefill is done once per
side and not timed here: each batch starts from copies of the prefilled
caches (ours Q4, the peer's in the model's dtype) and only the decode steps
are timed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.model import blas
from semantic.runtime.engine.engine import DECODE_ROWS
from semantic.runtime.model.models import load

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"


def contexts(tokenizer, n: int, length: int) -> list[list[int]]:
    """n different ~English contexts of ``length`` tokens (rotations of one text)."""
    base = tokenizer.encode(TEXT.read_text())
    while len(base) < length + 37 * n:
        base = base + base
    return [base[37 * i : 37 * i + length] for i in range(n)]


class Ours:
    """Our engine over Q4 caches, each context prefilled once: a run decodes
    copies of the first B caches."""

    name = "ours"

    def __init__(self, loaded, ctxs, decode_rows: int = DECODE_ROWS):
        from semantic.runtime.engine.engine import Engine, SamplingParams
        from semantic.runtime.engine.row_counts import cached

        # The decode step itself, one token a sequence as the peer's (drafts: ``bench speculation``).
        self.engine = Engine(loaded.model, loaded.tokenizer, decode_rows=decode_rows, speculation=False)
        self.engine.use_row_counts(cached(self.engine))  # the row counts a server would use here
        self.prefilled = []
        for ctx in ctxs:
            sid = self.engine.add(ctx, SamplingParams(max_tokens=1))
            while not self.engine.idle:
                for d in self.engine.prefill_step() + self.engine.step_once():
                    if d.finished and d.seq_id == sid:
                        self.prefilled.append(d.finished)
        full = [i for i, k in enumerate(loaded.spec.layers) if k.kind == "full"]
        live = [self.prefilled[0].cache[i] for i in full]  # buffers grow in steps: count only the cached tokens
        held = sum(t.nbytes for c in live for _, t in c.describe()[1].values())
        self.kv_bytes_ratio = held / (len(self.prefilled[0].cache_tokens) * loaded.spec.bytes_per_token(None))

    def use(self) -> None:
        """The model's layers as our engine runs them (the peer's run may have put back mlx-lm's)."""
        from semantic.runtime.engine import row_plans
        from semantic.runtime.model.lean import lean

        lean(self.engine.model)
        row_plans.apply(self.engine.model, self.engine.row_counts.plans)

    def run(self, B: int, steps: int) -> float:
        """System decode tokens/s of ``steps`` steps of B sequences, TTFT-free."""
        import mlx.core as mx

        from semantic.runtime.engine.engine import SamplingParams

        engine, sampling = self.engine, SamplingParams(max_tokens=steps + 2)
        for f in self.prefilled[:B]:
            tokens = list(f.cache_tokens)
            engine.add(tokens + [tokens[-1]], sampling, f.cache.clone(), len(tokens))
        while engine.prefilling:
            engine.prefill_step()
        engine.step_once()  # warm-up step with the full batch
        start, produced = time.perf_counter(), 0
        for _ in range(steps):
            produced += sum(len(d.tokens) for d in engine.step_once())
        tps = produced / (time.perf_counter() - start)
        while not engine.idle:
            engine.step_once()
        mx.clear_cache()
        return tps


class Peer:
    """The same workload on mlx-lm's ``BatchGenerator`` and ``BatchKVCache``."""

    name = "mlx-lm"

    def __init__(self, loaded, ctxs):
        import mlx.core as mx
        from mlx_lm.models.cache import make_prompt_cache

        self.model, self.ctxs = loaded.model, ctxs
        self.use()
        self.prefilled = []
        for ctx in ctxs:
            cache = make_prompt_cache(self.model)
            for start in range(0, len(ctx), 512):
                self.model(mx.array(ctx[start : start + 512])[None], cache=cache)
                mx.eval([c.state for c in cache])
            self.prefilled.append(cache)

    def use(self) -> None:
        """mlx-lm's own layers, not the row plans and lean forms ``Ours`` installs."""
        from semantic.runtime.engine import row_plans
        from semantic.runtime.model.lean import lean

        row_plans.apply(self.model, ())
        lean(self.model, on=False)

    def run(self, B: int, steps: int) -> float:
        import mlx.core as mx
        from mlx_lm.generate import BatchGenerator
        from mlx_lm.models.cache import KVCache

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

        gen = BatchGenerator(self.model, max_tokens=steps + 2, completion_batch_size=B, prefill_batch_size=B)
        gen.insert([[ctx[-1]] for ctx in self.ctxs[:B]], caches=[clone(c) for c in self.prefilled[:B]])
        while len(gen.next_generated()) < B:  # until every row decodes
            pass
        start, produced = time.perf_counter(), 0
        for _ in range(steps):
            produced += len(gen.next_generated())
        tps = produced / (time.perf_counter() - start)
        gen.close()
        mx.clear_cache()
        return tps


def measure(sides, batch_sizes, steps: int, repeats: int) -> dict[str, dict[int, float]]:
    """System decode tokens/s of each side at each batch size, the median of
    ``repeats`` runs. The sides take turns run by run, the first of one
    repeat last in the next (A B, B A, ...): a machine whose speed drifts
    over minutes (seen: 40%) then weighs on both alike."""
    runs = {side.name: {B: [] for B in batch_sizes} for side in sides}
    for B in batch_sizes:
        for r in range(repeats):
            for side in sides if r % 2 == 0 else sides[::-1]:
                side.use()
                runs[side.name][B].append(side.run(B, steps))
    return {name: {B: statistics.median(v) for B, v in by_size.items()} for name, by_size in runs.items()}


def prefill_peak(loaded, tokens: int, chunks=(128, 512, None)) -> dict:
    """Peak MLX memory above the model while prefilling ``tokens`` tokens, per
    chunk size (None = in one piece).  The engine's adaptive cap is lifted so
    the chunk size alone decides."""
    import mlx.core as mx

    from semantic.runtime.engine.engine import Engine, SamplingParams

    prompt = contexts(loaded.tokenizer, 1, tokens)[0]
    out = {}
    for chunk in chunks:
        engine = Engine(loaded.model, loaded.tokenizer, prefill_chunk=chunk or tokens, attention_budget=1 << 40)
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
    repeats = 3  # (the sides alternate run by run: ``measure``)
    ctxs = contexts(loaded.tokenizer, max(sizes), args.context)
    rows = getattr(args, "decode_rows", None) or DECODE_ROWS
    ours, peer = Ours(loaded, ctxs, rows), Peer(loaded, ctxs)
    tps = measure([ours, peer], sizes, steps, repeats)
    ours_tps, peer_tps = tps[ours.name], tps[peer.name]
    ours_stream = {B: v / B for B, v in ours_tps.items()}
    counts = ours.engine.row_counts.describe()
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
        "kv_bytes_ratio": round(ours.kv_bytes_ratio, 4),
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
    console.print(f"KV bytes held a token at this context (closed blocks Q4, the open one in float) / fp16: "
                  f"{result['kv_bytes_ratio']}")
    console.print(
        "prefill peak memory above the model, 4096-token prompt: "
        + ", ".join(f"{c}-token chunks {b / 2**20:.0f} MiB" for c, b in peak.items())
    )
    return 0
