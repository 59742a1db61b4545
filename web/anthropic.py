"""The Anthropic Messages API (``POST /v1/messages``): request parsing and
validation, the message JSON, the SSE stream, and error JSON.

A stream follows Anthropic's documented event sequence:

    message_start        the message, empty content, stop_reason null, zero usage
    ping
    (a model that reasons: content_block_start thinking, thinking_delta ..., content_block_stop)
    content_block_start  {"type": "text", "text": ""}
    content_block_delta  text_delta ...
    content_block_stop
    (per tool call:      content_block_start tool_use with input {},
                         content_block_delta input_json_delta, content_block_stop)
    message_delta        stop_reason, stop_sequence, cumulative usage
    message_stop

and a failure after the stream has begun is one ``error`` event, after which
the stream ends. The text block is always there, also when the reply is only
tool calls (then it is empty), and the non-streaming message has the same blocks.

The head goes out with the first token, or after ``HEARTBEAT_S`` while a
long prompt is still prefilling; then a ``ping`` follows each quiet
``HEARTBEAT_S``, so a client's idle timeout never fires during a prefill.
A model's reasoning (``<think>...</think>``, ``web.reasoning``) comes as a
``thinking`` block with an empty signature.

Claude Code's extras: ``system`` messages inside ``messages`` (its
mid-conversation system beta) stay where they are (``runtime.memory.turns.render``
folds them into the user turn for templates that refuse them); a system block
``x-anthropic-billing-header: ...`` is transport metadata, changing with every
request, and is dropped; ``X-Claude-Code-Session-Id`` (else the session in
``metadata.user_id``) is the request's session hint (``web.identity``).
``max_tokens`` above the server's cap is clamped to it.

Structured outputs: ``output_config.format`` (or the beta's top-level
``output_format``), ``{"type": "json_schema", "schema": {...}}``, is enforced
while decoding (``runtime.text.grammar``): the text block is JSON the schema
accepts, unless ``max_tokens`` cuts it.

Ignored without complaint: ``cache_control`` anywhere, ``thinking`` blocks
sent back in assistant turns, and request fields this server has no use for
(``thinking``, ``context_management``, ``output_config.effort``,
``service_tier``, beta headers, ...). Refused with a 400: images and
documents (this server reads text), server tools (``web_search_...``), a
JSON schema this server cannot enforce, and an output format beside
``tools``.
"""

from __future__ import annotations

import json
import logging
import re
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import TYPE_CHECKING

from semantic.actors import Delta
from semantic.runtime.text.json_reader import JSONError, read_json

from . import _validate as v
from ._aio import closing
from .protocols import ProtocolSpec
from .schema import (ChatRequest, ChatResult, Heartbeat, ReasoningDelta, RequestError, StopReason, StreamItem, Usage,
                     cancelled, load_json, stream_text)
from .sse import encode

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["PROTOCOL", "error_json", "events", "message_events", "message_json", "parse_count_tokens",
           "parse_request", "response_json"]

log = logging.getLogger("semantic.web")

_STOP = {StopReason.STOP: "end_turn", StopReason.LENGTH: "max_tokens", StopReason.STOP_SEQUENCE: "stop_sequence",
         StopReason.TOOL_USE: "tool_use"}
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                503: "overloaded_error", 529: "overloaded_error"}
_JOIN = "\n\n"  # between the text blocks of one message or of the system prompt
_BILLING = "x-anthropic-billing-header:"  # Claude Code's per-request system block: not part of the prompt
_SESSION = re.compile(r"_session_([0-9a-fA-F-]{8,})")  # older metadata.user_id: user_..._session_<uuid>


# --- requests -----------------------------------------------------------------


def parse_request(body: bytes, headers: Mapping[str, str] | None = None, *, max_tokens_cap: int) -> ChatRequest:
    """The ``ChatRequest`` in a ``/v1/messages`` body.

    ``max_tokens`` is required; above ``max_tokens_cap`` it is clamped to it.
    ``headers`` (lower-case names) may name the agent (``x-agent-id``, checked
    by the caller) and the session. Raises ``RequestError`` (400) naming the
    first field that breaks a rule.
    """
    data = load_json(body)
    return _request(data, headers or {}, min(v.integer(data, "max_tokens", required=True, lo=1), max_tokens_cap))


def parse_count_tokens(body: bytes) -> ChatRequest:
    """The conversation in a ``/v1/messages/count_tokens`` body (no ``max_tokens``)."""
    return _request(load_json(body), {}, 1)


