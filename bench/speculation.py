"""``semantic bench speculation``: what drafting from an agent's own history
(``runtime.engine.speculation``) buys a greedy decode.

In one process, on one engine with the row counts a server would use, each
workload runs with speculation on and off in alternating rounds (on/off,
off/on, ...):

* **edit** -- repeat a ~400-token text exactly, one word changed;
* **multi-turn** -- a coding agent's conversation: a source file comes back
  as tool output, then the agent is asked to show a method again with a
  small change (its reply quotes the tool output);
* **prose** -- an original story, sampled (temperature 0.8, a seed a round:
  greedy, the embedded model falls into loops, which drafts catch; sampled,
  it writes text that does not repeat);
* **edit x4** -- four agents at once, each editing a different word.

A workload shorter than the edit runs that many times more rounds (multi-turn
and prose: three times), so each ratio rests on about as many timed tokens.

A run's prompt is prefilled untimed, then its decode steps are timed until
it ends. Decode tokens/s is a sequence's tokens after its first over the
time since its first (``runtime.outcome.decode_rate``, as a server reports
it); for four agents, system tokens/s is every token the decode steps gave
over their wall time. Reported: medians on and off, their ratio, the tokens
generated, drafted and accepted (``Finished``), and whether the greedy
replies on and off are identical (sampled ones differ: drafts change how the
random key is used, not the distribution). ``--peer`` also runs the three single workloads over
HTTP against ``semantic serve`` (speculation on) and ``mlx_lm.server`` on the
same float32 weights (``bench.servers``), alternating servers, a fresh agent
id per request: median streamed decode tokens/s (``Turn.decode_tps``).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

from . import report

DATA = Path(__file__).parent / "data"
TARGETS = {"edit": 2.0, "multi-turn": 1.3, "prose": 0.97, "edit x4": 1.5}  # speculation on / off
CHANGES = (("dawn", "sunrise"), ("Gaul", "France"), ("flint", "chalk"), ("mirror", "lens"))  # one word each
EDIT_TOKENS = 400
SYSTEM = "You are a coding agent. You read files with tools and answer with code."
STORY = "Write a short original story about a lighthouse keeper's daughter who builds a clockwork bird."


def passage(tokenizer, tokens: int = EDIT_TOKENS) -> str:
    """The first paragraphs of ``lighthouses.txt``, until they hold ``tokens``."""
    taken = []
    for paragraph in (DATA / "lighthouses.txt").read_text().split("\n\n"):
        taken.append(paragraph)
        if len(tokenizer.encode("\n\n".join(taken))) >= tokens:
            break
    return "\n\n".join(taken)


def edit(text: str, change: tuple[str, str]) -> list[dict]:
    old, new = change
    return [{"role": "user", "content": f'Repeat the text below exactly, word for word, with one change: write '
                                        f'"{new}" instead of "{old}". Reply with the text only.\n\n{text}'}]


def coding_conversation() -> list[dict]:
    source = (DATA / "token_bucket.py.txt").read_text()
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": "Look at limits/token_bucket.py: I want acquire to wake up more often."},
        {"role": "assistant", "content": 'I will read the file first.\n\nread_file("limits/token_bucket.py")'},
        {"role": "user", "content": f"Tool output of read_file(\"limits/token_bucket.py\"):\n```python\n{source}```"},
        {"role": "assistant", "content": "I have read it. `acquire` sleeps until enough tokens have been refilled."},
        {"role": "user", "content": "Show me the whole `acquire` method again, unchanged except that it sleeps at "
                                    "most 0.1 seconds at a time: `time.sleep(min(wait, 0.1))`."},
    ]


TEMPERATURE = {"prose": 0.8}  # the others are greedy


def workloads(tokenizer) -> dict[str, tuple[list[dict], int]]:
    """Each single workload's messages and max tokens."""
    text = passage(tokenizer)
    return {
        "edit": (edit(text, CHANGES[0]), len(tokenizer.encode(text)) + 40),
        "multi-turn": (coding_conversation(), 160),
        "prose": ([{"role": "user", "content": STORY}], 160),
    }


