"""Exact speculative decoding: drafts from an agent's own memory, verified
inside the batch.

Agents mostly write what they have seen: a file shown to them with a line
changed, tool output quoted, identifiers repeated. A sequence's ``Drafter``
indexes its token history (the conversation it was prompted with and what it
has written since) by its last few tokens; where they occurred before, the
tokens that followed are offered as drafts. No draft model. Code quoted at
another depth than it was shown (a method quoted on its own, a block moved
into an ``if``) differs only in its indentation tokens: where the last tokens
occurred nowhere as they are, they are looked up with every line break's
indentation taken as the same (``Indents``), and the drafts' indentations
are shifted by what the quote's differ from the original's there.

The engine feeds a drafting sequence its next input and the drafts in
consecutive token slots of one decode forward (``runtime.engine.batch_cache``): each
slot computes exactly what a decode step of its token alone would, so slot
j's draw is the token decode would draw there. Drafts are taken while they
equal those draws, the first that does not is replaced by the draw, and the
rest are cut from every cache. Greedy output is therefore bitwise the output
without drafts. With temperature the sampler accepts a draft d with
probability p(d) and otherwise draws from p without d (``Sampler``, the
speculative-sampling rule for a draft that is certain), so each token's
distribution is exactly the model's.

``choose_drafts`` chooses how many drafts each sequence verifies in a step: the most
expected tokens per unit of time, from each sequence's recent acceptance and
what steps cost (``StepCosts``: measured as steps go, and at load); a
sequence whose drafts keep failing gets none, so text that never repeats
pays nothing.
"""

from __future__ import annotations

import numpy as np

from ..text.prefix import encode
from .row_counts import RowCounts

__all__ = ["Drafter", "Indents", "NGRAMS", "StepCosts", "TRY", "choose_drafts"]

NGRAMS = (4, 3, 2)  # the history's last tokens looked up, longest first
# Echoed text fails where the model changes a little (a line re-indented) and then echoes on:
# one miss should not stop a run, and a sequence whose drafts failed may try again.
_KEEP = 0.85  # weight of the acceptance counts so far at each verify (recent drafts count most)
_FORGET = 0.9  # at each step without drafts: the counts fade towards the prior
_PRIOR = 0.5  # drafts taken of 1 before any verdict
TRY = 2  # drafts a sequence verifies before its first verdict, whatever they cost


class Indents:
    """A tokenizer's indentation tokens: each single token that is a line break
    (or two) and a run of spaces or of tabs, by its kind and width, both ways
    (a bare line break is none: taken as one, it matched the history's
    line breaks to any indentation, and the shift it left was wrong)."""

    WIDEST = 64  # spaces or tabs looked up after a line break

    def __init__(self, widths: dict[int, tuple[str, int]]):
        self.widths = widths  # token -> (line breaks and the character, width)
        self._tokens = {kind_width: token for token, kind_width in widths.items()}
        kinds = sorted({kind for kind, _ in widths.values()})
        # What an indentation is looked up as: its kind alone (negative: never a token id).
        self.kinds = {token: -1 - kinds.index(kind) for token, (kind, _) in widths.items()}

    @classmethod
    def of(cls, tokenizer) -> Indents:
        widths: dict[int, tuple[str, int]] = {}
        for breaks in ("\n", "\n\n"):
            for char in " \t":
                for width in range(1, cls.WIDEST + 1):
                    ids = encode(tokenizer, breaks + char * width)
                    if len(ids) == 1:
                        widths[ids[0]] = (breaks + char, width)
        return cls(widths)

    def shifted(self, token: int, shift: int) -> int | None:
        """``token``, if an indentation, ``shift`` wider (None: no such token)."""
        if token not in self.widths:
            return token
        kind, width = self.widths[token]
        return self._tokens.get((kind, width + shift))


NO_INDENTS = Indents({})


