"""Prefix reuse: how much of an agent's stored cache a new prompt can keep.

The match is on text, then mapped to tokens.  A cache covers token ids
``tokens`` whose text is ``text`` (the rendered prompt plus the reply as the
model generated it).  A new prompt is rendered to text by the chat template:

* EXACT    the same text: keep every cached token (the engine re-feeds the last);
* EXTEND   the new text starts with the cached text: keep every cached token
           and tokenize only the new suffix;
* DIVERGE  they share a prefix: keep the longest run of cached tokens whose
           text is a prefix of the new text, if it is at least ``min_share``
           of the cache and the cache can be cut back that far (else back to
           its checkpoint, if that is within the shared part), and tokenize
           the rest;
* COLD     nothing worth keeping: tokenize the whole prompt.

Why text and not token ids: BPE is not compositional, and the chat template
re-renders the last reply as text, so re-tokenizing the conversation can give
different ids for text the cache already holds (a reply the model produced as
"Par" + "is" re-encodes as "Paris").  Matching text keeps the ids the model
actually saw and prefills only the new turn.  The price: a cached turn feeds
the model the ids it generated, where a cold run would feed the canonical
tokenization of the same text -- measured in ``docs/architecture.md``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["COLD", "DIVERGE", "EXACT", "EXTEND", "PrefixPlan", "plan"]

COLD, EXACT, EXTEND, DIVERGE = "cold", "exact", "extend", "diverge"


@dataclass(frozen=True)
class PrefixPlan:
    kind: str  # COLD, EXACT, EXTEND or DIVERGE
    keep: int  # cached tokens to keep (trim the cache to this many)
    prompt: list[int]  # the whole prompt's ids: tokens[:keep] + the new suffix's

    @property
    def suffix(self) -> list[int]:
        return self.prompt[self.keep:]


def encode(tokenizer, text: str) -> list[int]:
    """Ids of ``text`` as a continuation (the template carries its own BOS)."""
    return list(tokenizer.encode(text, add_special_tokens=False)) if text else []


def plan(
    tokenizer,
    new_text: str,
    tokens: list[int] | None = None,
    text: str = "",
    min_share: float = 0.5,
    trimmable: int | None = None,
    checkpoints: Sequence[int] = (),
) -> PrefixPlan:
    """Decide how a prompt ``new_text`` reuses a cache of ``tokens`` covering ``text``.

    ``trimmable``: how many tokens the cache can drop from its end (None: all;
    a sliding-window layer keeps only a few hundred beyond its window, a
    recurrent state none). EXACT drops one, DIVERGE what follows the shared
    part. ``checkpoints``: points the cache can go back to besides (a
    recurrent state's: where its last turn started, where its prompt ended).
    """
    trimmable = len(tokens or ()) if trimmable is None else trimmable
    if not tokens:
        return PrefixPlan(COLD, 0, encode(tokenizer, new_text))
    if new_text == text:
        if trimmable >= 1:  # the engine trims one token to get fresh logits
            return PrefixPlan(EXACT, len(tokens), list(tokens))
        back = max((at for at in checkpoints if at < len(tokens)), default=0)
        if back >= max(1, min_share * len(tokens)):
            return PrefixPlan(DIVERGE, back, list(tokens))
        return PrefixPlan(COLD, 0, encode(tokenizer, new_text))
    if new_text.startswith(text):
        return PrefixPlan(EXTEND, len(tokens), list(tokens) + encode(tokenizer, new_text[len(text):]))
    keep = _tokens_within(tokenizer, tokens, new_text)
    if keep < len(tokens) - trimmable:  # it cannot be cut back there: back to a checkpoint before, if any
        keep = max((at for at in checkpoints if at <= keep), default=0)
    if keep >= max(1, min_share * len(tokens)):
        kept_text = tokenizer.decode(tokens[:keep])
        return PrefixPlan(DIVERGE, keep, list(tokens[:keep]) + encode(tokenizer, new_text[len(kept_text):]))
    return PrefixPlan(COLD, 0, encode(tokenizer, new_text))


def _tokens_within(tokenizer, tokens: list[int], new_text: str) -> int:
    """The largest k whose decoded ``tokens[:k]`` is a prefix of ``new_text``.

    Binary search: a prefix of a prefix is a prefix (a k that splits a
    multi-byte character decodes to U+FFFD, which fails the test, so the
    search lands on a character boundary).
    """
    lo, hi = 0, len(tokens)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if new_text.startswith(tokenizer.decode(tokens[:mid])):
            lo = mid
        else:
            hi = mid - 1
    return lo
