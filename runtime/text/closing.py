"""How to finish what a grammar has begun, without the model: the tokens
that bring an llguidance matcher from where it is to where its grammar is
complete (``runtime.text.grammar`` forces them when a reply's ``max_tokens``
would otherwise cut it open).

``Closer.close`` walks a copy of the matcher. At each step it takes the
bytes llguidance forces, if any; else the first move that progresses -- a
special token the grammar allows (an end marker), one of a few single bytes
in ``ORDER`` (what closes JSON first: ``}``, ``]``, ``0``, ``"`` ...), or a
literal of the grammar's own text (``</think>``, ``\\n</parameter>\\n``: what
ends free text). A move progresses when after it the grammar is complete,
or allows a token it did not, or at most half the tokens it did: closing a
string does, one more character of it does not (it only drops tokens too
long for a bound). Where nothing progresses the first allowed move is taken
(a string that must be longer). Then a best-first search over every move
that progresses at each step looks for a completion of fewer bytes than the
walk's (at a choice: an optional member left out, the smaller value), for
``SEARCHED`` states at most, where the walk chose at most half as many
moves.

Every move is one the matcher allowed, so what ``close`` returns completes
any grammar by construction; its bytes are retokenized as the tokenizer
writes them (checked again). It is short, not always the shortest: for the
JSON this server writes it is the strings closed, the containers closed and
each required member's smallest value (``0``, ``""``, ``[]``, the first
``enum`` value), as the tests check; a grammar whose progress needs a move
the walk does not try may be finished the long way, or not within
``MOVES`` steps (None). Steps are counted, never timed, so ranks that walk
the same grammar agree.
"""

from __future__ import annotations

import heapq
import json
import re

import numpy as np
from llguidance import LLMatcher, LLTokenizer

__all__ = ["Closer", "MOVES", "grammar_literals"]

MOVES = 512  # steps of one walk before it gives up
SEARCHED = 64  # states a search for a shorter closing expands
PROBES = 8  # single bytes tried for progress at one step (a mask each)
LITERALS = 64  # a grammar's literals kept as moves
# Bytes in the order they are tried: what closes JSON, its smallest values, separators, markup, letters.
_FIRST = b'}]0"' + b",: \n123456789-.eE+ntf{[<>/" + bytes(range(97, 123)) + bytes(range(65, 91))
ORDER = _FIRST + bytes(b for b in range(256) if b not in _FIRST)
_FILL = b"a0A_ -"  # what lengthens a string or a name that must be longer, first

_QUOTED = re.compile(r'"((?:[^"\\\n]|\\.)*)"')  # a Lark string literal
_REGEX = re.compile(r"/((?:[^/\\\n]|\\.)+)/")  # a Lark regular expression
_REGEX_META = set("()[]{}*+?|.^$&~")


def grammar_literals(grammar: str) -> tuple[bytes, ...]:
    """The literal texts of ``grammar`` (llguidance's JSON form, or Lark):
    its quoted strings (``stop=`` values among them) and the literal runs in
    its regular expressions, 2-64 bytes each, markup first, at most ``LITERALS``."""
    try:
        parts = json.loads(grammar)["grammars"]
        texts = [p.get("lark_grammar") or json.dumps(p.get("json_schema", "")) for p in parts]
    except (ValueError, KeyError, TypeError, AttributeError):
        texts = [grammar]
    found: list[str] = []
    for text in texts:
        for quoted in _QUOTED.findall(text):
            try:
                found.append(json.loads(f'"{quoted}"'))
            except ValueError:
                pass
        for body in _REGEX.findall(text):
            found += _literal_runs(body)
    literals = dict.fromkeys(f.encode() for f in found if 2 <= len(f.encode()) <= 64)
    return tuple(sorted(literals, key=lambda lit: lit.isalnum()))[:LITERALS]  # (stable: markup first)


def _fill_rank(piece: bytes) -> int:
    """Where a byte comes among the ones that lengthen a string best (``_FILL``; others after)."""
    at = _FILL.find(piece)
    return len(_FILL) if at < 0 else at