class Drafter:
    """One sequence's token history, searched for drafts, and how its drafts fared."""

    def __init__(self, history: list[int], indents: Indents = NO_INDENTS):
        self.tokens = list(history)
        self.indents = indents
        # ``tokens`` as arrays, searched (grown by half): as they are, and each indentation as its kind
        self._array = np.zeros(len(history) + 256, np.int64)
        self._loose = np.zeros(len(history) + 256, np.int64)
        self._synced = 0
        self.shift = 0  # how much wider the latest quote's indentations are than the original's
        self.proposed = self.accepted = 0.0  # drafts judged and taken, decayed (``rate``)
        self.verdicts = 0  # steps that judged its drafts

    def extend(self, token: int) -> None:
        self.tokens.append(token)

    def offer(self, limit: int) -> list[int]:
        """Up to ``limit`` tokens that followed the latest earlier occurrence
        of the history's last ``NGRAMS`` tokens, the longest that occurred,
        as they are or else with any indentation; the drafts' indentations
        shifted by how the two occurrences' differ (where they hold none: as
        the last that did)."""
        n_tokens = len(self.tokens)
        if limit < 1 or n_tokens <= min(NGRAMS):
            return []
        self._sync()
        tokens, loose = self._array[:n_tokens], self._loose[:n_tokens]
        for n in NGRAMS:
            if n_tokens <= n:
                continue
            j = _latest(tokens, n)
            if j is None and any(t in self.indents.kinds for t in self.tokens[-n:]):
                j = _latest(loose, n)
            if j is None:
                continue
            for original, quote in zip(self.tokens[j : j + n], self.tokens[-n:]):
                if original in self.indents.widths:
                    self.shift = self.indents.widths[quote][1] - self.indents.widths[original][1]
            drafts = []
            for token in self.tokens[j + n : j + n + limit]:
                token = self.indents.shifted(token, self.shift)
                if token is None:
                    break
                drafts.append(token)
            return drafts
        return []

    def _sync(self) -> None:
        """Copy the tokens written since the last offer into the arrays searched."""
        n_tokens = len(self.tokens)
        if n_tokens > len(self._array):
            grown = n_tokens - len(self._array) + n_tokens // 2 + 256
            self._array = np.concatenate([self._array, np.zeros(grown, np.int64)])
            self._loose = np.concatenate([self._loose, np.zeros(grown, np.int64)])
        new = self.tokens[self._synced :]
        self._array[self._synced : n_tokens] = new
        self._loose[self._synced : n_tokens] = [self.indents.kinds.get(t, t) for t in new]
        self._synced = n_tokens

    @property
    def rate(self) -> float:
        """The chance the next draft is taken, from recent verdicts (1/2 before
        any, weighing one draft: an echo's first ``TRY`` drafts taken make it
        5/6, enough for four agents beside each other to draft on)."""
        return (self.accepted + _PRIOR) / (self.proposed + 1)

    def settle(self, proposed: int, accepted: int) -> None:
        """Count a step's verdict: the first ``accepted`` of ``proposed`` drafts
        taken (none proposed: the counts fade towards the prior). Drafts after
        the first refused were never judged, so they are not counted: ``rate``
        is the chance of a draft whose predecessors were taken, as ``choose_drafts``
        uses it."""
        if proposed:
            self.verdicts += 1
            self.proposed = _KEEP * self.proposed + min(proposed, accepted + 1)
            self.accepted = _KEEP * self.accepted + accepted
        else:
            self.proposed *= _FORGET
            self.accepted *= _FORGET


class StepCosts:
    """What a decode step costs (ms) by its sequences' slots (``widths``) and
    how many tokens each holds (``contexts``), for ``choose_drafts`` to weigh drafts.

    A step without drafts is built while the last one computes
    (``Decoder._launch``): it costs its computation, measured at each row
    count as steps go (``periods``; before any, the forward times measured at
    load, ``RowCounts.ms``, and its attention). A step with drafts costs
    that, its forwards' extra slots (from ``RowCounts.ms``) and their attention
    over their sequences' tokens (``key_ms`` a token, learned from drafting
    steps' computation: it grows with the context, and a draft's slot reads
    every key again) -- and two builds in the open: its own, and the next step's,
    which waits on its verdict. Where a step is built in the open whatever it
    feeds (``open``), its own build is paid either way. Forwards count one
    each when the row counts were not measured."""

    def __init__(self, counts: RowCounts):
        self.counts = counts
        # A forward's time, by its slots: the line through the times measured (each count's own
        # carries its measurement's noise: a count once measured faster than the one below it).
        slots = np.arange(1, len(counts.ms) + 1)
        self._line = np.polyfit(slots, counts.ms, 1) if len(counts.ms) > 1 else (0.0, sum(counts.ms))
        self.build_ms = 0.0  # building a step's graph, recently
        self.key_ms = 0.0  # a draft slot's attention, per token it attends over, recently
        self.drafted = False  # a step with drafts was measured (the first sets ``key_ms``)
        self.periods: dict[int, float] = {}  # computing a step without drafts, by its sequences, recently

    def __call__(self, widths: list[int], contexts: list[int], open: bool = False) -> float:
        if not self.counts.ms:
            return float(len(self.counts.pack(widths)))
        if max(widths) == 1:
            return self._plain(contexts) + (self.build_ms if open else 0.0)
        return (self._plain(contexts) + self._slots(widths) + self.key_ms * _extra_keys(widths, contexts)
                + 2 * self.build_ms)

    def _plain(self, contexts: list[int]) -> float:
        """Computing a step of these sequences without drafts."""
        if len(contexts) in self.periods:
            return self.periods[len(contexts)]
        ones = [1] * len(contexts)
        return self._forwards(ones) + self.key_ms * _keys(ones, contexts)

    def _slots(self, widths: list[int]) -> float:
        """What the drafts' slots add to a step's forwards."""
        return max(0.0, self._forwards(widths) - self._forwards([1] * len(widths)))

    def _forwards(self, widths: list[int]) -> float:
        slope, intercept = self._line
        return sum(float(intercept + slope * slots) for _, slots in self.counts.pack(widths))

    def built(self, ms: float) -> None:
        """A step's graph took ``ms`` to build."""
        self.build_ms += 0.2 * (ms - self.build_ms)

    def computed(self, widths: list[int], contexts: list[int], ms: float) -> None:
        """A step took ``ms`` to compute, from its start to its tokens."""
        if not self.counts.ms:
            return
        n = len(widths)
        if max(widths) == 1:
            period = self.periods.get(n, ms)
            self.periods[n] = period + 0.2 * (ms - period)
            return
        attention = max(0.0, ms - self._plain(contexts) - self._slots(widths))
        weight = 0.2 if self.drafted else 1.0  # (not from 0: a long context's drafts would look free)
        self.key_ms += weight * (attention / _extra_keys(widths, contexts) - self.key_ms)
        self.drafted = True


