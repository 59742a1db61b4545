"""Batch invariance, bit for bit: a sequence's logits at every decode step are
the same whatever runs beside it -- whatever its neighbours' lengths (a
left-padded layout would give it every padding 0-63), wherever it sits in
the batch (positions 0-8, across a decode-tile boundary), and however many
neighbours come and go (forwards of every row count the engine measured).

Written against the engine's public API so that it also runs on layouts that
pad rows: such a layout fails wherever the machine's vector width does not
divide a padding (softmax lanes, BLAS k-loops).
"""

from __future__ import annotations

import contextlib
import dataclasses
import random

import mlx.core as mx
import mlx.nn as nn
import pytest

from semantic.runtime.engine import prefill as prefill_module
from semantic.runtime.engine import sampling
from semantic.runtime.engine.batch_cache import PrefillBatch
from semantic.runtime.kv import SequenceCache
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.row_counts import RowCounts
from tests.runtime.test_engine import ByteTokenizer, drain, measured
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model

STEPS = 3  # the first token comes from the row's own prefill; then two batched decode steps
LONGEST = 130  # the anchor row; the others are 1-64 tokens shorter


@pytest.fixture
def logits_by_params(monkeypatch):
    """Every row of logits a sampler sees, keyed by its SamplingParams object
    (less those of a step computed ahead and dropped: ``Sampler.undo``). The
    engines these tests run verify no drafts, so every row seen is a step's
    (``test_speculation`` checks the rows drafts take)."""
    seen: dict[int, list[mx.array]] = {}
    call, undo = sampling.Sampler.__call__, sampling.Sampler.undo

    def recording(self, logits, draft=None, mask=None):
        assert draft is None and mask is None, "an engine of these tests verified a draft"
        seen.setdefault(id(self.params), []).append(logits)
        return call(self, logits)

    def forgetting(self):
        seen[id(self.params)].pop()
        undo(self)

    monkeypatch.setattr(sampling.Sampler, "__call__", recording)
    monkeypatch.setattr(sampling.Sampler, "undo", forgetting)
    return seen


def _base(model, tokenizer, tokens: list[int]) -> list:
    """The Q4 cache of ``tokens`` as a finished turn hands it back."""
    engine = Engine(model, tokenizer)  # prefill only
    sid = engine.add(tokens, SamplingParams(max_tokens=1))
    return drain(engine)[sid].cache


def _row(base_cache, tokens: list[int], length: int, cold: bool):
    """(prompt, cache, cached) for a row whose context is ``tokens[:length]``: cut from
    the base cache where every layer can be trimmed, else prefilled from scratch."""
    prompt = tokens[: length + 1]
    if cold:
        return prompt, None, 0
    cache = SequenceCache(base_cache).clone()
    for c in cache:
        c.trim(c.offset - length)
    return prompt, cache, length


def _run(model, tokenizer, rows, seen, row_counts) -> list[list[mx.array]]:
    engine = Engine(model, tokenizer, row_counts=row_counts, speculation=False)
    seen.clear()  # ids of dead objects are reused
    params = [SamplingParams(max_tokens=STEPS) for _ in rows]  # one object per row: the recorder's key
    for (prompt, cache, cached), p in zip(rows, params):
        engine.add(prompt, p, SequenceCache(cache).clone() if cache else None, cached)
    drain(engine)
    return [seen.pop(id(p)) for p in params]


