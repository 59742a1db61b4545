"""``semantic bench fidelity``: what the KV cache costs the model, in perplexity.

Each text is scored through the engine's own cache path: the model (made the
engine's), a fresh sequence cache at 16 bits (nothing quantized: the
reference), 8 and 4 bits, the text prefilled in chunks as the engine cuts
them (at most 256 tokens, never across a block's end), each chunk attending
over the cache the ones before it left. Perplexity is exp of the mean
negative log-likelihood of every token after the first. Then again with the
cache written to disk and read back part-way through (an agent's restart:
the text's middle, inside a block, so the open block goes to disk too).
Ratios are to full precision.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx

DATA = Path(__file__).parent / "data"
TEXTS = (DATA / "lighthouses.txt", DATA / "agent_cache.py.txt")  # prose; code (a module of this repo, as it was)
BITS = (16, 8, 4)


def chunks(n: int, restart: int | None, block: int) -> list[tuple[int, int]]:
    """The engine's cut of ``n`` prompt tokens: up to a block's end; also at ``restart``."""
    bounds = sorted({*range(0, n, block), n, *([restart] if restart else [])})
    return list(zip(bounds, bounds[1:]))


def perplexity(engine, tokens: list[int], restart: int | None = None) -> float:
    """The text's perplexity through a fresh cache of ``engine`` (its ``kv_bits``),
    written to disk and read back before token ``restart`` when given."""
    from semantic.runtime.store.cache_file import CacheStore, load
    from semantic.runtime.cache_records import BLOCK_TOKENS, CacheRecord
    from semantic.runtime.model.model_spec import ModelCacheSpec

    cache = engine.new_cache()
    view = cache.view()
    nll = 0.0
    for a, b in chunks(len(tokens), restart, BLOCK_TOKENS):
        if a == restart:
            spec = ModelCacheSpec.from_model(engine.model).hash
            with tempfile.TemporaryDirectory() as d:
                record = CacheRecord("fidelity", "bench/fidelity", spec, tokens[:a], "", 0.0, 0.0, cache)
                cache = load(CacheStore(d).save(record), model_id="bench/fidelity", spec_hash=spec).cache
            view = cache.view()
        logits = engine.model(mx.array(tokens[a:b])[None], cache=view)[0].astype(mx.float32)
        targets = mx.array(tokens[a + 1 : b + 1])
        logprobs = logits[: targets.size] - mx.logsumexp(logits[: targets.size], axis=-1, keepdims=True)
        nll -= mx.take_along_axis(logprobs, targets[:, None], axis=-1).sum().item()
    return math.exp(nll / (len(tokens) - 1))


def fidelity(loaded, texts: list[tuple[str, list[int]]], log=lambda line: None) -> dict:
    from semantic.runtime.engine.engine import Engine

    engines = {bits: Engine(loaded.model, loaded.tokenizer, kv_bits=bits, speculation=False) for bits in BITS}
    out = {"model": loaded.name, "texts": []}
    for name, tokens in texts:
        restart = len(tokens) // 2 | 1  # odd: inside a block
        ppl = {str(bits): perplexity(engines[bits], tokens) for bits in BITS}
        after = {str(bits): perplexity(engines[bits], tokens, restart) for bits in BITS}
        row = {
            "name": name,
            "tokens": len(tokens),
            "ppl": {k: round(v, 4) for k, v in ppl.items()},
            "ratio": {k: round(ppl[k] / ppl["16"], 5) for k in ("8", "4")},
            "ratio_after_restart": {k: round(after[k] / after["16"], 5) for k in ("8", "4")},
        }
        out["texts"].append(row)
        log(f"{name}: {len(tokens)} tokens, perplexity {row['ppl']}, ratio {row['ratio']}, "
            f"after a restart {row['ratio_after_restart']}")
    return out


def run(args: argparse.Namespace) -> int:
    from semantic.runtime.model.models import load

    loaded = load(args.model, progress=False)
    texts = [(Path(p).name, loaded.tokenizer.encode(Path(p).read_text())[: args.tokens]) for p in args.text or TEXTS]
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    result = fidelity(loaded, texts, log)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{'text':28} {'tokens':>6} {'ppl 16-bit':>10} {'8-bit':>8} {'4-bit':>8} {'after a restart: 8':>19} {'4':>8}")
    for row in result["texts"]:
        r, a = row["ratio"], row["ratio_after_restart"]
        print(f"{row['name']:28} {row['tokens']:6} {row['ppl']['16']:10.4f} {r['8'] - 1:+8.2%} {r['4'] - 1:+8.2%} "
              f"{a['8'] - 1:+19.2%} {a['4'] - 1:+8.2%}")
    return 0