def decode(engine, prompts: list[list[int]], max_tokens: int, speculate: bool, temperature: float = 0.0,
           seed: int = 0) -> dict:
    """Prefill ``prompts`` untimed, then decode them all to their end, timed."""
    from semantic.runtime.engine.engine import SamplingParams
    from semantic.runtime.outcome import decode_rate

    engine.speculation = speculate  # read by ``add``
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=0.95 if temperature else 1.0,
                              seed=seed)
    ids = [engine.add(p, sampling) for p in prompts]
    first, done = {}, {}

    def note(deltas) -> None:
        now = time.perf_counter()
        for d in deltas:
            if d.tokens:
                first.setdefault(d.seq_id, now)
            if d.finished:
                done[d.seq_id] = (d.finished, now)

    while engine.prefilling:
        note(engine.prefill_step())
    start, decoded = time.perf_counter(), 0
    while not engine.idle:
        deltas = engine.step_once()
        decoded += sum(len(d.tokens) for d in deltas)
        note(deltas)
    wall = time.perf_counter() - start
    finished = [done[i][0] for i in ids]
    return {
        "decode_tps": [decode_rate(len(done[i][0].output_tokens), done[i][1] - first[i] if i in first else None)
                       for i in ids],
        "system_tps": decoded / wall if wall > 0 else None,
        "tokens": sum(len(f.output_tokens) for f in finished),
        "drafted": sum(f.drafted_tokens for f in finished),
        "accepted": sum(f.accepted_tokens for f in finished),
        "outputs": [f.output_tokens for f in finished],
    }


def compare(engine, prompts: list[list[int]], max_tokens: int, rounds: int, figure: str, target: float,
            temperature: float = 0.0) -> dict:
    """``rounds`` of decoding ``prompts`` with speculation on and off, the order
    swapped each round (sampled: the round's seed for both); ``figure``: the
    run's rate compared."""
    runs = {True: [], False: []}
    for r in range(rounds):
        for on in (True, False) if r % 2 == 0 else (False, True):
            runs[on].append(decode(engine, prompts, max_tokens, on, temperature, seed=r))

    def rate(run: dict) -> float | None:
        return run["system_tps"] if figure == "system_tps" else run["decode_tps"][0]

    on, off = ({"tps": _median(rate(x) for x in runs[side]), "tokens": runs[side][-1]["tokens"],
                "drafted": runs[side][-1]["drafted"], "accepted": runs[side][-1]["accepted"]}
               for side in (True, False))
    ratio = report.ratio(on["tps"], off["tps"])
    return {"figure": figure, "rounds": rounds, "prompt_tokens": [len(p) for p in prompts], "max_tokens": max_tokens,
            "temperature": temperature, "on": on, "off": off, "ratio": ratio, "target": target,
            "met": ratio is not None and ratio >= target,
            # greedy speculation is exact: the replies must not differ
            "identical": None if temperature else all(x["outputs"] == runs[False][0]["outputs"]
                                                      for x in runs[True] + runs[False])}


def _median(values) -> float | None:
    m = report.median(values)
    return None if m is None else round(m, 2)


def in_process(loaded, rounds: int, max_tokens: int | None = None, log=lambda line: None) -> dict:
    """Every workload on one engine; ``max_tokens`` caps each workload's (tests)."""
    from semantic.runtime.engine.engine import Engine
    from semantic.runtime.engine.row_counts import cached

    tok = loaded.tokenizer
    engine = Engine(loaded.model, tok)
    engine.use_row_counts(cached(engine))  # the row counts a server would use here

    def render(messages: list[dict]) -> list[int]:
        return tok.apply_chat_template(messages, add_generation_prompt=True)

    def cap(n: int) -> int:
        return min(n, max_tokens) if max_tokens else n

    singles = workloads(tok)
    for on in (True, False):  # warm-up: both kinds of step built once
        decode(engine, [render(singles["edit"][0])], cap(16), on)
    out = {}
    for name, (messages, n) in singles.items():
        # A shorter workload runs more rounds, so each times about as many tokens as
        # the edit's: a few rounds of a short reply are too noisy to compare (docs/benchmarks.md,
        # "`bench speculation` rounds").
        runs = rounds * max(1, round(singles["edit"][1] / n))
        out[name] = compare(engine, [render(messages)], cap(n), runs, "decode_tps", TARGETS[name],
                            TEMPERATURE.get(name, 0.0))
        log(_line(name, out[name]))
    text = passage(tok)
    prompts = [render(edit(text, change)) for change in CHANGES]
    out["edit x4"] = compare(engine, prompts, cap(singles["edit"][1]), rounds, "system_tps", TARGETS["edit x4"])
    log(_line("edit x4", out["edit x4"]))
    return {"workloads": out, "row_counts": {"counts": engine.row_counts.counts, "ms": engine.row_counts.ms}}


