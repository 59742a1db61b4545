"""``semantic bench model``: prefill and decode tokens/s of one sequence."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.model.models import load


def measure(loaded, prompt_tokens: int, decode_tokens: int) -> tuple[float, float]:
    """One run: (prefill tokens/s, decode tokens/s), greedy, fresh cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    model = loaded.model
    vocab = loaded.config["vocab_size"]
    tokens = mx.random.randint(100, vocab, (1, prompt_tokens))
    cache = make_prompt_cache(model)
    start = time.perf_counter()
    logits = model(tokens, cache=cache)[:, -1]
    token = mx.argmax(logits, axis=-1)
    mx.eval(token)
    prefill = prompt_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    for _ in range(decode_tokens):
        token = mx.argmax(model(token[:, None], cache=cache)[:, -1], axis=-1)
        mx.eval(token)
    decode = decode_tokens / (time.perf_counter() - start)
    return prefill, decode


def run(args: argparse.Namespace) -> int:
    loaded = load(args.model)
    measure(loaded, 64, 4)  # warm up kernels and allocator
    runs = [measure(loaded, args.prompt_tokens, args.decode_tokens) for _ in range(args.runs)]
    result = {
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "decode_tokens": args.decode_tokens,
        "runs": args.runs,
        "prefill_tps": round(statistics.median(r[0] for r in runs), 1),
        "decode_tps": round(statistics.median(r[1] for r in runs), 1),
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(
            f"{args.model}: prefill {result['prefill_tps']} tok/s ({args.prompt_tokens} tokens), "
            f"decode {result['decode_tps']} tok/s ({args.decode_tokens} tokens), median of {args.runs}"
        )
    return 0
