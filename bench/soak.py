"""``semantic bench soak``: many agents over a long run stay inside their memory
and disk budgets, and no turn fails while room could be made.

``agents`` agents, each with a system prompt of its own, take ``turns`` greedy
turns each through the actor runtime, ``concurrency`` agents at a time (a
pool: an agent's turns run in order, the next agent starts when one is done).
The KV budget holds ``hot_agents`` agents: ``concurrency`` turns in progress
(with their float working copies) and the rest idle; the disk budget holds
~``disk_share`` of all agents' cache files.
A sampler on the event loop reads the runtime's figures every 50 ms.

Reported: turns run and failed; the most KV budget in use against the
budget; MLX active memory above what it was before the first turn (caches,
working copies and activations) against the budget; the most disk in use
against the disk budget; demotions, prefix drops and preemptions; histories
that are not complete afterwards; wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

QUESTIONS = ("Name a fruit.", "What colour is it?", "Is it sweet?")
TOKENS_PER_AGENT = 160  # a system prompt and three short turns: about what each agent's cache holds


def system(i: int) -> str:
    return f"You are assistant number {i}, helpful and brief."


async def soak(loaded, root: Path, *, agents: int, turns: int, concurrency: int, max_tokens: int,
               hot_agents: int, disk_share: float, log=lambda line: None) -> dict:
    """Run the soak; return its figures."""
    import anyio
    import mlx.core as mx

    from semantic.actors import Runtime
    from semantic.runtime.memory.model_caches import kv_budget
    from semantic.runtime.cache_records import BLOCK_TOKENS

    kv = kv_budget(loaded, 1 << 40)
    # ``concurrency`` turns in progress (with their working copies), the rest of ``hot_agents`` idle.
    budget = (concurrency * kv.bytes_for(TOKENS_PER_AGENT, running=True)
              + max(0, hot_agents - concurrency) * kv.bytes_for(TOKENS_PER_AGENT))
    spec, closed = loaded.spec, TOKENS_PER_AGENT // BLOCK_TOKENS * BLOCK_TOKENS
    open_block = (TOKENS_PER_AGENT - closed) * spec.n_full * spec.n_kv_heads * spec.kv_width * loaded.dtype.size
    per_file = closed * spec.bytes_per_token(4) + open_block + 4096  # Q4 blocks, the open block's floats, the rest
    disk_budget = int(disk_share * agents * per_file)
    failures: list[str] = []
    peak = {"hot": 0, "active": 0, "disk": 0}
    done = 0
    async with Runtime.open(loaded, root, budget, disk_budget=disk_budget) as rt:
        baseline = mx.get_active_memory()

        async def sample() -> None:
            while True:
                memory = await anyio.to_thread.run_sync(rt.memory)
                peak["hot"] = max(peak["hot"], memory["hot_bytes"])
                peak["active"] = max(peak["active"], memory["mlx_active_bytes"] - baseline)
                peak["disk"] = max(peak["disk"], memory["disk_bytes"])
                await anyio.sleep(0.05)

        async def converse(i: int) -> None:
            nonlocal done
            agent = await rt.agent(f"agent-{i:04d}", system=system(i))
            for q in QUESTIONS[:turns]:
                try:
                    await agent.reply(q, max_tokens=max_tokens)
                except Exception as e:  # a failed turn is the soak's finding, not its end
                    failures.append(f"agent-{i:04d}: {type(e).__name__}: {e}")
            done += 1
            if done % 25 == 0:
                log(f"{done}/{agents} agents done")

        start = time.perf_counter()
        next_agent = iter(range(agents))
        async with anyio.create_task_group() as watch:
            watch.start_soon(sample)

            async def worker() -> None:
                for i in next_agent:  # shared: each agent is taken by one worker
                    await converse(i)

            async with anyio.create_task_group() as pool:
                for _ in range(concurrency):
                    pool.start_soon(worker)
            watch.cancel_scope.cancel()
        wall = time.perf_counter() - start
        await rt.flush()
        memory = rt.memory()
        infos = await rt.agents()
    incomplete = [a.id for a in infos if len(a.history) != 1 + 2 * turns]
    return {
        "agents": agents, "turns": agents * turns, "failed": len(failures), "failures": failures[:5],
        "kv_budget_bytes": budget, "kv_peak_bytes": peak["hot"], "mlx_above_baseline_peak_bytes": peak["active"],
        "disk_budget_bytes": disk_budget, "disk_peak_bytes": peak["disk"], "disk_end_bytes": memory["disk_bytes"],
        "demotions": memory["demotions"], "prefix_drops": memory["prefix_drops"],
        "preemptions": memory["preemptions"], "histories": len(infos), "incomplete_histories": incomplete,
        "wall_s": round(wall, 1),
    }


def run(args: argparse.Namespace) -> int:
    import anyio

    from semantic.runtime.model.models import load

    loaded = load(args.model, progress=False)
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    with tempfile.TemporaryDirectory(prefix="semantic-soak-") as root:
        result = anyio.run(lambda: soak(
            loaded, Path(root), agents=args.agents, turns=3, concurrency=args.concurrency,
            max_tokens=args.tokens, hot_agents=args.hot_agents, disk_share=0.3, log=log))
    if args.json:
        print(json.dumps(result))
        return 0
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    print(f"{result['turns']} turns of {result['agents']} agents, {args.concurrency} at a time "
          f"({args.model}, {result['wall_s']} s): {result['failed']} failed")
    print(f"KV budget: peak {mib(result['kv_peak_bytes'])} of {mib(result['kv_budget_bytes'])}; "
          f"MLX active memory above the start: peak {mib(result['mlx_above_baseline_peak_bytes'])}")
    print(f"disk: peak {mib(result['disk_peak_bytes'])} of {mib(result['disk_budget_bytes'])} "
          f"(end {mib(result['disk_end_bytes'])})")
    print(f"demotions {result['demotions']}, prefix drops {result['prefix_drops']}, "
          f"preemptions {result['preemptions']}; {result['histories']} histories, "
          f"{len(result['incomplete_histories'])} incomplete")
    ok = not result["failed"] and not result["incomplete_histories"] and result["kv_peak_bytes"] <= result[
        "kv_budget_bytes"] and result["disk_peak_bytes"] <= result["disk_budget_bytes"]
    return 0 if ok else 1

