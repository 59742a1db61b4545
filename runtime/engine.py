"""The batched engine: many sequences, each with its own Q4 KV cache, decoded
together one token per step.

The GPU actor drives it step by step and is its only caller (one thread):

* ``add`` queues a sequence: its prompt tokens and, optionally, an existing
  per-sequence Q4 cache that covers a prefix of them; ``add_choices`` asks
  for more replies to its prompt, prefilled once (each starts from a copy of
  its cache once the prompt is in, and samples on its own);
* ``prefill_step`` runs the next pending prefill's chunk, with the chunks of
  those after it that may share its forward (round-robin, so a long prompt
  cannot starve short ones); a sequence whose prefill completes
  samples its first token and joins the decode batch -- or, after a long
  final chunk, joins it with its last prompt token still to feed, and the next
  decode step samples its first token;
* ``step_once`` feeds every decoding sequence its next input (the token it
  sampled last, or the prompt token it joined with) and samples the next --
  and, for a sequence whose history offers drafts worth verifying, the
  drafts in the slots after its input, taking those the draws agree with
  and one more (``runtime.speculation``). While the same sequences decode, the
  step after is built and started on those tokens before they are read, so
  the model's graph is built while the last step computes; a sequence that
  finishes, joins or leaves drops that step (undone in every cache);
* a sequence that asks for its prompt's log-probabilities
  (``SamplingParams.prompt_logprobs``) has each prefill chunk's rows scored
  in the forward that feeds it (``_score_prompt``): it is prefilled alone,
  from its first token;
* ``cancel`` drops a sequence wherever it is;
* ``preempt`` takes a sequence out to free its cache (the owner stores it)
  and ``resume`` puts it back with that cache, or with none (its tokens are
  then recomputed): it goes on as if it had never left.

Every call returns ``Delta``s; the last delta of a sequence carries
``Finished`` with its Q4 cache and the exact token ids it covers.

Batch invariance: a prefill chunk's size depends only on its sequence, and
chunks share a forward only from the size ``calibrate`` measured to leave
them as alone (``RowCounts.prefill_from``); a decode step runs the decoding
sequences in forwards whose token slots are one of ``row_counts`` (measured
to agree by ``calibrate``: ``runtime.row_counts``); attention runs per
sequence over its own cache (``runtime.batch_cache``). So a sequence's
logits are bitwise the same whatever else runs, wherever it sits in the
batch.

(Long on purpose: one class, the step loop, whose sequences, steps and
drafts share its private state; pieces that need none of it live in
``runtime.calibration``, ``runtime.speculation``, ``runtime.row_counts`` and
``runtime.sampling``.)
"""

from __future__ import annotations

import functools
import itertools
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Sequence as Seq

import mlx.core as mx
import mlx.nn as nn

from . import calibration
from .batch_cache import BatchQuantizedKVCache, PrefillBatch
from .cache_records import BLOCK_TOKENS
from .evaluator import Evaluator
from .kv import LayerCache, SequenceCache, device_float_head, make_sequence_cache
from . import row_plans
from .grammar import Grammars
from .lean import lean
from .reply_text import ReplyText
from .row_counts import RowCounts
from .rowwise import rowwise
from .sampling import Draw, Sampler, SamplingParams, TokenLogprob, row_logprobs
from .speculation import TRY, Drafter, Indents, StepCosts, allot

__all__ = ["Engine", "Delta", "Finished", "SamplingParams", "TokenLogprob"]

STOP, LENGTH, CANCELLED, PREEMPTED = "stop", "length", "cancelled", "preempted"
DECODE_ROWS = 8  # the most token slots of a decode forward (``Engine.decode_rows``)
_LAST_IN_CHUNK = 64  # a final chunk longer than this leaves its last token to the decode batch


@dataclass(frozen=True)
class Finished:
    reason: str  # "stop" (end of turn or stop string), "length", "cancelled" or "preempted" (``resume`` goes on)
    cache: SequenceCache  # per-layer single-sequence caches, materialised
    cache_tokens: tuple[int, ...]  # exactly the token ids the cache covers
    output_tokens: tuple[int, ...]  # generated ids (end-of-turn token excluded)
    text: str  # generated text, cut before a stop string
    prompt_tokens: int
    reused_tokens: int  # prompt tokens served from the given cache
    prefilled_tokens: int  # prompt tokens computed by this request
    stop_sequence: str | None = None  # the stop string that ended it, if one did
    logprobs: tuple[TokenLogprob, ...] = ()  # of each output token, when ``SamplingParams.logprobs`` asked
    drafted_tokens: int = 0  # drafts verified (``runtime.speculation``)
    accepted_tokens: int = 0  # of them, taken as output
    # Of each prompt token (the first's logprob None), when ``SamplingParams.prompt_logprobs`` asked;
    # a sequence cancelled mid-prefill has those of the chunks it ran.
    prompt_logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class Delta:
    seq_id: int
    tokens: tuple[int, ...]  # new token ids (empty on a bare finish)
    text: str  # new text, safe to show (whole characters, no partial stop string)
    finished: Finished | None = None
    logprobs: tuple[TokenLogprob, ...] = ()  # of ``tokens``, when asked
    prompt_logprobs: tuple[TokenLogprob, ...] = ()  # of the prompt's tokens: on a sequence's first delta, when asked


