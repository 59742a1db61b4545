"""The in-process backend: scenario agents are agents of an actor ``Runtime``.

Each cache key is one runtime agent; closing a conversation deletes that
agent (its hot cache, cache files and history), since run ids are never
reused.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

from semantic.actors import Agent, Runtime

from .backend import Sampling, TurnEvent

__all__ = ["LocalAgent", "LocalBackend", "local_backend"]


@asynccontextmanager
async def local_backend(model: str | None = None, cache_dir=None) -> AsyncIterator[LocalBackend]:
    """A runtime on ``model`` (None: the embedded SmolLM2) for the length of the block."""
    async with Runtime.open(model or "smollm2", cache_dir=cache_dir) as rt:
        yield LocalBackend(rt)


class LocalBackend:
    def __init__(self, runtime: Runtime):
        self.runtime = runtime

    async def open_agent(self, agent: str, system: str, cache_key: str, *, use_cache: bool = True) -> LocalAgent:
        return LocalAgent(await self.runtime.agent(cache_key, system=system), use_cache)


class LocalAgent:
    def __init__(self, agent: Agent, use_cache: bool):
        self.agent = agent
        self.use_cache = use_cache
        self.closed = False

    async def turn(self, prompt: str, sampling: Sampling) -> AsyncGenerator[TurnEvent, None]:
        reply = self.agent.send(prompt, use_cache=self.use_cache, max_tokens=sampling.max_tokens,
                                temperature=sampling.temperature, top_p=sampling.top_p, stop=sampling.stop,
                                seed=sampling.seed)
        async with reply:  # closing early cancels the turn; the history stays as it was
            async for delta in reply:
                yield delta
        yield reply.result

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.agent.delete()

