"""The OpenAI Responses API (``/v1/responses``), as the chat routes use it:
the response JSON, the SSE events and error JSON here, and the names of its
requests (``web.responses_request``) and response ids
(``web.response_ids``), imported from those modules.

**Response ids name agent states** (``web.response_ids``): an id says which
agent and which point of its conversation a response is, and no store is
kept beside the agents.

``previous_response_id`` continues that state: the conversation is the
agent's history up to the reply plus the new ``input``. An agent still at that
state takes the turn; one that moved on (an older id) is *forked* there, so a
branch never loses the work of another. Its system prompt carries over unless
the request gives new ``instructions`` (OpenAI drops the old ones; a local
cache is better kept). Without ``previous_response_id`` the request is a
stateless one, and its agent is found by content (``web.identity``), with
``prompt_cache_key`` (else ``user``) as the session hint: Codex sends its
whole input every turn with ``store: false``.

A stream is ``event:``/``data:`` pairs whose ``type`` equals the event name,
each with a ``sequence_number`` from 0:

    response.created, response.in_progress           (status "in_progress")
    response.output_item.added   (reasoning)          for a model that reasons (``web.reasoning``),
    response.reasoning_text.delta ...                 its ``<think>`` text, then
    response.reasoning_text.done, response.output_item.done
    response.output_item.added   (message)            with the first text
    response.content_part.added  (output_text)
    response.output_text.delta ...
    response.output_text.done, response.content_part.done, response.output_item.done
    response.output_item.added   (function_call)      per tool call, then
    response.function_call_arguments.delta / .done, response.output_item.done
    response.completed | response.incomplete          (with usage)

A reply with neither text nor calls still gets its (empty) message item. An
SSE comment (``: keep-alive``) follows each quiet ``HEARTBEAT_S``. A failure
after the stream has begun is an ``error`` event and then ``response.failed``.

``include: ["message.output_text.logprobs"]`` or ``top_logprobs`` (0-20) puts
each output token's log-probability (``runtime.engine.sampling``) in the
``output_text`` part's ``logprobs``; streaming, each
``response.output_text.delta`` carries those of the tokens whose text it
adds (tokens whose text is held back, as a call's markup may be, come with
the next delta that has text, or in one with an empty ``delta`` before
``response.output_text.done``, which has them all again).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator
from typing import TYPE_CHECKING

from semantic.actors import Delta, Message

from ._aio import closing
from .harmony import HARMONY, read_harmony
from .openai import drafts_json
from .reasoning import CLOSE, OPEN, split_reasoning
from .response_ids import ResponseState, not_found, parse_response_id, response_id
from .responses_request import ResponsesRequest, continued, parse_request
from .protocols import ProtocolSpec
from .schema import (ChatResult, Heartbeat, LogprobsDelta, ReasoningDelta, RequestError, StopReason, StreamItem, Usage,
                     cancelled, logprob_json, stream_text)
from .sse import KEEP_ALIVE, encode
from .tools import ToolFormat, parse_tool_calls

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["PROTOCOL", "ResponseState", "ResponsesRequest", "continued", "deleted_json", "error_json", "events",
           "not_found", "parse_request", "parse_response_id", "response_id", "response_json", "stored_json"]

log = logging.getLogger("semantic.web")

_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}


# --- responses ----------------------------------------------------------------


def _usage(usage: Usage) -> dict:
    return {"input_tokens": usage.prompt_tokens,
            "input_tokens_details": {"cached_tokens": usage.cache_read_input_tokens,
                                     "cache_write_tokens": usage.input_tokens},
            "output_tokens": usage.output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0, **drafts_json(usage)},
            "total_tokens": usage.prompt_tokens + usage.output_tokens}


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _message_item(item_id: str, text: str, status: str, logprobs=()) -> dict:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": [logprob_json(lp) for lp in logprobs]}
    content = [part] if status != "in_progress" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _call_item(item_id: str, call, status: str = "completed") -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call.id, "name": call.name,
            "arguments": json.dumps(call.arguments, ensure_ascii=False) if status == "completed" else "",
            "status": status}


def _reasoning_item(item_id: str, text: str | None) -> dict:
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content,
            "status": "in_progress" if text is None else "completed"}


def _output(result: ChatResult, message_id: str | None = None, reasoning_id: str | None = None) -> list[dict]:
    status = "incomplete" if result.stop_reason == StopReason.LENGTH else "completed"
    out = []
    if result.reasoning is not None:
        out.append(_reasoning_item(reasoning_id or _item_id("rs"), result.reasoning))
    if result.text or not result.tool_calls:
        out.append(_message_item(message_id or _item_id("msg"), result.text, status,
                                 result.turn.logprobs if result.turn is not None else ()))
    out += [_call_item(_item_id("fc"), call) for call in result.tool_calls]
    return out


def _response(rid: str, *, model: str, created: float, status: str, output: list[dict], usage: Usage | None,
              req: ResponsesRequest | None, result: ChatResult | None = None, error: dict | None = None) -> dict:
    """A response object; ``req`` None: one rebuilt from an agent's history (the request is unknown)."""
    incomplete = result is not None and result.stop_reason == StopReason.LENGTH
    extra = req.extra if req is not None else {}
    body = {
        "id": rid,
        "object": "response",
        "created_at": created,
        "status": "incomplete" if incomplete and status == "completed" else status,
        "error": error,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": req.instructions if req else None,
        "max_output_tokens": req.max_output_tokens if req else None,
        "model": model,
        "output": output,
        "parallel_tool_calls": req.parallel_tool_calls if req else True,
        "previous_response_id": req.previous_response_id if req else None,
        "reasoning": {"effort": None, "summary": None},
        "store": req.store if req else True,
        "temperature": req.temperature if req else None,
        "text": extra.get("text") or {"format": {"type": "text"}},
        "tool_choice": req.echo_tool_choice if req else "auto",
        "tools": list(req.echo_tools) if req else [],
        "top_p": req.top_p if req else None,
        "truncation": "disabled",
        "usage": _usage(usage) if usage is not None else None,
        "user": extra.get("user"),
        "metadata": dict(req.metadata or {}) if req else {},
    }
    if "prompt_cache_key" in extra:
        body["prompt_cache_key"] = extra["prompt_cache_key"]
    if status == "completed" and not incomplete:
        body["completed_at"] = int(time.time())
    return body


