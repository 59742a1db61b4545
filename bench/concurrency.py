"""``semantic bench concurrency``: many agents at once through the actor runtime.

* **scaling** -- 1, 2, 4 and 8 fresh agents send at once, each a ~``context``-token
  prompt asking for ``tokens`` tokens (greedy).  ``system_tps``: tokens generated
  by all agents / wall time from the sends to the last token (prefill included);
  ``per_stream_tps``: the median agent's decode rate after its first token;
  ``ttft_ms``: the median agent's time to first token.
* **staggered** -- agent A sends; agent B sends 1 s later.  ``staggered_b_ttft_ms``:
  B's time to first token from its send, with the runtime batching both;
  ``sequential_b_ttft_ms``: the same when turns run one after another (B's turn
  starts when A's ends; timed from the same moment B arrived).
* **together** -- 4 fresh agents send at once, on a runtime that prefills
  their prompts one chunk a forward and on one that batches chunks
  (``Runtime.open(engine=EngineOptions(batch_prefill=...))``): median and last TTFT, system tok/s.
* **loop lateness** -- while the 8 agents run, a task on the event loop sleeps
  5 ms at a time and records how late it wakes (p50 / p99 / max, ms): the loop
  never waits on MLX.

Every figure is the median over ``repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.outcome import decode_rate

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"
ASK = "Retell the text above in detail, paragraph by paragraph."
SYSTEM = "You are a careful reader."
SIZES = (1, 2, 4, 8)
TOGETHER = 4  # agents arriving together, with their prefills batched and not
PING_S = 0.005


def prompt(tokenizer, context: int, *key) -> str:
    """A user message that renders to about ``context`` tokens; each ``key`` starts
    elsewhere in the text (stable across runs)."""
    words = TEXT.read_text().split()
    start, text = zlib.crc32(repr(key).encode()) % len(words), []
    while len(text) % 25 or len(tokenizer.encode(" ".join(text))) < context - 40:
        text.append(words[(start + len(text)) % len(words)])
    return " ".join(text) + "\n\n" + ASK


class Ping:
    """Sleeps ``PING_S`` at a time on the event loop and records how late it wakes."""

    def __init__(self):
        self.late: list[float] = []

    async def run(self) -> None:
        import anyio

        while True:
            start = time.perf_counter()
            await anyio.sleep(PING_S)
            self.late.append(time.perf_counter() - start - PING_S)


async def one_turn(agent, text: str, tokens: int, start: float) -> dict:
    """Send at ``start`` (perf_counter); return first/last token times and the count."""
    first = last = None
    async for _ in agent.send(text, max_tokens=tokens):
        last = time.perf_counter()
        first = first or last
    result = agent.last_result
    return {"start": start, "first": first, "last": last, "tokens": result.output_tokens,
            "prompt": result.prompt_tokens}


async def scaling_round(rt, tokenizer, n: int, context: int, tokens: int, tag: str, ping: Ping | None) -> dict:
    import anyio

    agents = [await rt.agent(f"{tag}-{n}-{i}", system=SYSTEM) for i in range(n)]
    texts = [prompt(tokenizer, context, tag, n, i) for i in range(n)]
    runs = [None] * n
    async with anyio.create_task_group() as tg:
        if ping is not None:
            tg.start_soon(ping.run)
        start = time.perf_counter()

        async def go(i):
            runs[i] = await one_turn(agents[i], texts[i], tokens, start)

        async with anyio.create_task_group() as turns:
            for i in range(n):
                turns.start_soon(go, i)
        tg.cancel_scope.cancel()
    end = max(r["last"] for r in runs)
    return {
        "system_tps": sum(r["tokens"] for r in runs) / (end - start),
        "per_stream_tps": statistics.median(decode_rate(r["tokens"], r["last"] - r["first"]) or 0.0 for r in runs),
        "ttft_ms": statistics.median((r["first"] - start) * 1000 for r in runs),
        "last_ttft_ms": max((r["first"] - start) * 1000 for r in runs),
        "prompt_tokens": statistics.median(r["prompt"] for r in runs),
        "tokens": sum(r["tokens"] for r in runs),
    }


async def staggered_round(rt, tokenizer, context: int, tokens: int, tag: str, delay: float) -> dict:
    """B's TTFT with batching, and with A's turn running to its end before B's."""
    import anyio

    out = {}
    for mode in ("staggered", "sequential"):
        a = await rt.agent(f"{tag}-{mode}-A", system=SYSTEM)
        b = await rt.agent(f"{tag}-{mode}-B", system=SYSTEM)
        ta, tb = prompt(tokenizer, context, tag, "A"), prompt(tokenizer, context, tag, "B")
        result = {}
        async with anyio.create_task_group() as tg:
            start = time.perf_counter()
            a_done = anyio.Event()

            async def run_a():
                result["a"] = await one_turn(a, ta, tokens, start)
                a_done.set()

            tg.start_soon(run_a)
            await anyio.sleep(delay)
            arrived = time.perf_counter()
            if mode == "sequential":
                await a_done.wait()  # one turn after another: B starts when A ends
            result["b"] = await one_turn(b, tb, tokens, arrived)
        out[mode] = (result["b"]["first"] - arrived) * 1000
    return out


