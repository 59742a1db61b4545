"""A chat request as the model's template can take it: the conversation,
the tools, and the grammar its reply must follow (``prepare``), for the
chat core (``web.chat``) to run.

Tools depend on the model's chat template (``web.tools``):

* a template that takes ``tools`` gets the request's tool definitions and its
  tool turns as they are, and calls in the reply are parsed back into
  ``tool_use`` blocks when the format is known (Hermes/Qwen ``<tool_call>``,
  Llama 3.1 JSON); an unknown format answers with the calls left in the text;
* a template without tools (the embedded SmolLM2) cannot show the model a
  tool: its tools are told in the system prompt in the Hermes format, the
  reply is held to text or a call in that format, tool calls in the
  history are written in that format, as the model wrote them where its
  agent's history holds them (``identity.as_generated``), and results
  become user text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from semantic.actors import GrammarError, Message

from .harmony import Harmony, speaks_harmony
from .harmony import call_grammar as harmony_grammar
from .reasoning import ThinkTags
from .schema import ChatRequest, RequestError
from .tool_grammar import call_grammar
from .tools import (DEEPSEEK, LibraryFormat, ToolFormat, deepseek_tool_prompt, flatten_tool_messages, supports_tools,
                    tool_format, tool_prompt)

__all__ = ["Prepared", "context_first", "prepare", "with_system"]


@dataclass(frozen=True)
class Prepared:
    """What the runtime gets for one request."""

    messages: tuple[Message, ...]  # the whole conversation, system prompt first
    tools: tuple[dict, ...] | None  # for the chat template (None: none, or it takes none)
    fmt: ToolFormat | None  # how to parse calls out of the reply
    tool_names: frozenset[str]
    grammar: str | None = None  # what the reply must follow: the request's format, or a forced call
    holds_calls: bool = False  # the grammar holds the reply's calls: they are whole even where the limit cut it
    tools_told: bool = False  # the tools are told in the system prompt in the Hermes format (``tool_prompt``)
    calls_as_text: bool = False  # the conversation's calls are text in the Hermes format (``flatten_tool_messages``)


def prepare(req: ChatRequest, chat_template: str | None, library: LibraryFormat | None = None,
            tokens: Mapping[str, int] | None = None, reasoning: ThinkTags | Harmony | None = None,
            tell_tools: bool = True) -> Prepared:
    """The conversation and tools of ``req`` as this model's template can take
    them (``library``: the call format mlx-lm found for its tokenizer;
    ``tokens``: its ``added_tokens``; ``reasoning``: how its replies reason),
    and the grammar its reply must follow.

    A template that takes tools gets them; DeepSeek's, which takes none but
    writes calls, has them told in the system prompt as DeepSeek lays them
    out (``deepseek_tool_prompt``); any other template gets the conversation
    flattened to text and the tools told in the system prompt in the Hermes
    format (``tool_prompt``), whatever the ``tool_choice`` but ``none``
    (``tell_tools`` False: not under ``auto``, where they would not fit). A
    forced call (``required``) is held to one call of the tools in the
    model's format; tools that ask to be ``strict``, and tools told in the
    Hermes format, hold an ``auto`` reply to text or valid calls
    (``call_grammar``; GPT-OSS: ``harmony.call_grammar``). A model that
    reasons may think before the reply the grammar holds. Raises
    ``RequestError`` (400) for forced or strict tools whose schemas cannot
    be enforced (told ones are then told, and their calls not held)."""
    conversation = context_first(req.conversation())
    forced = bool(req.tools) and req.tool_choice == "required"
    calls_as_text = False
    told = False  # the tools are told in the system prompt in the Hermes format: their calls are held to it
    if supports_tools(chat_template):
        tools = req.tools or None
        fmt = tool_format(chat_template, library) if tools else None
    elif isinstance(library, LibraryFormat) and library.parser in DEEPSEEK:  # its calls, but no tools in the template
        tools, fmt = None, library if req.tools else None
        if req.tools:
            conversation = with_system(conversation, deepseek_tool_prompt(req.tools, library))
    else:
        if calls_as_text := any(m["role"] == "tool" or m.get("tool_calls") for m in conversation):
            conversation = flatten_tool_messages(conversation)
        tools, fmt, told = None, None, bool(req.tools) and (tell_tools or forced)
        if told:
            conversation = with_system(conversation, tool_prompt(req.tools))
            fmt = "hermes"
    grammar = req.grammar
    required = forced or (req.strict_tools and bool(tools or fmt))  # what cannot be enforced is refused
    holds_calls = required or told
    if holds_calls:
        try:
            if speaks_harmony(chat_template) and tools:
                grammar, reasoning = harmony_grammar(req.callable_tools, forced), None  # (its own thoughts first)
            elif fmt is not None:
                grammar = call_grammar(fmt, req.callable_tools, forced, tokens) or grammar
        except GrammarError as e:
            if required:
                raise RequestError(400, f"tools: this server cannot enforce a call of these tools: {e}",
                                   "tools") from None
            holds_calls = False  # told under auto: its calls are parsed as a template's are, not held
    if grammar is not None and reasoning is not None:
        grammar = reasoning.constrain(grammar, tokens or {})
    messages = tuple(Message(m["role"], m["content"], tuple(m.get("tool_calls") or ()), m.get("tool_call_id"),
                             m.get("name")) for m in conversation)
    return Prepared(messages, tools, fmt, req.tool_names if fmt else frozenset(), grammar,
                    holds_calls and grammar is not None, told, calls_as_text)


def with_system(conversation: list[dict], text: str) -> list[dict]:
    """``conversation`` with ``text`` after its system prompt (or as one)."""
    if conversation and conversation[0]["role"] == "system":
        return [{**conversation[0], "content": conversation[0]["content"] + "\n\n" + text}, *conversation[1:]]
    return [{"role": "system", "content": text}, *conversation]


def context_first(conversation: list[dict]) -> list[dict]:
    """``conversation`` with each system message that follows a user message
    moved before it: Claude Code attaches its environment and reminders to the
    user's message as a system message after it, and a model answers the
    message it sees last (a small one continues the system text instead)."""
    out: list[dict] = []
    for m in conversation:
        at = len(out)
        if m["role"] == "system":
            while at > 0 and out[at - 1]["role"] == "user":
                at -= 1
        out.insert(at, m)
    return out
