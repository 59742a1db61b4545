"""The prefill queue: pending prompts fed a chunk a forward, round-robin, so a
long prompt cannot starve short ones; chunks of several sequences share a
forward only from the size ``calibrate`` measured to leave them as alone
(``RowCounts.prefill_from``).

``Engine`` queues sequences here (``queue``) and asks for the next forward
(``run``); what a sequence whose prompt is in does next (its first token, its
choices) is the engine's."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

from . import row_plans
from .batch_cache import PrefillBatch
from .row_counts import RowCounts
from .sampling import TokenLogprob, row_logprobs
from .sequence import Sequence

__all__ = ["Pick", "Prefiller"]

_LAST_IN_CHUNK = 64  # a final chunk longer than this leaves its last token to the decode batch


class Pick(NamedTuple):
    """A pending prefill's part of the next forward."""

    seq: Sequence
    tokens: int  # of its pending prompt
    joins_decode: bool  # its last prompt token joins the next decode step


class Prefiller:
    """Pending prefills and how their chunks are cut (``Engine`` documents the settings)."""

    def __init__(self, model: nn.Module, token_bytes: Callable[[int], bytes], *, prefill_chunk: int, prefill_rows: int,
                 batch_prefill: bool, min_chunk: int, attention_budget: int):
        self.model = model
        self.token_bytes = token_bytes
        self.prefill_chunk = prefill_chunk
        self.prefill_rows = prefill_rows
        self.batch_prefill = batch_prefill
        self.min_chunk = min_chunk
        self.attention_budget = attention_budget
        self.query_heads = _query_heads(model)
        self.queue: deque[Sequence] = deque()

    def picks(self, row_counts: RowCounts) -> list[Pick]:
        """The pending prefills whose chunks run in the next prefill forward, in
        queue order. The first in the queue, alone -- or, where the measured
        counts let chunks of its size batch (``RowCounts.prefill_from``) and it
        needs no logits (no sampling, no scoring of its prompt), with the ones
        after it of which the same holds, while the forward holds at most
        ``prefill_rows`` tokens. A sequence that generates nothing
        (``max_tokens`` 0) takes its last prompt token in its chunk."""
        picks, rows, batching = [], 0, False
        for seq in self.queue:
            n = self.chunk_size(len(seq.cached))
            if len(seq.pending) - n < self.min_chunk:
                n = len(seq.pending)  # a short rest would cost a forward of its own: it comes along
            joins_decode = _LAST_IN_CHUNK < len(seq.pending) <= n and seq.sampling.max_tokens > 0
            if joins_decode:
                # Only the last token's logits are needed, but a chunk computes them for
                # every position (vocab x hidden a token): the last prompt token joins
                # the next decode step instead, beside the other sequences' tokens.
                n = len(seq.pending) - 1
            may_batch = self.batch_prefill and row_counts.prefill_from is not None and not seq.scores_prompt and (
                n >= row_counts.prefill_from and (joins_decode or n < len(seq.pending)))
            if not picks:
                batching = may_batch  # the first in the queue decides whether others may join it
            elif not (batching and may_batch) or rows + n > self.prefill_rows:
                break
            picks.append(Pick(seq, n, joins_decode))
            rows += n
        return picks

    def run(self, picks: list[Pick]) -> mx.array | None:
        """Feed the picks' chunks in one forward and take them off the queue;
        the lone pick's logits (a batched forward computes none: only its cache
        writes are read). A pick whose prompt is still pending and does not
        ride goes back to the queue's end, its caches evaluated."""
        chunks = [seq.pending[:n] for seq, n, _ in picks]
        logits = None
        if len(picks) == 1:
            seq = picks[0].seq
            logits = self.model(mx.array(chunks[0])[None], cache=seq.view)[0]
            if seq.scores_prompt:
                self._score_prompt(seq, logits)
        else:
            lengths = [len(c) for c in chunks]
            with row_plans.chunked(lengths):
                self.model(mx.array([t for c in chunks for t in c])[None],
                           cache=[PrefillBatch(layer, lengths) for layer in zip(*(p.seq.view for p in picks))])
        for _ in picks:
            self.queue.popleft()
        for (seq, _, joins_decode), chunk in zip(picks, chunks):
            seq.cached += chunk
            if joins_decode or not seq.pending:  # the prompt is in: recurrent layers keep their state here (a checkpoint)
                seq.cache.mark()
            if seq.pending:
                mx.eval(seq.view.arrays())
                if not joins_decode:
                    self.queue.append(seq)  # round-robin among pending prefills
        return logits

    def chunk_size(self, context: int) -> int:
        # Attention scores of a chunk are heads x chunk x context floats: cap them.
        per_token = self.query_heads * (context + self.prefill_chunk) * 4
        fit = self.attention_budget // max(per_token, 1)
        return int(min(self.prefill_chunk, max(self.min_chunk, fit)))

    def _score_prompt(self, seq: Sequence, logits: mx.array) -> None:
        """Score the prompt tokens a chunk's ``logits`` predict, the chunk
        being the tokens after ``seq.cached``: row ``j`` is the model's
        prediction of the token after the chunk's ``j``-th, so a chunk of
        ``n`` from offset ``o`` scores prompt tokens ``o + 1`` to ``o + n``
        (its last row the next chunk's first token, or nothing past the
        prompt). The first token has nothing before it: logprob None."""
        start, pieces = len(seq.cached), self.token_bytes
        if start == 0:
            seq.prompt_logprobs.append(TokenLogprob(seq.prompt[0], pieces(seq.prompt[0]), None))
        targets = seq.prompt[start + 1 : min(start + 1 + logits.shape[0], seq.prompt_tokens)]
        if not targets:
            return
        values, ids = row_logprobs(logits[: len(targets)], targets, seq.sampling.prompt_logprobs)
        mx.eval(values, ids)
        for token, v, top in zip(targets, values.tolist(), ids.tolist()):
            seq.prompt_logprobs.append(TokenLogprob.of(token, v, top, pieces))


def _query_heads(model: nn.Module) -> int:
    attn = next(layer.self_attn for layer in model.layers if "self_attn" in layer)
    for name in ("n_heads", "num_attention_heads", "num_heads"):
        if isinstance(value := getattr(attn, name, None), int):
            return value
    return 32
