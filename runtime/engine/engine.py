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
  and one more (``runtime.engine.speculation``). While the same sequences decode, the
  step after is built and started on those tokens before they are read, so
  the model's graph is built while the last step computes; a sequence that
  finishes, joins or leaves drops that step (undone in every cache);
* a sequence that asks for its prompt's log-probabilities
  (``SamplingParams.prompt_logprobs``) has each prefill chunk's rows scored
  in the forward that feeds it (``Prefiller``): it is prefilled alone,
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
to agree by ``calibrate``: ``runtime.engine.row_counts``); attention runs per
sequence over its own cache (``runtime.engine.batch_cache``). So a sequence's
logits are bitwise the same whatever else runs, wherever it sits in the
batch.

Parts: the prefill queue (``runtime.engine.prefill``), the decode batch
(``runtime.engine.decode``), a sequence's state (``runtime.engine.sequence``); what a
drawn token becomes and every sequence's way in and out are the engine's.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import replace
from typing import Sequence as Seq

import mlx.core as mx
import mlx.nn as nn

from . import calibration, row_plans
from .batch_cache import BatchQuantizedKVCache
from .decode import Decoder
from ..text.grammar import Grammars
from ..kv import SequenceCache, device_float_head, make_sequence_cache
from ..model.lean import lean
from .prefill import Prefiller
from ..text.reply_text import ReplyText, reply_detokenizer
from .row_counts import RowCounts
from .rowwise import rowwise
from .sampling import Sampler, SamplingParams, TokenLogprob
from .sequence import CANCELLED, LENGTH, PREEMPTED, STOP, Delta, Finished, FinishReason, Sequence
from .speculation import Drafter, Indents

__all__ = ["DECODE_ROWS", "Delta", "Engine", "FinishReason", "Finished", "SamplingParams", "TokenLogprob"]

DECODE_ROWS = 8  # the most token slots of a decode forward (``Engine.decode_rows``)


def _settled(method):
    """An engine command: it waits for the decode step computing ahead, if any
    (it may read or change what that step computes), and builds its graphs
    on the evaluator's stream."""

    @functools.wraps(method)
    def command(self, *args, **kwargs):
        self._decoder.evaluator.settle()
        with mx.stream(self._decoder.evaluator.stream):
            return method(self, *args, **kwargs)

    return command


