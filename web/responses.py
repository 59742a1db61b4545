"""The OpenAI Responses API (``/v1/responses``): request parsing and
validation, response ids, the response JSON, the SSE events, and error JSON.

**Response ids name agent states.** A response is the reply of an agent's
turn, and its id says which agent and which point of its conversation:

    resp_<agent id>_<n>_<h>

``n`` is the number of messages in the agent's history once the reply is in
(the reply is message ``n``), ``h`` 12 hex digits of a hash of the ``n - 1``
messages before it (the prompt, system prompt first). The agent id may hold
``_`` itself; ``n`` and ``h`` never do, so the id splits from the right. No
store is kept beside the agents: an id stays valid as long as its agent's
history starts with that prompt and a reply -- across restarts, and until the
agent is deleted, pruned or rewritten by another conversation.

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

``text.format`` ``json_schema`` and ``json_object`` are enforced while
decoding (``runtime.grammar``) and echoed: the output text is JSON the schema
accepts, unless ``max_output_tokens`` cuts it.

Refused with a 400: input items other than messages, function calls, their
outputs and reasoning (ignored); image, audio and file parts; a JSON schema
this server cannot enforce, or ``text.format`` beside function tools;
``background``; ``conversation``. Hosted and custom tools
(``web_search``, ``local_shell``, Codex's ``namespace`` ...) are ignored:
only function tools reach the model. ``store``, other ``include`` entries,
``reasoning``, ``text.verbosity``, ``truncation``, ``client_metadata`` and
other unknown fields are accepted and ignored (``store`` and ``metadata`` are
echoed).

``include: ["message.output_text.logprobs"]`` or ``top_logprobs`` (0-20) puts
each output token's log-probability (``runtime.sampling``) in the
``output_text`` part's ``logprobs``; streaming, each
``response.output_text.delta`` carries those of the tokens whose text it
adds (tokens whose text is held back, as a call's markup may be, come with
the next delta that has text, or in one with an empty ``delta`` before
``response.output_text.done``, which has them all again).

(Long on purpose: one protocol's whole shape -- request items, output items,
stored responses, streaming events -- as ``web.anthropic`` and ``web.openai``
each hold theirs.)
"""

from __future__ import annotations

import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from semantic.actors import AGENT_CHARS, MAX_LOGPROBS, Message

from . import _validate as v
from ._aio import closing
from .harmony import HARMONY, read_harmony
from .identity import state_hash
from .openai import drafts_json, function_tool, session_hint, text_parts, tool_arguments
from .reasoning import CLOSE, OPEN, split_reasoning
from .schema import (ChatRequest, ChatResult, Heartbeat, LogprobsDelta, ReasoningDelta, RequestError, StreamItem,
                     TextDelta, Usage, cancelled, load_json, logprob_json, stream_text)
from .sse import KEEP_ALIVE, encode
from .tools import ToolFormat, parse_tool_calls

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["ResponseState", "ResponsesRequest", "continued", "deleted_json", "error_json", "events",
           "not_found", "parse_request", "parse_response_id", "response_id", "response_json", "stored_json"]

log = logging.getLogger("semantic.web")

_JOIN = "\n\n"  # between the text parts of one message, and between leading system messages
_ID = re.compile(rf"resp_({AGENT_CHARS.pattern})_([1-9][0-9]{{0,8}})_([0-9a-f]{{12}})")  # the agent-id rule's characters
_ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 429: "rate_limit_error"}
_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED_ITEMS = ("reasoning",)


# --- requests -----------------------------------------------------------------


@dataclass(frozen=True)
class ResponsesRequest(ChatRequest):
    """A ``ChatRequest`` with what a Responses request adds: the state it
    continues, and the fields its response echoes."""

    previous_response_id: str | None = None
    store: bool = True
    instructions: str | None = None
    max_output_tokens: int | None = None  # as asked (None: not given)
    parallel_tool_calls: bool = True
    echo_tools: tuple[dict, ...] = ()  # the function tools, in the Responses shape
    echo_tool_choice: object = "auto"
    extra: Mapping = field(default_factory=dict)  # other fields echoed as given (reasoning, text, user ...)


@dataclass(frozen=True)
class ResponseState:
    """What a response id names: message ``n`` of ``agent_id``'s history,
    the reply to a prompt whose hash is ``prompt_hash``."""

    agent_id: str
    n: int
    prompt_hash: str

    @property
    def id(self) -> str:
        return f"resp_{self.agent_id}_{self.n}_{self.prompt_hash}"

    def matches(self, history: tuple[Message, ...]) -> bool:
        """Whether ``history`` holds this state (it may have gone on since)."""
        return (len(history) >= self.n and history[self.n - 1].role == "assistant"
                and state_hash(history[:self.n - 1]) == self.prompt_hash)