class _Endless:
    """A tokenizer without end tokens: every row decodes all its steps, whatever the model draws."""

    eos_token_ids: set = set()

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def assert_batch_invariant(model, tokenizer, seen):
    tokenizer = _Endless(tokenizer)
    counts = measured(model, tokenizer)
    tokens = mx.random.randint(1, VOCAB, (LONGEST + 1,), key=mx.random.key(7)).tolist()
    base = _base(model, tokenizer, tokens)
    lengths = [LONGEST] + [LONGEST - p for p in range(1, 65)]
    cold = SequenceCache(base).trimmable_tokens < base[0].offset - min(lengths)  # a cache that cannot be cut back that far
    alone = {n: _run(model, tokenizer, [_row(base, tokens, n, cold)], seen, counts)[0] for n in lengths}
    failures = []
    for q in range(8):
        # The anchor (longest) and 8 rows whose paddings under it are 8r + q + 1: every
        # padding 1-64 once over the q loop; rotated so each lands at many positions.
        batch = [LONGEST] + [LONGEST - (8 * r + q + 1) for r in range(8)]
        batch = batch[q:] + batch[:q]
        runs = _run(model, tokenizer, [_row(base, tokens, n, cold) for n in batch], seen, counts)
        for position, (n, got) in enumerate(zip(batch, runs)):
            want = alone[n]
            assert len(got) == len(want) == STEPS
            steps = [k for k in range(STEPS) if not mx.array_equal(got[k], want[k]).item()]
            if steps:
                worst = max(mx.abs(got[k] - want[k]).max().item() for k in steps)
                failures.append(f"padding {LONGEST - n} at position {position}: steps {steps}, max |diff| {worst:.2e}")
    assert not failures, f"{len(failures)} of 72 rows differ from alone:\n" + "\n".join(failures)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_rows_are_bitwise_invariant_tiny(arch, logits_by_params):
    assert_batch_invariant(tiny_model(arch), ByteTokenizer(), logits_by_params)


@pytest.mark.slow
@pytest.mark.model
def test_rows_are_bitwise_invariant_smollm2(smollm2, logits_by_params):
    assert_batch_invariant(smollm2.model, smollm2.tokenizer, logits_by_params)


def _come_and_go(model, tokenizer, seen, row_counts, seed: int = 0) -> list[str]:
    """A probe sequence decodes 12 steps alone, then beside 1-7 neighbours that
    arrive and leave (finish or are cancelled) at random steps; every step's
    logits must be bitwise the same. Returns what differed."""
    rng = random.Random(seed)
    prompt = lambda: [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))]
    probe, steps = prompt(), 12
    runs = []
    for busy in (False, True):
        engine = Engine(model, tokenizer, row_counts=row_counts, speculation=False)
        seen.clear()
        params = SamplingParams(max_tokens=steps)
        engine.add(probe, params)
        live: list[int] = []

        def act(step):
            if not busy:
                return
            if live and rng.random() < 0.3:
                engine.cancel(live.pop(rng.randrange(len(live))))
            for _ in range(rng.randrange(0, 3)):
                if len(live) < 7:
                    live.append(engine.add(prompt(), SamplingParams(max_tokens=rng.randrange(1, 10))))

        act(0)
        drain(engine, act)
        runs.append(seen.pop(id(params)))
    alone, busy = runs
    assert len(alone) == len(busy) == steps
    return [f"step {k}" for k in range(steps) if not mx.array_equal(alone[k], busy[k]).item()]


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_rows_agree_as_neighbours_come_and_go(arch, logits_by_params):
    model, tok = tiny_model(arch), ByteTokenizer()
    counts = measured(model, tok)
    for seed in range(3):
        assert not _come_and_go(model, tok, logits_by_params, counts, seed), (counts, seed)


@pytest.mark.slow
@pytest.mark.model
def test_rows_agree_as_neighbours_come_and_go_smollm2(smollm2, logits_by_params):
    """The embedded model at every count measured here: where the weight shapes
    needed plans (SkylakeX, Cooperlake), with them."""
    counts = measured(smollm2.model, smollm2.tokenizer)
    assert not _come_and_go(smollm2.model, smollm2.tokenizer, logits_by_params, counts), counts


class _RowCountDependent(nn.Module):
    """A final norm whose rows shift by a count-dependent amount in forwards of
    ``bad`` rows (``only``: that row alone): a reduction whose blocking
    follows M, as BLAS kernels do."""

    def __init__(self, norm: nn.Module, bad: set[int], only: int | None = None):
        super().__init__()
        self.norm, self.bad, self.only = norm, bad, only

    def __call__(self, x):
        y = self.norm(x)
        if x.shape[1] not in self.bad:
            return y
        if self.only is not None:
            return y + 1e-3 * (mx.arange(x.shape[1]) == self.only)[:, None]
        return y + 1e-3 * x.shape[1]


