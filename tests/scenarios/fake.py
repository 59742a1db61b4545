"""A backend without a model: deterministic replies, every prompt recorded,
tokens faked as whitespace-separated words.

The conversation is rendered like a chat template (role markers, one message
after another), and the fake "cache" of a key holds the text of its last
prompt + reply.  A turn reuses that many words exactly when the new prompt
text starts with it; so the report's reuse numbers are computed here, as a
real engine would, not asserted by the runner.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel

from semantic.runtime.outcome import TurnResult
from semantic.scenarios.backend import Delta, Sampling, TurnEvent
from semantic.scenarios.runner import Event, PhaseStarted

MARKER = re.compile(r"«(\w+)\|(\w+)\|(\d+)»")


def marker(phase: str, agent: str, n: int) -> str:
    """A string that can only have come from ``agent``'s reply number ``n`` in ``phase``."""
    return f"«{phase}|{agent}|{n}»"


@dataclass(frozen=True)
class Received:
    """One turn as the backend saw it."""

    agent: str
    cache_key: str
    phase: str  # the phase the runner had announced (via observe)
    prompt: str  # the new user message
    conversation: str  # the whole rendered prompt: system + history + the new user message
    reply: str
    sampling: Sampling
    reused: int
    prompt_tokens: int


@dataclass(frozen=True)
class Opened:
    agent: str
    system: str
    cache_key: str
    use_cache: bool


def words(text: str) -> int:
    return len(text.split())


def render(system: str, messages: list[tuple[str, str]]) -> str:
    """A chat template: each message opens with its role marker; the prompt ends with the assistant's."""
    return f"<|system|>\n{system}\n" + "".join(f"<|{role}|>\n{text}\n" for role, text in messages) + "<|assistant|>\n"


@dataclass
class FakeBackend:
    reply: Callable[[str, str, int], str] | None = None  # (phase, agent, n) -> reply text
    block: anyio.Event | None = None  # if set, every turn waits on it after its first delta
    phase: str = "?"
    opened: list[Opened] = field(default_factory=list)
    received: list[Received] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)
    cache: dict[str, str] = field(default_factory=dict)  # cache key -> the text its cache covers

    def observe(self, event: Event) -> None:
        """Pass as the runner's ``on_event`` so replies carry the phase's marker."""
        if isinstance(event, PhaseStarted):
            self.phase = event.phase.name

    async def open_agent(self, agent: str, system: str, cache_key: str, *, use_cache: bool = True) -> FakeHandle:
        assert all(o.cache_key != cache_key for o in self.opened), f"cache key {cache_key} opened twice"
        self.opened.append(Opened(agent, system, cache_key, use_cache))
        return FakeHandle(self, agent, system, cache_key, use_cache)

    def of(self, agent: str) -> list[Received]:
        return [r for r in self.received if r.agent == agent]


@dataclass
class FakeHandle:
    backend: FakeBackend
    agent: str
    system: str
    cache_key: str
    use_cache: bool
    messages: list[tuple[str, str]] = field(default_factory=list)
    closed: bool = False

    async def turn(self, prompt: str, sampling: Sampling) -> AsyncIterator[TurnEvent]:
        assert not self.closed, "turn on a closed handle"
        b = self.backend
        n = sum(1 for r in b.received if r.agent == self.agent) + 1
        text = render(self.system, [*self.messages, ("user", prompt)])
        cached = b.cache.get(self.cache_key, "") if self.use_cache else ""
        reused = words(cached) if cached and text.startswith(cached) else 0
        reply = (b.reply or _default_reply)(b.phase, self.agent, n)
        pieces = reply.split(" ")
        for i, piece in enumerate(pieces):
            yield Delta(piece if i == len(pieces) - 1 else piece + " ")
            if b.block is not None:
                await b.block.wait()
            await anyio.lowlevel.checkpoint()
        # Only a finished turn changes the conversation (the protocol's cancellation promise).
        self.messages += [("user", prompt), ("assistant", reply)]
        b.cache[self.cache_key] = text + reply
        prompt_tokens = words(text)
        b.received.append(
            Received(self.agent, self.cache_key, b.phase, prompt, text, reply, sampling, reused, prompt_tokens))
        prefilled, generated = prompt_tokens - reused, words(reply)
        # 0.5 ms a prefilled word, 1 ms before it, 100 words/s after the first.
        yield TurnResult("stop", reply, prompt_tokens, reused, prefilled, generated, queued_s=0.0,
                         ttft_s=(1.0 + 0.5 * prefilled) / 1000, prefill_s=0.5 * prefilled / 1000,
                         decode_s=(generated - 1) / 100.0)

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.backend.closed.append(self.cache_key)


def _default_reply(phase: str, agent: str, n: int) -> str:
    return f"{marker(phase, agent, n)} {agent} speaks in {phase}, turn {n}."