@dataclass(eq=False)
class _Sequence:
    id: int
    prompt: list[int]
    sampling: SamplingParams
    sampler: Sampler
    reply: ReplyText  # its text, stop strings found, what has been shown
    cache: SequenceCache  # per-layer caches of record (what a finished sequence hands back)
    view: SequenceCache  # the same caches as attention sees them (``SequenceCache.view``)
    fed: list[int]  # token ids whose K/V are in the cache
    reused: int
    prompt_tokens: int  # the prompt as given (``resume`` may extend ``prompt`` with tokens to recompute)
    drafter: Drafter | None  # its history, for drafts (None: it does not speculate)
    output: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of ``output``, when asked
    drafted: int = 0  # drafts verified
    accepted: int = 0  # drafts taken
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # of the prompt tokens fed so far, when asked
    delivered: bool = False  # a delta went out (the first carries ``prompt_logprobs``)
    continues: bool = False  # its text continues the prompt's (``Engine.add``)
    # Its cache came from the caller (``add``, ``resume``) and may be lazy on the caller's own
    # streams, which the evaluator's thread cannot evaluate: its next step starts on the caller's.
    callers_cache: bool = False

    @property
    def pending(self) -> list[int]:
        return self.prompt[len(self.fed):]

    @property
    def next_input(self) -> int:
        """What the next decode step feeds: the last prompt token (it joined the
        batch with it pending), else the last token sampled."""
        return self.prompt[len(self.fed)] if len(self.fed) < len(self.prompt) else self.output[-1]


@dataclass(eq=False)
class _Step:
    """A decode step started (its tokens computing) and not yet read."""

    rows: list[_Sequence]
    drafts: list[list[int]]  # each row's drafts, fed after its next input (``runtime.speculation``)
    tokens: mx.array  # each token slot's draw: a row's slots are its input's, then each draft's
    logprobs: list  # each slot's ``Draw.logprobs``
    # Each forward's rows, and the batch caches it wrote with the steps each held before.
    tiles: list[tuple[list[_Sequence], list[tuple[BatchQuantizedKVCache, int]]]]
    states: list[tuple[LayerCache, int, list]]  # recurrent layers before it (they cannot be cut back)
    contexts: list[int]  # tokens each row's cache held before it
    launched: float  # ``perf_counter`` when its build was done and it started computing
    evaluation: Future | None  # what to wait on before reading its tokens (``Evaluator.start``)

    @property
    def layers(self) -> list[tuple[BatchQuantizedKVCache, int]]:
        return [layer for _, layers in self.tiles for layer in layers]


def _settled(method):
    """An engine command: it waits for the decode step computing ahead, if any
    (it may read or change what that step computes), and builds its graphs
    on the evaluator's stream."""

    @functools.wraps(method)
    def command(self, *args, **kwargs):
        self._evaluator.settle()
        with mx.stream(self._evaluator.stream):
            return method(self, *args, **kwargs)

    return command


