"""What every route speaks, whatever its protocol: one normalised request in,
a stream of text deltas and one result out, and the error a client sees.

The protocol modules (``web.anthropic``, ``web.openai``) turn a request body
into a ``ChatRequest`` and a ``ChatResult`` back into their own JSON and SSE;
nothing here knows a protocol, a model or the runtime.

Messages in a ``ChatRequest`` are ready for a Hugging Face chat template:

    {"role": "system" | "user" | "assistant" | "tool", "content": str}

An assistant message may carry the calls it made, arguments as a dict (HF
templates ``tojson`` them), and a tool message names the call it answers:

    {"role": "assistant", "content": "Let me look.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": "18C"}

``content`` is always a string, never ``None`` (templates concatenate it).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from semantic.runtime.text.json_reader import JSONError, read_json
from semantic.actors import Delta, TokenLogprob

from ._aio import closing

__all__ = [
    "ChatRequest",
    "ChatResult",
    "CompletionRequest",
    "Heartbeat",
    "LogprobsDelta",
    "PromptLogprobs",
    "ReasoningDelta",
    "RequestError",
    "ROLES",
    "StopReason",
    "StreamItem",
    "ToolCall",
    "Usage",
    "cancelled",
    "load_json",
    "logprob_json",
    "stream_text",
]

ROLES = ("system", "user", "assistant", "tool")

class StopReason(StrEnum):
    """How a reply ended, as the protocols tell it: the runtime's ``FinishReason``
    with a stop string's stop told apart and the calls read out of a reply."""

    STOP = "stop"  # the model ended its turn
    LENGTH = "length"  # max_tokens, or the context, ran out
    STOP_SEQUENCE = "stop_sequence"  # a stop string ended it (``ChatResult.stop_sequence``)
    TOOL_USE = "tool_use"  # it ended with tool calls (``ChatResult.tool_calls``)
    CANCELLED = "cancelled"  # the server cancelled it (shutting down)


_STOP_REASONS = tuple(r.value for r in StopReason)


class RequestError(Exception):
    """A request the server will not serve; ``message`` is fit to show the client.

    ``status`` is the HTTP status (4xx: the client's fault, 5xx: ours); each
    protocol turns it into its own error type and JSON. ``param`` names the
    offending field when there is one (``messages[2].content``); ``code`` is a
    machine-readable reason where a protocol defines one
    (``previous_response_not_found``).
    """

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        if not 400 <= status <= 599:
            raise ValueError(f"an error status is 4xx or 5xx, not {status}")
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def __repr__(self) -> str:
        return f"RequestError({self.status}, {self.message!r}, param={self.param!r})"


def load_json(body: bytes) -> dict:
    """The JSON object in a request body; raises ``RequestError`` (400) otherwise."""
    try:
        data = read_json(body, "request body")
    except JSONError as e:
        raise RequestError(400, str(e)) from None
    if not isinstance(data, dict):
        raise RequestError(400, "request body must be a JSON object")
    return data


