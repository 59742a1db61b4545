"""One chat turn for a route: a ``ChatRequest`` becomes the runtime's
conversation, an agent turn runs it, and its deltas and end come back as
``StreamItem``\\ s (text deltas, then one ``ChatResult``).

Tools depend on the model's chat template (``web.tools``):

* a template that takes ``tools`` gets the request's tool definitions and its
  tool turns as they are, and calls in the reply are parsed back into
  ``tool_use`` blocks when the format is known (Hermes/Qwen ``<tool_call>``,
  Llama 3.1 JSON); an unknown format answers with the calls left in the text;
* a template without tools (the embedded SmolLM2) cannot show the model a
  tool, so definitions are dropped and tool calls and results in the history
  are flattened into plain text; the reply is always text (``end_turn``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

from actors import ContextTooLong, Message, Reply, RuntimeClosed, RuntimeUnhealthy, TurnCancelled, TurnResult
from runtime.agent_cache import OutOfMemory
from runtime.errors import SemanticError

from .schema import ChatRequest, ChatResult, RequestError, StreamItem, TextDelta, Usage
from .tools import ToolCallFilter, ToolFormat, finish_result, flatten_tool_messages, supports_tools, tool_format

__all__ = ["Prepared", "chat_result", "prepare", "run_turn", "sampling", "turn_error"]


@dataclass(frozen=True)
class Prepared:
    """What the runtime gets for one request."""

    messages: tuple[Message, ...]  # the whole conversation, system prompt first
    tools: tuple[dict, ...] | None  # for the chat template (None: none, or it takes none)
    fmt: ToolFormat | None  # how to parse calls out of the reply
    tool_names: frozenset[str]


def prepare(req: ChatRequest, chat_template: str | None) -> Prepared:
    """The conversation and tools of ``req`` as this model's template can take them."""
    conversation = req.conversation()
    if supports_tools(chat_template):
        tools = req.tools or None
        fmt = tool_format(chat_template) if tools else None
    else:
        if any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
            conversation = flatten_tool_messages(conversation)
        tools, fmt = None, None
    messages = tuple(Message(m["role"], m["content"], tuple(m.get("tool_calls") or ()), m.get("tool_call_id"),
                             m.get("name")) for m in conversation)
    return Prepared(messages, tools, fmt, req.tool_names if tools else frozenset())


def sampling(req: ChatRequest) -> dict:
    """The runtime's sampling arguments; greedy unless the client set a temperature."""
    out: dict = {"max_tokens": req.max_tokens, "stop": req.stop}
    for key in ("temperature", "top_p", "top_k", "seed"):
        if (value := getattr(req, key)) is not None:
            out[key] = value
    return out


def chat_result(result: TurnResult) -> ChatResult:
    usage = Usage(result.prefilled_tokens, result.reused_tokens, result.output_tokens)
    stop = getattr(result, "stop_sequence", None)
    if result.reason == "stop":
        return ChatResult(result.text, "stop_sequence" if stop else "stop", usage, stop or None)
    return ChatResult(result.text, "length" if result.reason == "length" else "cancelled", usage)


def turn_error(e: Exception) -> RequestError:
    """The client's view of a runtime error that ended a turn (or refused it)."""
    if isinstance(e, ContextTooLong):
        return RequestError(400, str(e))
    if isinstance(e, OutOfMemory):
        return RequestError(503, f"the server's KV cache budget is full: {e}")
    if isinstance(e, (RuntimeClosed, TurnCancelled)):
        return RequestError(503, "the server is shutting down; try again")
    if isinstance(e, RuntimeUnhealthy):
        return RequestError(503, "the model failed and the server must be restarted; see its log")
    return RequestError(500, f"the turn failed: {e}")


async def run_turn(reply: Reply, prepared: Prepared) -> AsyncIterator[StreamItem]:
    """The items of one turn: ``TextDelta`` items (tool-call markup held back),
    then its ``ChatResult`` with tool calls parsed out.  Runtime errors become
    ``RequestError``.  Closing the iterator, or cancelling its reader, cancels
    the turn (the agent's history stays as it was)."""
    hold = ToolCallFilter(prepared.fmt) if prepared.fmt else None
    try:
        async for delta in reply:
            if text := hold.feed(delta.text) if hold else delta.text:
                yield TextDelta(text)
    except TurnCancelled:
        pass  # the runtime shut down under it: a "cancelled" result
    except SemanticError as e:  # TurnError, OutOfMemory, RuntimeClosed, ...: the turn did not run
        raise turn_error(e) from None
    finally:
        reply.close()
    yield finish_result(chat_result(reply.result), prepared.fmt, prepared.tool_names)
