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
reply (``runtime.text.closing``: what a token that leaves the kept one costs,
once). The rest of the difference is the
step no longer built while the last one computes, as a grammar's next mask
waits on the last token.

``--parse``: what a client of the ``openai`` SDK gets back. A ``semantic
serve`` on the model (a subprocess), and ``client.chat.completions.parse``
with five ordinary Pydantic models -- numbers without bounds, strings and
lists without limits; one nested with a list, one of floats -- ``--tries``
times each (temperature 1, seeds 0..tries-1, four at once) at ``--max-tokens``:
how many come back parsed, and what each miss was (a reply cut at the limit:
which string, list or number ran on; one that did not validate; an error).
``--asks extract`` (the default) has the model extract each object from a
short text, as OpenAI's own examples of ``parse`` do; ``--asks describe``
only names the thing, so the model invents every value. (Needs the
``openai`` package: the ``dev`` extras.)
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
    from semantic.runtime.text.grammar import Grammars

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
    from semantic.runtime.text.grammar import Grammars

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

    from semantic.runtime.text.closing import Closer

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
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from semantic.runtime.text.grammar import json_schema

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


def parse_models() -> dict:
    """The five models of ``--parse``, by name: ordinary Pydantic models, nothing bounded."""
    from pydantic import BaseModel

    class City(BaseModel):  # integers
        name: str
        country: str
        population: int
        founded: int

    class Product(BaseModel):  # floats
        name: str
        price: float
        weight_kg: float
        in_stock: bool

    class Item(BaseModel):
        title: str
        quantity: int
        unit_price: float

    class Order(BaseModel):  # nested, with a list
        order_id: int
        customer: str
        items: list[Item]
        total: float

    class Match(BaseModel):
        home_team: str
        away_team: str
        home_goals: int
        away_goals: int
        attendance: int

    class Weather(BaseModel):  # floats
        city: str
        temperature_c: float
        humidity: float
        wind_kmh: float

    return {m.__name__: m for m in (City, Product, Order, Match, Weather)}


EXTRACT = "Extract the information from the text into the given structure."
ASKS = {  # [system prompt, user message] per model
    "extract": {
        "City": [EXTRACT, "Lisbon is the capital of Portugal, on the Atlantic coast. About 545,000 people live in the "
                          "city itself; it was founded long before Rome."],
        "Product": [EXTRACT, "For sale: a green city bicycle with seven gears and a basket, 12.4 kg, now 349.90 euros. "
                             "Only two left in the shop."],
        "Order": [EXTRACT, "Order from Maria Silva: two copies of 'The Old Man and the Sea' at 9.99 each, one 'Dune' "
                           "at 12.50 and one 'Emma' at 7.25."],
        "Match": [EXTRACT, "Yesterday Benfica beat Porto 3-1 at the Estadio da Luz in front of 61,000 fans."],
        "Weather": [EXTRACT, "Oslo today: cloudy, minus 3.5 degrees, humidity at 81 percent, wind from the north at "
                             "22.3 km/h."],
    },
    "describe": {
        "City": [None, "Describe Lisbon."],
        "Product": [None, "Describe a bicycle for sale in a shop."],
        "Order": [None, "Write an order for three books placed in an online shop."],
        "Match": [None, "Report the result of yesterday's football match."],
        "Weather": [None, "What is the weather like in Oslo today?"],
    },
}


class _Number(str):
    """A number's literal as the reply wrote it (``json.loads`` hooks)."""


def _digits(literal: str) -> int:
    """Significant digits of a JSON number's literal (its mantissa's, leading zeros left out)."""
    mantissa = literal.lstrip("-").split("e")[0].split("E")[0].replace(".", "")
    return len(mantissa.lstrip("0")) or 1


def _parts(value, path: str, out: dict) -> None:
    """The longest string (characters), list (items) and number (significant digits) in ``value``."""
    if isinstance(value, _Number):
        kind, size = "number", _digits(value)
    elif isinstance(value, str):
        kind, size = "string", len(value)
    elif isinstance(value, list):
        kind, size = "list", len(value)
        for i, v in enumerate(value):
            _parts(v, f"{path}[{i}]", out)
    elif isinstance(value, dict):
        for k, v in value.items():
            _parts(v, f"{path}.{k}" if path else k, out)
        return
    else:
        return
    if size > out.get(kind, ("", -1))[1]:
        out[kind] = (path, size)