@dataclass(frozen=True)
class ChatRequest:
    """One chat turn, whichever API it came in on (see the module docstring
    for the message format)."""

    messages: tuple[dict, ...]
    max_tokens: int
    system: str | None = None
    model: str | None = None  # as the client named it (the server picks a model by it: ``web.state``)
    temperature: float | None = None  # None: not given, the server's default applies
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False  # OpenAI's stream_options.include_usage
    agent_id: str | None = None  # None: find the agent by the conversation's text
    hint: str | None = None  # a client's session key: conversations of one session may take over each other's agent
    tools: tuple[dict, ...] | None = None  # {"type": "function", "function": {name, description, parameters}}
    tool_choice: Literal["auto", "required"] = "auto"
    tool_name: str | None = None  # the one of ``tools`` a forced call must be of (None: any)
    strict_tools: bool = False  # a tool asked for strict adherence: "auto" holds calls to the tools too
    metadata: Mapping | None = None
    grammar: str | None = None  # structured output: the reply follows it (``runtime.text.grammar``)
    logprobs: int | None = None  # None: not asked; n: each token's logprob and the n likeliest tokens'
    choices: int = 1  # replies to the prompt (OpenAI's ``n``), prefilled once

    def __post_init__(self):
        if not self.messages:
            raise ValueError("a chat request needs at least one message")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")
        if bad := [m.get("role") for m in self.messages if m.get("role") not in ROLES]:
            raise ValueError(f"message roles must be one of {ROLES}, not {bad[0]!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    def conversation(self) -> list[dict]:
        """The messages for the chat template: the system prompt first, if any."""
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + [dict(m) for m in self.messages]

    @property
    def tool_names(self) -> frozenset[str]:
        return frozenset(t["function"]["name"] for t in self.tools or ())

    @property
    def callable_tools(self) -> tuple[dict, ...]:
        """The tools a forced call may be of: the one named, or all."""
        return tuple(t for t in self.tools or () if self.tool_name in (None, t["function"]["name"]))


@dataclass(frozen=True)
class CompletionRequest:
    """One raw-text completion (OpenAI's legacy ``/v1/completions``): the model
    continues ``prompt`` as it is, no chat template."""

    prompt: str
    max_tokens: int  # 0: generate nothing (score the prompt: ``echo`` with ``logprobs``)
    model: str | None = None
    echo: bool = False  # the reply's text (and logprobs) begin with the prompt's
    logprobs: int | None = None  # None: not asked; n: each token's logprob and the n likeliest tokens'
    temperature: float | None = None  # None: not given, greedy
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    agent_id: str | None = None  # None: a new anonymous agent
    hint: str | None = None  # a client's session key (the new agent's id carries its hash)
    choices: int = 1  # OpenAI's ``n``: replies to the prompt, prefilled once

    def __post_init__(self):
        if not self.prompt:
            raise ValueError("a completion request needs a prompt")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")

    @property
    def prompt_logprobs(self) -> int | None:
        """What the prompt's tokens are scored with: the echo's logprobs (None: not scored)."""
        return self.logprobs if self.echo else None


@dataclass(frozen=True)
class Usage:
    input_tokens: int  # prompt tokens prefilled for this request
    cache_read_input_tokens: int = 0  # prompt tokens served from the agent's cache
    output_tokens: int = 0
    drafted_tokens: int = 0  # drafts verified while decoding (``runtime.engine.speculation``)
    accepted_tokens: int = 0  # of them, taken as output

    def __post_init__(self):
        if min(self.input_tokens, self.cache_read_input_tokens, self.output_tokens, self.drafted_tokens,
               self.accepted_tokens) < 0:
            raise ValueError("token counts must be >= 0")

    @property
    def prompt_tokens(self) -> int:
        """The whole prompt, cached or not (OpenAI's ``prompt_tokens``)."""
        return self.input_tokens + self.cache_read_input_tokens


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: dict = field(hash=False)


@dataclass(frozen=True)
class ChatResult:
    """How a turn ended. ``text`` excludes any tool calls parsed out of it."""

    text: str
    stop_reason: StopReason
    usage: Usage
    stop_sequence: str | None = None  # the stop string that ended it ("stop_sequence" only)
    tool_calls: tuple[ToolCall, ...] = ()  # non-empty when stop_reason is "tool_use"; or "length" (a held call, cut)
    reasoning: str | None = None  # what the model thought before answering (``web.reasoning``), if it did
    turn: object = field(default=None, compare=False)  # the runtime's record (timings), when there is one
    choices: tuple[ChatResult, ...] = ()  # the request's other replies (``ChatRequest.choices``), 1 first

    def __post_init__(self):
        if self.stop_reason not in _STOP_REASONS:
            raise ValueError(f"stop_reason must be one of {_STOP_REASONS}, not {self.stop_reason!r}")
        object.__setattr__(self, "stop_reason", StopReason(self.stop_reason))
        if (self.stop_sequence is not None) != (self.stop_reason == StopReason.STOP_SEQUENCE):
            raise ValueError("stop_sequence is given exactly when stop_reason is 'stop_sequence'")
        if self.stop_reason == StopReason.TOOL_USE and not self.tool_calls:
            raise ValueError("stop_reason 'tool_use' needs tool_calls")
        if self.tool_calls and self.stop_reason not in (StopReason.TOOL_USE, StopReason.LENGTH):
            raise ValueError("tool_calls are given only when stop_reason is 'tool_use' or 'length'")
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @property
    def every(self) -> tuple[ChatResult, ...]:
        """Every reply: this one (choice 0), then the others."""
        return (self, *self.choices)

    @property
    def total_usage(self) -> Usage:
        """The request's usage: its prompt once, every choice's output and drafts."""
        u = self.usage
        return Usage(u.input_tokens, u.cache_read_input_tokens, *(
            sum(getattr(r.usage, key) for r in self.every)
            for key in ("output_tokens", "drafted_tokens", "accepted_tokens")))


@dataclass(frozen=True)
class ReasoningDelta:
    text: str  # more of what the model thinks before it answers
    choice: int = 0


@dataclass(frozen=True)
class LogprobsDelta:
    """The log-probabilities of the tokens just generated (only when the request asked)."""

    logprobs: tuple[TokenLogprob, ...]
    choice: int = 0


@dataclass(frozen=True)
class PromptLogprobs:
    """The log-probabilities of the prompt's tokens (only when the request
    asked: ``CompletionRequest.prompt_logprobs``), before a choice's first text."""

    logprobs: tuple[TokenLogprob, ...]  # every prompt token's; the first's logprob is None
    choice: int = 0


def logprob_json(lp: TokenLogprob, top: bool = True) -> dict:
    """One token's entry as OpenAI writes it: its text, logprob, UTF-8 bytes and the likeliest tokens'."""
    out = {"token": lp.piece.decode("utf-8", "replace"), "logprob": lp.logprob, "bytes": list(lp.piece)}
    if top:
        out["top_logprobs"] = [logprob_json(t, top=False) for t in lp.top]
    return out


@dataclass(frozen=True)
class Heartbeat:
    """Nothing new for a while (a long prompt prefilling): a stream sends its keep-alive."""


# What a streaming route consumes: ReasoningDelta, Delta (the reply's text, as the runtime's deltas
# carry it: one type from the engine to here) and Heartbeat items
# (and LogprobsDelta and PromptLogprobs, when asked for), then exactly one
# ChatResult. The text deltas joined are a prefix of the result's text; the
# stream builders send the rest (text held back while a tool call might have
# been starting).
StreamItem = ReasoningDelta | Delta | LogprobsDelta | PromptLogprobs | Heartbeat | ChatResult


def cancelled() -> RequestError:
    """What a client gets for a turn cancelled under it (the server shutting down)."""
    return RequestError(503, "the turn was cancelled before it finished; try again")


async def stream_text(items: AsyncIterable[StreamItem], logprobs: bool = False) -> AsyncIterator[StreamItem]:
    """A turn's text as it streams (non-empty ``Delta`` pieces, then what each
    reply's result holds beyond them; heartbeats and reasoning as they come, and
    log-probabilities with ``logprobs``), then its ``ChatResult``.  ``items`` is
    closed before the rest of the text comes; a cancelled result raises ``cancelled()``."""
    parts: dict[int, list[str]] = {}  # by choice
    async with closing(items) as stream:  # closed once the result is in
        async for item in stream:
            if isinstance(item, (Heartbeat, ReasoningDelta)) or (
                    logprobs and isinstance(item, (LogprobsDelta, PromptLogprobs))):
                yield item
                continue
            if isinstance(item, (LogprobsDelta, PromptLogprobs)):
                continue
            if isinstance(item, Delta):
                if item.text:
                    parts.setdefault(item.choice, []).append(item.text)
                    yield item
                continue
            result = item
            break
        else:
            raise AssertionError("the item stream ended without a ChatResult")
    if result.stop_reason == StopReason.CANCELLED:
        raise cancelled()
    for choice, reply in enumerate(result.every):
        sent = "".join(parts.get(choice, ()))
        assert reply.text.startswith(sent), "streamed text must be a prefix of the result's text"
        if rest := reply.text[len(sent):]:
            yield Delta(rest, choice=choice)
    yield result