def _request(data: dict, headers: Mapping[str, str], max_tokens: int) -> ChatRequest:
    messages = tuple(_messages(data))
    system = _system(data)
    tools, tool_choice, tool_name = _tools(data)
    metadata = v.obj(data, "metadata")
    grammar = _output_format(data)
    v.no_tools_with(grammar, tools, "output_config.format")
    return ChatRequest(
        messages=messages,
        max_tokens=max_tokens,
        system=system,
        model=v.string(data, "model"),
        temperature=v.number(data, "temperature", lo=0, hi=1),
        top_p=v.number(data, "top_p", lo=0, hi=1, lo_open=True),
        top_k=v.integer(data, "top_k", lo=0),
        stop=v.strings(data, "stop_sequences"),
        stream=v.boolean(data, "stream"),
        agent_id=headers.get("x-agent-id"),
        hint=headers.get("x-claude-code-session-id") or _metadata_session(metadata),
        tools=tools,
        tool_choice=tool_choice,
        tool_name=tool_name,
        strict_tools=v.strict_tools(data),
        metadata=metadata,
        grammar=grammar,
    )


def _output_format(data: dict) -> str | None:
    """Structured outputs: ``output_config.format``, or the beta's ``output_format``."""
    config = v.obj(data, "output_config") or {}
    if config.get("format") is not None:
        return v.output_format(config, "format", "output_config.", kinds=("json_schema",))
    return v.output_format(data, "output_format", kinds=("json_schema",))


def _metadata_session(metadata: Mapping | None) -> str | None:
    """The session in Claude Code's ``metadata.user_id``: a JSON object's
    ``session_id``, or the older ``user_<hash>_account_<id>_session_<uuid>``."""
    user_id = (metadata or {}).get("user_id")
    if not isinstance(user_id, str):
        return None
    try:
        session = read_json(user_id).get("session_id")
        return session if isinstance(session, str) and session else None
    except (JSONError, AttributeError):
        pass
    return m[1] if (m := _SESSION.search(user_id)) else None


def _system(data: dict) -> str | None:
    system = data.get("system")
    if system is None:
        return None
    if isinstance(system, str):
        texts = [system]
    elif isinstance(system, list):
        texts = _text_blocks(system, "system")
    else:
        raise v.bad("system", f"must be a string or an array of text blocks, not {v.jtype(system)}")
    texts = [t.partition("\n")[2] if t.startswith(_BILLING) else t for t in texts]  # the header is one line
    return _JOIN.join(t for t in texts if t) or None


def _text_blocks(blocks: list, where: str) -> list[str]:
    texts = []
    for i, block in enumerate(blocks):
        at = f"{where}[{i}]"
        if (kind := _block_type(block, at)) != "text":
            raise v.bad(at + ".type", f"must be 'text', not {kind!r}")
        if text := v.string(block, "text", at + ".", required=True):
            texts.append(text)
    return texts


def _messages(data: dict) -> list[dict]:
    out: list[dict] = []
    names: dict[str, str] = {}  # tool_use id -> tool name, for the results that answer them
    for i, msg in enumerate(v.seq(data, "messages", required=True, nonempty=True)):
        at = f"messages[{i}]"
        if not isinstance(msg, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(msg)}")
        role = v.string(msg, "role", at + ".", required=True)
        if role not in ("user", "assistant", "system"):
            raise v.bad(at + ".role", f"must be 'user', 'assistant' or 'system', not {role!r}")
        content = msg.get("content")
        if role == "system":  # Claude Code's mid-conversation system messages
            if not isinstance(content, (str, list)):
                raise v.bad(at + ".content", f"must be a string or an array of text blocks, not {v.jtype(content)}")
            text = content if isinstance(content, str) else _JOIN.join(_text_blocks(content, at + ".content"))
            out.append({"role": "system", "content": text})
        elif isinstance(content, str):
            out.append({"role": role, "content": content})
        elif isinstance(content, list):
            out += _user_blocks(content, at, names) if role == "user" else [_assistant_blocks(content, at, names)]
        else:
            raise v.bad(at + ".content", f"must be a string or an array of content blocks, not {v.jtype(content)}")
    if all(m["role"] == "system" for m in out):
        raise v.bad("messages", "must hold a user message, not only system messages")
    return out


def _block_type(block: object, at: str) -> str:
    if not isinstance(block, dict):
        raise v.bad(at, f"must be a content block object, not {v.jtype(block)}")
    return v.string(block, "type", at + ".", required=True)


def _unsupported(kind: str, at: str) -> RequestError:
    if kind in ("image", "document"):
        return v.bad(at + ".type", f"{kind!r} blocks are not supported (this server reads text only)")
    return v.bad(at + ".type", f"{kind!r} blocks are not supported here")


