"""The OpenAI Responses API's request (``POST /v1/responses``): its body
read and validated into a ``ResponsesRequest`` -- input items, function
tools, ``tool_choice`` and the fields its response echoes -- and the
conversation a ``previous_response_id`` continues (``web.responses``: the
response JSON and its events; ``web.response_ids``: the ids).

``text.format`` ``json_schema`` and ``json_object`` are enforced while
decoding (``runtime.text.grammar``) and echoed: the output text is JSON the schema
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
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from semantic.actors import MAX_LOGPROBS, Message

from . import _validate as v
from .openai import function_tool, session_hint, text_parts, tool_arguments
from .response_ids import parse_response_id
from .schema import ChatRequest, load_json

__all__ = ["ResponsesRequest", "continued", "parse_request"]

_JOIN = "\n\n"  # between the text parts of one message, and between leading system messages
_TEXT_PARTS = ("input_text", "output_text", "text")
_IGNORED_ITEMS = ("reasoning",)


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
