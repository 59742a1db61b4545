"""Constrained decoding: a grammar a sequence's reply must follow, compiled
and matched by llguidance (the library llama.cpp and vLLM use).

A grammar is llguidance's text (its JSON form, or Lark): ``json_schema``
makes one from a JSON schema, ``JSON_OBJECT`` allows any JSON object, and
``lark`` one from llguidance's Lark, where ``json_rule`` embeds a schema;
``within`` puts a grammar inside another (after a model's reasoning).
``check`` refuses what llguidance cannot compile, naming it (unsupported
schema keywords, bad types), without a tokenizer, so a request is refused
before it queues. A schema's objects are closed unless it says otherwise,
and its numbers are those a float64 holds (``runtime.json_grammar``).

``Grammars`` belongs to one engine: the tokenizer as llguidance reads it
(built on first use, ~0.3 s; it also gives a token's exact bytes, for
log-probabilities) and the last ``CACHED`` grammars compiled against it;
``constraint`` gives each sequence its own matcher. A ``Constraint`` says
which tokens may come next (``allowed``: a mask over the logits row, which
is that sequence's alone, so batch invariance holds) and follows the tokens
taken (``advance``). The end-of-turn tokens are allowed
exactly where the grammar may end, and are the only ones allowed where it
must: a finite grammar ends the reply by construction.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from .json_grammar import LAYOUT, json_lark, strict

__all__ = ["CACHED", "Constraint", "GrammarError", "Grammars", "JSON_OBJECT", "check", "json_rule", "json_schema",
           "lark", "within"]

CACHED = 32  # compiled grammars kept per engine (a compile can take 0.1-1 s for a large schema)
_log = logging.getLogger(__name__)


class GrammarError(ValueError):
    """A grammar (or schema) llguidance cannot compile; the message says why."""


def check(grammar: str) -> None:
    """Raise ``GrammarError`` if ``grammar`` does not compile."""
    if error := LLMatcher.validate_grammar(grammar):
        raise GrammarError(error)


def json_schema(schema: Mapping) -> str:
    """The grammar of the JSON documents ``schema`` allows, laid out as
    Python's ``json.dumps`` does (``", "`` and ``": "``, no other whitespace:
    free whitespace would let a model pad forever), its objects closed where
    it lists their properties and says nothing of others, its numbers those
    a float64 holds (``runtime.json_grammar``); raises ``GrammarError``
    naming what is unsupported."""
    schema = _checked(schema)
    text = _written(schema)
    if text is None:
        return LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=LAYOUT)
    return LLMatcher.grammar_from_lark(text)


def json_rule(schema: Mapping) -> str:
    """A Lark rule's body matching what ``json_schema(schema)`` allows; raises ``GrammarError``."""
    schema = _checked(schema)
    text = _written(schema)
    if text is None:
        return "%json " + json.dumps({**schema, "x-guidance": LAYOUT})
    return "%lark {\n" + text + "\n}"


def _checked(schema: Mapping):
    """``schema`` closed (``json_grammar.strict``), once llguidance has said it can enforce it."""
    if not isinstance(schema, Mapping):
        raise GrammarError(f"a JSON schema is an object, not {type(schema).__name__}")
    schema = strict(dict(schema))
    try:
        check(LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=LAYOUT))
    except (TypeError, ValueError) as e:
        raise GrammarError(str(e)) from None
    return schema


def _written(schema) -> str | None:
    """``schema`` (checked) as Lark, or None where llguidance holds it whole, its numbers unbounded."""
    text = json_lark(schema)
    if text is not None and (error := LLMatcher.validate_grammar(text)):  # json_grammar's bug, not the client's
        _log.warning("a JSON schema's Lark does not compile, llguidance holds the schema alone: %s", error)
        return None
    return text


def lark(text: str) -> str:
    """The grammar of a Lark ``text`` (llguidance's dialect); raises ``GrammarError``."""
    grammar = LLMatcher.grammar_from_lark(text)
    check(grammar)
    return grammar


JSON_OBJECT = json_schema({"type": "object"})


def within(text: str, grammar: str) -> str:
    """``grammar`` inside the Lark ``text``, which names it ``@answer`` (a
    reasoning model's thoughts, then its constrained answer); raises ``GrammarError``."""
    try:
        inner = json.loads(grammar)["grammars"]  # llguidance's JSON form
    except (ValueError, KeyError, TypeError):
        inner = [{"lark_grammar": grammar}]
    whole = json.dumps({"grammars": [{"lark_grammar": text}, {**inner[0], "name": "answer"}, *inner[1:]]})
    check(whole)
    return whole


class Constraint:
    """One sequence's matcher: the tokens it may take next, and those it took."""

    def __init__(self, matcher: LLMatcher, vocab: int, ends: Iterable[int]):
        self._matcher = matcher
        self._vocab = vocab
        self._ends = tuple(ends)
        self._words = np.zeros((vocab + 31) // 32, np.int32)

    def allowed(self, size: int) -> mx.array:
        """A (size,) bool mask over a logits row: the tokens the grammar allows next."""
        if self._matcher.is_error():  # cannot happen to a token it allowed; end the turn rather than guess
            bits = np.zeros(self._vocab, bool)
            bits[list(self._ends)] = True
        else:
            self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        if size > self._vocab:  # the model's rows may be padded past the tokenizer's ids
            bits = np.concatenate([bits, np.zeros(size - self._vocab, bool)])
        return mx.array(bits[:size])

    def advance(self, token: int) -> None:
        self._matcher.consume_token(token)

    def allows(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row from here (up to
        an end-of-turn token, which ends a reply rather than drafting one)."""
        n = self._matcher.validate_tokens(drafts)
        return next((i for i, t in enumerate(drafts[:n]) if t in self._ends), n)

    def masks(self, drafts: list[int], size: int) -> list[mx.array]:
        """``allowed`` here and after each of ``drafts`` (which it ``allows``):
        the masks of a decode step's slots that verify them; the matcher is
        left where it was."""
        out = [self.allowed(size)]
        for token in drafts:
            self._matcher.consume_token(token)
            out.append(self.allowed(size))
        if drafts:
            self._matcher.rollback(len(drafts))
        return out


class Grammars:
    """The grammars of one tokenizer (an mlx-lm ``TokenizerWrapper``), compiled once each."""

    def __init__(self, tokenizer, ends: Iterable[int]):
        self._tokenizer = tokenizer
        self._ends = sorted(ends)
        self._ll: LLTokenizer | None = None
        self._compiled: OrderedDict[str, LLMatcher] = OrderedDict()

    def constraint(self, grammar: str) -> Constraint:
        """A fresh matcher of ``grammar`` (compiled on first use); raises ``GrammarError``."""
        ll = self._llguidance()
        matcher = self._compiled.pop(grammar, None)
        if matcher is None:
            matcher = LLMatcher(ll, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
        self._compiled[grammar] = matcher
        while len(self._compiled) > CACHED:
            self._compiled.popitem(last=False)
        return Constraint(matcher.deep_copy(), ll.vocab_size, self._ends)

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (a UTF-8 character may span tokens); for a
        tokenizer llguidance cannot read (not a fast one), its decoded text's."""
        try:
            return self._llguidance().decode_bytes([token])
        except ValueError:
            return self._tokenizer.decode([token]).encode()

    def _llguidance(self) -> LLTokenizer:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(getattr(self._tokenizer, "_tokenizer", self._tokenizer),
                                                    eos_token=self._ends)
        return self._ll
