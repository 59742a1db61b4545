"""The OpenAI chat completions API (``POST /v1/chat/completions``): request
parsing and validation, the completion JSON, the SSE chunks, and error JSON.

A stream is ``data:`` lines only:

    chunk  delta {"role": "assistant", "content": ""}
    chunk  delta {"content": "..."} ...
    chunk  delta {"tool_calls": [{index, id, type, function: {name, arguments}}]}  (one per call)
    chunk  delta {}, finish_reason "stop" | "length" | "tool_calls"
    chunk  choices [], usage                     (only with stream_options.include_usage)
    [DONE]

Every chunk carries ``"usage": null`` when usage was asked for, as OpenAI's
do. A failure after the stream has begun is one ``{"error": {...}}`` chunk
(the ``openai`` SDK raises it) and then ``[DONE]``.

The stream's first chunk goes out with the first token, or after
``HEARTBEAT_S`` while a long prompt is still prefilling; an SSE comment
(``: keep-alive``) follows each quiet ``HEARTBEAT_S``. ``prompt_cache_key``,
else ``user``, is the request's session hint (``web.identity``); the
``X-Agent-Id`` header or ``session_id`` names the agent. ``max_tokens``
above the server's cap is clamped to it.

A model's reasoning (``<think>...</think>``, ``web.reasoning``) is the
message's ``reasoning_content`` (streamed as ``reasoning_content`` deltas),
as DeepSeek's API and vLLM send it.

Leading ``system`` and ``developer`` messages become the system prompt; later
ones stay where they are. Refused with a 400: images, audio and files (this
server reads text), ``n`` outside 1-16, legacy ``function`` messages, a JSON
schema this server cannot enforce, and ``response_format`` beside ``tools``.
Other unknown fields are ignored.

``n`` > 1: the replies are one prompt prefilled once and decoded together
(``Agent.send``'s ``choices``), each sampled on its own (with a ``seed``,
choice ``i`` takes ``seed + i``); ``usage`` counts the prompt once and every
choice's output. The conversation's agent keeps choice 0. Streamed, each
chunk carries one choice's delta (its ``index``).

``logprobs: true`` (with ``top_logprobs``, 0-20) puts each output token's
log-probability (``runtime.engine.sampling``) in ``choices[0].logprobs.content``;
streaming, a chunk with an empty delta carries those of the tokens whose
text came before it.

``response_format`` ``json_schema`` (``strict`` or not) and ``json_object``
are enforced while decoding (``runtime.text.grammar``): the reply's content is
JSON that the schema accepts, laid out as ``json.dumps`` does, unless
``max_tokens`` cuts it (``finish_reason: "length"``).
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import TYPE_CHECKING

from semantic.actors import MAX_CHOICES, MAX_LOGPROBS, Delta
from semantic.runtime.text.json_reader import JSONError, read_json

from . import _validate as v
from ._aio import closing
from .protocols import ProtocolSpec
from .schema import (ChatRequest, ChatResult, Heartbeat, ReasoningDelta, RequestError, StopReason, StreamItem, Usage,
                     cancelled, load_json, logprob_json, stream_text)
from .sse import KEEP_ALIVE, encode

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["PROTOCOL", "completion_chunks", "completion_json", "drafts_json", "error_json", "events", "function_tool",
           "parse_request", "response_json", "session_hint", "tool_arguments", "usage_json"]

log = logging.getLogger("semantic.web")

_FINISH = {StopReason.STOP: "stop", StopReason.STOP_SEQUENCE: "stop", StopReason.LENGTH: "length",
           StopReason.TOOL_USE: "tool_calls"}
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error",
                429: "rate_limit_error"}
_JOIN = "\n\n"  # between the text parts of one message, and between leading system messages
_DONE = encode("[DONE]")


# --- requests -----------------------------------------------------------------


def request_fields(data: dict, headers: Mapping[str, str] | None) -> dict:
    """What a request says alike on the chat and the legacy completions routes:
    its agent (the ``x-agent-id`` header, or the body's ``session_id``; the
    two must agree), model, sampling settings and streaming, as the request
    types name them."""
    agent_id = (headers or {}).get("x-agent-id")
    session = v.string(data, "session_id", nonempty=True)
    if agent_id is not None and session is not None and session != agent_id:
        raise v.bad("session_id", f"names agent {session!r} but the X-Agent-Id header names {agent_id!r}")
    stream = v.boolean(data, "stream")
    options = v.obj(data, "stream_options") or {}
    return dict(
        model=v.string(data, "model"),
        temperature=v.number(data, "temperature", lo=0, hi=2),
        top_p=v.number(data, "top_p", lo=0, hi=1, lo_open=True),
        top_k=v.integer(data, "top_k", lo=0),  # not OpenAI's, but common among local servers
        stop=v.strings(data, "stop", allow_one=True),
        seed=v.integer(data, "seed"),
        stream=stream,
        include_usage=stream and v.boolean(options, "include_usage", "stream_options."),
        agent_id=agent_id if agent_id is not None else session,
        hint=session_hint(data),
    )


def parse_request(body: bytes, headers: Mapping[str, str] | None = None, *, max_tokens_cap: int) -> ChatRequest:
    """The ``ChatRequest`` in a ``/v1/chat/completions`` body.

    ``max_completion_tokens`` (or the older ``max_tokens``) is clamped to
    ``max_tokens_cap`` and defaults to it. ``headers`` (lower-case names) may
    name the agent (``x-agent-id``); the body's ``session_id`` names it too,
    and the two must agree. Raises ``RequestError`` (400) naming the first
    field that breaks a rule.
    """
    data = load_json(body)
    system, messages = _messages(data)
    asked = v.integer(data, "max_completion_tokens", lo=1) or v.integer(data, "max_tokens", lo=1)
    max_tokens = min(asked or max_tokens_cap, max_tokens_cap)
    common = request_fields(data, headers)
    tools, tool_choice, tool_name = _tools(data)
    grammar = v.output_format(data, "response_format", schema_in="json_schema")
    top = v.integer(data, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not v.boolean(data, "logprobs"):
        raise v.bad("top_logprobs", "needs logprobs: true")
    v.no_tools_with(grammar, tools, "response_format")
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        system=system,
        **common,
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        strict_tools=v.strict_tools(data, "function"),
        metadata=v.obj(data, "metadata"),
        grammar=grammar,
        logprobs=(top or 0) if v.boolean(data, "logprobs") else None,
        choices=v.integer(data, "n", lo=1, hi=MAX_CHOICES) or 1,
    )


def session_hint(data: dict) -> str | None:
    """OpenAI's cache routing hints, as a session hint: ``prompt_cache_key``, else ``user``."""
    return v.string(data, "prompt_cache_key", nonempty=True) or v.string(data, "user", nonempty=True)