class Engine:
    """Continuous batching over per-sequence Q4 caches.  Not thread-safe: one owner.

    ``row_counts``: the token slots a decode forward may have (``calibrate``
    measures them; more sequences than the largest take more forwards);
    without it every forward has exactly ``decode_rows``, the most
    ``calibrate`` tries.  ``max_chunk``: the most prompt tokens of one
    sequence a prefill forward takes (fewer when its attention would pass
    ``attention_budget``, not below ``min_chunk``; more by a rest shorter than
    ``min_chunk``, which would cost a forward of its own); ``prefill_rows``
    (default twice ``max_chunk``): the most of several sequences' chunks
    together, where ``row_counts`` lets them share a forward and
    ``batch_prefill``.  ``model`` is made ``rowwise`` and ``lean`` in place.  ``shared_tokens``:
    a model sharded over ranks maps the tokens this rank sampled to those every
    rank goes on with (rank 0's: another CPU may round the logits differently).
    ``speculation``: decoding sequences verify drafts from their own history
    in the same forwards (``runtime.speculation``; not sharded: each rank
    would choose its own). ``float_head``: the closed tokens of a running
    sequence attended over unpacked in float, the rest packed
    (``kv.DequantizingKVCache``; None: all; "device": ``device_float_head``).
    """

    def __init__(
        self,
        model: nn.Module,
        tokenizer,
        *,
        kv_bits: int = 4,
        kv_group_size: int = 64,
        max_chunk: int = 512,
        prefill_rows: int | None = None,
        batch_prefill: bool = True,
        min_chunk: int = 32,
        attention_budget: int = 128 << 20,
        float_head: int | None | str = "device",
        decode_rows: int = DECODE_ROWS,
        row_counts: RowCounts | None = None,
        shared_tokens=None,
        speculation: bool = True,
    ):
        if decode_rows < 1:
            raise ValueError("decode_rows must be at least 1")
        self.model = lean(rowwise(model))
        self.tokenizer = tokenizer
        self.kv_bits = kv_bits
        self.kv_group_size = kv_group_size
        self.max_chunk = max_chunk
        self.prefill_rows = prefill_rows or 2 * max_chunk
        self.batch_prefill = batch_prefill
        self.min_chunk = min_chunk
        self.attention_budget = attention_budget
        self.float_head = device_float_head(model) if float_head == "device" else float_head
        self.decode_rows = decode_rows
        # BLAS picks kernels by shape, and kernels sum differently: decode forwards have only
        # token slot counts whose rows agree (``calibrate``), or one count.
        self.use_row_counts(row_counts or RowCounts.fixed(decode_rows))
        self.shared_tokens = shared_tokens or (lambda tokens: tokens)
        # Build each decode step while the last computes (not sharded: ranks act on rank 0's tokens).
        self.compute_ahead = shared_tokens is None
        self.speculation = speculation and shared_tokens is None
        self._n_heads = _query_heads(model)
        self._eos = set(tokenizer.eos_token_ids)
        self._grammars = Grammars(tokenizer, self._eos)
        self._ids = itertools.count()
        self._prefilling: deque[_Sequence] = deque()
        self._decoding: list[_Sequence] = []
        self._preempted: dict[int, _Sequence] = {}  # out of the engine, without their caches
        self._choices: dict[int, list[_Sequence]] = {}  # by the sequence whose prompt they wait on (``add_choices``)
        # Each decode forward's per-layer batch caches, kept while its sequences stay the same:
        # they hold the newest tokens' Q4 rows until ``_flush`` writes them to the records.
        self._batches: dict[tuple[int, ...], list[BatchQuantizedKVCache]] = {}
        self._ahead: _Step | None = None  # the decode step started on tokens not yet read
        self._evaluator = Evaluator()  # where steps compute: a step ahead, while the next is built
        self._held: set[int] = set()  # sequences whose next step verifies no drafts (``hold_drafts``)

    @functools.cached_property
    def _indents(self) -> Indents:
        return Indents.of(self.tokenizer)  # (for drafts: only an engine that speculates looks)

    # -- queries ---------------------------------------------------------

    @property
    def prefilling(self) -> int:
        return len(self._prefilling)

    @property
    def decoding(self) -> int:
        return len(self._decoding)

    @property
    def idle(self) -> bool:
        return not self._prefilling and not self._decoding

    def decode_lengths(self) -> dict[int, tuple[int, int]]:
        """For each decoding sequence: the tokens its cache may hold once the
        next decode step is read -- that step's input, and the next one's,
        which a step built ahead writes before its own turn to reserve (counted
        whether or not one is, so a reply cut by its budget ends at the same
        token either way) -- and how many drafts the step may add for a while
        (those it rejects are cut at its end). ``hold_drafts`` if those
        cannot fit."""
        ahead = self._ahead.rows if self._ahead is not None and self._ahead.rows == self._decoding else ()
        return {seq.id: (len(seq.fed) + 1, 0) if seq in ahead else (len(seq.fed) + 2, self._draft_room(seq))
                for seq in self._decoding}

    def hold_drafts(self, seq_id: int) -> None:
        """Verify no drafts for this sequence in the next decode step (its owner
        has no room for them)."""
        self._held.add(seq_id)

    def new_cache(self) -> SequenceCache:
        return make_sequence_cache(self.model, bits=self.kv_bits, group_size=self.kv_group_size)

    # -- commands --------------------------------------------------------

    @_settled
    def add(
        self,
        prompt: Seq[int],
        sampling: SamplingParams = SamplingParams(),
        cache: Seq | None = None,
        cached_tokens: int = 0,
        continues: bool = False,
    ) -> int:
        """Queue a sequence; return its id.

        ``cache`` (a ``SequenceCache``, or its layers) must hold exactly the K/V
        of ``prompt[:cached_tokens]``.  At least one prompt token is always
        prefilled, so a fully cached prompt goes back a token (or to the last
        point before it that its layers can go back to).  A sequence whose
        prompt is scored (``sampling.prompt_logprobs``) takes no cache: every
        token it scores must be fed, and it scores them all.  ``continues``:
        the reply's text continues the prompt's (a raw completion), so its
        first token keeps a leading space, which a chat reply's text drops
        (``_detokenizer``).
        """
        prompt = list(prompt)
        cache = None if cache is None else _sequence_cache(cache)
        if not prompt:
            raise ValueError("prompt must hold at least one token")
        if cached_tokens and sampling.prompt_logprobs is not None:
            raise ValueError("a prompt whose log-probabilities are asked for is prefilled whole: give no cache")
        if cache is None:
            if cached_tokens:
                raise ValueError("cached_tokens given without a cache")
            cache = self.new_cache()
        elif not 0 <= cached_tokens <= len(prompt):
            raise ValueError(f"cached_tokens={cached_tokens} outside the prompt (0..{len(prompt)})")
        elif any(c.offset != cached_tokens for c in cache):
            raise ValueError(f"the cache holds {cache[0].offset} tokens, not cached_tokens={cached_tokens}")
        if cached_tokens == len(prompt):  # back a token, or to the last point before it the cache can go back to
            back = cached_tokens - 1
            if not all(c.can_rewind(back) for c in cache):
                back = max((at for at in cache.checkpoints() if at < cached_tokens), default=0)
            cache.rewind(back)
            cached_tokens = back
        cache.mark()  # and where the turn starts: the conversation cached so far
        seq = self._sequence(prompt, sampling, cache, cached_tokens, continues)
        seq.callers_cache = cached_tokens > 0
        self._prefilling.append(seq)
        return seq.id

    @_settled
    def add_choices(self, seq_id: int, count: int) -> list[int]:
        """``count`` more replies to the prompt of a sequence still prefilling;
        their ids. The prompt is prefilled once: when it is in, each choice
        starts from a copy of the sequence's cache and samples on its own --
        with the seed plus its number (1, 2, ...) when the sampling has a seed,
        so choice ``i`` is what a lone sequence with that seed would say."""
        seq = next((s for s in self._prefilling if s.id == seq_id), None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not prefilling: choices start with its prompt")
        p = seq.sampling
        choices = [self._sequence(seq.prompt, p if p.seed is None else replace(p, seed=p.seed + i),
                                  SequenceCache(), 0, seq.continues)
                   for i in range(1, count + 1)]
        self._choices.setdefault(seq_id, []).extend(choices)
        return [c.id for c in choices]

    def _sequence(self, prompt: list[int], sampling: SamplingParams, cache: SequenceCache,
                  cached_tokens: int, continues: bool = False) -> _Sequence:
        return _Sequence(
            id=next(self._ids),
            prompt=prompt,
            sampling=sampling,
            sampler=Sampler(sampling, sampling.grammar and self._grammars.constraint(sampling.grammar,
                                                                                    sampling.max_tokens)),
            reply=ReplyText(self._detokenizer(continues), sampling.stop),
            continues=continues,
            cache=cache,
            view=cache.view(self.float_head),
            fed=prompt[:cached_tokens],
            reused=cached_tokens,
            prompt_tokens=len(prompt),
            drafter=Drafter(prompt, self._indents) if self.speculation else None,
        )

    def _detokenizer(self, continues: bool):
        """A fresh streaming detokenizer for a reply. mlx-lm's drop the space
        that begins a text (its first token's " The" is "The"), as a chat reply
        wants; one whose text ``continues`` the prompt's is first given the
        text "a", left out, so nothing begins there (one that holds "a" back
        is left as it is)."""
        detokenizer = self.tokenizer.detokenizer
        if continues:
            for token in self._primer:
                detokenizer.add_token(token)
            if detokenizer.last_segment != "a":
                detokenizer.reset()
        return detokenizer

    @functools.cached_property
    def _primer(self) -> list[int]:
        return list(self.tokenizer.encode("a", add_special_tokens=False))

    def _fork_choices(self, seq: _Sequence) -> list[_Sequence]:
        """The choices waiting on ``seq``'s prompt, each now with a copy of its
        cache, fed what it was fed."""
        choices = self._choices.pop(seq.id, [])
        for c in choices:
            c.cache = seq.cache.clone()
            c.view = c.cache.view(self.float_head)
            c.fed, c.reused = list(seq.fed), len(seq.fed)
            c.prompt_logprobs = list(seq.prompt_logprobs)
        return choices

    def prefill_step(self) -> list[Delta]:
        """Run the next pending prefill's next chunk -- with the chunks of the
        ones after it that may join it (``_picks``), in one forward; [] when
        none is pending, at once: the decode step computing ahead goes on (a
        server asks every step, and waiting here would build each next step
        with nothing computing beside it)."""
        return self._prefill() if self._prefilling else []

    @_settled
    def _prefill(self) -> list[Delta]:
        picks = self._picks()
        chunks = [seq.pending[:n] for seq, n, _ in picks]
        if len(picks) == 1:
            logits = self.model(mx.array(chunks[0])[None], cache=picks[0][0].view)
            if _scores(picks[0][0]):
                self._score_prompt(picks[0][0], logits[0])
        else:  # only cache writes are read: no logits are computed
            lengths = [len(c) for c in chunks]
            with row_plans.chunked(lengths):
                self.model(mx.array([t for c in chunks for t in c])[None],
                           cache=[PrefillBatch(layer, lengths) for layer in zip(*(seq.view for seq, _, _ in picks))])
        for _ in picks:
            self._prefilling.popleft()
        deltas = []
        for (seq, _, ride), chunk in zip(picks, chunks):
            seq.fed += chunk
            if ride or not seq.pending:  # the prompt is in: recurrent layers keep their state here (a checkpoint)
                seq.cache.mark()
            if seq.pending:
                mx.eval(seq.view.arrays())
                if ride:  # its last prompt token is the next decode step's input, as its choices'
                    self._decoding += [seq, *self._fork_choices(seq)]
                else:
                    self._prefilling.append(seq)  # round-robin among pending prefills
                continue
            for s in [seq, *self._fork_choices(seq)]:  # each draws from the prompt's last logits
                if not s.sampling.max_tokens:  # the prompt was all it asked for
                    mx.eval(s.view.arrays())
                    deltas.append(self._delta(s, (), "", LENGTH))
                    continue
                draw = s.sampler(logits[0, -1])
                token = self.shared_tokens(draw.token[None])[0]
                mx.eval(token, draw.logprobs, s.view.arrays())
                new, text, reason = self._accept(s, token.item(), draw.logprobs)
                if reason is None:
                    self._decoding.append(s)
                deltas.append(self._delta(s, new, text, reason))
        return deltas

    def _picks(self) -> list[tuple[_Sequence, int, bool]]:
        """The pending prefills whose chunks run in the next prefill forward, in
        queue order, each with its chunk's tokens and whether its last prompt
        token rides the next decode step. The first in the queue, alone -- or,
        where the measured counts let chunks of its size batch
        (``RowCounts.prefill_from``) and it needs no logits (no sampling, no
        scoring of its prompt), with the ones after it of which the same
        holds, while the forward holds at most ``prefill_rows`` tokens. A
        sequence that generates nothing (``max_tokens`` 0) takes its last
        prompt token in its chunk."""
        picks, rows, batching = [], 0, False
        for seq in self._prefilling:
            n = self._chunk_size(len(seq.fed))
            if len(seq.pending) - n < self.min_chunk:
                n = len(seq.pending)  # a short rest would cost a forward of its own: it comes along
            ride = _LAST_IN_CHUNK < len(seq.pending) <= n and seq.sampling.max_tokens > 0
            if ride:
                # Only the last token's logits are needed, but a chunk computes them for
                # every position (vocab x hidden a token): the last prompt token rides
                # the next decode step instead, beside the other sequences' tokens.
                n = len(seq.pending) - 1
            joins = self.batch_prefill and self.row_counts.prefill_from is not None and not _scores(seq) and (
                n >= self.row_counts.prefill_from and (ride or n < len(seq.pending)))
            if not picks:
                batching = joins  # the first in the queue decides whether others may join it
            elif not (batching and joins) or rows + n > self.prefill_rows:
                break
            picks.append((seq, n, ride))
            rows += n
        return picks

    def step_once(self) -> list[Delta]:
        """At least one new token for every decoding sequence; [] when none is decoding.

        A sequence whose history offers drafts worth verifying
        (``runtime.speculation``) feeds them after its next input in the same
        forward, and takes those its draws agree with and one more; the rest
        are cut from its caches. While the same sequences go on decoding
        without drafts (none waiting to join, none at its last token, none
        under a grammar, none whose history offers drafts), the next step is
        built and started on these tokens before they are read (``_launch``),
        so the model's graph is built while the last step computes. A
        sequence that still finishes (end of turn, a stop string), joins or
        leaves drops that step (``_drop_ahead``): nothing it computed is kept.
        The step ahead computes on the evaluator's thread (``runtime.evaluator``)
        while this returns and the next call builds the one after it."""
        with mx.stream(self._evaluator.stream):
            return self._step()

    def _step(self) -> list[Delta]:
        if not self._decoding:
            return []
        if self._ahead is not None and self._ahead.rows != self._decoding:
            self._drop_ahead()  # a sequence joined: a fresh step feeds everyone
        built_ahead = self._ahead is not None
        step, self._ahead = self._ahead or self._launch(), None
        self._held.clear()  # (for that step only)
        if self.compute_ahead and not self._prefilling and not any(step.drafts) and all(
                len(seq.output) + 1 < seq.sampling.max_tokens and seq.sampler.constraint is None
                for seq in step.rows) and not any(self._drafts_pay(step.rows)):
            # (not when a sequence is about to join or reach its length, nor when a grammar's
            # next mask or a sequence's drafts wait on these tokens)
            self._ahead = self._launch(after=step)
        computed = None if step.evaluation is None else step.evaluation.result()
        tokens = step.tokens.tolist()
        if computed is None and not built_ahead:  # (not on the CPU: its time since it started)
            computed = (time.perf_counter() - step.launched) * 1e3
        if computed is not None:
            self._costs.computed([1 + len(d) for d in step.drafts], step.contexts, computed)
        if self._ahead is not None:
            for seq, token in zip(step.rows, tokens):
                seq.fed.append(token)  # what the step ahead feeds
        results, at = [], 0
        for seq, drafts in zip(step.rows, step.drafts):
            width = 1 + len(drafts)
            results.append(self._verify(seq, drafts, tokens[at : at + width], step.logprobs[at : at + width], step))
            at += width
        self._decoding = [seq for seq, (_, _, reason) in zip(step.rows, results) if reason is None]
        if len(self._decoding) < len(step.rows):
            self._drop_ahead()
            self._flush()
        return [self._delta(seq, *result) for seq, result in zip(step.rows, results)]

    def _verify(self, seq: _Sequence, drafts: list[int], tokens: list[int], logprobs: list,
                step: _Step) -> tuple[tuple[int, ...], str, str | None]:
        """Take a sequence's tokens of a step: the draw of each slot while the
        draft fed there equals it, then the draw that differs (or the last
        slot's); drafts after the last taken are cut from its caches."""
        agreed = next((j for j, d in enumerate(drafts) if tokens[j] != d), len(drafts))
        new, text, reason = (), "", None
        taken = 0
        while reason is None and taken <= agreed:
            more, shown, reason = self._accept(seq, tokens[taken], logprobs[taken])
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

    def _cut(self, seq: _Sequence, n: int, step: _Step) -> None:
        """Drop a sequence's last ``n`` tokens of ``step`` (drafts not taken) from
        ``fed`` and every cache: rows the step holds, records, recurrent states."""
        del seq.fed[len(seq.fed) - n :]
        tile, layers = next((tile, layers) for tile, layers in step.tiles if seq in tile)
        i = tile.index(seq)
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

    @property
    def row_counts(self) -> RowCounts:
        return self._row_counts

    def use_row_counts(self, counts: RowCounts) -> None:
        """Run decode forwards of the token slots ``counts`` holds from now on
        (what ``calibrate`` measured, perhaps at an earlier start), each weight
        taking its rows as measured (``row_plans``)."""
        row_plans.apply(self.model, counts.plans)
        self._row_counts = counts
        self._costs = StepCosts(counts)  # what a step costs, for ``allot``

    @_settled
    def calibrate(self, max_rows: int | None = None, seed: int = 0) -> RowCounts:
        """What ``runtime.calibration`` measures for this engine's model: which
        decode row counts 1..``max_rows`` (default ``decode_rows``) and from
        which size prompt chunks leave a sequence's logits bitwise as alone.
        Does not change the engine (``use_row_counts`` does) and leaves its
        sequences alone."""
        return calibration.calibrate(self, max_rows or self.decode_rows, seed)

    @_settled
    def cancel(self, seq_id: int, reason: str = CANCELLED) -> Delta | None:
        """Drop a sequence; its final delta says ``reason`` (``cancelled``, or
        ``length`` when its owner cannot let it grow).  None if unknown.

        The returned cache is consistent: it covers exactly ``cache_tokens``
        (the prompt so far, plus the tokens fed back while decoding).
        """
        seq = self._take(seq_id)
        return None if seq is None else Delta(seq.id, (), "", self._finished(seq, reason))

    @_settled
    def preempt(self, seq_id: int) -> Finished | None:
        """Take a running sequence out of the engine so its cache can be freed;
        ``Finished(preempted)`` hands the cache over (it covers ``cache_tokens``).
        The sequence keeps its sampler, detokenizer and output for ``resume``."""
        seq = self._take(seq_id)
        if seq is None:
            return None
        finished = self._finished(seq, PREEMPTED)
        seq.cache = seq.view = None
        self._preempted[seq.id] = seq
        return finished

    @_settled
    def resume(self, seq_id: int, cache: Seq | None = None, cached_tokens: int = 0) -> None:
        """Put a preempted sequence back.  ``cache`` holds the K/V of the first
        ``cached_tokens`` of its ``cache_tokens`` (the preempted cache itself,
        perhaps through a file), or is None: the rest is prefilled again."""
        seq = self._preempted[seq_id]
        if cache is None:
            cache, cached_tokens = self.new_cache(), 0
        cache = _sequence_cache(cache)
        if not 0 <= cached_tokens <= len(seq.fed) or any(c.offset != cached_tokens for c in cache):
            raise ValueError(f"a resumed cache must cover 0..{len(seq.fed)} of the sequence's tokens exactly")
        del self._preempted[seq_id]
        if len(seq.fed) >= len(seq.prompt):  # it was decoding: its next input is the last token it sampled
            seq.prompt = seq.fed + seq.output[-1:]
        seq.fed = seq.fed[:cached_tokens]
        seq.cache, seq.view = cache, cache.view(self.float_head)
        seq.callers_cache = cached_tokens > 0
        # One token left is a decode input (as before it left); more are a prefill, chunked as before.
        (self._decoding.append if len(seq.pending) == 1 else self._prefilling.append)(seq)

    def discard(self, seq_id: int) -> None:
        """Forget a preempted sequence (its turn was cancelled while out)."""
        self._preempted.pop(seq_id, None)

    def _flush(self) -> None:
        """Write every decode forward's held Q4 rows to the records; forget the forwards."""
        for batch in self._batches.values():
            for layer in batch:
                layer.flush()
        self._batches = {}

    def _take(self, seq_id: int) -> _Sequence | None:
        self._drop_ahead()
        self._flush()
        for queue in (self._prefilling, self._decoding, *self._choices.values()):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    self._choices = {k: v for k, v in self._choices.items() if v}
                    return seq
        return None

    # -- internals -------------------------------------------------------

    def _launch(self, after: _Step | None = None) -> _Step:
        """Build and start a decode step of the decoding sequences, in forwards
        of ``row_counts``: fed their next inputs and the drafts ``_drafts_pay``
        allots them, or (``after``) the tokens that step samples, still
        computing, which ``step_once`` appends to ``fed`` once read."""
        start = time.perf_counter()
        rows = list(self._decoding)
        contexts = [len(seq.fed) for seq in rows]
        drafts = self._drafts_pay(rows, open=True) if after is None else [[] for _ in rows]
        tiles, at = [], 0
        for n, slots in self.row_counts.pack([1 + len(d) for d in drafts]):
            tiles.append((rows[at : at + n], drafts[at : at + n], slots))
            at += n
        keys = [tuple(seq.id for seq in tile) for tile, _, _ in tiles]
        if set(keys) != self._batches.keys():  # the forwards' sequences changed: records first
            self._flush()
            self._batches = {key: _batch(s.view for s in tile) for key, (tile, _, _) in zip(keys, tiles)}
        for layer in (layer for batch in self._batches.values() for layer in batch if layer.full):
            layer.flush()  # only steps that are read (``after`` is, next) are ever held
        for key, (tile, _, _) in zip(keys, tiles):
            if any(c.offset and c.offset % BLOCK_TOKENS == 0 for seq in tile for c in seq.view if c.attends_new):
                for layer in self._batches[key]:
                    layer.flush()  # the record closes the block before a step's first token (``kv.quantized``)
        states = [(c, c.offset, list(c.cache)) for seq in rows for c in seq.view if c.recurrent]
        written = [[(layer, layer.held) for layer in self._batches[key]] for key in keys]
        if after is None:
            fed = [[seq.next_input, *d] for seq, d in zip(rows, drafts)]
            for seq, tokens in zip(rows, fed):
                seq.fed += tokens
            inputs = mx.array([t for tokens in fed for t in tokens])
        else:
            inputs = after.tokens
        draws: list[Draw] = []
        at = 0
        for key, (tile, tile_drafts, slots) in zip(keys, tiles):
            widths = [1 + len(d) for d in tile_drafts]
            for layer in self._batches[key]:
                layer.widths = widths
            logits = self.forward(self._batches[key], inputs[at : at + sum(widths)], slots)
            slot = 0
            for seq, d in zip(tile, tile_drafts):  # each slot draws what decode would there: a draft is taken if drawn
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
        here = not self.compute_ahead or any(seq.callers_cache for seq in rows)
        evaluation = self._evaluator.start(tokens, [lp for lp in logprobs if lp is not None],
                                           [seq.view.arrays() for seq in rows], held, here=here)
        for seq in rows:
            seq.callers_cache = False
        return _Step(rows, drafts, tokens, logprobs, [(tile, w) for (tile, _, _), w in zip(tiles, written)], states,
                     contexts, launched, evaluation)

    def _draft_room(self, seq: _Sequence) -> int:
        """The most drafts a sequence may verify in its next step."""
        if seq.drafter is None or seq.id in self._held:
            return 0
        block_left = BLOCK_TOKENS - 1 - len(seq.fed) % BLOCK_TOKENS  # a step's tokens share a block (``kv.quantized``)
        return max(0, min(self.row_counts.counts[-1] - 1, seq.sampling.max_tokens - len(seq.output) - 1, block_left))

    def _drafts_pay(self, rows: list[_Sequence], open: bool = False) -> list[list[int]]:
        """The drafts each sequence verifies in its next step (``open``: one
        built in the open whatever it feeds): what its history offers, as many
        as ``allot`` finds pay for their slots -- and up to ``TRY`` where a
        sequence's drafts were never judged, as far as its forward has room:
        only verdicts tell its own rate, and the rate before any cannot pay
        everywhere (four agents beside each other)."""
        offers = [self._offer(seq) for seq in rows]
        if not any(offers):
            return offers
        tries = [TRY if seq.drafter is not None and not seq.drafter.verdicts else 0 for seq in rows]
        counts = allot(offers, [0.0 if seq.drafter is None else seq.drafter.rate for seq in rows],
                       [len(seq.fed) for seq in rows], self._costs, open, tries)
        return [offer[:n] for offer, n in zip(offers, counts)]

    def _offer(self, seq: _Sequence) -> list[int]:
        """What a sequence's history offers as drafts, as far as its grammar allows them."""
        if seq.drafter is None:
            return []
        offer = seq.drafter.offer(self._draft_room(seq))
        c = seq.sampler.constraint
        return offer if c is None or not offer else offer[: c.allows(offer)]

    def _drop_ahead(self) -> None:
        """Undo the step computed ahead, if any: each of its sequences as before
        it (its input out of ``fed``, its sampler's draw, its token out of every
        cache: held rows and working copies dropped, records cut back,
        recurrent states restored)."""
        step, self._ahead = self._ahead, None
        if step is None:
            return
        self._evaluator.settle()
        for seq in step.rows:
            seq.fed.pop()
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

    def prefilled(self, tokens: list[int]) -> SequenceCache:
        """A fresh sequence cache holding ``tokens``, prefilled alone."""
        cache = self.new_cache()
        view = cache.view(self.float_head)
        self.model(mx.array(tokens)[None], cache=view)
        mx.eval(view.arrays())
        return cache

    def _chunk_size(self, context: int) -> int:
        # Attention scores of a chunk are heads x chunk x context floats: cap them.
        per_token = self._n_heads * (context + self.max_chunk) * 4
        fit = self.attention_budget // max(per_token, 1)
        return int(min(self.max_chunk, max(self.min_chunk, fit)))

    def _accept(self, seq: _Sequence, token: int, logprobs=None) -> tuple[tuple[int, ...], str, str | None]:
        """Record a sampled token (with its ``Draw.logprobs``, evaluated, if
        asked for) -- or, under a grammar, the token it takes instead to close
        within ``max_tokens`` (``Constraint.fit``): (new token ids, text to
        show, finish reason or None)."""
        reason = None
        c = seq.sampler.constraint
        drawn, token = token, token if c is None else c.fit(token)  # (another, to close within max_tokens)
        if c is not None and token is not None:
            c.advance(token)
        new: tuple[int, ...] = () if token is None else (token,)
        if token is None:  # the grammar is complete here and what was drawn would not fit: the limit ends it
            reason = LENGTH
        elif token in self._eos:
            reason, new = STOP, ()
        else:
            seq.output.append(token)
            if seq.drafter is not None:
                seq.drafter.extend(token)
            if token != drawn and seq.sampling.logprobs is not None:  # the only token the grammar allowed
                seq.logprobs.append(TokenLogprob.certain(token, self._grammars.token_bytes(token),
                                                         seq.sampling.logprobs > 0))
            elif logprobs is not None:
                seq.logprobs.append(TokenLogprob.read(token, logprobs, self._grammars.token_bytes))
            seq.reply.add(token)
            if len(seq.output) >= seq.sampling.max_tokens:
                reason = LENGTH
        if reason is not None:
            seq.reply.finish()
        text, hit = seq.reply.release(final=reason is not None)
        return new, text, STOP if hit else reason

    def _delta(self, seq: _Sequence, new: tuple[int, ...], text: str, reason: str | None) -> Delta:
        first, seq.delivered = not seq.delivered, True
        return Delta(seq.id, new, text, None if reason is None else self._finished(seq, reason),
                     tuple(seq.logprobs[-len(new):]) if new and seq.logprobs else (),
                     tuple(seq.prompt_logprobs) if first else ())

    def _score_prompt(self, seq: _Sequence, logits: mx.array) -> None:
        """Score the prompt tokens a chunk's ``logits`` predict, the chunk
        being the tokens after ``seq.fed``: row ``j`` is the model's
        prediction of the token after the chunk's ``j``-th, so a chunk of
        ``n`` from offset ``o`` scores prompt tokens ``o + 1`` to ``o + n``
        (its last row the next chunk's first token, or nothing past the
        prompt). The first token has nothing before it: logprob None."""
        start, pieces = len(seq.fed), self._grammars.token_bytes
        if start == 0:
            seq.prompt_logprobs.append(TokenLogprob(seq.prompt[0], pieces(seq.prompt[0]), None))
        targets = seq.prompt[start + 1 : min(start + 1 + logits.shape[0], seq.prompt_tokens)]
        if not targets:
            return
        values, ids = row_logprobs(logits[: len(targets)], targets, seq.sampling.prompt_logprobs)
        mx.eval(values, ids)
        for token, v, top in zip(targets, values.tolist(), ids.tolist()):
            seq.prompt_logprobs.append(TokenLogprob.of(token, v, top, pieces))

    def _finished(self, seq: _Sequence, reason: str) -> Finished:
        mx.eval(seq.cache.arrays())
        return Finished(
            reason=reason,
            cache=seq.cache,
            cache_tokens=tuple(seq.fed),
            output_tokens=tuple(seq.output),
            text=seq.reply.text,
            prompt_tokens=seq.prompt_tokens,
            reused_tokens=seq.reused,
            prefilled_tokens=min(len(seq.fed), seq.prompt_tokens) - seq.reused,
            stop_sequence=seq.reply.stop if reason == STOP else None,
            logprobs=tuple(seq.logprobs),
            drafted_tokens=seq.drafted,
            accepted_tokens=seq.accepted,
            prompt_logprobs=tuple(seq.prompt_logprobs),
        )


def _scores(seq: _Sequence) -> bool:
    """Whether the sequence's next prefill chunk is scored: it asked, and its
    prompt is not scored yet (a resumed sequence that recomputes it was)."""
    return seq.sampling.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.prompt_tokens


def _batch(views) -> list[BatchQuantizedKVCache]:
    """Per-layer batch caches of the sequences whose attention views are ``views``."""
    return [BatchQuantizedKVCache(layer) for layer in zip(*views)]


def _sequence_cache(cache: Seq) -> SequenceCache:
    """``cache`` as a ``SequenceCache`` (a list of layer caches: one over the same layers)."""
    return cache if isinstance(cache, SequenceCache) else SequenceCache(cache)


def _query_heads(model: nn.Module) -> int:
    attn = next(layer.self_attn for layer in model.layers if "self_attn" in layer)
    for name in ("n_heads", "num_attention_heads", "num_heads"):
        if isinstance(value := getattr(attn, name, None), int):
            return value
    return 32