def _turn_id(turn: ChatTurn) -> str:
    return response_id(turn.agent_id, turn.messages)


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    """The non-streaming response for ``turn``; a 503 for a cancelled turn."""
    if result.stop_reason == StopReason.CANCELLED:
        raise cancelled()
    return _response(_turn_id(turn), model=turn.model, created=turn.created, status="completed",
                     output=_output(result), usage=result.usage, req=turn.request, result=result)


def stored_json(state: ResponseState, history: tuple[Message, ...], *, model: str, created: float,
                fmt: ToolFormat | None) -> dict:
    """The response ``state`` names, rebuilt from its agent's ``history`` (which holds it):
    its reply, with tool calls parsed out as the model's format has them (new call ids).
    The request and its usage are not stored: ``usage`` is null, echoed fields their defaults."""
    reply = history[state.n - 1].content
    if HARMONY in reply:  # a GPT-OSS reply
        thought, text, calls = read_harmony(reply)
    else:
        thought, reply = split_reasoning(reply, opened=CLOSE in reply and OPEN not in reply)
        text, calls = parse_tool_calls(reply, fmt) if fmt else (reply, [])
    reason = StopReason.TOOL_USE if calls else StopReason.STOP
    result = ChatResult(text, reason, Usage(0), tool_calls=tuple(calls), reasoning=thought)
    return _response(state.id, model=model, created=created, status="completed", output=_output(result),
                     usage=None, req=None)


def deleted_json(response: str) -> dict:
    return {"id": response, "object": "response.deleted", "deleted": True}