def _messages(data: dict) -> tuple[str | None, tuple[dict, ...]]:
    system: list[str] = []
    out: list[dict] = []
    names: dict[str, str] = {}  # tool call id -> tool name, for the results that answer them
    for i, msg in enumerate(v.seq(data, "messages", required=True, nonempty=True)):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(msg)}")
        role = v.string(msg, "role", at + ".", required=True)
        if role in ("system", "developer"):
            text = _text(msg, at, required=True)
            if out:
                out.append({"role": "system", "content": text})
            else:
                system.append(text)
        elif role == "user":
            out.append({"role": "user", "content": _text(msg, at, required=True)})
        elif role == "assistant":
            out.append(_assistant(msg, at, names))
        elif role == "tool":
            call_id = v.string(msg, "tool_call_id", at + ".", required=True, nonempty=True)
            out.append({"role": "tool", "tool_call_id": call_id, "content": _text(msg, at, required=True)}
                       | ({"name": names[call_id]} if call_id in names else {}))
        else:
            raise v.bad(at + ".role", "must be 'system', 'developer', 'user', 'assistant' or 'tool', "
                                      f"not {role!r}")
    if not out:
        raise v.bad("messages", "must hold a user message, not only system messages")
    return (_JOIN.join(system) if system else None), tuple(out)


def _text(msg: dict, at: str, required: bool) -> str:
    """A message's content as one string: a string, or text parts joined."""
    content = msg.get("content")
    if content is None:
        if required:
            raise v.bad(at + ".content", "is required")
        return ""
    if isinstance(content, str):
        return content
    return text_parts(content, at + ".content", ("text",), ("image_url", "input_audio", "file"))


def text_parts(content: object, at: str, text_kinds: tuple[str, ...], media_kinds: tuple[str, ...]) -> str:
    """Content parts as one string: the text parts (and refusals' text) joined;
    a media part is a 400 saying this server reads text, another kind a 400."""
    if not isinstance(content, list):
        raise v.bad(at, f"must be a string or an array of content parts, not {v.jtype(content)}")
    texts = []
    for j, part in enumerate(content):
        where = f"{at}[{j}]"
        if not isinstance(part, dict):
            raise v.bad(where, f"must be a content part object, not {v.jtype(part)}")
        kind = v.string(part, "type", where + ".", required=True)
        if kind in text_kinds:
            texts.append(v.string(part, "text", where + ".", required=True))
        elif kind == "refusal":
            texts.append(v.string(part, "refusal", where + ".", required=True))
        elif kind in media_kinds:
            raise v.bad(where + ".type", f"{kind!r} parts are not supported (this server reads text only)")
        else:
            raise v.bad(where + ".type", f"{kind!r} parts are not supported")
    return _JOIN.join(t for t in texts if t)


