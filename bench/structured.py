"""``semantic bench structured``: what a grammar costs a decode step.

In one process, on one engine: B agents (each of ``--batch``, default 1 and
8) decode at once, free or each under a JSON schema (an array of at least 50
short strings, so no reply can end within the timed steps; ``max_tokens``
far past them, so no reply is closing at its limit there), in alternating
rounds. Each ``step_once`` is timed while all B decode; reported are the
medians of those steps for both, their ratio, and two parts of a row's
grammar work timed alone, walking a valid reply token by token: the mask
(llguidance's ``compute_mask`` and making it an MLX array) and keeping the
reply closable within its limit (``Constraint.fit`` and ``advance`` against
``advance`` alone: checking the closing still holds, and finding a new one
where it does not), and finding a closing anew from each place of that
reply (``runtime.closing``: what a token that leaves the kept one costs,
once). The rest of the difference is the
step no longer built while the last one computes, as a grammar's next mask
waits on the last token.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx

SCHEMA = {
    "type": "object",
    "properties": {"notes": {"type": "array", "items": {"type": "string", "maxLength": 60}, "minItems": 50}},
    "required": ["notes"],
    "additionalProperties": False,
}
TOPICS = ("lighthouses", "rivers", "bridges", "harbours", "mountains", "forests", "deserts", "islands")


def step_times(engine, prompts: list[list[int]], sampling, steps: int) -> list[float]:
    """Seconds of each decode step while every one of ``prompts`` decodes."""
    ids = [engine.add(p, sampling) for p in prompts]
    while engine.prefilling:
        engine.prefill_step()
    times = []
    while engine.decoding == len(prompts) and len(times) < steps:
        start = time.perf_counter()
        engine.step_once()
        times.append(time.perf_counter() - start)
    for i in ids:
        engine.cancel(i)
    return times[1:]  # the first step after the prefill builds its forwards


REPLY = json.dumps({"notes": ["a short note about the sea"] * 8})


def mask_us(grammar: str, tokenizer, vocab: int) -> float:
    """Median microseconds of one row's mask, walking a valid reply token by token."""
    from semantic.runtime.grammar import Grammars

    constraint = Grammars(tokenizer, tokenizer.eos_token_ids).constraint(grammar)
    times = []
    for token in tokenizer.encode(REPLY, add_special_tokens=False):
        start = time.perf_counter()
        mx.eval(constraint.allowed(vocab))
        times.append(time.perf_counter() - start)
        constraint.advance(token)
    return statistics.median(times) * 1e6


def closing_us(grammar: str, tokenizer, limit: int) -> dict:
    """Microseconds a token takes to follow a valid reply under ``limit``
    (``fit`` and ``advance``) and without one (``advance``): medians and means
    (a mean holds the new closings found where the reply left the last)."""
    from semantic.runtime.grammar import Grammars

    grammars = Grammars(tokenizer, tokenizer.eos_token_ids)
    grammars.constraint(grammar, limit)  # (the grammar compiled, its first closing found: once per engine)
    out = {}
    for name, kept in (("advance", None), ("closing", limit)):
        constraint, times = grammars.constraint(grammar, kept), []
        for token in tokenizer.encode(REPLY, add_special_tokens=False):
            start = time.perf_counter()
            constraint.advance(token if kept is None else constraint.fit(token))
            times.append(time.perf_counter() - start)
        out[name] = {"median": round(statistics.median(times) * 1e6, 1), "mean": round(statistics.mean(times) * 1e6, 1)}
    return out


def search_ms(grammar: str, tokenizer) -> dict:
    """Milliseconds a closing takes to find anew (``Closer.close``: what a
    token that leaves the kept one costs), from each place of a valid reply:
    median and most."""
    import llguidance.hf
    from llguidance import LLMatcher

    from semantic.runtime.closing import Closer

    ends = sorted(tokenizer.eos_token_ids)
    ll = llguidance.hf.from_tokenizer(getattr(tokenizer, "_tokenizer", tokenizer), eos_token=ends)
    closer, matcher = Closer(ll, ends), LLMatcher(ll, grammar, log_level=0)
    literals, times = closer.literals(grammar), []
    for token in tokenizer.encode(REPLY, add_special_tokens=False):
        start = time.perf_counter()
        closer.close(matcher, literals)
        times.append(time.perf_counter() - start)
        matcher.consume_token(token)
    return {"median": round(statistics.median(times) * 1e3, 2), "max": round(max(times) * 1e3, 2)}


def structured(loaded, batches: tuple[int, ...], steps: int, rounds: int, log=lambda line: None) -> dict:
    from semantic.runtime.engine import Engine, SamplingParams
    from semantic.runtime.grammar import json_schema

    engine = Engine(loaded.model, loaded.tokenizer, speculation=False)  # the decode step itself, without drafts
    tok = loaded.tokenizer
    grammar = json_schema(SCHEMA)
    limit = steps + 1024  # (far past the timed steps: the grammar's steps, not its closing at the limit)
    free, shaped = SamplingParams(max_tokens=limit), SamplingParams(max_tokens=limit, grammar=grammar)
    out = {"steps": steps, "rounds": rounds, "batches": []}
    for b in batches:
        prompts = [tok.apply_chat_template([{"role": "user", "content": f"Write notes about {TOPICS[i % 8]} as JSON."}],
                                           add_generation_prompt=True) for i in range(b)]
        times = {"free": [], "grammar": []}
        for r in range(rounds):
            for name, sampling in (("free", free), ("grammar", shaped))[:: 1 if r % 2 == 0 else -1]:
                times[name] += step_times(engine, prompts, sampling, steps)
        # (a free reply may end by itself: its steps stop counting there, and with none there is no figure;
        # the target: the grammar costs a step at most 10%)
        row = {"batch": b, **{f"{k}_step_ms": round(statistics.median(v) * 1e3, 2) if v else None
                              for k, v in times.items()},
               "steps_timed": {k: len(v) for k, v in times.items()}}
        row["ratio"] = row["free_step_ms"] and round(row["grammar_step_ms"] / row["free_step_ms"], 3)
        out["batches"].append(row)
        log(f"batch {b}: free {row['free_step_ms']} ms a step, grammar {row['grammar_step_ms']} ms: {row['ratio']}x")
    out["mask_us_per_row"] = round(mask_us(grammar, tok, loaded.config["vocab_size"]), 1)
    out["closing_us_per_row"] = closing_us(grammar, tok, limit)
    out["closing_search_ms"] = search_ms(grammar, tok)
    return out


def run(args: argparse.Namespace) -> int:
    from semantic.runtime.models import load

    loaded = load(args.model, progress=False)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    result = structured(loaded, tuple(args.batch), args.steps, args.rounds, log)
    if args.json:
        print(json.dumps(result))
        return 0
    for row in result["batches"]:
        print(f"batch {row['batch']}: decode step {row['free_step_ms']} ms free, {row['grammar_step_ms']} ms with a "
              f"JSON schema: {row['ratio']}x, target <= 1.10 (medians of {row['steps_timed']['free']} / "
              f"{row['steps_timed']['grammar']} steps)")
    print(f"the mask alone: {result['mask_us_per_row']} us a row (median)")
    kept = result["closing_us_per_row"]
    print(f"a token taken: {kept['advance']['median']} us a row (mean {kept['advance']['mean']}); kept closable "
          f"within its limit: {kept['closing']['median']} us (mean {kept['closing']['mean']})")
    search = result["closing_search_ms"]
    print(f"a closing found anew: {search['median']} ms (median over the reply's places; at most {search['max']})")
    return 0