def reply_parts(content: str) -> dict:
    """``{"string": [path, chars], "list": [path, items], "number": [path, digits]}`` of a reply
    (each the longest of its kind; a kind the reply has none of is left out); {} if it is not JSON."""
    try:
        value = json.loads(content, parse_int=_Number, parse_float=_Number)
    except ValueError:
        return {}
    out: dict = {}
    _parts(value, "", out)
    return {k: list(v) for k, v in out.items()}


def what_ran_on(content: str, parts: dict) -> str:
    """What filled a reply the limit cut: a number past a float64's digits, else its longest string
    when that holds half the reply or more, else its longest list."""
    path, digits = parts.get("number", ("", 0))
    if digits > 19:
        return f"a number that never ends ({path}: {digits} digits)"
    path, chars = parts.get("string", ("", 0))
    if chars * 2 >= len(content):
        return f"a string ran on ({path}: {chars} characters)"
    if "list" in parts:
        path, items = parts["list"]
        return f"a list ran on ({path}: {items} items)" if items > 3 else "strings and items filled the limit"
    return "cut at the limit"


def parse_run(url: str, model: str, tries: int, max_tokens: int, asks: str = "extract",
              log=lambda line: None) -> dict:
    """``--parse`` against the server at ``url``: per Pydantic model, the tries that came back parsed and
    each miss (``{"seed", "reason": "length" | "invalid" | "error", "tokens", "what", "parts", "content"}``),
    and the longest number any reply held."""
    from concurrent.futures import ThreadPoolExecutor

    import openai
    import pydantic

    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)

    def one(cls, seed: int) -> dict:
        system, user = ASKS[asks][cls.__name__]
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        try:
            done = client.chat.completions.parse(model=model, response_format=cls, messages=messages,
                                                 temperature=1.0, seed=seed, max_tokens=max_tokens)
        except openai.LengthFinishReasonError as e:  # the SDK refuses a reply the limit cut
            content = e.completion.choices[0].message.content or ""
            parts = reply_parts(content)
            return {"seed": seed, "reason": "length", "tokens": e.completion.usage.completion_tokens,
                    "what": what_ran_on(content, parts), "parts": parts, "content": content}
        except pydantic.ValidationError as e:
            return {"seed": seed, "reason": "invalid", "tokens": None, "what": str(e).splitlines()[0], "parts": {},
                    "content": None}
        except openai.OpenAIError as e:
            return {"seed": seed, "reason": "error", "tokens": None, "what": f"{type(e).__name__}: {e}"[:300],
                    "parts": {}, "content": None}
        content = done.choices[0].message.content
        assert isinstance(done.choices[0].message.parsed, cls)
        return {"seed": seed, "reason": None, "tokens": done.usage.completion_tokens, "parts": reply_parts(content),
                "content": content}

    out = {"tries": tries, "max_tokens": max_tokens, "temperature": 1.0, "asks": asks, "models": []}
    longest = ("", 0)
    start = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:  # four at once: the server batches them
        for name, cls in parse_models().items():
            replies = list(pool.map(lambda seed: one(cls, seed), range(tries)))
            for r in replies:
                path, digits = r["parts"].get("number", ("", 0))
                if digits > longest[1]:
                    longest = (f"{name}.{path}", digits)
            misses = [r for r in replies if r["reason"]]
            row = {"model": name, "parsed": tries - len(misses), "tries": tries, "misses": misses,
                   "example": next((r["content"] for r in replies if not r["reason"]), None)}
            out["models"].append(row)
            log(f"{name}: {row['parsed']}/{tries} parsed ({time.perf_counter() - start:.0f} s)")
    out["longest_number"] = list(longest)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


def _parse_main(args: argparse.Namespace) -> int:
    import tempfile
    from pathlib import Path

    from .servers import Server, ours_spec

    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="semantic-bench-parse-") as tmp:
        server = Server(ours_spec(args.model, Path(tmp) / "agents"), Path(tmp) / "server.log")
        server.start()
        try:
            result = parse_run(server.url, args.model, args.tries, args.max_tokens, args.asks, log)
        finally:
            server.stop()
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"chat.completions.parse, {args.asks} asks, temperature 1, seeds 0-{args.tries - 1}, "
          f"max_tokens {args.max_tokens}: parsed of {args.tries} ({result['seconds']} s)")
    for row in result["models"]:
        print(f"  {row['model']}: {row['parsed']}")
        for miss in row["misses"]:
            tokens = f" at {miss['tokens']} tokens" if miss["tokens"] is not None else ""
            print(f"    seed {miss['seed']}: {miss['reason']}{tokens}: {miss['what']}")
    path, digits = result["longest_number"]
    print(f"the longest number in any reply: {digits} significant digits ({path})")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.parse:
        return _parse_main(args)
    from semantic.runtime.model.models import load

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