def _assistant(msg: dict, at: str, names: dict[str, str]) -> dict:
    calls = []
    for k, call in enumerate(v.seq(msg, "tool_calls", at + ".") or ()):
        where = f"{at}.tool_calls[{k}]"
        if not isinstance(call, dict):
            raise v.bad(where, f"must be an object, not {v.jtype(call)}")
        call_id = v.string(call, "id", where + ".", required=True, nonempty=True)
        function = v.obj(call, "function", where + ".", required=True)
        name = v.string(function, "name", where + ".function.", required=True, nonempty=True)
        args = tool_arguments(function.get("arguments"), where + ".function.arguments")
        names[call_id] = name
        calls.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}})
    out = {"role": "assistant", "content": _text(msg, at, required=not calls)}
    if calls:
        out["tool_calls"] = calls
    return out


def _tools(data: dict) -> tuple[tuple[dict, ...] | None, str, str | None]:
    tools = v.seq(data, "tools")
    if not tools:
        return None, "auto", None
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(tool)}")
        if (kind := v.string(tool, "type", at + ".", required=True)) != "function":
            raise v.bad(at + ".type", f"only 'function' tools are supported, not {kind!r}")
        out.append(function_tool(v.obj(tool, "function", at + ".", required=True), at + ".function.", seen))
    choice = data.get("tool_choice")
    if choice is None or choice == "auto":
        return tuple(out), "auto", None
    if choice == "none":
        return None, "auto", None
    if choice == "required":
        return tuple(out), "required", None
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = v.string(v.obj(choice, "function", "tool_choice.", required=True), "name",
                        "tool_choice.function.", required=True)
        if name not in seen:
            raise v.bad("tool_choice.function.name", f"names no tool in 'tools': {name!r}")
        return tuple(out), "required", name
    raise v.bad("tool_choice", "must be 'none', 'auto', 'required' or "
                               "{'type': 'function', 'function': {'name': ...}}")


def tool_arguments(args: object, where: str) -> dict:
    """A tool call's arguments: a JSON object, or a string encoding one (empty: ``{}``)."""
    if isinstance(args, str):
        try:
            args = read_json(args) if args.strip() else {}
        except JSONError as e:
            raise v.bad(where, str(e).removeprefix("JSON ")) from None
    if not isinstance(args, dict):
        raise v.bad(where, f"must encode a JSON object, not {v.jtype(args)}")
    return args


def function_tool(function: dict, where: str, seen: set[str]) -> dict:
    """A function tool for the chat template, ``{"type": "function", "function": {name, description?,
    parameters?}}``, from the object ``function`` that holds those fields (at ``where``, e.g.
    ``tools[0].function.``); ``seen`` collects the names, which must be unique."""
    name = v.string(function, "name", where, required=True, nonempty=True)
    if name in seen:
        raise v.bad(where + "name", f"tool names must be unique; {name!r} appears twice")
    seen.add(name)
    clean = {"name": name}
    if (description := v.string(function, "description", where)) is not None:
        clean["description"] = description
    if (parameters := v.obj(function, "parameters", where)) is not None:
        clean["parameters"] = parameters
    return {"type": "function", "function": clean}


# --- responses ----------------------------------------------------------------


def new_completion_id() -> str:
    return "chatcmpl-" + secrets.token_hex(12)


def usage_json(result: ChatResult) -> dict:
    """The request's usage as OpenAI writes it (the prompt once, every choice's output)."""
    usage = result.total_usage
    return {"prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.output_tokens,
            "total_tokens": usage.prompt_tokens + usage.output_tokens,
            "prompt_tokens_details": {"cached_tokens": usage.cache_read_input_tokens},
            "completion_tokens_details": drafts_json(usage)}


def drafts_json(usage: Usage) -> dict:
    """Drafts verified, as OpenAI reports a prediction's tokens (``runtime.engine.speculation``)."""
    return {"accepted_prediction_tokens": usage.accepted_tokens,
            "rejected_prediction_tokens": usage.drafted_tokens - usage.accepted_tokens}