class Engine:
    """Continuous batching over per-sequence Q4 caches.  Not thread-safe: one owner.

    ``row_counts``: the token slots a decode forward may have (``calibrate``
    measures them; more sequences than the largest take more forwards);
    without it every forward has exactly ``decode_rows``, the most
    ``calibrate`` tries.  ``prefill_chunk``: the most prompt tokens of one
    sequence a prefill forward takes (fewer when its attention would pass
    ``attention_budget``, not below ``min_chunk``; more by a rest shorter than
    ``min_chunk``, which would cost a forward of its own); ``prefill_rows``
    (default twice ``prefill_chunk``): the most of several sequences' chunks
    together, where ``row_counts`` lets them share a forward and
    ``batch_prefill``.  ``model`` is made ``rowwise`` and ``lean`` in place.  ``shared_tokens``:
    a model sharded over ranks maps the tokens this rank sampled to those every
    rank goes on with (rank 0's: another CPU may round the logits differently).
    ``speculation``: decoding sequences verify drafts from their own history
    in the same forwards (``runtime.engine.speculation``; not sharded: each rank
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
        prefill_chunk: int = 512,
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
        self.float_head = device_float_head(model) if float_head == "device" else float_head
        self.decode_rows = decode_rows
        self.shared_tokens = shared_tokens or (lambda tokens: tokens)
        self.speculation = speculation and shared_tokens is None
        self._eos = set(tokenizer.eos_token_ids)
        self._grammars = Grammars(tokenizer, self._eos)
        self._ids = itertools.count()
        self._prefiller = Prefiller(self.model, self._grammars.token_bytes, prefill_chunk=prefill_chunk,
                                    prefill_rows=prefill_rows or 2 * prefill_chunk, batch_prefill=batch_prefill,
                                    min_chunk=min_chunk, attention_budget=attention_budget)
        # BLAS picks kernels by shape, and kernels sum differently: decode forwards have only
        # token slot counts whose rows agree (``calibrate``), or one count.
        counts = row_counts or RowCounts.fixed(decode_rows)
        row_plans.apply(self.model, counts.plans)
        self._decoder = Decoder(self.model, counts, self.shared_tokens, pipelined=shared_tokens is None)
        self._preempted: dict[int, Sequence] = {}  # out of the engine, without their caches
        self._choices: dict[int, list[Sequence]] = {}  # by the sequence whose prompt they wait on (``add_choices``)

    @functools.cached_property
    def _indents(self) -> Indents:
        return Indents.of(self.tokenizer)  # (for drafts: only an engine that speculates looks)

    # -- queries ---------------------------------------------------------

    @property
    def prefill_chunk(self) -> int:
        return self._prefiller.prefill_chunk

    @property
    def prefill_rows(self) -> int:
        return self._prefiller.prefill_rows

    @property
    def prefilling(self) -> int:
        return len(self._prefiller.queue)

    @property
    def decoding(self) -> int:
        return len(self._decoder.rows)

    @property
    def idle(self) -> bool:
        return not self._prefiller.queue and not self._decoder.rows

    def decode_lengths(self) -> dict[int, tuple[int, int]]:
        """Each decoding sequence's room to reserve for its next step (``Decoder.lengths``)."""
        return self._decoder.lengths()

    def hold_drafts(self, seq_id: int) -> None:
        """Verify no drafts for this sequence in the next decode step (its owner
        has no room for them)."""
        self._decoder.hold_drafts(seq_id)

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
        (``reply_detokenizer``).
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
        self._prefiller.queue.append(seq)
        return seq.id

    @_settled
    def add_choices(self, seq_id: int, count: int) -> list[int]:
        """``count`` more replies to the prompt of a sequence still prefilling;
        their ids. The prompt is prefilled once: when it is in, each choice
        starts from a copy of the sequence's cache and samples on its own --
        with the seed plus its number (1, 2, ...) when the sampling has a seed,
        so choice ``i`` is what a lone sequence with that seed would say."""
        seq = next((s for s in self._prefiller.queue if s.id == seq_id), None)
        if seq is None:
            raise ValueError(f"sequence {seq_id} is not prefilling: choices start with its prompt")
        p = seq.sampling
        choices = [self._sequence(seq.prompt, p if p.seed is None else replace(p, seed=p.seed + i),
                                  SequenceCache(), 0, seq.continues, choice=i)
                   for i in range(1, count + 1)]
        self._choices.setdefault(seq_id, []).extend(choices)
        return [c.id for c in choices]

    def _sequence(self, prompt: list[int], sampling: SamplingParams, cache: SequenceCache,
                  cached_tokens: int, continues: bool = False, choice: int = 0) -> Sequence:
        return Sequence(
            id=next(self._ids),
            prompt=prompt,
            sampling=sampling,
            sampler=Sampler(sampling, sampling.grammar and self._grammars.constraint(sampling.grammar,
                                                                                    sampling.max_tokens)),
            reply=ReplyText(reply_detokenizer(self.tokenizer, continues), sampling.stop),
            continues=continues,
            cache=cache,
            view=cache.view(self.float_head),
            cached=prompt[:cached_tokens],
            reused=cached_tokens,
            prompt_tokens=len(prompt),
            drafter=Drafter(prompt, self._indents) if self.speculation else None,
            choice=choice,
        )

    def _fork_choices(self, seq: Sequence) -> list[Sequence]:
        """The choices waiting on ``seq``'s prompt, each now with a copy of its
        cache, fed what it was fed."""
        choices = self._choices.pop(seq.id, [])
        for c in choices:
            c.cache = seq.cache.clone()
            c.view = c.cache.view(self.float_head)
            c.cached, c.reused = list(seq.cached), len(seq.cached)
            c.prompt_logprobs = list(seq.prompt_logprobs)
        return choices

    def prefill_step(self) -> list[Delta]:
        """Run the next pending prefill's next chunk -- with the chunks of the
        ones after it that may join it (``Prefiller.picks``), in one forward; [] when
        none is pending, at once: the decode step computing ahead goes on (a
        server asks every step, and waiting here would build each next step
        with nothing computing beside it)."""
        return self._prefill() if self._prefiller.queue else []

    @_settled
    def _prefill(self) -> list[Delta]:
        picks = self._prefiller.picks(self.row_counts)
        logits = self._prefiller.run(picks)
        deltas = []
        for seq, _, joins_decode in picks:
            if seq.pending:
                if joins_decode:  # its last prompt token is the next decode step's input, as its choices'
                    self._decoder.join(seq, *self._fork_choices(seq))
                continue
            for s in [seq, *self._fork_choices(seq)]:  # each draws from the prompt's last logits
                if not s.sampling.max_tokens:  # the prompt was all it asked for
                    mx.eval(s.view.arrays())
                    deltas.append(self._delta(s, (), "", LENGTH))
                    continue
                draw = s.sampler(logits[-1])
                token = self.shared_tokens(draw.token[None])[0]
                mx.eval(token, draw.logprobs, s.view.arrays())
                new, text, reason = self._accept(s, token.item(), draw.logprobs)
                if reason is None:
                    self._decoder.join(s)
                deltas.append(self._delta(s, new, text, reason))
        return deltas

    def step_once(self) -> list[Delta]:
        """At least one new token for every decoding sequence; [] when none is decoding.

        A sequence whose history offers drafts worth verifying
        (``runtime.engine.speculation``) feeds them after its next input in the same
        forward, and takes those its draws agree with and one more; the rest
        are cut from its caches. While the same sequences go on decoding
        without drafts (none waiting to join, none at its last token, none
        under a grammar, none whose history offers drafts), the next step is
        built and started on these tokens before they are read, so the
        model's graph is built while the last step computes. A sequence that
        still finishes (end of turn, a stop string), joins or leaves drops
        that step (``Decoder.drop_next_step``): nothing it computed is kept. The
        step ahead computes on the evaluator's thread (``runtime.engine.evaluator``)
        while this returns and the next call builds the one after it."""
        with mx.stream(self._decoder.evaluator.stream):
            results = self._decoder.step(self._accept, prefills_waiting=bool(self._prefiller.queue))
        return [self._delta(*result) for result in results]

    @property
    def row_counts(self) -> RowCounts:
        return self._decoder.row_counts

    def use_row_counts(self, counts: RowCounts) -> None:
        """Run decode forwards of the token slots ``counts`` holds from now on
        (what ``calibrate`` measured, perhaps at an earlier start), each weight
        taking its rows as measured (``row_plans``)."""
        row_plans.apply(self.model, counts.plans)
        self._decoder.use_row_counts(counts)

    @_settled
    def calibrate(self, max_rows: int | None = None, seed: int = 0) -> RowCounts:
        """What ``runtime.engine.calibration`` measures for this engine's model: which
        decode row counts 1..``max_rows`` (default ``decode_rows``) and from
        which size prompt chunks leave a sequence's logits bitwise as alone.
        Does not change the engine (``use_row_counts`` does) and leaves its
        sequences alone."""
        return calibration.calibrate(self, max_rows or self.decode_rows, seed)

    @_settled
    def cancel(self, seq_id: int, reason: FinishReason = CANCELLED) -> Delta | None:
        """Drop a sequence; its final delta says ``reason`` (``cancelled``, or
        ``length`` when its owner cannot let it grow).  None if unknown.

        The returned cache is consistent: it covers exactly ``cache_tokens``
        (the prompt so far, plus the tokens fed back while decoding).
        """
        seq = self._take(seq_id)
        if seq is None:
            return None
        return Delta("", choice=seq.choice, seq_id=seq.id, finished=self._finished(seq, reason))

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
        if not 0 <= cached_tokens <= len(seq.cached) or any(c.offset != cached_tokens for c in cache):
            raise ValueError(f"a resumed cache must cover 0..{len(seq.cached)} of the sequence's tokens exactly")
        del self._preempted[seq_id]
        if len(seq.cached) >= len(seq.prompt):  # it was decoding: its next input is the last token it sampled
            seq.prompt = seq.cached + seq.output[-1:]
        seq.cached = seq.cached[:cached_tokens]
        seq.cache, seq.view = cache, cache.view(self.float_head)
        seq.callers_cache = cached_tokens > 0
        # One token left is a decode input (as before it left); more are a prefill, chunked as before.
        (self._decoder.join if len(seq.pending) == 1 else self._prefiller.queue.append)(seq)

    def discard(self, seq_id: int) -> None:
        """Forget a preempted sequence (its turn was cancelled while out)."""
        self._preempted.pop(seq_id, None)

    def _take(self, seq_id: int) -> Sequence | None:
        self._decoder.drop_next_step()
        self._decoder.flush()
        for queue in (self._prefiller.queue, self._decoder.rows, *self._choices.values()):
            for seq in queue:
                if seq.id == seq_id:
                    queue.remove(seq)
                    self._choices = {k: v for k, v in self._choices.items() if v}
                    return seq
        return None

    # -- for ``runtime.engine.calibration`` ---------------------------------------

    def forward(self, batch: list[BatchQuantizedKVCache], inputs, slots: int) -> mx.array:
        """One decode forward (``Decoder.forward``)."""
        return self._decoder.forward(batch, inputs, slots)

    def prefilled(self, tokens: list[int]) -> SequenceCache:
        """A fresh sequence cache holding ``tokens``, prefilled alone."""
        cache = self.new_cache()
        view = cache.view(self.float_head)
        self.model(mx.array(tokens)[None], cache=view)
        mx.eval(view.arrays())
        return cache

    # -- what a drawn token becomes --------------------------------------

    def _accept(self, seq: Sequence, token: int, logprobs=None) -> tuple[tuple[int, ...], str, str | None]:
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

    def _delta(self, seq: Sequence, new: tuple[int, ...], text: str, reason: FinishReason | None) -> Delta:
        first, seq.delivered = not seq.delivered, True
        return Delta(text, new, tuple(seq.logprobs[-len(new):]) if new and seq.logprobs else (), seq.choice,
                     tuple(seq.prompt_logprobs) if first else (), seq.id,
                     None if reason is None else self._finished(seq, reason))

    def _finished(self, seq: Sequence, reason: FinishReason) -> Finished:
        mx.eval(seq.cache.arrays())
        return Finished(
            reason=reason,
            cache=seq.cache,
            cache_tokens=tuple(seq.cached),
            output_tokens=tuple(seq.output),
            text=seq.reply.text,
            prompt_tokens=seq.prompt_tokens,
            reused_tokens=seq.reused,
            prefilled_tokens=min(len(seq.cached), seq.prompt_tokens) - seq.reused,
            stop_sequence=seq.reply.stop if reason == STOP else None,
            logprobs=tuple(seq.logprobs),
            drafted_tokens=seq.drafted,
            accepted_tokens=seq.accepted,
            prompt_logprobs=tuple(seq.prompt_logprobs),
        )


def _sequence_cache(cache: Seq) -> SequenceCache:
    """``cache`` as a ``SequenceCache`` (a list of layer caches: one over the same layers)."""
    return cache if isinstance(cache, SequenceCache) else SequenceCache(cache)