def _literal_runs(regex: str) -> list[str]:
    """The runs of literal characters in a regular expression's text."""
    runs, run, i = [], "", 0
    while i < len(regex):
        ch = regex[i]
        if ch == "\\" and i + 1 < len(regex):
            escaped = regex[i + 1]
            literal = {"n": "\n", "t": "\t", "r": "\r"}.get(escaped, None if escaped.isalnum() else escaped)
            if literal is None:  # a class (\d, \w ...): the run ends
                runs.append(run)
                run = ""
            else:
                run += literal
            i += 2
            continue
        if ch in _REGEX_META:
            runs.append(run)
            run = ""
        else:
            run += ch
        i += 1
    return [*runs, run]


class Closer:
    """Completions of grammars over one tokenizer (as llguidance reads it)."""

    def __init__(self, tokenizer: LLTokenizer, ends):
        self._tokenizer = tokenizer
        ends = set(ends)
        single: dict[int, int] = {}
        specials = []
        for token in range(tokenizer.vocab_size):
            if tokenizer.is_special_token(token):
                if token not in ends:
                    specials.append(token)
                continue
            piece = tokenizer.decode_bytes([token])
            if len(piece) == 1:
                single.setdefault(piece[0], token)
        self._bytes = np.array([single[b] for b in ORDER if b in single], np.int64)  # single-byte tokens, in ORDER
        self._specials = np.array(specials, np.int64)
        self._special_set = set(specials)
        self._words = np.zeros((tokenizer.vocab_size + 31) // 32, np.uint32)

    def is_special(self, token: int) -> bool:
        return token in self._special_set

    def text(self, tokens: list[int]) -> bytes:
        """The bytes ``tokens`` write (not special ones)."""
        return self._tokenizer.decode_bytes(tokens)

    def tokens(self, text: bytes) -> list[int]:
        """``text`` as the tokenizer writes it."""
        return self._tokenizer.tokenize_bytes(text) if text else []

    def literals(self, grammar: str) -> tuple[tuple[int, ...], ...]:
        """``grammar_literals(grammar)`` as moves: each literal's tokens."""
        return tuple(m for m in (tuple(self._tokenizer.tokenize_bytes(lit)) for lit in grammar_literals(grammar)) if m)

    def close(self, matcher: LLMatcher, literals: tuple[tuple[int, ...], ...] = ()) -> list[int] | None:
        """Tokens after which ``matcher``'s grammar is complete ([] where it is
        now), found as the module docstring says (``literals``: the grammar's,
        as ``literals`` gives them); None where none was found within
        ``MOVES`` steps. ``matcher`` is not changed."""
        walk = self._walk(matcher, literals)
        if walk is None:
            return None
        moves, chosen = walk
        # (a search tries no literal, which is what ends free text; and one state a choice, it seldom
        # ends a long walk within SEARCHED)
        if chosen <= SEARCHED // 2 and not any(tuple(m) in literals for m in moves):
            moves = self._search(matcher, sum(len(self.text(m)) for m in moves)) or moves
        return self._written(matcher, moves)

    def _walk(self, matcher: LLMatcher, literals) -> tuple[list[list[int]], int] | None:
        """The moves of a greedy walk to the end (at each step the first that
        progresses), and how many were chosen (not forced)."""
        walk, moves, chosen = matcher.deep_copy(), [], 0
        for _ in range(MOVES):
            if walk.is_accepting():
                return moves, chosen
            step = self._forced(walk)
            if step is None:
                step = next(self._progress(walk, self._mask(walk), literals), None) or self._first(walk)
                chosen += 1
            if step is None:
                return None
            move, walk = step
            moves.append(move)
        return None

    def _search(self, matcher: LLMatcher, bound: int) -> list[list[int]] | None:
        """The moves of the fewest bytes to the end, under ``bound``: best first
        over every move that progresses at each step (literals aside: free
        text's end is the walk's), at most ``SEARCHED`` states expanded; None
        where none is found shorter."""
        frontier = [(0, 0, [], matcher.deep_copy())]
        pushed = 1
        for _ in range(SEARCHED):
            if not frontier:
                return None
            cost, _, moves, state = heapq.heappop(frontier)
            if state.is_accepting():
                return moves
            step = self._forced(state)
            if step is not None:
                steps = [step]
            else:
                steps = list(self._progress(state, self._mask(state), ())) or [s for s in [self._first(state)] if s]
            for move, after in steps:
                more = cost + len(self.text(move))
                if more < bound:
                    heapq.heappush(frontier, (more, pushed, [*moves, move], after))
                    pushed += 1
        return None

    def _forced(self, state: LLMatcher) -> tuple[list[int], LLMatcher] | None:
        """The bytes llguidance forces from ``state`` as one move, and the matcher after it; None: none forced."""
        forced = state.compute_ff_bytes()
        if not forced:
            return None
        move, after = self._tokenizer.tokenize_bytes(forced), state.deep_copy()
        return (move, after) if after.consume_tokens(move) else None

    def _progress(self, state: LLMatcher, mask: np.ndarray, literals):
        """Each move from ``state`` (whose ``mask`` was computed last) that
        progresses, with the matcher after it, in the order they are tried:
        after it the grammar is complete, or allows a token it did not, or
        allows at most half the tokens it did (a string closed: not one
        more character of it, which drops only tokens too long for a bound)."""
        allowed = int(np.bitwise_count(mask).sum())
        for move in [*self._tried(), *(list(m) for m in literals)]:
            if len(move) > 1 and state.validate_tokens(move) < len(move):
                continue
            after = state.deep_copy()  # (not a rollback: llguidance cannot roll back past a stop= lexeme)
            if not after.consume_tokens(move):
                continue
            if after.is_accepting():
                yield move, after
                continue
            now = self._mask(after)
            if (now & ~mask).any() or 2 * int(np.bitwise_count(now).sum()) <= allowed:
                yield move, after

    def _tried(self) -> list[list[int]]:
        """The single moves tried from the state whose mask was computed last:
        the special tokens it allows, then up to ``PROBES`` bytes in ``ORDER``."""
        return [[t] for t in self._allowed(self._specials)] + [[t] for t in self._allowed(self._bytes)[:PROBES]]

    def _first(self, state: LLMatcher) -> tuple[list[int], LLMatcher] | None:
        """Where no move progresses (a string that must be longer): a special
        token, else the byte that fills best (``_FILL`` first); and the matcher after it."""
        self._mask(state)
        single = sorted(self._allowed(self._bytes), key=lambda t: _fill_rank(self.text([t])))
        first = next(iter(self._allowed(self._specials) + single), None)
        if first is None:
            return None
        after = state.deep_copy()
        return ([first], after) if after.consume_token(first) else None

    def _written(self, matcher: LLMatcher, moves: list[list[int]]) -> list[int]:
        """The moves' tokens, their bytes retokenized as the tokenizer writes
        them where the matcher takes that (checked), else as they were."""
        taken = [t for move in moves for t in move]
        written: list[int] = []
        run = b""
        for token in taken:
            if token in self._special_set:
                written += [*self._tokenizer.tokenize_bytes(run), token] if run else [token]
                run = b""
            else:
                run += self._tokenizer.decode_bytes([token])
        if run:
            written += self._tokenizer.tokenize_bytes(run)
        check = matcher.deep_copy()
        return written if check.consume_tokens(written) and check.is_accepting() else taken

    def _allowed(self, tokens: np.ndarray) -> list[int]:
        """Those of ``tokens`` the last mask computed allows, in their order."""
        w = self._words
        return tokens[(w[tokens >> 5] >> (tokens & 31).astype(np.uint32)) & 1 == 1].tolist()

    def _mask(self, matcher: LLMatcher) -> np.ndarray:
        """``matcher``'s mask (left in ``_words`` for ``_allowed`` too): one bit a token."""
        matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        return self._words.copy()