async def measure(model, sizes, context: int, tokens: int, repeats: int, delay: float, log) -> dict:
    from semantic.actors import EngineOptions, Runtime

    scaling = {n: [] for n in sizes}
    staggered, sequential, late = [], [], []
    with tempfile.TemporaryDirectory(prefix="semantic-bench-concurrency-") as root:
        async with Runtime.open(model, cache_dir=root, budget=2 << 30) as rt:
            tokenizer = model.tokenizer
            warm = await rt.agent("warm-up", system=SYSTEM)
            await warm.reply("Say hello.", max_tokens=4)
            for r in range(repeats):
                for n in sizes:
                    ping = Ping() if n == max(sizes) else None
                    row = await scaling_round(rt, tokenizer, n, context, tokens, f"r{r}", ping)
                    scaling[n].append(row)
                    if ping is not None:
                        late += ping.late
                    log(f"round {r + 1}/{repeats}, {n} agent(s): {row['system_tps']:.1f} tok/s system, "
                        f"{row['per_stream_tps']:.1f} tok/s per stream, TTFT {row['ttft_ms']:.0f} ms")
                s = await staggered_round(rt, tokenizer, context, tokens, f"r{r}", delay)
                staggered.append(s["staggered"])
                sequential.append(s["sequential"])
                log(f"round {r + 1}/{repeats}, staggered B TTFT: {s['staggered']:.0f} ms batched, "
                    f"{s['sequential']:.0f} ms one after another")
        together = {}
        for batched in (False, True):  # 4 agents arriving together: their prompt chunks one by one, then batched
            async with Runtime.open(model, cache_dir=Path(root) / f"together-{batched}", budget=2 << 30,
                                    engine=EngineOptions(batch_prefill=batched)) as rt:
                await (await rt.agent("warm-up", system=SYSTEM)).reply("Say hello.", max_tokens=4)
                rows = [await scaling_round(rt, model.tokenizer, TOGETHER, context, tokens, f"t{r}", None)
                        for r in range(repeats)]
            together["batched" if batched else "one_by_one"] = {
                key: round(statistics.median(row[key] for row in rows), 1)
                for key in ("ttft_ms", "last_ttft_ms", "system_tps")}
            log(f"{TOGETHER} agents together, prefill {'batched' if batched else 'one by one'}: "
                f"{together['batched' if batched else 'one_by_one']}")
    med = statistics.median
    late_ms = sorted(x * 1000 for x in late)
    pick = (lambda key: {n: round(med(row[key] for row in scaling[n]), 2) for n in sizes})
    system_tps = pick("system_tps")
    return {
        "context": context,
        "output_tokens": tokens,
        "repeats": repeats,
        "prompt_tokens": pick("prompt_tokens"),
        "system_tps": system_tps,
        "per_stream_tps": pick("per_stream_tps"),
        "ttft_ms": {n: round(v, 1) for n, v in pick("ttft_ms").items()},
        "scaling_4_vs_1": round(system_tps[4] / system_tps[1], 3) if 4 in sizes and 1 in sizes else None,
        "staggered_delay_s": delay,
        "staggered_b_ttft_ms": round(med(staggered), 1),
        "sequential_b_ttft_ms": round(med(sequential), 1),
        "staggered_speedup": round(med(sequential) / med(staggered), 2),
        "loop_lateness_p50_ms": round(late_ms[len(late_ms) // 2], 2),
        "loop_lateness_p99_ms": round(late_ms[min(len(late_ms) - 1, int(len(late_ms) * 0.99))], 2),
        "loop_lateness_max_ms": round(late_ms[-1], 2),
        "loop_pings": len(late_ms),
        "together": together,
    }


def run(args: argparse.Namespace) -> int:
    import anyio

    from semantic.runtime.model.models import load

    context = args.context or (256 if args.quick else 1024)
    tokens = args.tokens or (64 if args.quick else 128)
    repeats = args.repeats or 3
    loaded = load(args.model)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    result = anyio.run(measure, loaded, SIZES, context, tokens, repeats, 1.0, log, backend=args.backend)
    result = {"model": args.model, "backend": args.backend, **result}
    if args.json:
        print(json.dumps(result))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{len(SIZES)} agent counts, ~{context}-token prompts, {tokens} tokens each, "
                        f"median of {repeats} ({args.model}, {args.backend})")
    for col in ("agents", "system tok/s", "per-stream tok/s", "TTFT ms"):
        table.add_column(col, justify="right")
    for n in SIZES:
        table.add_row(str(n), f"{result['system_tps'][n]:.1f}", f"{result['per_stream_tps'][n]:.1f}",
                      f"{result['ttft_ms'][n]:.0f}")
    console = Console()
    console.print(table)
    console.print(f"system throughput, 4 agents / 1 agent: {result['scaling_4_vs_1']}x")
    console.print(f"staggered arrivals (B 1 s after A): B's TTFT {result['staggered_b_ttft_ms']:.0f} ms batched, "
                  f"{result['sequential_b_ttft_ms']:.0f} ms one after another ({result['staggered_speedup']}x)")
    for mode, row in result["together"].items():
        console.print(f"{TOGETHER} agents arriving together, prefill {mode.replace('_', ' ')}: TTFT median "
                      f"{row['ttft_ms']:.0f} ms, last {row['last_ttft_ms']:.0f} ms, {row['system_tps']:.1f} tok/s")
    console.print(f"event-loop lateness under 8 agents: p50 {result['loop_lateness_p50_ms']} ms, "
                  f"p99 {result['loop_lateness_p99_ms']} ms, max {result['loop_lateness_max_ms']} ms")
    return 0
