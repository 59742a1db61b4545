"""Constrained decoding: a grammar a sequence's reply must follow, compiled
and matched by llguidance (the library llama.cpp and vLLM use).

A grammar is llguidance's text (its JSON form, or Lark): ``json_schema``
makes one from a JSON schema, ``JSON_OBJECT`` allows any JSON object, and
``lark`` one from llguidance's Lark, where ``json_rule`` embeds a schema;
``within`` puts a grammar inside another (after a model's reasoning).
``check`` refuses what llguidance cannot compile, naming it (unsupported
schema keywords, bad types), without a tokenizer, so a request is refused
before it queues. A schema's objects are closed unless it says otherwise,
and its numbers are those a float64 holds (``runtime.text.json_grammar``).

``Grammars`` belongs to one engine: the tokenizer as llguidance reads it
(built on first use, ~0.3 s; it also gives a token's exact bytes, for
log-probabilities) and the last ``CACHED`` grammars compiled against it;
``constraint`` gives each sequence its own matcher. A ``Constraint`` says
which tokens may come next (``allowed``: a mask over the logits row, which
is that sequence's alone, so batch invariance holds) and follows the tokens
taken (``advance``). The end-of-turn tokens are allowed
exactly where the grammar may end, and are the only ones allowed where it
must: a finite grammar ends the reply by construction.

Given the reply's ``max_tokens``, a ``Constraint`` also closes the grammar
within it: it keeps a closing (``runtime.text.closing``: tokens that complete
the grammar from here, found without the model), allows only the
closing's next token once the tokens left are no more than it, and takes
that token instead of a draw that would leave too few (``fit``); so a reply
the limit cuts is still a document its grammar accepts.
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from .closing import Closer
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
    a float64 holds (``runtime.text.json_grammar``); raises ``GrammarError``
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
    """One sequence's matcher: the tokens it may take next, and those it took.

    With a ``limit`` (the reply's ``max_tokens``) it also keeps a closing:
    tokens that complete the grammar from here (``runtime.text.closing``, found
    without the model), and keeps the reply within reach of its end: where
    the tokens left are no more than the closing's, only the closing's next
    token is allowed; and a token drawn that would leave too few to close
    (it opens what cannot end in time) is refused by ``fit`` for the
    closing's next token. So a reply the limit cuts is one the grammar
    accepts -- unless the limit is shorter than the grammar's smallest
    document, or no closing was found (``Closer.close``; from there the
    reply is cut as it comes)."""

    def __init__(self, matcher: LLMatcher, vocab: int, ends: Iterable[int], limit: int | None = None,
                 closer: Closer | None = None, literals: tuple[tuple[int, ...], ...] = (),
                 closing: list[int] | None = None):
        self._matcher = matcher
        self._vocab = vocab
        self._ends = tuple(ends)
        self._words = np.zeros((vocab + 31) // 32, np.int32)
        self._limit = limit  # tokens the reply may still take
        self._closer = closer
        self._literals = literals  # the grammar's, for ``Closer.close``
        self._closing = closing if limit is not None and closer is not None else None  # None: none kept
        self._after: tuple[int, list[int] | None] | None = None  # a token ``fit`` saw, and the closing after it

    @property
    def closing(self) -> tuple[int, ...] | None:
        """The tokens kept to complete the grammar from here (None: no limit, or none found)."""
        return None if self._closing is None else tuple(self._closing)

    def allowed(self, size: int) -> mx.array:
        """A (size,) bool mask over a logits row: the tokens the grammar allows
        next -- only the closing's next where the limit leaves no more room."""
        if self._closing and self._limit <= len(self._closing):
            bits = np.zeros(max(size, self._vocab), bool)
            bits[self._closing[0]] = True
            return mx.array(bits[:size])
        return self._grammar_mask(self._matcher, size)

    def _grammar_mask(self, matcher: LLMatcher, size: int) -> mx.array:
        if matcher.is_error():  # cannot happen to a token it allowed; end the turn rather than guess
            bits = np.zeros(self._vocab, bool)
            bits[list(self._ends)] = True
        else:
            matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
            bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")[: self._vocab].astype(bool)
        if size > self._vocab:  # the model's rows may be padded past the tokenizer's ids
            bits = np.concatenate([bits, np.zeros(size - self._vocab, bool)])
        return mx.array(bits[:size])

    def fit(self, token: int) -> int | None:
        """The token to take for a draw of ``token``: itself, unless it would
        leave too few tokens to close the grammar within the limit; then the
        closing's next (None: the grammar is complete here; end the reply)."""
        if self._closing is None or token in self._ends:
            return token
        after = self._closing_after(token)
        if after is None or len(after) < self._limit:
            return token
        return self._closing[0] if self._closing else None

    def advance(self, token: int) -> None:
        """Take ``token`` (what ``fit`` gave, where a limit is kept)."""
        if self._closing is not None and token not in self._ends:
            self._closing = self._closing_after(token)
            self._limit -= 1
        self._after = None
        self._matcher.consume_token(token)

    def _closing_after(self, token: int) -> list[int] | None:
        """A closing after ``token``: the rest of this one where the token is
        its next; where it holds, the rest after the bytes the token wrote of
        it, or this one still (``_closings_kept``); else a new one (None: none
        found)."""
        if self._after is not None and self._after[0] == token:
            return self._after[1]
        closing = self._closing
        if closing and token == closing[0]:
            after = closing[1:]
        else:
            matcher = self._matcher.deep_copy()
            if not matcher.consume_token(token):
                after = None
            else:
                after = next((c for c in self._closings_kept(token, closing) if _closes(matcher, c)), None)
                if after is None:
                    after = self._closer.close(matcher, self._literals)
        self._after = (token, after)
        return after

    def _closings_kept(self, token: int, closing: list[int]):
        """The closings that may still hold after ``token``, from the one before
        it: where the token's text ends with the closing's first bytes (all of
        them: ``", "`` of ``", ""]}``; the last: the ``"`` of ``."``), the rest
        of the closing; else all of it (the token was content: a string's next word)."""
        plain = next((i for i, t in enumerate(closing) if self._closer.is_special(t)), len(closing))
        head, piece = self._closer.text(closing[:plain]), self._closer.text([token])
        if piece and not self._closer.is_special(token):
            for start in range(len(piece)):
                if head.startswith(piece[start:]):
                    yield self._closer.tokens(head[len(piece) - start:]) + closing[plain:]
        yield closing

    def allows(self, drafts: list[int]) -> int:
        """How many of ``drafts`` the grammar allows in a row from here (up to
        an end-of-turn token, which ends a reply rather than drafting one; and
        short of where the limit would leave no more room than the closing)."""
        n = self._matcher.validate_tokens(drafts)
        if self._closing is not None:
            n = min(n, max(0, self._limit - len(self._closing) - 1))
        return next((i for i, t in enumerate(drafts[:n]) if t in self._ends), n)

    def masks(self, drafts: list[int], size: int) -> list[mx.array]:
        """``allowed`` here and after each of ``drafts`` (which it ``allows``):
        the masks of a decode step's slots that verify them; the matcher is
        left where it was."""
        out = [self.allowed(size)]
        if drafts:
            ahead = self._matcher.deep_copy()  # (not a rollback: llguidance cannot roll back past a stop= lexeme)
            for token in drafts:
                ahead.consume_token(token)
                out.append(self._grammar_mask(ahead, size))
        return out


def _closes(matcher: LLMatcher, closing: list[int]) -> bool:
    """Whether ``closing`` completes ``matcher``'s grammar (the matcher is not changed)."""
    check = matcher.deep_copy()
    return check.consume_tokens(closing) and check.is_accepting()


class Grammars:
    """The grammars of one tokenizer (an mlx-lm ``TokenizerWrapper``), compiled once each."""

    def __init__(self, tokenizer, ends: Iterable[int]):
        self._tokenizer = tokenizer
        self._ends = sorted(ends)
        self._ll: LLTokenizer | None = None
        self._closer: Closer | None = None
        self._compiled: OrderedDict[str, _Compiled] = OrderedDict()

    def constraint(self, grammar: str, limit: int | None = None) -> Constraint:
        """A fresh matcher of ``grammar`` (compiled on first use), keeping the
        reply closable within ``limit`` tokens if given (``Constraint``);
        raises ``GrammarError``."""
        ll = self._llguidance()
        compiled = self._compiled.pop(grammar, None)
        if compiled is None:
            matcher = LLMatcher(ll, grammar, log_level=0)
            if matcher.is_error():
                raise GrammarError(matcher.get_error())
            compiled = _Compiled(matcher)
        self._compiled[grammar] = compiled
        while len(self._compiled) > CACHED:
            self._compiled.popitem(last=False)
        if limit is None:
            return Constraint(compiled.matcher.deep_copy(), ll.vocab_size, self._ends)
        if compiled.literals is None:  # (found once: the smallest document's closing, from the start)
            closer = self._get_closer()
            compiled.literals = closer.literals(grammar)
            compiled.closing = closer.close(compiled.matcher, compiled.literals)
        return Constraint(compiled.matcher.deep_copy(), ll.vocab_size, self._ends, limit, self._get_closer(),
                          compiled.literals, compiled.closing and list(compiled.closing))

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (a UTF-8 character may span tokens); for a
        tokenizer llguidance cannot read (not a fast one), its decoded text's."""
        try:
            return self._llguidance().decode_bytes([token])
        except ValueError:
            return self._tokenizer.decode([token]).encode()

    def _get_closer(self) -> Closer:
        if self._closer is None:
            self._closer = Closer(self._llguidance(), self._ends)
        return self._closer

    def _llguidance(self) -> LLTokenizer:
        if self._ll is None:
            import llguidance.hf

            self._ll = llguidance.hf.from_tokenizer(getattr(self._tokenizer, "_tokenizer", self._tokenizer),
                                                    eos_token=self._ends)
        return self._ll


@dataclass(eq=False)
class _Compiled:
    """A grammar compiled: its matcher at the start and, once a limit asked, its literals and closing there."""

    matcher: LLMatcher
    literals: tuple[tuple[int, ...], ...] | None = None
    closing: list[int] | None = None
