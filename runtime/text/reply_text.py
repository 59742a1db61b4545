"""A reply's text as it streams: its tokens detokenized one at a time, its
stop strings found, and what may be shown now -- all of it but an end that
could still begin a stop string."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["ReplyText", "reply_detokenizer"]


def reply_detokenizer(tokenizer, continues: bool):
    """A fresh streaming detokenizer for a reply. mlx-lm's drop the space that
    begins a text (its first token's " The" is "The"), as a chat reply wants;
    one whose text ``continues`` the prompt's is first given the text "a",
    left out, so nothing begins there (one that holds "a" back is left as it
    is)."""
    detokenizer = tokenizer.detokenizer
    if continues:
        for token in tokenizer.encode("a", add_special_tokens=False):
            detokenizer.add_token(token)
        if detokenizer.last_segment != "a":
            detokenizer.reset()
    return detokenizer


class ReplyText:
    def __init__(self, detokenizer, stops: Sequence[str] = ()):
        self.detokenizer = detokenizer  # a streaming detokenizer (mlx-lm's), fresh
        self.stops = tuple(stops)
        self.text = ""  # all generated text so far, cut before a stop string once one is found
        self.shown = 0  # length of ``text`` already handed out
        self.stop: str | None = None  # the stop string found in ``text``

    def add(self, token: int) -> None:
        self.detokenizer.add_token(token)
        self.text += self.detokenizer.last_segment

    def finish(self) -> None:
        """The reply ends: what the detokenizer held back joins the text."""
        self.detokenizer.finalize()
        self.text += self.detokenizer.last_segment

    def release(self, final: bool) -> tuple[str, bool]:
        """Text that may be shown now, and whether a stop string ended the reply
        (the text is cut before it). Until ``final`` an end of the text that
        could begin a stop string is held back."""
        start = max(0, self.shown - max((len(s) for s in self.stops), default=0))
        hits = [(i, s) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            at, self.stop = min(hits)
            self.text = self.text[:at]
            end, hit = len(self.text), True
        else:
            hold = 0 if final else max((_overlap(self.text, s) for s in self.stops), default=0)
            end, hit = len(self.text) - hold, False
        text = self.text[self.shown : end]
        self.shown = max(self.shown, end)
        return text, hit


def _overlap(text: str, stop: str) -> int:
    """Length of the longest end of ``text`` that begins ``stop``."""
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