def _user_blocks(blocks: list, where: str, names: dict[str, str]) -> list[dict]:
    """User text blocks become user messages; each tool_result a tool message, in order."""
    out: list[dict] = []
    texts: list[str] = []

    def flush():
        if texts:
            out.append({"role": "user", "content": _JOIN.join(texts)})
            texts.clear()

    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            if text := v.string(block, "text", at + ".", required=True):
                texts.append(text)
        elif kind == "tool_result":
            flush()
            out.append(_tool_result(block, at, names))
        else:
            raise _unsupported(kind, at)
    flush()
    if not out:  # e.g. only empty text blocks
        out.append({"role": "user", "content": ""})
    return out


def _tool_result(block: dict, at: str, names: dict[str, str]) -> dict:
    call_id = v.string(block, "tool_use_id", at + ".", required=True)
    content = block.get("content")
    if content is None:
        text = ""
    elif isinstance(content, str):
        text = content
    elif isinstance(content, list):  # text blocks; an image a tool returned is only named
        parts = []
        for k, part in enumerate(content):
            kind = _block_type(part, f"{at}.content[{k}]")
            if kind == "text":
                parts.append(v.string(part, "text", f"{at}.content[{k}].", required=True))
            elif kind in ("image", "document"):
                parts.append(f"[{kind} omitted: this server reads text only]")
            else:
                raise _unsupported(kind, f"{at}.content[{k}]")
        text = _JOIN.join(p for p in parts if p)
    else:
        raise v.bad(at + ".content", f"must be a string or an array of blocks, not {v.jtype(content)}")
    if v.boolean(block, "is_error", at + "."):
        text = "Error: " + text
    msg = {"role": "tool", "tool_call_id": call_id, "content": text}
    if call_id in names:
        msg["name"] = names[call_id]
    return msg


def _assistant_blocks(blocks: list, where: str, names: dict[str, str]) -> dict:
    texts, calls = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        kind = _block_type(block, at)
        if kind == "text":
            if text := v.string(block, "text", at + ".", required=True):
                texts.append(text)
        elif kind == "tool_use":
            call_id = v.string(block, "id", at + ".", required=True, nonempty=True)
            name = v.string(block, "name", at + ".", required=True, nonempty=True)
            args = v.obj(block, "input", at + ".")
            names[call_id] = name
            calls.append({"id": call_id, "type": "function",
                          "function": {"name": name, "arguments": {} if args is None else args}})
        elif kind in ("thinking", "redacted_thinking"):
            continue  # this server never thinks out loud; a client may echo another model's
        else:
            raise _unsupported(kind, at)
    msg = {"role": "assistant", "content": _JOIN.join(texts)}
    if calls:
        msg["tool_calls"] = calls
    return msg


def _tools(data: dict) -> tuple[tuple[dict, ...] | None, str, str | None]:
    tools = v.seq(data, "tools")
    if tools is None or not tools:
        return None, "auto", None
    out, seen = [], set()
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(tool)}")
        kind = v.string(tool, "type", at + ".")
        if kind not in (None, "custom"):
            raise v.bad(at + ".type", f"server tool {kind!r} is not supported (only tools the client runs)")
        name = v.string(tool, "name", at + ".", required=True, nonempty=True)
        if name in seen:
            raise v.bad(at + ".name", f"tool names must be unique; {name!r} appears twice")
        seen.add(name)
        schema = v.obj(tool, "input_schema", at + ".", required=True)
        function = {"name": name}
        if (description := v.string(tool, "description", at + ".")) is not None:
            function["description"] = description
        function["parameters"] = schema
        out.append({"type": "function", "function": function})
    choice = v.obj(data, "tool_choice")
    if choice is None:
        return tuple(out), "auto", None
    kind = v.string(choice, "type", "tool_choice.", required=True)
    if kind == "auto":
        return tuple(out), "auto", None
    if kind == "any":
        return tuple(out), "required", None
    if kind == "none":
        return None, "auto", None
    if kind == "tool":
        name = v.string(choice, "name", "tool_choice.", required=True)
        if name not in seen:
            raise v.bad("tool_choice.name", f"names no tool in 'tools': {name!r}")
        return tuple(out), "required", name
    raise v.bad("tool_choice.type", f"must be 'auto', 'any', 'tool' or 'none', not {kind!r}")


# --- responses ----------------------------------------------------------------


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def _usage(usage: Usage) -> dict:
    return {"input_tokens": usage.input_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": usage.cache_read_input_tokens, "output_tokens": usage.output_tokens,
            "drafted_tokens": usage.drafted_tokens, "accepted_tokens": usage.accepted_tokens}


