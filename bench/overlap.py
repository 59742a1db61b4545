"""``semantic bench overlap``: a warm load and a large write while another agent
decodes.  The decoding agent's step time during the disk work, against an
undisturbed run, shows whether the GPU thread waits on the disk.

Setup: agent ``warm`` holds a ``context``-token conversation, on disk only.
Each round, through the actor runtime:

* undisturbed -- a fresh agent decodes ``tokens`` tokens alone; every interval
  between two of its tokens is a decode step;
* disturbed -- another fresh agent decodes the same; after its first few
  tokens ``warm`` is forked: the persistence actor reads its ``context``
  tokens from disk (the warm load), the GPU thread makes the caches and copies
  the fork's blocks out, and the persistence actor writes the whole fork (the
  large write).  The window is from the fork request until that write is on
  disk (``flush``); the decoding agent's steps that overlap it are the
  disturbed ones.  ``warm`` is then demoted again for the next round.

Reported: medians of both, their ratio (the target: at most 1.3x), the
longest step in each window (median over rounds: a stall of the GPU thread
shows there, where the median step hides it), and the window's median
length.  On a machine with few cores the reader's and
writer's threads also take CPU from the decode (two cores here): that is in
the ratio too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

PROMPT = "Count from 1 to 300, separated by commas."
LEAD = 4  # the decoding agent's tokens before the disk work starts


async def overlap(loaded, root: Path, *, context: int, tokens: int, rounds: int, log=lambda line: None) -> dict:
    import anyio

    from semantic.actors import Runtime
    from semantic.bench.ttft import conversation

    undisturbed: list[float] = []
    disturbed: list[float] = []
    worst: list[float] = []  # per round: the longest step in the window (a stall shows here, not in the median)
    windows: list[float] = []
    async with Runtime.open(loaded, root) as rt:
        messages = conversation(loaded.tokenizer, context)
        warm = await rt.agent("warm", system=messages[0]["content"])
        await warm.reply(messages[1]["content"], max_tokens=1)
        log(f"warm agent ready ({context} tokens)")

        async def to_disk() -> None:
            await rt.demote("warm")
            with anyio.fail_after(60):
                while rt.cache_tier("warm") != "warm":
                    await anyio.sleep(0.01)

        async def decode(agent_id: str, started: anyio.Event | None = None) -> list[float]:
            agent = await rt.agent(agent_id)
            times = []
            async with agent.send(PROMPT, max_tokens=tokens) as reply:
                async for _ in reply:
                    times.append(time.perf_counter())
                    if started is not None and len(times) == LEAD:
                        started.set()
            return times

        for r in range(rounds):
            await to_disk()
            times = await decode(f"alone-{r}")
            undisturbed += [b - a for a, b in zip(times[LEAD - 1:], times[LEAD:])]
            started, window = anyio.Event(), []

            async def disk_work() -> None:
                await started.wait()
                window.append(time.perf_counter())
                await warm.fork(f"copy-{r}")
                await rt.flush()
                window.append(time.perf_counter())

            result: list[float] = []

            async def decoding() -> None:
                result.extend(await decode(f"beside-{r}", started))

            async with anyio.create_task_group() as tg:
                tg.start_soon(disk_work)
                tg.start_soon(decoding)
            t0, t1 = window
            if result[-1] < t1:
                log(f"round {r}: the decode ended before the disk work did; use more --tokens")
            steps = [b - a for a, b in zip(result, result[1:]) if b > t0 and a < t1]
            disturbed += steps
            worst += [max(steps)] if steps else []
            windows.append(t1 - t0)
            log(f"round {r + 1}/{rounds}: window {1000 * (t1 - t0):.0f} ms, "
                f"{sum(1 for a, b in zip(result, result[1:]) if b > t0 and a < t1)} steps in it")
        stats = rt.stats()
    alone = statistics.median(undisturbed)
    beside = statistics.median(disturbed) if disturbed else None  # None: every decode ended before the disk work
    return {
        "context": context, "rounds": rounds, "tokens": tokens,
        "undisturbed_step_ms": round(1000 * alone, 1),
        "disturbed_step_ms": None if beside is None else round(1000 * beside, 1),
        "ratio": None if beside is None else round(beside / alone, 3),
        "worst_step_ms": round(1000 * statistics.median(worst), 1) if worst else None,
        "window_ms": round(1000 * statistics.median(windows), 1),
        "disturbed_steps": len(disturbed), "writes": stats["writes"],
    }


def run(args: argparse.Namespace) -> int:
    import anyio

    from semantic.runtime.model.models import load

    loaded = load(args.model, progress=False)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="semantic-overlap-") as root:
        result = anyio.run(lambda: overlap(loaded, Path(root), context=args.context, tokens=args.tokens,
                                           rounds=args.rounds, log=log))
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"decode step beside a {result['context']}-token warm load and its fork's write "
          f"({result['rounds']} rounds, window median {result['window_ms']} ms, {result['disturbed_steps']} steps): "
          f"{result['disturbed_step_ms']} ms against {result['undisturbed_step_ms']} ms alone: "
          f"{result['ratio']}x (target <= 1.3x); the longest step in the window: {result['worst_step_ms']} ms "
          f"(median of rounds)")
    return 0
