"""The seam between the scenario runner and whatever runs the model.

The runner drives agents through two small protocols and never sees a
tokenizer, a cache or a socket.  Two backends will implement them: the
in-process actor runtime and an HTTP client for ``semantic serve``; tests use
a fake.

An agent handle is a *conversation*: ``open_agent`` starts it with a system
prompt, and every ``turn`` appends one user message and the assistant's reply.
The backend keeps the history; the runner only ever appends.  So the prompt of
turn n+1, rendered by the chat template, starts with the prompt + reply of
turn n, and a caching backend can EXTEND the agent's cache instead of
re-reading it.

Nothing here imports MLX, anyio or an HTTP client: a turn ends with the
runtime's own ``TurnResult``, after its own ``Delta`` items (``runtime.outcome``,
plain data).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Protocol

from semantic.runtime.outcome import Delta, TurnResult

__all__ = ["AgentHandle", "Backend", "Delta", "Sampling", "TurnEvent"]


@dataclass(frozen=True)
class Sampling:
    """How one turn samples; mirrors ``runtime.engine.sampling.SamplingParams`` (0 = greedy)."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None


TurnEvent = Delta | TurnResult  # deltas (their text: the next piece of the reply), then the result


class AgentHandle(Protocol):
    """One agent's conversation on one cache key.  Used by one task at a time."""

    def turn(self, prompt: str, sampling: Sampling) -> AsyncGenerator[TurnEvent, None]:
        """Append ``prompt`` as the next user message and stream the reply.

        An async generator (``async def`` with ``yield``): the runner closes
        it with ``aclose()`` when it stops early.

        Yields ``Delta`` items, then exactly one ``runtime.outcome.TurnResult``
        (its ``text`` the whole reply, stop strings cut), then stops.
        On success the reply becomes the next assistant message.  Cancelled
        (or closed) before the result is yielded, the conversation is left
        as it was before the call: neither the prompt nor a partial reply is
        kept (the cache may keep what it computed; a later prompt that
        extends it may reuse that).  Raises ``runtime.errors.SemanticError`` for failures a user
        can act on (server gone, out of memory).
        """
        ...

    async def close(self) -> None:
        """End the conversation.  Its cache key is never used again by this
        run, so the backend may drop the cache.  Idempotent."""
        ...


class Backend(Protocol):
    async def open_agent(self, agent: str, system: str, cache_key: str, *, use_cache: bool = True) -> AgentHandle:
        """Start a conversation for scenario agent ``agent`` with system prompt
        ``system``, whose cache lives under ``cache_key``.

        ``use_cache=False`` (``--no-cache``) makes every turn prefill its whole
        prompt: ``reused_tokens`` is then 0 and nothing is read from or kept
        for reuse.  The runner opens each cache key once per run.
        """
        ...