def _thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}  # nothing to sign: it stays local


def _tool_block(call) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments}


def message_json(result: ChatResult, *, model: str, message_id: str | None = None) -> dict:
    """The non-streaming response body for ``result``.

    Raises ``RequestError`` (503) for a cancelled turn, which has no message.
    """
    if result.stop_reason == StopReason.CANCELLED:
        raise cancelled()
    return {
        "id": message_id or new_message_id(),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": ([_thinking_block(result.reasoning)] if result.reasoning is not None else [])
                   + [{"type": "text", "text": result.text}] + [_tool_block(c) for c in result.tool_calls],
        "stop_reason": _STOP[result.stop_reason],
        "stop_sequence": result.stop_sequence,
        "usage": _usage(result.usage),
    }


def error_json(err: RequestError) -> dict:
    """Anthropic's error body: ``{"type": "error", "error": {"type", "message"}}``."""
    kind = _ERROR_TYPES.get(err.status, "invalid_request_error" if err.status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": err.message}}


def _event(data: dict) -> bytes:
    return encode(data, data["type"])


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    return message_json(result, model=turn.model)


def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    return message_events(items, model=turn.model)


async def message_events(items: AsyncIterable[StreamItem], *, model: str,
                         message_id: str | None = None) -> AsyncIterator[bytes]:
    """The SSE stream of one message, encoded.

    The head (``message_start``, ``ping``) goes out with the first item, before
    the prompt's usage is known: ``message_start`` has zeros, the final
    ``message_delta`` the result's cumulative counts. Each block starts when
    its first piece comes: a ``thinking`` block for the model's reasoning,
    then the text block (always there, empty when the reply is only tool
    calls), then one ``tool_use`` block per call. ``items`` are reasoning and
    text deltas and heartbeats (each a ``ping``) and then one ``ChatResult``.
    A ``RequestError`` raised by ``items`` becomes an ``error`` event with its
    message, another exception an ``error`` event saying the server failed
    (and a log record), a cancelled result an ``overloaded_error`` event; the
    stream ends after any of them. Cancellation is never caught.
    """
    started = False
    block: str | None = None  # the kind of the block open now
    index = -1

    def switch(kind: str, content: dict) -> list[bytes]:
        nonlocal block, index
        out = [_event({"type": "content_block_stop", "index": index})] if block is not None else []
        block, index = kind, index + 1
        return out + [_event({"type": "content_block_start", "index": index, "content_block": content})]

    try:
        async with closing(stream_text(items)) as pieces:
            async for piece in pieces:
                if not started:
                    started = True
                    start = {"id": message_id or new_message_id(), "type": "message", "role": "assistant",
                             "model": model, "content": [], "stop_reason": None, "stop_sequence": None,
                             "usage": _usage(Usage(0))}
                    yield _event({"type": "message_start", "message": start})
                    yield _event({"type": "ping"})
                if isinstance(piece, Heartbeat):
                    yield _event({"type": "ping"})
                elif isinstance(piece, ReasoningDelta):
                    for event in switch("thinking", _thinking_block("")) if block != "thinking" else ():
                        yield event
                    yield _event({"type": "content_block_delta", "index": index,
                                  "delta": {"type": "thinking_delta", "thinking": piece.text}})
                elif isinstance(piece, Delta):
                    for event in switch("text", {"type": "text", "text": ""}) if block != "text" else ():
                        yield event
                    yield _event({"type": "content_block_delta", "index": index,
                                  "delta": {"type": "text_delta", "text": piece.text}})
                else:
                    result = piece
    except RequestError as err:
        yield _event(error_json(err))
        return
    except Exception:
        log.exception("a /v1/messages stream failed")
        yield _event(error_json(RequestError(500, "the server failed while generating; see its log")))
        return
    for event in switch("text", {"type": "text", "text": ""}) if block != "text" else ():
        yield event
    for call in result.tool_calls:
        for event in switch("tool_use", {**_tool_block(call), "input": {}}):
            yield event
        yield _event({"type": "content_block_delta", "index": index,
                      "delta": {"type": "input_json_delta", "partial_json": json.dumps(call.arguments)}})
    yield _event({"type": "content_block_stop", "index": index})
    yield _event({"type": "message_delta",
                  "delta": {"stop_reason": _STOP[result.stop_reason], "stop_sequence": result.stop_sequence},
                  "usage": _usage(result.usage)})
    yield _event({"type": "message_stop"})


# "/": its errors answer every path no other protocol claims (the models, health, a 404)
PROTOCOL = ProtocolSpec("anthropic", ("/v1/messages", "/"), response_json, events, error_json)
