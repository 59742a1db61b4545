"""``semantic bench ttft``: time to first token, cold vs hot vs warm.

For each context length, median of ``repeats``:

* cold  -- a fresh agent whose prompt is the whole context (no cache);
* hot   -- the same agent's ~50-token follow-up, its cache in memory;
* warm  -- the same follow-up in a fresh process whose model is loaded but
           whose agent cache is only on disk: timed from sending the
           follow-up (the cache is read from disk inside that time) to the
           first token.  ``load_ms`` is reading the cache file alone;
* written -- the bytes the cache store writes for a ~20-token follow-up
           after that (``CacheStore.bytes_written``: blocks, ring, text and
           manifest), next to the whole cache's bytes on disk: it must not
           grow with the context.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.memory.model_caches import open_caches

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"
SHORT_FOLLOW_UP = "And in one sentence, which lighthouse would you most like to visit?"
FOLLOW_UP = (
    "Thank you. Now, in two short sentences, tell me which of the engineering problems "
    "described above you find the most interesting, and explain why it mattered for ships."
)


def conversation(tokenizer, context: int) -> list[dict]:
    """A system prompt and a user message that render to about ``context`` tokens."""
    words = TEXT.read_text().split()
    text, n = [], 0
    while n < context - 40:
        text.append(words[len(text) % len(words)])
        if len(text) % 50 == 0:
            n = len(tokenizer.encode(" ".join(text)))
    return [
        {"role": "system", "content": "You are a careful reader who answers briefly."},
        {"role": "user", "content": "Read this:\n" + " ".join(text)},
    ]


def _warm_up(engine) -> None:
    from semantic.runtime.engine.engine import SamplingParams

    engine.add([1, 2, 3], SamplingParams(max_tokens=2))
    while not engine.idle:
        engine.prefill_step()
        engine.step_once()


def warm_worker(spec: dict) -> dict:
    """In a fresh process: load the model, then time the follow-up from disk."""
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from semantic.runtime.model.models import load
    from semantic.runtime.memory.turns import run_turn

    loaded = load(spec["model"], progress=False)
    engine = Engine(loaded.model, loaded.tokenizer)
    _warm_up(engine)
    caches = open_caches(loaded, Path(spec["root"]))
    start = time.perf_counter()
    record = caches.disk.store.load(spec["agent"], loaded.name, loaded.spec.hash)
    load_ms = (time.perf_counter() - start) * 1000
    assert record is not None, "the cache file did not load"
    del record
    result = run_turn(engine, caches, spec["agent"], spec["messages"], SamplingParams(max_tokens=1))
    return {
        "warm_ms": result.ttft_s * 1000,
        "load_ms": load_ms,
        "reused": result.reused_tokens,
        "prefilled": result.prefilled_tokens,
    }


def measure(loaded, context: int, repeats: int, root: Path) -> dict:
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from semantic.runtime.memory.turns import run_turn

    engine = Engine(loaded.model, loaded.tokenizer)
    _warm_up(engine)
    caches = open_caches(loaded, root)
    cold, hot, warm, load_ms, written, short_tokens, on_disk, tokens = [], [], [], [], [], [], [], 0
    for r in range(repeats):
        agent = f"ctx{context}-{r}"
        messages = conversation(loaded.tokenizer, context)
        first = run_turn(engine, caches, agent, messages, SamplingParams(max_tokens=8))
        cold.append(first.ttft_s * 1000)
        tokens = first.prompt_tokens
        follow = messages + [
            {"role": "assistant", "content": first.text},
            {"role": "user", "content": FOLLOW_UP},
        ]
        caches.flush()  # on disk for the warm run, before this process extends it
        hot_turn = run_turn(engine, caches, agent, follow, SamplingParams(max_tokens=1))
        hot.append(hot_turn.ttft_s * 1000)
        assert hot_turn.prefilled_tokens < 80, "the follow-up reused the cache"
        spec = {"model": loaded.name, "root": str(root), "agent": agent, "messages": follow}
        out = subprocess.run(
            [sys.executable, "-m", "semantic.bench.ttft", json.dumps(spec)],
            capture_output=True, text=True, check=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        w = json.loads(out.stdout.strip().splitlines()[-1])
        assert w["prefilled"] < 80, "the warm follow-up reused the cache from disk"
        warm.append(w["warm_ms"])
        load_ms.append(w["load_ms"])
        caches.flush()  # the hot turn's cache (the warm run needed the one before)
        short = follow + [
            {"role": "assistant", "content": hot_turn.text},
            {"role": "user", "content": SHORT_FOLLOW_UP},
        ]
        before = caches.disk.store.bytes_written
        short_turn = run_turn(engine, caches, agent, short, SamplingParams(max_tokens=1))
        caches.flush()
        written.append(caches.disk.store.bytes_written - before)
        short_tokens.append(short_turn.prefilled_tokens)
        on_disk.append(caches.disk.store.info(agent, loaded.name)["bytes"])
    med = statistics.median
    return {"tokens": tokens, "cold": med(cold), "hot": med(hot), "warm": med(warm), "load": med(load_ms),
            "written": med(written), "short_tokens": med(short_tokens), "on_disk": med(on_disk)}


def run(args: argparse.Namespace) -> int:
    from semantic.runtime.model.models import load

    contexts = [int(c) for c in args.contexts.split(",")] if args.contexts else (
        [1024, 2048, 4096] if args.quick else [1024, 2048, 4096, 8192]
    )
    loaded = load(args.model)
    too_long = [c for c in contexts if c + 200 > loaded.context_length]
    if too_long:
        from semantic.runtime.errors import SemanticError

        raise SemanticError(f"contexts {too_long} do not fit the model's {loaded.context_length}-token window")
    rows = {}
    with tempfile.TemporaryDirectory(prefix="semantic-bench-ttft-") as root:
        for c in contexts:
            rows[c] = measure(loaded, c, args.repeats, Path(root) / str(c))
            if not args.json:
                r = rows[c]
                print(f"{c:>6} tokens: cold {r['cold']:.0f} ms, hot {r['hot']:.0f} ms, warm {r['warm']:.0f} ms "
                      f"(load {r['load']:.1f} ms); a {r['short_tokens']:.0f}-token follow-up wrote "
                      f"{r['written']:.0f} bytes of a {r['on_disk']:.0f}-byte cache", file=sys.stderr)
    result = {
        "model": args.model,
        "repeats": args.repeats,
        "contexts": contexts,
        "prompt_tokens": {c: rows[c]["tokens"] for c in contexts},
        "cold_ms": {c: round(rows[c]["cold"], 1) for c in contexts},
        "hot_ms": {c: round(rows[c]["hot"], 1) for c in contexts},
        "warm_ms": {c: round(rows[c]["warm"], 1) for c in contexts},
        "load_ms": {c: round(rows[c]["load"], 2) for c in contexts},
        "warm_over_hot": {c: round(rows[c]["warm"] / rows[c]["hot"], 2) for c in contexts},
        "cold_over_warm": {c: round(rows[c]["cold"] / rows[c]["warm"], 1) for c in contexts},
        "follow_up_tokens": {c: rows[c]["short_tokens"] for c in contexts},
        "bytes_written_per_follow_up": {c: rows[c]["written"] for c in contexts},
        "cache_bytes_on_disk": {c: rows[c]["on_disk"] for c in contexts},
    }
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"TTFT, median of {args.repeats} ({args.model})")
    for col in ("context", "cold ms", "hot ms", "warm ms", "load ms", "warm/hot", "cold/warm", "follow-up writes"):
        table.add_column(col, justify="right")
    for c in contexts:
        table.add_row(
            str(c), f"{result['cold_ms'][c]:.0f}", f"{result['hot_ms'][c]:.0f}", f"{result['warm_ms'][c]:.0f}",
            f"{result['load_ms'][c]:.1f}", f"{result['warm_over_hot'][c]:.2f}x", f"{result['cold_over_warm'][c]:.1f}x",
            f"{result['bytes_written_per_follow_up'][c] / 1024:.0f} KiB",
        )
    Console().print(table)
    return 0


if __name__ == "__main__":  # the warm worker: a fresh process
    print(json.dumps(warm_worker(json.loads(sys.argv[1]))))