def response_id(agent_id: str, prompt: tuple[Message, ...]) -> str:
    """The id of the reply of ``agent_id`` to ``prompt`` (its whole conversation)."""
    return ResponseState(agent_id, len(prompt) + 1, state_hash(prompt)).id


def not_found(response: str, param: str | None = None) -> RequestError:
    """A response id this server does not know (OpenAI's 404)."""
    if param == "previous_response_id":
        return RequestError(404, f"Previous response with id {response!r} not found.", param,
                            "previous_response_not_found")
    return RequestError(404, f"Response with id {response!r} not found.", param)


def parse_response_id(response: str, param: str | None = None) -> ResponseState:
    """The state a response id names; a 404 for one this server cannot have made."""
    if not (m := _ID.fullmatch(response)):
        raise not_found(response, param)
    return ResponseState(m[1], int(m[2]), m[3])


def parse_request(body: bytes, headers: Mapping[str, str] | None = None, *, max_tokens_cap: int) -> ResponsesRequest:
    """The request in a ``POST /v1/responses`` body (see the module docstring).

    ``max_output_tokens`` is clamped to ``max_tokens_cap`` and defaults to it.
    ``headers`` (lower-case names) may name the agent (``x-agent-id``); with a
    ``previous_response_id`` it must name that response's agent. Raises
    ``RequestError`` (400, or 404 for a malformed ``previous_response_id``)
    naming the first field that breaks a rule."""
    data = load_json(body)
    previous = v.string(data, "previous_response_id", nonempty=True)
    agent_id = (headers or {}).get("x-agent-id")
    if previous is not None:
        state = parse_response_id(previous, "previous_response_id")
        if agent_id is not None and agent_id != state.agent_id:
            raise v.bad("previous_response_id", f"continues agent {state.agent_id!r} but the X-Agent-Id header "
                                                f"names {agent_id!r}")
    instructions = v.string(data, "instructions")
    system, messages = _input(data, leading_system=previous is None)
    if instructions:
        system = instructions + (_JOIN + system if system else "")
    asked = v.integer(data, "max_output_tokens", lo=1)
    _refuse_unsupported(data)
    tools, chat_tools, choice, echo_choice = _tools(data)
    grammar = v.output_format(v.obj(data, "text") or {}, "format", "text.")
    top = v.integer(data, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    with_logprobs = top is not None or "message.output_text.logprobs" in v.strings(data, "include")
    v.no_tools_with(grammar, chat_tools, "text.format")
    extra = {k: data[k] for k in ("reasoning", "text", "user", "prompt_cache_key", "truncation")
             if data.get(k) is not None}
    return ResponsesRequest(
        messages=messages,
        max_tokens=min(asked or max_tokens_cap, max_tokens_cap),
        system=system,
        model=v.string(data, "model"),
        temperature=v.number(data, "temperature", lo=0, hi=2),
        top_p=v.number(data, "top_p", lo=0, hi=1, lo_open=True),
        top_k=v.integer(data, "top_k", lo=0),  # not OpenAI's, but common among local servers
        seed=v.integer(data, "seed"),
        stream=v.boolean(data, "stream"),
        agent_id=agent_id,
        hint=session_hint(data),
        tools=chat_tools,
        tool_choice=choice,
        tool_name=echo_choice["name"] if isinstance(echo_choice, dict) else None,
        strict_tools=v.strict_tools(data),
        metadata=v.obj(data, "metadata"),
        previous_response_id=previous,
        store=v.boolean(data, "store", default=True),
        instructions=instructions,
        max_output_tokens=asked,
        parallel_tool_calls=v.boolean(data, "parallel_tool_calls", default=True),
        echo_tools=tools,
        echo_tool_choice=echo_choice,
        extra=extra,
        grammar=grammar,
        logprobs=(top or 0) if with_logprobs else None,
    )


def continued(req: ResponsesRequest, history: tuple[Message, ...]) -> ResponsesRequest:
    """``req`` after ``history`` (its previous response's state, reply last):
    that conversation, then the request's input; the request's instructions,
    if any, replace the history's system prompt."""
    before = [m.as_dict() for m in history]
    system = before.pop(0)["content"] if before and before[0]["role"] == "system" else None
    return replace(req, system=req.system if req.system is not None else system,
                   messages=(*before, *req.messages))


def _refuse_unsupported(data: dict) -> None:
    if v.boolean(data, "background"):
        raise v.bad("background", "background responses are not supported")
    if data.get("conversation") is not None:
        raise v.bad("conversation", "conversations are not supported; continue a response with "
                                    "previous_response_id")


def _input(data: dict, leading_system: bool) -> tuple[str | None, tuple[dict, ...]]:
    """The system prompt (leading system/developer messages, when
    ``leading_system``) and the messages of ``input``."""
    raw = data.get("input")
    if isinstance(raw, str):
        if not raw:
            raise v.bad("input", "must not be empty")
        return None, ({"role": "user", "content": raw},)
    items = v.seq(data, "input", required=True, nonempty=True)
    system: list[str] = []
    out: list[dict] = []
    names: dict[str, str] = {}  # call id -> tool name, for the outputs that answer them
    for i, item in enumerate(items):
        at = f"input[{i}]"
        if not isinstance(item, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(item)}")
        kind = v.string(item, "type", at + ".") or ("message" if "role" in item else None)
        if kind == "message":
            role = v.string(item, "role", at + ".", required=True)
            text = _text(item, at)
            if role in ("system", "developer"):
                if leading_system and not out:
                    system.append(text)
                else:
                    out.append({"role": "system", "content": text})
            elif role in ("user", "assistant"):
                out.append({"role": role, "content": text})
            else:
                raise v.bad(at + ".role", f"must be 'user', 'assistant', 'system' or 'developer', not {role!r}")
        elif kind == "function_call":
            call_id = v.string(item, "call_id", at + ".", required=True, nonempty=True)
            name = v.string(item, "name", at + ".", required=True, nonempty=True)
            args = tool_arguments(item.get("arguments"), at + ".arguments")
            names[call_id] = name
            call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":  # text and calls: one assistant message
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id = v.string(item, "call_id", at + ".", required=True, nonempty=True)
            output = item.get("output")
            text = output if isinstance(output, str) else _parts(output, at + ".output")
            out.append({"role": "tool", "tool_call_id": call_id, "content": text}
                       | ({"name": names[call_id]} if call_id in names else {}))
        elif kind in _IGNORED_ITEMS:
            continue
        elif kind is None:
            raise v.bad(at + ".type", "is required")
        else:
            raise v.bad(at + ".type", f"{kind!r} items are not supported")
    if not out:
        raise v.bad("input", "must hold a message or a function call output, not only system messages")
    return (_JOIN.join(system) if system else None), tuple(out)


def _text(item: dict, at: str) -> str:
    content = item.get("content")
    if isinstance(content, str):
        return content
    if content is None:
        raise v.bad(at + ".content", "is required")
    return _parts(content, at + ".content")


def _parts(content: object, at: str) -> str:
    """Text parts joined (``input_text``, ``output_text``; a refusal's text)."""
    return text_parts(content, at, _TEXT_PARTS, ("input_image", "input_file", "input_audio"))


def _tools(data: dict) -> tuple[tuple[dict, ...], tuple[dict, ...] | None, str, object]:
    """(the function tools to echo, the chat template's tools, "auto" | "required", the choice to echo).
    Tools of other types are ignored."""
    echo, chat, seen = [], [], set()
    for i, tool in enumerate(v.seq(data, "tools") or ()):
        at = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise v.bad(at, f"must be an object, not {v.jtype(tool)}")
        if v.string(tool, "type", at + ".", required=True) != "function":
            continue  # hosted tools (web_search, ...), custom and namespaced ones: nothing a local model runs
        definition = function_tool(tool, at + ".", seen)
        chat.append(definition)
        echo.append({"type": "function", **definition["function"], "strict": v.boolean(tool, "strict", at + ".")}
                    | ({} if "parameters" in definition["function"] else {"parameters": None}))
    choice = data.get("tool_choice")
    if choice is None or choice == "auto":
        return tuple(echo), tuple(chat) or None, "auto", "auto"
    if choice == "none":
        return tuple(echo), None, "auto", "none"
    if choice == "required":
        return tuple(echo), tuple(chat) or None, "required", "required"
    if isinstance(choice, dict) and choice.get("type") == "function":
        name = v.string(choice, "name", "tool_choice.", required=True)
        if name not in seen:
            raise v.bad("tool_choice.name", f"names no function tool in 'tools': {name!r}")
        return tuple(echo), tuple(chat), "required", {"type": "function", "name": name}
    if isinstance(choice, dict):  # a hosted tool, allowed_tools, ...: the function tools as with "auto"
        return tuple(echo), tuple(chat) or None, "auto", "auto"
    raise v.bad("tool_choice", "must be 'none', 'auto', 'required' or {'type': 'function', 'name': ...}")


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
    status = "incomplete" if result.stop_reason == "length" else "completed"
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
    incomplete = result is not None and result.stop_reason == "length"
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
    if result.stop_reason == "cancelled":
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
    result = ChatResult(text, "tool_use" if calls else "stop", Usage(0), tool_calls=tuple(calls), reasoning=thought)
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
                elif isinstance(piece, TextDelta):
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