def test_calibration_rejects_row_counts_whose_rows_differ(logits_by_params):
    """With a forward that computes rows differently at each of 5-8 rows, each
    of those counts agrees only with itself, the engine decodes within one
    class, and replies stay the same alone and batched; made to use every
    count anyway, the same comparison fails (so it would catch a scheduler
    that strays outside the measured set)."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    model.model.norm = _RowCountDependent(model.model.norm, bad={5, 6, 7, 8})
    counts = Engine(model, tok).calibrate()  # not measured(): this model is not what its shapes say
    assert all(len(c) == 1 for c in counts.classes if {5, 6, 7, 8} & set(c)), counts.classes
    assert counts.counts in counts.classes, counts
    assert not _come_and_go(model, tok, logits_by_params, counts)
    every = RowCounts(tuple(range(1, 9)))
    assert any(_come_and_go(model, tok, logits_by_params, every, seed) for seed in range(3))


def test_plans_are_measured_again_for_the_counts_the_forward_allows(monkeypatch):
    """Matmuls whose rows change from 5 rows on (as where OpenBLAS splits M
    between threads), in a forward whose rows at 5-8 depend on their place
    (no plan covers the norm): the counts are 1-4, and a plan that makes the
    matmul's 5-8 agree, which would cost the counts in use, is not kept --
    1-4 need none."""
    _matmuls_row_by_row(monkeypatch, shift=lambda m: 1e-3 * (5 <= m <= 8))
    model, tok = tiny_model("llama"), ByteTokenizer()
    model.model.norm = _RowCountDependent(model.model.norm, bad={5, 6, 7, 8}, only=1)
    counts = Engine(model, tok, speculation=False).calibrate()
    assert counts.classes == ((1, 2, 3, 4),) and counts.counts == (1, 2, 3, 4), counts
    assert counts.plans == (), counts.plans


def test_calibration_checks_every_slot(monkeypatch):
    """A forward whose second row of four comes out its own way (as Prescott's
    kernels compute the third of 9 rows): 4 is never used, though its first,
    middle and last slots agree with every other count."""
    _matmuls_row_by_row(monkeypatch)
    model, tok = tiny_model("llama"), ByteTokenizer()
    model.model.norm = _RowCountDependent(model.model.norm, bad={4}, only=1)
    counts = Engine(model, tok, speculation=False).calibrate()
    assert counts.classes == ((1, 2, 3, 5, 6, 7, 8),), counts.classes


def _matmuls_row_by_row(monkeypatch, shift=lambda m: 0.0) -> None:
    """Every linear layer and tied embedding's logits computed one row at a
    time (no rule of this machine's kernels), linear layers' rows shifted by
    ``shift(row count)``."""
    plain, logits = nn.Linear.__call__, nn.Embedding.as_linear
    one_by_one = lambda f: lambda self, x: mx.concatenate(
        [f(self, x[..., i : i + 1, :]) for i in range(x.shape[-2])], axis=-2)
    monkeypatch.setattr(nn.Embedding, "as_linear", one_by_one(logits))
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: one_by_one(plain)(self, x) + shift(x.shape[-2]))


def _prefill_together(model, tokenizer, seen, row_counts, seed: int = 0,
                      prefill_chunk: int = 96) -> tuple[list[str], int]:
    """A probe sequence with a long prompt (several chunks) prefills and
    decodes alone, then beside others that arrive with it and later, with
    prompts of many lengths; every logits row it samples from must be bitwise
    the same. Returns what differed, and how many layers' prefill batches held
    several chunks."""
    rng = random.Random(seed)
    prompt = lambda n: [rng.randrange(1, VOCAB) for _ in range(n)]
    probe, steps = prompt(3 * prefill_chunk + 17), 6

    class Counting(PrefillBatch):
        shared = 0

        def __init__(self, caches, lengths):
            super().__init__(caches, lengths)
            Counting.shared += len(lengths) > 1

    runs = []
    for busy in (False, True):
        # Three chunks' rows a forward: a final chunk with its short rest still finds a neighbour.
        engine = Engine(model, tokenizer, prefill_chunk=prefill_chunk, prefill_rows=3 * prefill_chunk,
                        row_counts=row_counts, speculation=False)
        seen.clear()
        params = SamplingParams(max_tokens=steps)

        def act(step):
            if busy and step in (0, 2, 3):
                for _ in range(rng.randrange(1, 3)):
                    engine.add(prompt(rng.choice([5, 30, 70, 150, 2 * prefill_chunk + 3])),
                               SamplingParams(max_tokens=rng.randrange(1, 6)))

        act(0)
        engine.add(probe, params)
        act(1)
        prefill_module.PrefillBatch, plain = Counting, prefill_module.PrefillBatch
        try:
            drain(engine, act)
        finally:
            prefill_module.PrefillBatch = plain
        runs.append(seen.pop(id(params)))
    alone, busy = runs
    assert len(alone) == len(busy) == steps
    return [f"step {k}" for k in range(steps) if not mx.array_equal(alone[k], busy[k]).item()], Counting.shared


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_a_prefill_batched_with_others_equals_alone(arch, logits_by_params):
    """Every family: chunks that the measured counts let share a forward do,
    and the probe's logits are bitwise those it gets alone."""
    model, tok = tiny_model(arch), ByteTokenizer()
    counts = measured(model, tok)
    shared = 0
    for seed in range(2):
        differ, n = _prefill_together(model, tok, logits_by_params, counts, seed)
        assert not differ, (counts.prefill_from, seed, differ)
        shared += n
    assert counts.prefill_from is None or shared, "no forward held several chunks"


@pytest.mark.slow
@pytest.mark.model
def test_a_prefill_batched_with_others_equals_alone_smollm2(smollm2, logits_by_params):
    counts = measured(smollm2.model, smollm2.tokenizer)
    differ, shared = _prefill_together(smollm2.model, smollm2.tokenizer, logits_by_params, counts, prefill_chunk=256)
    assert not differ and (counts.prefill_from is None or shared), (counts.prefill_from, differ)


class _ChunkCountDependent(nn.Module):
    """A layer norm whose rows shift in forwards of more than ``rows`` rows:
    a kernel that changes with the row count from some count on."""

    def __init__(self, norm: nn.Module, rows: int):
        super().__init__()
        self.norm, self.rows = norm, rows

    def __call__(self, x):
        y = self.norm(x)
        return y + 1e-3 if x.shape[1] > self.rows else y


def test_calibration_keeps_apart_chunks_whose_rows_would_differ(logits_by_params):
    """Rows that change past 40 rows: chunks smaller than that would change
    beside others, so only larger ones may share a forward -- and a probe
    prefilled in chunks of 32 gets the same logits; made to batch every chunk
    anyway, it does not (so the comparison would catch a scheduler that
    batched chunks the measurement keeps apart)."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    model.model.layers[0].input_layernorm = _ChunkCountDependent(model.model.layers[0].input_layernorm, 40)
    counts = Engine(model, tok).calibrate()
    assert counts.prefill_from is not None and counts.prefill_from > 40, counts.prefill_from
    together = lambda counts, seed: _prefill_together(model, tok, logits_by_params, counts, seed, prefill_chunk=32)[0]
    assert not any(together(counts, seed) for seed in range(2))
    assert any(together(dataclasses.replace(counts, prefill_from=1), seed) for seed in range(2))


def test_chunks_sharing_a_forward_take_their_matmuls_alone(logits_by_params, monkeypatch):
    """Matmuls whose rows depend on the row count (as under OpenBLAS's Prescott
    kernels, which run each thread's share of M in pairs of rows and a row
    left over their own way): chunks that share a prefill forward still get
    the logits they get alone, because each linear layer runs once per chunk
    (``row_plans.chunked``) -- and without that they do not."""
    from semantic.runtime.engine import row_plans

    plain = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: plain(self, x) + 1e-3 * (x.shape[-2] % 5))
    model, tok = tiny_model("llama"), ByteTokenizer()
    counts = dataclasses.replace(Engine(model, tok).calibrate(), prefill_from=1)  # every chunk may share a forward
    together = lambda seed: _prefill_together(model, tok, logits_by_params, counts, seed, prefill_chunk=32)
    for seed in range(2):
        differ, shared = together(seed)
        assert not differ and shared, (seed, differ, shared)
    monkeypatch.setattr(row_plans, "chunked", lambda lengths: contextlib.nullcontext())
    assert any(together(seed)[0] for seed in range(2))
