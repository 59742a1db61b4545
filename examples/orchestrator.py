"""A tiny orchestrator on the in-process actor API: two agents argue for and
against at once (batched on one model), a third streams a verdict.

    make example                              # from a fresh clone (sets everything up)
    .venv/bin/python examples/orchestrator.py [--fresh] [--topic "learn to sail"]

Agents are persistent: run it again and they continue their conversations,
each turn prefilling only its new tokens from the agent's cached history (see
"from cache" below); ``--fresh`` deletes them first.  Caches and histories live
in ``~/.cache/semantic/agents`` (``SEMANTIC_HOME`` moves it).
"""

from __future__ import annotations

import argparse
import time

import anyio

import semantic.runtime  # noqa: F401  (picks the fast BLAS before MLX loads)
from semantic.actors import Agent, Runtime

DEBATERS = {  # agent id: (system prompt, what it is asked)
    "example-alice": ("You are an enthusiastic optimist.", "Give one reason to {topic}."),
    "example-bob": ("You are a cautious accountant.", "Give one reason not to {topic}."),
}
JUDGE = ("example-judge", "You are a fair judge.")


def footnote(agent: Agent) -> str:
    r = agent.last_result
    return (f"({r.output_tokens} tokens; prompt {r.prompt_tokens} tokens, {r.reused_tokens} from cache; "
            f"first token after {r.ttft_s * 1000:.0f} ms)")


async def main(topic: str, fresh: bool) -> None:
    async with Runtime.open("smollm2") as rt:
        if fresh:
            for name in (*DEBATERS, JUDGE[0]):
                await (await rt.agent(name)).delete()
        debaters = [await rt.agent(name, system=system) for name, (system, _) in DEBATERS.items()]
        judge = await rt.agent(JUDGE[0], system=JUDGE[1])
        print(f"model {rt.model}; topic: {topic!r}; the judge has {len(judge.history)} messages of history\n")

        answers: dict[str, str] = {}

        async def argue(agent: Agent) -> None:  # both debaters run at once, batched
            ask = DEBATERS[agent.id][1].format(topic=topic)
            answers[agent.id] = await agent.reply(ask, max_tokens=40)

        start = time.perf_counter()
        async with anyio.create_task_group() as tg:
            for agent in debaters:
                tg.start_soon(argue, agent)
        print(f"both argued in {time.perf_counter() - start:.1f} s, side by side:")
        for agent in debaters:
            print(f"\n[{agent.id}] {answers[agent.id].strip()}\n  {footnote(agent)}")

        names = {a.id: a.id.removeprefix("example-").title() for a in debaters}
        case = " ".join(f"{names[a.id]} says: {answers[a.id].strip()}" for a in debaters)
        print(f"\n[{judge.id}] ", end="", flush=True)
        async for delta in judge.send(f"{case} Which argument is more convincing, and why?", max_tokens=60):
            print(delta.text, end="", flush=True)  # streamed as it is generated
        print(f"\n  {footnote(judge)}")
    print("\nAll caches and histories are on disk; run again to continue the conversations.")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--topic", default="learn to sail", help='completes "Give one reason to ..."')
    parser.add_argument("--fresh", action="store_true", help="delete the example's agents first")
    args = parser.parse_args()
    anyio.run(main, args.topic, args.fresh)
