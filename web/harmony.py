"""GPT-OSS's replies, in OpenAI's harmony format, read as text.

A reply is a run of messages. Each has a header, then ``<|message|>`` and
its content, and ends at ``<|end|>`` (the next one opens with
``<|start|>assistant``), ``<|call|>`` or ``<|return|>`` (these two end the
turn: end-of-turn tokens, which never reach the text). The header names the
channel (``<|channel|>analysis``) and may name a recipient (`` to=functions.get_weather``,
before or after the channel) and a content type (``<|constrain|>json``, or
``json``). As GPT-OSS's chat template (``chat_template.jinja``) and the
harmony spec define them:

* ``analysis``: reasoning -- clients get it apart, as with ``<think>``;
* ``final``: the answer;
* ``commentary`` to ``functions.NAME``: a call of tool NAME, its content the
  arguments (JSON); ``commentary`` to no one: a preamble, shown as text.

``openai-harmony`` reads the same tokens, but it downloads its vocabulary
on first use, which a machine without the internet cannot; the format is
small enough to read from the text, which mlx-lm's detokenizer gives with
the markers in it. A reply with no harmony header (a model that does not
follow it) is all text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

from semantic.actors import grammar
from semantic.runtime.text.json_reader import JSONError, read_json

from .schema import ToolCall
from .tool_grammar import arguments_rule
from .tools import new_call_id

__all__ = ["HARMONY", "Harmony", "HarmonySplitter", "call_grammar", "read_harmony", "speaks_harmony"]

HARMONY = "<|channel|>"  # what a harmony template (GPT-OSS's) holds
_MESSAGE = "<|message|>"
_ENDS = ("<|end|>", "<|call|>", "<|return|>", "<|start|>")  # what ends a message's content
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=<\||\s|$)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")
_JOIN = "\n\n"  # between two messages of one kind


def speaks_harmony(chat_template: str | None) -> bool:
    return bool(chat_template) and HARMONY in chat_template


class HarmonySplitter:
    """Splits a streamed reply into ``("thinking", ...)`` and ``("text", ...)``
    parts (``ReasoningSplitter``'s interface), holding back headers and any
    tail that could still be a marker; calls are kept in ``calls`` as
    ``(recipient, arguments text)``, never shown. Two messages of one kind
    are joined by a blank line."""

    def __init__(self):
        self.calls: list[tuple[str, str]] = []
        self.reasoned = False
        self._buf = ""
        self._first = True  # nothing read yet: a reply that does not open with a header is all text
        self._plain = False
        self._kind: str | None = None  # the message being read: "thinking", "text" or "call"; None: a header
        self._recipient = ""
        self._call = ""  # the call's arguments so far
        self._started = False  # the message has shown some of its content
        self._shown: set[str] = set()  # kinds of the messages shown so far

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._plain:
                out.append(("text", self._buf))
                self._buf = ""
            elif self._kind is None:
                if not self._header():
                    break
            else:
                ends = [i for i in (self._buf.find(e) for e in _ENDS) if i >= 0]
                if not ends:
                    keep = max(_partial_tail(self._buf, e) for e in _ENDS)
                    self._content(out, self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                end = min(ends)
                self._content(out, self._buf[:end])
                self._close()
                marker = next(e for e in _ENDS if self._buf.startswith(e, end))
                self._buf = self._buf[end + (0 if marker == "<|start|>" else len(marker)):]  # (a header's start)
        return out

    def end(self) -> list[tuple[str, str]]:
        """What was held back, once the reply is over."""
        out: list[tuple[str, str]] = []
        rest, self._buf = self._buf, ""
        if self._kind is not None:
            self._content(out, rest)
            self._close()
        elif rest.strip() and (self._first or "<|" not in rest):  # not a header after all
            out.append(("text", rest))
        return out

    def _header(self) -> bool:
        """Read a header up to ``<|message|>``; False: it is not all here yet."""
        head = self._buf.lstrip()
        if self._first and head and not any(head.startswith(m) or m.startswith(head) for m in ("<|", "to=")):
            self._plain = True
            return True
        at = self._buf.find(_MESSAGE)
        if at < 0:
            return False
        header, self._buf = self._buf[:at], self._buf[at + len(_MESSAGE):]
        self._first = False
        channel = m[1] if (m := _CHANNEL.search(header)) else "final"
        self._recipient = m[1] if (m := _RECIPIENT.search(header)) else ""
        if self._recipient and self._recipient != "assistant":
            self._kind = "call"
        else:
            self._kind = "thinking" if channel == "analysis" else "text"
            self.reasoned = self.reasoned or self._kind == "thinking"
        return True

    def _content(self, out: list[tuple[str, str]], text: str) -> None:
        if not text:
            return
        if self._kind == "call":
            self._call += text
            return
        if not self._started and self._kind in self._shown:
            text = _JOIN + text
        self._started = True
        self._shown.add(self._kind)
        out.append((self._kind, text))

    def _close(self) -> None:
        if self._kind == "call":
            self.calls.append((self._recipient, self._call))
        self._kind, self._recipient, self._call, self._started = None, "", "", False


def read_harmony(text: str) -> tuple[str | None, str, list[ToolCall]]:
    """(the reasoning, the text, the calls) of a whole reply; the reasoning is
    None when it has none. A call whose arguments are not a JSON object stays
    in the text, as its arguments."""
    splitter = HarmonySplitter()
    parts = splitter.feed(text) + splitter.end()
    thinking = "".join(t for kind, t in parts if kind == "thinking")
    answer = "".join(t for kind, t in parts if kind == "text")
    calls = []
    for recipient, arguments in splitter.calls:
        try:
            parsed = read_json(arguments) if arguments.strip() else {}
        except JSONError:
            parsed = None
        if isinstance(parsed, dict):
            calls.append(ToolCall(new_call_id(), recipient.removeprefix("functions."), parsed))
        else:
            answer += (_JOIN if answer else "") + arguments
    return (thinking if splitter.reasoned else None), answer, calls


def call_grammar(tools, forced: bool = True) -> str:
    """The grammar of a harmony reply that may reason first (``analysis``),
    then is one call of one of ``tools`` with arguments its schema accepts,
    as GPT-OSS writes one (``<|channel|>commentary to=functions.NAME
    <|constrain|>json<|message|>{...}``, which ends the turn with ``<|call|>``)
    -- or, not ``forced``, that or an answer (``final``). The markers are
    GPT-OSS's special tokens. Raises ``GrammarError``."""
    calls = " | ".join(json.dumps(f"commentary to=functions.{t['function']['name']} ") + ' <|constrain|> "json" '
                       '<|message|> ' + arguments_rule(t) for t in tools)
    reply = f"({calls})" if forced else f'("final" <|message|> /(?s:.*)/ | {calls})'
    return grammar.lark(f"start: think? <|channel|> {reply}\n{_THINK}")


_THINK = 'think: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"'  # a harmony thought


class Harmony:
    """How a harmony model's replies are read (``web.chat``): as ``ThinkTags`` for ``<think>``."""

    def splitter(self) -> HarmonySplitter:
        return HarmonySplitter()

    def read(self, text: str) -> tuple[str | None, str, list[ToolCall]]:
        return read_harmony(text)

    def constrain(self, answer: str, tokens: Mapping[str, int]) -> str:
        """The grammar of a reply that may reason first, then answers on the
        ``final`` channel as the grammar ``answer`` says (the markers are
        GPT-OSS's special tokens, named)."""
        return grammar.within(f'start: think? <|channel|> "final" <|message|> @answer\n{_THINK}', answer)


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    return next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)
