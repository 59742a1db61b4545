"""The decode batch: every decoding sequence fed its next token (and the
drafts worth verifying, ``runtime.engine.speculation``) in forwards of the measured
row counts, one step built and started while the last computes.

``Engine`` owns a ``Decoder`` and hands it the sequences whose prompts are
in (``join``); ``step`` reads a step's tokens and verifies them, the
engine's ``accept`` turning each into text and a finish reason. The step
computing ahead is undone whenever the batch changes (``drop_next_step``), and
the newest tokens' rows the batch caches hold go to the records whenever
its forwards' sequences change (``flush``)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from .batch_cache import BatchQuantizedKVCache
from ..cache_records import BLOCK_TOKENS
from .evaluator import Evaluator
from ..kv import LayerCache
from .row_counts import RowCounts
from .sampling import Draw
from .sequence import Sequence
from .speculation import TRY, StepCosts, choose_drafts

__all__ = ["DecodeStep", "Decoder"]

Accept = Callable[[Sequence, int, object], tuple[tuple[int, ...], str, "str | None"]]


@dataclass(eq=False)
class DecodeStep:
    """A decode step started (its tokens computing) and not yet read."""

    rows: list[Sequence]
    drafts: list[list[int]]  # each row's drafts, fed after its next input (``runtime.engine.speculation``)
    tokens: mx.array  # each token slot's draw: a row's slots are its input's, then each draft's
    logprobs: list  # each slot's ``Draw.logprobs``
    # Each forward's rows, and the batch caches it wrote with the steps each held before.
    forwards: list[tuple[list[Sequence], list[tuple[BatchQuantizedKVCache, int]]]]
    states: list[tuple[LayerCache, int, list]]  # recurrent layers before it (they cannot be cut back)
    contexts: list[int]  # tokens each row's cache held before it
    launched: float  # ``perf_counter`` when its build was done and it started computing
    evaluation: Future | None  # what to wait on before reading its tokens (``Evaluator.start``)

    @property
    def layers(self) -> list[tuple[BatchQuantizedKVCache, int]]:
        return [layer for _, layers in self.forwards for layer in layers]


class Decoder:
    """The decoding sequences (``rows``, in batch order) and the steps that feed them.

    ``row_counts``: the token slots a forward may have.
    ``shared_tokens``: what a sharded model's ranks go on with (``Engine``).
    ``pipelined``: build each step while the last computes (not sharded:
    ranks act on rank 0's tokens).
    """

    def __init__(self, model: nn.Module, row_counts: RowCounts, shared_tokens, *, pipelined: bool):
        self.model = model
        self.shared_tokens = shared_tokens
        self.pipelined = pipelined
        self.use_row_counts(row_counts)  # (``Engine.use_row_counts``)
        self.rows: list[Sequence] = []
        # Each decode forward's per-layer batch caches, kept while its sequences stay the same:
        # they hold the newest tokens' Q4 rows until ``flush`` writes them to the records.
        self._batches: dict[tuple[int, ...], list[BatchQuantizedKVCache]] = {}
        self._next_step: DecodeStep | None = None  # the decode step started on tokens not yet read
        self.evaluator = Evaluator()  # where steps compute: a step ahead, while the next is built
        self._held: set[int] = set()  # sequences whose next step verifies no drafts (``hold_drafts``)

    def use_row_counts(self, counts: RowCounts) -> None:
        self.row_counts = counts
        self._costs = StepCosts(counts)  # what a step costs, for ``choose_drafts``

    def join(self, *seqs: Sequence) -> None:
        """Sequences whose prompts are in (or whose last prompt token is this step's input)."""
        self.rows += seqs

    def lengths(self) -> dict[int, tuple[int, int]]:
        """For each decoding sequence: the tokens its cache may hold once the
        next decode step is read -- that step's input, and the next one's,
        which a step built ahead writes before its own turn to reserve (counted
        whether or not one is, so a reply cut by its budget ends at the same
        token either way) -- and how many drafts the step may add for a while
        (those it rejects are cut at its end). ``hold_drafts`` if those
        cannot fit."""
        ahead = self._next_step.rows if self._next_step is not None and self._next_step.rows == self.rows else ()
        return {seq.id: (len(seq.cached) + 1, 0) if seq in ahead else (len(seq.cached) + 2, self._draft_room(seq))
                for seq in self.rows}

    def hold_drafts(self, seq_id: int) -> None:
        """Verify no drafts for this sequence in the next decode step (its owner
        has no room for them)."""
        self._held.add(seq_id)

    def step(self, accept: Accept, prefills_waiting: bool) -> list[tuple[Sequence, tuple[int, ...], str, str | None]]:
        """Read the next decode step (launched now, or the one computing ahead)
        and verify each row's tokens, ``accept(seq, token, logprobs)`` (the
        engine's) recording each token taken: (sequence, new token ids, text
        to show, finish reason or None) a row. ``prefills_waiting``: a
        sequence is about to join, so no step is built ahead of this one's."""
        if not self.rows:
            return []
        if self._next_step is not None and self._next_step.rows != self.rows:
            self.drop_next_step()  # a sequence joined: a fresh step feeds everyone
        built_before = self._next_step is not None
        step, self._next_step = self._next_step or self._launch(), None
        self._held.clear()  # (for that step only)
        if self.pipelined and not prefills_waiting and not any(step.drafts) and all(
                len(seq.output) + 1 < seq.sampling.max_tokens and seq.sampler.constraint is None
                for seq in step.rows) and not any(self._drafts_pay(step.rows)):
            # (not when a sequence is about to join or reach its length, nor when a grammar's
            # next mask or a sequence's drafts wait on these tokens)
            self._next_step = self._launch(after=step)
        computed = None if step.evaluation is None else step.evaluation.result()
        tokens = step.tokens.tolist()
        if computed is None and not built_before:  # (not on the CPU: its time since it started)
            computed = (time.perf_counter() - step.launched) * 1e3
        if computed is not None:
            self._costs.computed([1 + len(d) for d in step.drafts], step.contexts, computed)
        if self._next_step is not None:
            for seq, token in zip(step.rows, tokens):
                seq.cached.append(token)  # what the step ahead feeds
        results, at = [], 0
        for seq, drafts in zip(step.rows, step.drafts):
            width = 1 + len(drafts)
            results.append(self._verify(accept, seq, drafts, tokens[at : at + width], step.logprobs[at : at + width],
                                        step))
            at += width
        self.rows = [seq for seq, (_, _, reason) in zip(step.rows, results) if reason is None]
        if len(self.rows) < len(step.rows):
            self.drop_next_step()
            self.flush()
        return [(seq, *result) for seq, result in zip(step.rows, results)]

    def _verify(self, accept: Accept, seq: Sequence, drafts: list[int], tokens: list[int], logprobs: list,
                step: DecodeStep) -> tuple[tuple[int, ...], str, str | None]:
        """Take a sequence's tokens of a step: the draw of each slot while the
        draft fed there equals it, then the draw that differs (or the last
        slot's); drafts after the last taken are cut from its caches."""
        agreed = next((j for j, d in enumerate(drafts) if tokens[j] != d), len(drafts))
        new, text, reason = (), "", None
        taken = 0
        while reason is None and taken <= agreed:
            more, shown, reason = accept(seq, tokens[taken], logprobs[taken])
            new, text, taken = new + more, text + shown, taken + 1
            if more != (tokens[taken - 1],):  # an end, or the grammar took another token: later slots are moot
                break
        if drafts:
            seq.drafted += len(drafts)
            seq.accepted += taken - 1
            seq.sampler.undo(len(drafts) + 1 - taken)  # the draws of slots not taken: the next draws as they would
            self._cut(seq, len(drafts) - (taken - 1), step)  # (none cut: recurrent states drop their trail)
        if seq.drafter is not None:
            seq.drafter.settle(len(drafts), agreed)
        return new, text, reason

    def _cut(self, seq: Sequence, n: int, step: DecodeStep) -> None:
        """Drop a sequence's last ``n`` tokens of ``step`` (drafts not taken) from
        ``cached`` and every cache: rows the step holds, records, recurrent states."""
        del seq.cached[len(seq.cached) - n :]
        forward, layers = next((forward, layers) for forward, layers in step.forwards if seq in forward)
        i = forward.index(seq)
        for layer, held in layers:
            c = layer.caches[i]
            if c.recurrent:
                c.cut(n)
            elif not n:
                continue
            elif layer.held > held:  # the step's rows wait in the batch (attention through working copies)
                layer.cut(i, n)
            else:
                trimmed = c.trim(n)
                assert trimmed == n, "every cache a decode step writes can drop its last tokens"


    def flush(self) -> None:
        """Write every decode forward's held Q4 rows to the records; forget the forwards."""
        for batch in self._batches.values():
            for layer in batch:
                layer.flush()
        self._batches = {}

    def _launch(self, after: DecodeStep | None = None) -> DecodeStep:
        """Build and start a decode step of the decoding sequences, in forwards
        of ``row_counts``: fed their next inputs and the drafts ``_drafts_pay``
        allots them, or (``after``) the tokens that step samples, still
        computing, which ``step_once`` appends to ``cached`` once read."""
        start = time.perf_counter()
        rows = list(self.rows)
        contexts = [len(seq.cached) for seq in rows]
        drafts = self._drafts_pay(rows, open=True) if after is None else [[] for _ in rows]
        forwards, at = [], 0
        for n, slots in self.row_counts.pack([1 + len(d) for d in drafts]):
            forwards.append((rows[at : at + n], drafts[at : at + n], slots))
            at += n
        keys = [tuple(seq.id for seq in forward) for forward, _, _ in forwards]
        if set(keys) != self._batches.keys():  # the forwards' sequences changed: records first
            self.flush()
            self._batches = {key: _batch(s.view for s in forward) for key, (forward, _, _) in zip(keys, forwards)}
        for layer in (layer for batch in self._batches.values() for layer in batch if layer.full):
            layer.flush()  # only steps that are read (``after`` is, next) are ever held
        for key, (forward, _, _) in zip(keys, forwards):
            if any(c.offset and c.offset % BLOCK_TOKENS == 0 for seq in forward for c in seq.view if c.attends_new):
                for layer in self._batches[key]:
                    layer.flush()  # the record closes the block before a step's first token (``kv.quantized``)
        states = [(c, c.offset, list(c.cache)) for seq in rows for c in seq.view if c.recurrent]
        written = [[(layer, layer.held) for layer in self._batches[key]] for key in keys]
        if after is None:
            fed = [[seq.next_input, *d] for seq, d in zip(rows, drafts)]
            for seq, tokens in zip(rows, fed):
                seq.cached += tokens
            inputs = mx.array([t for tokens in fed for t in tokens])
        else:
            inputs = after.tokens
        draws: list[Draw] = []
        at = 0
        for key, (forward, forward_drafts, slots) in zip(keys, forwards):
            widths = [1 + len(d) for d in forward_drafts]
            for layer in self._batches[key]:
                layer.widths = widths
            logits = self.forward(self._batches[key], inputs[at : at + sum(widths)], slots)
            slot = 0
            for seq, d in zip(forward, forward_drafts):  # each slot draws what decode would there: a draft is taken if drawn
                c = seq.sampler.constraint  # (a grammar's mask at each slot: after the drafts before it)
                masks = c.masks(d, logits.shape[-1]) if c is not None and d else [None] * (1 + len(d))
                draws += [seq.sampler(logits[slot + j], mask) for j, mask in enumerate(masks)]
                slot += 1 + len(d)
            at += slot
        tokens = self.shared_tokens(mx.stack([d.token for d in draws]))
        logprobs = [d.logprobs for d in draws]
        held = [b.arrays for batch in self._batches.values() for b in batch]
        launched = time.perf_counter()
        self._costs.built((launched - start) * 1e3)
        # A step computes on the evaluator's thread, the next built meanwhile (none is where
        # steps are not computed ahead: ranks wait on each other's), but one that may hold the
        # caller's arrays on its own streams starts here.
        here = not self.pipelined or any(seq.callers_cache for seq in rows)
        evaluation = self.evaluator.start(tokens, [lp for lp in logprobs if lp is not None],
                                           [seq.view.arrays() for seq in rows], held, here=here)
        for seq in rows:
            seq.callers_cache = False
        tiled = [(forward, w) for (forward, _, _), w in zip(forwards, written)]
        return DecodeStep(rows, drafts, tokens, logprobs, tiled, states, contexts, launched, evaluation)

    def _draft_room(self, seq: Sequence) -> int:
        """The most drafts a sequence may verify in its next step."""
        if seq.drafter is None or seq.id in self._held:
            return 0
        block_left = BLOCK_TOKENS - 1 - len(seq.cached) % BLOCK_TOKENS  # a step's tokens share a block (``kv.quantized``)
        return max(0, min(self.row_counts.counts[-1] - 1, seq.sampling.max_tokens - len(seq.output) - 1, block_left))

    def _drafts_pay(self, rows: list[Sequence], open: bool = False) -> list[list[int]]:
        """The drafts each sequence verifies in its next step (``open``: one
        built in the open whatever it feeds): what its history offers, as many
        as ``choose_drafts`` finds pay for their slots -- and up to ``TRY`` where a
        sequence's drafts were never judged, as far as its forward has room:
        only verdicts tell its own rate, and the rate before any cannot pay
        everywhere (four agents beside each other)."""
        offers = [self._offer(seq) for seq in rows]
        if not any(offers):
            return offers
        tries = [TRY if seq.drafter is not None and not seq.drafter.verdicts else 0 for seq in rows]
        counts = choose_drafts(offers, [0.0 if seq.drafter is None else seq.drafter.rate for seq in rows],
                       [len(seq.cached) for seq in rows], self._costs, open, tries)
        return [offer[:n] for offer, n in zip(offers, counts)]

    def _offer(self, seq: Sequence) -> list[int]:
        """What a sequence's history offers as drafts, as far as its grammar allows them."""
        if seq.drafter is None:
            return []
        offer = seq.drafter.offer(self._draft_room(seq))
        c = seq.sampler.constraint
        return offer if c is None or not offer else offer[: c.allows(offer)]

    def drop_next_step(self) -> None:
        """Undo the step computed ahead, if any: each of its sequences as before
        it (its input out of ``cached``, its sampler's draw, its token out of every
        cache: held rows and working copies dropped, records cut back,
        recurrent states restored)."""
        step, self._next_step = self._next_step, None
        if step is None:
            return
        self.evaluator.settle()
        for seq in step.rows:
            seq.cached.pop()
            seq.sampler.undo()
        for layer, held in step.layers:
            if layer.held > held:  # the step's rows wait in the batch (attention through working copies)
                layer.drop_last()
                continue
            for c in layer.caches:  # it wrote them to the records
                if not c.recurrent:
                    trimmed = c.trim(1)
                    assert trimmed == 1, "every cache a decode step writes can drop its last token"
        for c, offset, state in step.states:
            c.offset, c.cache = offset, state

    def forward(self, batch: list[BatchQuantizedKVCache], inputs, slots: int) -> mx.array:
        """One decode forward: ``inputs[i]`` (token ids) into the sequence of
        ``batch``'s slot ``i``, the slots after them padded with token 0; the
        logits of every slot."""
        inputs = mx.array(inputs) if isinstance(inputs, list) else inputs.astype(mx.int32)
        padding = mx.zeros((slots - inputs.shape[0],), mx.int32)
        return self.model(mx.concatenate([inputs, padding])[None], cache=batch)[0]



def _batch(views) -> list[BatchQuantizedKVCache]:
    """Per-layer batch caches of the sequences whose attention views are ``views``."""
    return [BatchQuantizedKVCache(layer) for layer in zip(*views)]
