"""Reasoning in generated text: models that think out loud (Qwen3, DeepSeek-R1
distills, QwQ) write ``<think>...</think>`` before their answer. Clients get
it apart from the answer: Anthropic ``thinking`` blocks, OpenAI
``reasoning_content``, Responses ``reasoning`` items.

A reply reasons when it opens with ``<think>``, or, for a template whose
generation prompt already opened the tag (``opened``: DeepSeek-R1's, Qwen3
thinking-2507's), until its first ``</think>``.
"""

from __future__ import annotations

from collections.abc import Mapping

from semantic.actors import grammar

__all__ = ["OPEN", "CLOSE", "ReasoningSplitter", "ThinkTags", "answer_text", "split_reasoning"]

OPEN, CLOSE = "<think>", "</think>"


def split_reasoning(text: str, opened: bool = False) -> tuple[str | None, str]:
    """(the reasoning, the answer) of a whole reply; None when it did not reason."""
    splitter = ReasoningSplitter(opened)
    parts = splitter.feed(text) + splitter.end()
    thinking = "".join(t for kind, t in parts if kind == "thinking")
    return (thinking if splitter.reasoned else None), "".join(t for kind, t in parts if kind == "text")


class ThinkTags:
    """How a ``<think>`` model's replies are read (``web.chat``; ``web.harmony.Harmony`` for GPT-OSS's)."""

    def __init__(self, opened: bool):
        self.opened = opened

    def splitter(self) -> ReasoningSplitter:
        return ReasoningSplitter(self.opened)

    def read(self, text: str) -> tuple[str | None, str, list]:
        """(the reasoning, the answer, no calls: ``web.tools`` reads those)."""
        return (*split_reasoning(text, self.opened), [])

    def constrain(self, answer: str, tokens: Mapping[str, int]) -> str:
        """The grammar of a reply that may reason first (must, when the prompt
        opened the tag: then it closes it) and whose answer follows the grammar
        ``answer``. ``tokens``: the tokenizer's added tokens (Qwen3's tags are
        tokens of their own, which llguidance reads as special, never as text)."""
        if CLOSE in tokens:  # no text holds the token: the thought ends where it comes
            thought = f"thought: /(?s:.*)/ <[{tokens[CLOSE]}]>"
        else:
            thought = f'thought[stop="{CLOSE}"]: /(?s:.*)/'
        opening = f"<[{tokens[OPEN]}]>" if OPEN in tokens else f'"{OPEN}"'
        head = "thought /[ \\t\\n]*/" if self.opened else f"({opening} thought /[ \\t\\n]*/)?"
        return grammar.within(f"start: {head} @answer\n{thought}", answer)


def answer_text(text: str) -> str:
    """A stored reply as a client sends it back: its answer, without reasoning."""
    return text.rpartition(CLOSE)[2].lstrip() if CLOSE in text else text


class ReasoningSplitter:
    """Splits streamed text into ``("thinking", ...)`` and ``("text", ...)``
    parts, holding back a tail that could still grow into a tag."""

    def __init__(self, opened: bool = False):
        self.opened = opened  # the prompt opened the tag: the reply starts inside it
        self.reasoned = opened
        self._state = "thinking" if opened else "start"
        self._buf = ""

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if head.startswith(OPEN):
                    self._state, self._buf, self.reasoned = "thinking", head[len(OPEN):], True
                elif OPEN.startswith(head):
                    break  # (whitespace and) a prefix of the tag: wait
                else:
                    self._state = "text"
            elif self._state == "thinking":
                end = self._buf.find(CLOSE)
                if end < 0:
                    keep = _partial_tail(self._buf, CLOSE)
                    if len(self._buf) > keep:
                        out.append(("thinking", self._buf[:len(self._buf) - keep]))
                        self._buf = self._buf[len(self._buf) - keep:]
                    break
                if end:
                    out.append(("thinking", self._buf[:end]))
                self._state, self._buf = "after", self._buf[end + len(CLOSE):]
            elif self._state == "after":  # the blank lines between the reasoning and the answer
                self._buf = self._buf.lstrip()
                if self._buf:
                    self._state = "text"
            else:
                out.append(("text", self._buf))
                self._buf = ""
        return [(kind, t) for kind, t in out if t]

    def end(self) -> list[tuple[str, str]]:
        """What was held back, once the reply is over."""
        rest, self._buf = self._buf, ""
        if not rest or self._state == "after":
            return []
        return [("thinking" if self._state == "thinking" else "text", rest)]


def _partial_tail(text: str, tag: str) -> int:
    """How many characters at the end of ``text`` could start ``tag``."""
    return next((k for k in range(len(tag) - 1, 0, -1) if text.endswith(tag[:k])), 0)