def _latest(a: np.ndarray, n: int) -> int | None:
    """Where the latest earlier occurrence of ``a``'s last ``n`` starts that has
    a follower (it ends before the last), if any."""
    same = a[n - 1 : -1] == a[-1]
    for back in range(1, n):
        same &= a[n - 1 - back : len(a) - 1 - back] == a[-1 - back]
    found = np.flatnonzero(same)
    return int(found[-1]) if found.size else None


def _keys(widths: list[int], contexts: list[int]) -> int:
    """Tokens a step's slots attend over: slot j of a sequence holding c sees c + j + 1."""
    return sum(w * c + w * (w + 1) // 2 for w, c in zip(widths, contexts))


def _extra_keys(widths: list[int], contexts: list[int]) -> int:
    """Tokens a step's draft slots attend over."""
    return _keys(widths, contexts) - _keys([1] * len(widths), contexts)


def choose_drafts(offers: list[list[int]], rates: list[float], contexts: list[int], costs: StepCosts,
          open: bool = False, least: list[int] | None = None) -> list[int]:
    """How many of its offered drafts each sequence verifies in the next step
    (``open``: one built in the open whatever it feeds; ``least``: how many
    a sequence verifies whatever they cost, its first offer's try).

    A sequence with t drafts whose next draft is taken with chance r yields
    1 + r + ... + r^t tokens expected; what the step costs is ``costs``'s
    estimate. Drafts are added likeliest first, and the allotment with the
    most expected tokens per unit of time wins -- none when no draft pays for
    its slot, the attention it adds and the builds it keeps in the open.
    No draft, tried or paid for, moves a sequence into another forward than
    it runs in without drafts: the engine would rebuild every sequence's
    working copies for that step and again for the next, which costs more
    than the drafts save (docs/benchmarks.md, "Drafts kept in their
    sequence's forward")."""
    groups = _groups(costs, [0] * len(offers))
    taken, tokens = [0] * len(offers), float(len(offers))
    for i, n in enumerate(least or []):
        while taken[i] < min(n, len(offers[i])) and _groups(costs, _plus(taken, i)) == groups:
            taken[i] += 1
            tokens += rates[i] ** taken[i]
    best, chosen = tokens / costs([1 + t for t in taken], contexts, open), list(taken)
    candidates = sorted(((rates[i] ** (j + 1), i) for i, offer in enumerate(offers)
                         for j in range(taken[i], len(offer))), reverse=True)
    full = set()  # sequences whose next draft would move them
    for value, i in candidates:
        if i in full or _groups(costs, _plus(taken, i)) != groups:
            full.add(i)
            continue
        taken[i] += 1
        tokens += value
        ratio = tokens / costs([1 + t for t in taken], contexts, open)
        if ratio > best:
            best, chosen = ratio, list(taken)
    return chosen


def _plus(taken: list[int], i: int) -> list[int]:
    """``taken`` with one draft more for sequence ``i``."""
    return [t + (j == i) for j, t in enumerate(taken)]


def _groups(costs: StepCosts, taken: list[int]) -> list[int]:
    """How many sequences each forward of a step runs, with ``taken`` drafts each
    (a sequence's slots that no forward holds: none)."""
    top = costs.counts.counts[-1]
    if max(taken, default=0) + 1 > top:
        return []
    return [n for n, _ in costs.counts.pack([1 + t for t in taken])]