def error_json(err: RequestError) -> dict:
    """OpenAI's error body, ``{"error": {"message", "type", "param", "code"}}``
    (its Responses API answers a missing response with ``invalid_request_error``)."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    return response_events(items, rid=_turn_id(turn), model=turn.model, created=turn.created, req=turn.request)


async def response_events(items: AsyncIterable[StreamItem], *, rid: str, model: str, created: float,
                          req: ResponsesRequest | None) -> AsyncIterator[bytes]:
    """The SSE stream of one response, encoded (see the module docstring).

    ``items`` are reasoning and text deltas and heartbeats, then one ``ChatResult``. A
    ``RequestError`` raised by ``items`` (a cancelled result included) becomes
    an ``error`` event and ``response.failed`` with its message; another
    exception the same, saying the server failed (and a log record).
    Cancellation is never caught."""
    seq = 0

    def event(kind: str, **fields) -> bytes:
        nonlocal seq
        body = {"type": kind, "sequence_number": seq, **fields}
        seq += 1
        return encode(body, event=kind)

    def response(status: str, **kw) -> dict:
        return _response(rid, model=model, created=created, status=status, req=req, **kw)

    yield event("response.created", response=response("in_progress", output=[], usage=None))
    yield event("response.in_progress", response=response("in_progress", output=[], usage=None))
    message_id, reasoning_id = _item_id("msg"), _item_id("rs")
    started = False
    thought: list[str] | None = None  # the reasoning so far, while its item is open
    index = 0  # the output index of the item streaming now
    with_logprobs = req is not None and req.logprobs is not None
    unsent: list[str] = []  # text not yet sent: it waits for its tokens' logprobs, which follow it
    unsent_logprobs: list = []  # logprobs not yet sent: they wait for text

    def send_text():
        nonlocal started, unsent_logprobs
        if thought is not None:
            yield from end_reasoning()
        if not started:
            started = True
            yield from start_message()
        yield event("response.output_text.delta", item_id=message_id, output_index=index, content_index=0,
                    delta="".join(unsent), logprobs=[logprob_json(lp) for lp in unsent_logprobs])
        unsent.clear()
        unsent_logprobs = []

    def start_message():
        yield event("response.output_item.added", output_index=index,
                    item=_message_item(message_id, "", "in_progress"))
        yield event("response.content_part.added", item_id=message_id, output_index=index, content_index=0,
                    part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def end_reasoning():
        nonlocal thought, index
        text, thought = "".join(thought), None
        yield event("response.reasoning_text.done", item_id=reasoning_id, output_index=index, content_index=0,
                    text=text)
        yield event("response.output_item.done", output_index=index, item=_reasoning_item(reasoning_id, text))
        index += 1

    try:
        async with closing(stream_text(items, with_logprobs)) as pieces:
            async for piece in pieces:
                if isinstance(piece, Heartbeat):
                    yield KEEP_ALIVE
                elif isinstance(piece, ReasoningDelta):
                    if thought is None:
                        thought = []
                        yield event("response.output_item.added", output_index=index,
                                    item=_reasoning_item(reasoning_id, None))
                    thought.append(piece.text)
                    yield event("response.reasoning_text.delta", item_id=reasoning_id, output_index=index,
                                content_index=0, delta=piece.text)
                elif isinstance(piece, Delta):
                    unsent.append(piece.text)
                    if not with_logprobs:
                        for chunk in send_text():
                            yield chunk
                elif isinstance(piece, LogprobsDelta):
                    unsent_logprobs += piece.logprobs
                    if unsent:
                        for chunk in send_text():
                            yield chunk
                else:
                    result = piece
    except Exception as e:
        if isinstance(e, RequestError):
            err = e
        else:
            log.exception("a /v1/responses stream failed")
            err = RequestError(500, "the server failed while generating; see its log")
        code = err.code or ("server_error" if err.status >= 500 else "invalid_request_error")
        yield event("error", code=code, message=err.message, param=err.param)
        failed = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
        yield event("response.failed", response=response("failed", output=[], usage=None, error=failed))
        return
    output = _output(result, message_id, reasoning_id)
    if unsent or (unsent_logprobs and any(item["type"] == "message" for item in output)):
        for chunk in send_text():
            yield chunk
    if thought is not None:
        for chunk in end_reasoning():
            yield chunk
    elif result.reasoning is not None:  # an empty reasoning: nothing streamed
        yield event("response.output_item.added", output_index=index, item=_reasoning_item(reasoning_id, None))
        yield event("response.output_item.done", output_index=index, item=output[index])
        index += 1
    if output[index]["type"] == "message":
        if not started:
            for chunk in start_message():
                yield chunk
        item = output[index]
        part = item["content"][0]
        yield event("response.output_text.done", item_id=message_id, output_index=index, content_index=0,
                    text=part["text"], logprobs=part["logprobs"])
        yield event("response.content_part.done", item_id=message_id, output_index=index, content_index=0,
                    part=part)
        yield event("response.output_item.done", output_index=index, item=item)
        index += 1
    for call, item in zip(result.tool_calls, output[index:]):
        yield event("response.output_item.added", output_index=index,
                    item=_call_item(item["id"], call, "in_progress"))
        yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                    delta=item["arguments"])
        yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                    name=call.name, arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
        index += 1
    final = response("completed", output=output, usage=result.usage, result=result)
    yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed", response=final)


PROTOCOL = ProtocolSpec("responses", ("/v1/responses",), response_json, events, error_json)
