"""Per-sequence sampling: temperature, top-p, top-k, min-p, a seed, a
grammar the reply must follow, and the log-probabilities to report.

Each sequence owns an MLX random key, so its draws do not depend on which
other sequences share the batch.  Temperature 0 is greedy (argmax).  A
grammar (``runtime.text.grammar``) masks the row before either: only the tokens
it allows next can be drawn.  ``logprobs`` reports, for each token drawn, its
log-probability and the most likely tokens': float32 log-softmax of the row it
is drawn from, after the grammar's mask and before temperature, top-k, top-p
and min-p (the model's distribution over what it may say).
``prompt_logprobs`` reports the same of each prompt token given the tokens
before it, from the rows of the prefill chunks that feed them
(``row_logprobs``).
"""

from __future__ import annotations

import math
import random
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..text.grammar import Constraint, check

__all__ = ["Draw", "MAX_LOGPROBS", "SamplingParams", "Sampler", "TokenLogprob", "row_logprobs"]

MAX_LOGPROBS = 20  # alternatives a token may report (OpenAI's limit)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int = 256  # 0: prefill the prompt, generate nothing
    stop: tuple[str, ...] = field(default=())
    seed: int | None = None
    grammar: str | None = None  # llguidance's grammar text (``runtime.text.grammar.json_schema``)
    logprobs: int | None = None  # None: none; n: each token's logprob and the n most likely tokens'
    prompt_logprobs: int | None = None  # the same of each prompt token (None: none); its prefill reuses no cache

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError("temperature must be >= 0")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError("top_k must be >= 0")
        if not 0 <= self.min_p < 1:
            raise ValueError("min_p must be in [0, 1)")
        if self.max_tokens < 0:
            raise ValueError("max_tokens must be >= 0")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        object.__setattr__(self, "stop", tuple(self.stop))
        if self.grammar is not None:
            check(self.grammar)
        for name in ("logprobs", "prompt_logprobs"):
            if (n := getattr(self, name)) is not None and not 0 <= n <= MAX_LOGPROBS:
                raise ValueError(f"{name} must be in [0, {MAX_LOGPROBS}]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability, and the most likely tokens at its place."""

    token: int
    piece: bytes  # the token's bytes (a UTF-8 character may span tokens)
    logprob: float | None  # None: a prompt's first token (nothing comes before it to score it)
    top: tuple[TokenLogprob, ...] = ()  # most likely first; tokens a grammar forbids are left out

    @classmethod
    def read(cls, token: int, packed: tuple[mx.array, mx.array], pieces: Callable[[int], bytes]) -> TokenLogprob:
        """From a ``Draw``'s evaluated ``logprobs``; ``pieces`` gives a token's bytes."""
        return cls.of(token, *(a.tolist() for a in packed), pieces)

    @classmethod
    def certain(cls, token: int, piece: bytes, top: bool) -> TokenLogprob:
        """A token that was the only one allowed (a grammar closing within the
        limit): log-probability 0, and itself as the top (``top``) alternative."""
        return cls(token, piece, 0.0, (cls(token, piece, 0.0),) if top else ())

    @classmethod
    def of(cls, token: int, values: list[float], ids: list[int], pieces: Callable[[int], bytes]) -> TokenLogprob:
        """From ``values`` (the token's logprob, then the top's) and the top's ``ids``."""
        top = tuple(cls(t, pieces(t), v) for t, v in zip(ids, values[1:]) if v > -math.inf)
        return cls(token, pieces(token), values[0], top)


def row_logprobs(logits: mx.array, targets: list[int], top: int) -> tuple[mx.array, mx.array]:
    """The log-probabilities of ``targets`` under ``logits`` (a row each: row
    ``i`` is what the model predicts where ``targets[i]`` stands) and of the
    ``top`` likeliest tokens of each row, as ``TokenLogprob.of`` reads them:
    ``(values, ids)``, lazy, of shapes ``(n, 1 + top)`` and ``(n, top)``. The
    float32 log-softmax of each row, as a draw's."""
    rows = logits.astype(mx.float32)
    logprobs = rows - mx.logsumexp(rows, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(logprobs, mx.array(targets)[:, None], axis=-1)
    if not top:
        return chosen, mx.zeros((len(targets), 0), mx.int32)
    vocab = logprobs.shape[-1]
    if top == 1:  # (what harnesses ask for: an argmax is ~15x cheaper than a partition)
        ids = mx.argmax(logprobs, axis=-1, keepdims=True)
    else:
        ids = mx.argpartition(logprobs, vocab - top, axis=-1)[:, vocab - top :]
    values = mx.take_along_axis(logprobs, ids, axis=-1)
    order = mx.argsort(-values, axis=-1)
    ids, values = mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)
    return mx.concatenate([chosen, values], axis=-1), ids


class Draw(NamedTuple):
    token: mx.array  # the token id (a lazy scalar)
    logprobs: tuple[mx.array, mx.array] | None  # lazy: ([its logprob, the top's ...], [the top's ids]); or None


class Sampler:
    """Draws one token from a row of logits; owns its random key, and the
    sequence's ``constraint`` if it has a grammar (``advance`` it with each
    token taken: the next draw's mask depends on it). Draw n of a sequence
    uses the n-th key of its seed's chain, whatever else was drawn and
    undone, so drafted slots draw what decoding one token a step would."""

    def __init__(self, params: SamplingParams, constraint: Constraint | None = None):
        self.params = params
        self.constraint = constraint
        seed = params.seed if params.seed is not None else random.getrandbits(32)
        self._key = mx.random.key(seed)
        self._trail: deque[mx.array] = deque(maxlen=64)  # the key before each recent draw (``undo``)

    def __call__(self, logits: mx.array, mask: mx.array | None = None) -> Draw:
        """``logits``: (vocab,) -> the token drawn, and its logprobs if asked for (lazy).

        ``mask``: the grammar's at this place, where it is not the
        constraint's now (a slot after drafts: ``Constraint.masks``). A
        draft fed before this place is taken when it is the token drawn here
        (``runtime.engine.decode``): with temperature that happens with the chance
        p(draft) the row gives it, and the reply is the one without drafts."""
        p = self.params
        self._trail.append(self._key)
        if self.constraint is not None:
            mask = self.constraint.allowed(logits.shape[-1]) if mask is None else mask
            logits = mx.where(mask, logits, -mx.inf)
        logprobs = None if p.greedy and p.logprobs is None else logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if p.greedy:
            token = mx.argmax(logits, axis=-1)
        else:
            token = self._draw(logprobs)
        if p.logprobs is None:
            return Draw(token, None)
        top = mx.argpartition(-logprobs, p.logprobs - 1)[: p.logprobs] if p.logprobs else mx.array([], mx.int32)
        top = top[mx.argsort(-logprobs[top])]
        return Draw(token, (mx.concatenate([logprobs[token][None], logprobs[top]]), top))

    def _scaled(self, logprobs: mx.array) -> mx.array:
        """The logits a token is drawn from: the row's log-softmax under top-k,
        min-p and top-p, over the temperature; (1, vocab)."""
        p = self.params
        logprobs = logprobs[None]
        if p.top_k > 0:
            logprobs = apply_top_k(logprobs, p.top_k)
        if p.min_p > 0:
            logprobs = apply_min_p(logprobs, p.min_p)
        if p.top_p < 1:
            logprobs = apply_top_p(logprobs, p.top_p)
        return logprobs * (1 / p.temperature)

    def _draw(self, logprobs: mx.array) -> mx.array:
        """A token from the row's log-softmax, under temperature, top-k, min-p and top-p."""
        self._key, key = mx.random.split(self._key)
        return mx.random.categorical(self._scaled(logprobs), key=key)[0]

    def undo(self, draws: int = 1) -> None:
        """Forget the last ``draws`` draws: the next call draws as the first of
        them did (a decode step computed ahead and then dropped; a drafting
        step's slots after the tokens taken: ``runtime.engine.decode``)."""
        for _ in range(draws):
            self._key = self._trail.pop()