def _line(name: str, w: dict) -> str:
    what = "system tok/s" if w["figure"] == "system_tps" else "decode tok/s"
    on, off = w["on"], w["off"]
    return (f"{name}: {what} {on['tps']} with speculation, {off['tps']} without: {w['ratio']}x over {w['rounds']} rounds "
            f"(target >= {w['target']}x: {'met' if w['met'] else 'MISSED'}); {on['tokens']} tokens, "
            f"{on['drafted']} drafted, {on['accepted']} accepted"
            + (f"; sampled at {w['temperature']}" if w["temperature"] else "")
            + ("; REPLIES DIFFER on/off" if w["identical"] is False else ""))


def over_http(model: str, singles: dict, rounds: int, workdir: Path, log) -> dict:
    """Each single workload against ``semantic serve`` and ``mlx_lm.server``,
    alternating servers: median streamed decode tokens/s."""
    import httpx

    from .client import chat
    from .servers import Server, ours_spec, peer_dir, peer_spec
    from .workloads import OURS, PEER, TIMEOUT

    log(f"preparing the peer's model directory (the float32 weights we compute with) for {model}")
    specs = {OURS: ours_spec(model, workdir / "semantic-cache"),
             PEER: peer_spec(peer_dir(model, workdir / "peer-model"), workdir / "peer")}
    servers = {side: Server(spec, workdir / f"{side}.log") for side, spec in specs.items()}
    out = {}
    try:
        for s in servers.values():
            log(f"starting {s.spec.name}")
            s.start()
        with httpx.Client(timeout=TIMEOUT) as client:

            def send(side: str, messages: list[dict], max_tokens: int, temperature: float = 0.0):
                s = servers[side]  # a fresh agent: no cache reused between rounds
                return chat(client, s.url, f"spec-{uuid.uuid4().hex[:12]}", messages, max_tokens, s.spec.body_model,
                            temperature)

            for side in servers:  # warm-up: the model loaded, a long prompt's kernels built
                send(side, singles["edit"][0], 8)
            for name, (messages, max_tokens) in singles.items():
                tps = {OURS: [], PEER: []}
                tokens = {}
                for r in range(rounds):
                    for side in (OURS, PEER) if r % 2 == 0 else (PEER, OURS):
                        turn = send(side, messages, max_tokens, TEMPERATURE.get(name, 0.0))
                        tps[side].append(turn.decode_tps)
                        tokens[side] = turn.completion_tokens
                ours, peer = _median(tps[OURS]), _median(tps[PEER])
                out[name] = {"ours_tps": ours, "peer_tps": peer, "ratio": report.ratio(ours, peer),
                             "tokens": tokens}
                log(f"{name} over HTTP: decode tok/s ours {ours}, peer {peer}: {out[name]['ratio']}x")
    finally:
        for s in servers.values():
            s.stop()
    return {"servers": {side: s.spec.name for side, s in servers.items()}, "workloads": out}


def run(args: argparse.Namespace) -> int:
    from semantic.runtime.model.models import load

    from .compare import machine

    rounds = args.rounds or (2 if args.quick else 3)
    log = (lambda line: None) if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    info = machine()
    loaded = load(args.model, progress=False)
    result = {"benchmark": "semantic bench speculation", "model": args.model, "quick": bool(args.quick),
              "rounds": rounds, "machine": info, **in_process(loaded, rounds, log=log)}
    if args.peer:
        with tempfile.TemporaryDirectory(prefix="semantic-bench-speculation-") as tmp:
            result["http"] = over_http(args.model, workloads(loaded.tokenizer), rounds, Path(tmp), log)
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"speculation on/off, median of {rounds} rounds or more ({args.model}); row counts "
          f"{list(result['row_counts']['counts'])}")
    for name, w in result["workloads"].items():
        print(_line(name, w))
    for name, w in result.get("http", {}).get("workloads", {}).items():
        print(f"{name} over HTTP: decode tok/s semantic serve {w['ours_tps']}, mlx_lm.server {w['peer_tps']}: "
              f"{w['ratio']}x")
    return 0