def _tool_calls(result: ChatResult) -> list[dict]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in result.tool_calls]


def completion_json(result: ChatResult, *, model: str, completion_id: str | None = None,
                    created: int | None = None, logprobs: bool = False) -> dict:
    """The non-streaming response body for ``result`` (with its tokens'
    ``logprobs`` from the runtime's record, when asked).

    Raises ``RequestError`` (503) for a cancelled turn, which has no completion.
    """
    if result.stop_reason == StopReason.CANCELLED:
        raise cancelled()

    def choice(index: int, reply: ChatResult) -> dict:
        message = {"role": "assistant", "content": reply.text or (None if reply.tool_calls else ""),
                   "refusal": None}
        if reply.reasoning is not None:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = _tool_calls(reply)
        return {"index": index, "message": message,
                "logprobs": _logprobs(reply.turn.logprobs if reply.turn else ()) if logprobs else None,
                "finish_reason": _FINISH[reply.stop_reason]}

    return {
        "id": completion_id or new_completion_id(),
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": model,
        "choices": [choice(i, reply) for i, reply in enumerate(result.every)],
        "usage": usage_json(result),
        "system_fingerprint": None,
    }


def error_json(err: RequestError) -> dict:
    """OpenAI's error body: ``{"error": {"message", "type", "param", "code"}}``."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "server_error")
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": err.code}}


def _logprobs(entries) -> dict:
    return {"content": [logprob_json(lp) for lp in entries], "refusal": None}


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    return completion_json(result, model=turn.model, created=turn.created, logprobs=turn.request.logprobs is not None)


def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    return completion_chunks(items, model=turn.model, include_usage=turn.request.include_usage, created=turn.created,
                             logprobs=turn.request.logprobs is not None)


async def completion_chunks(items: AsyncIterable[StreamItem], *, model: str, include_usage: bool = False,
                            completion_id: str | None = None, created: int | None = None,
                            logprobs: bool = False) -> AsyncIterator[bytes]:
    """The SSE stream of one completion, encoded (see the module docstring).

    ``items`` are text deltas and then one ``ChatResult``. A ``RequestError``
    raised by ``items`` becomes an error chunk with its message, another
    exception an error chunk saying the server failed (and a log record), a
    cancelled result a 503 error chunk; ``[DONE]`` follows each. Cancellation
    is never caught.
    """
    head = {"id": completion_id or new_completion_id(), "object": "chat.completion.chunk",
            "created": int(time.time()) if created is None else created, "model": model,
            "system_fingerprint": None}

    def chunk(delta: dict, finish: str | None = None, logprobs: dict | None = None, index: int = 0) -> bytes:
        body = {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        return encode(body | {"usage": None} if include_usage else body)

    started: set[int] = set()  # choices whose first chunk went out
    try:
        async with closing(stream_text(items, logprobs)) as pieces:
            async for piece in pieces:
                if isinstance(piece, Heartbeat):
                    if not started:  # (a long prompt prefilling: the stream begins)
                        started.add(0)
                        yield chunk({"role": "assistant", "content": ""})
                    yield KEEP_ALIVE
                    continue
                if isinstance(piece, ChatResult):
                    result = piece
                    continue
                if piece.choice not in started:
                    started.add(piece.choice)
                    yield chunk({"role": "assistant", "content": ""}, index=piece.choice)
                if isinstance(piece, ReasoningDelta):
                    yield chunk({"reasoning_content": piece.text}, index=piece.choice)
                elif isinstance(piece, Delta):
                    yield chunk({"content": piece.text}, index=piece.choice)
                else:  # log-probabilities: their tokens' text came before them, or is held back
                    yield chunk({}, logprobs=_logprobs(piece.logprobs), index=piece.choice)
    except RequestError as err:
        yield encode(error_json(err))
        yield _DONE
        return
    except Exception:
        log.exception("a /v1/chat/completions stream failed")
        yield encode(error_json(RequestError(500, "the server failed while generating; see its log")))
        yield _DONE
        return
    for index, reply in enumerate(result.every):
        if index not in started:
            yield chunk({"role": "assistant", "content": ""}, index=index)
        for i, call in enumerate(_tool_calls(reply)):
            yield chunk({"tool_calls": [{"index": i, **call}]}, index=index)
        yield chunk({}, _FINISH[reply.stop_reason], index=index)
    if include_usage:
        yield encode({**head, "choices": [], "usage": usage_json(result)})
    yield _DONE


PROTOCOL = ProtocolSpec("openai", ("/v1/chat",), response_json, events, error_json)
