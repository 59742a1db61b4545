"""The agent API (``/v1/agents``): request parsing and response bodies.

The server keeps each agent's history; a client sends only the new message.

    POST   /v1/agents                {"id", "system"?, "model"?}   201 created, 200 exists alike, 409 differs
    GET    /v1/agents                {"agents": [summary, ...]}
    GET    /v1/agents/{id}           summary + "history"
    DELETE /v1/agents/{id}           {"id", "deleted": true}
    POST   /v1/agents/{id}/messages  {"content", "max_tokens", "temperature"?, "top_p"?, "top_k"?,
                                      "seed"?, "stop"?, "stream"?, "use_cache"?, "model"?, "format"?,
                                      "logprobs"?}
    POST   /v1/agents/{id}/fork      {"id"}                       201 {"id", "forked_from", ...}

A turn answers ``turn_json`` (or, streaming, ``event: delta`` {"text"}
events -- ``event: reasoning`` {"text"} first for a model that reasons --
and then ``event: done`` with the same object); errors are
``{"error": {"type", "message"}}`` (an ``event: error`` mid-stream).

``logprobs``: n (0-20) adds ``"logprobs"``, each output token's
log-probability and the n likeliest tokens' (``runtime.engine.sampling``), to the
turn's object (the one ``done`` carries, streaming).

``format``: ``{"type": "json_schema", "schema": {...}}`` or ``{"type":
"json_object"}`` makes the reply JSON that follows it (``runtime.text.grammar``),
unless ``max_tokens`` cuts it; ``{"type": "text"}`` is the default.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from semantic.actors import MAX_LOGPROBS, AgentInfo, Delta, TurnResult

from . import _validate as v
from ._aio import closing
from .protocols import ProtocolSpec
from .schema import (ChatResult, Heartbeat, LogprobsDelta, ReasoningDelta, RequestError, StopReason, StreamItem,
                     load_json, logprob_json)
from .sse import KEEP_ALIVE, encode

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["PROTOCOL", "NewAgent", "TurnRequest", "agent_json", "error_json", "events", "parse_fork",
           "parse_new_agent", "parse_turn", "response_json", "turn_events", "turn_json"]

_STOP = {StopReason.STOP: "end_turn", StopReason.LENGTH: "max_tokens", StopReason.STOP_SEQUENCE: "stop_sequence",
         StopReason.TOOL_USE: "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                408: "request_timeout", 409: "conflict_error", 413: "request_too_large", 503: "overloaded_error"}


@dataclass(frozen=True)
class NewAgent:
    id: str
    system: str | None
    model: str | None


@dataclass(frozen=True)
class TurnRequest:
    content: str
    sampling: dict  # SamplingParams fields
    stream: bool
    use_cache: bool
    model: str | None  # None: the server's first model


def parse_new_agent(body: bytes) -> NewAgent:
    data = load_json(body)
    return NewAgent(v.string(data, "id", required=True), v.string(data, "system"), v.string(data, "model"))


def parse_fork(body: bytes) -> str:
    return v.string(load_json(body), "id", required=True)


def parse_turn(body: bytes, *, max_tokens_cap: int) -> TurnRequest:
    """A turn's body; ``max_tokens`` above ``max_tokens_cap`` is clamped to it."""
    data = load_json(body)
    sampling = {
        "max_tokens": min(v.integer(data, "max_tokens", required=True, lo=1), max_tokens_cap),
        "stop": v.strings(data, "stop", allow_one=True),
        "temperature": v.number(data, "temperature", lo=0, hi=2),
        "top_p": v.number(data, "top_p", lo=0, hi=1, lo_open=True),
        "top_k": v.integer(data, "top_k", lo=0),
        "seed": v.integer(data, "seed"),
        "grammar": v.output_format(data, "format"),
        "logprobs": v.integer(data, "logprobs", lo=0, hi=MAX_LOGPROBS),
    }
    return TurnRequest(
        content=v.string(data, "content", required=True),
        sampling={k: x for k, x in sampling.items() if x is not None},
        stream=v.boolean(data, "stream"),
        use_cache=v.boolean(data, "use_cache", default=True),
        model=v.string(data, "model"),
    )


def agent_json(info: AgentInfo, *, history: bool = False) -> dict:
    system = info.history[0].content if info.history and info.history[0].role == "system" else None
    out = {"id": info.id, "model": info.model, "system": system, "messages": len(info.history),
           "tokens_cached": info.tokens, "bytes": info.bytes, "tier": info.tier, "last_use": info.last_use}
    if history:
        out["history"] = [m.as_dict() for m in info.history]
    return out


def turn_json(agent_id: str, model: str, result: ChatResult) -> dict:
    """A finished turn on ``model`` (``result`` as ``web.chat`` builds it, with the runtime's record)."""
    if result.stop_reason == StopReason.CANCELLED:
        raise RequestError(503, "the turn was cancelled before it finished; try again")
    timing = {"ttft_ms": None, "queued_ms": None, "prefill_ms": None, "decode_ms": None, "decode_tps": None}
    turn: TurnResult | None = result.turn
    if turn is not None:
        ms = lambda s: None if s is None else round(s * 1000, 3)  # noqa: E731
        timing = {"ttft_ms": ms(turn.ttft_s), "queued_ms": ms(turn.queued_s), "prefill_ms": ms(turn.prefill_s),
                  "decode_ms": ms(turn.decode_s),
                  "decode_tps": None if turn.decode_tps is None else round(turn.decode_tps, 3)}
    u = result.usage
    return {
        "agent_id": agent_id,
        "model": model,
        "role": "assistant",
        "content": result.text,
        "reasoning": result.reasoning,
        "stop_reason": _STOP[result.stop_reason],
        "stop_sequence": result.stop_sequence,
        "usage": {"prompt_tokens": u.prompt_tokens, "reused_tokens": u.cache_read_input_tokens,
                  "prefilled_tokens": u.input_tokens, "output_tokens": u.output_tokens,
                  "drafted_tokens": u.drafted_tokens, "accepted_tokens": u.accepted_tokens},
        "timing": timing,
        **({"logprobs": [logprob_json(lp) for lp in turn.logprobs]} if turn is not None and turn.logprobs else {}),
    }


def error_json(err: RequestError) -> dict:
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"error": {"type": kind, "message": err.message}}


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    return turn_json(turn.agent_id, turn.model, result)


def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    return turn_events(turn.agent_id, turn.model, items)


async def turn_events(agent_id: str, model: str, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    """The SSE stream of one turn: ``delta`` events, an SSE comment for each
    heartbeat, then ``done`` with the ``turn_json`` object.  A ``RequestError``
    before the first event propagates (the response turns it into a plain HTTP
    error); later, it becomes an ``error`` event."""
    sent = False
    try:
        async with closing(items) as stream:
            async for item in stream:
                if isinstance(item, Heartbeat):
                    sent = True
                    yield KEEP_ALIVE
                elif isinstance(item, LogprobsDelta):
                    continue  # they come with ``done``
                elif isinstance(item, (Delta, ReasoningDelta)):
                    sent = True
                    yield encode({"text": item.text}, "delta" if isinstance(item, Delta) else "reasoning")
                else:
                    body = turn_json(agent_id, model, item)
                    sent = True
                    yield encode(body, "done")
    except RequestError as err:
        if not sent:
            raise
        yield encode(error_json(err), "error")


PROTOCOL = ProtocolSpec("agent", ("/v1/agents",), response_json, events, error_json)
