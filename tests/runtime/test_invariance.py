"""Batch invariance, bit for bit: a sequence's logits at every decode step are
the same whatever runs beside it -- whatever its neighbours' lengths (a
left-padded layout would give it every padding 0-63) and wherever it sits in
the batch (positions 0-8, across a decode-tile boundary).

Written against the engine's public API so that it also runs on layouts that
pad rows: such a layout fails wherever the machine's vector width does not
divide a padding (softmax lanes, BLAS k-loops).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime import sampling
from runtime.batch_cache import copy_cache, trimmable_tokens
from runtime.engine import Engine, SamplingParams
from tests.runtime.test_engine import ByteTokenizer, drain
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model

STEPS = 3  # the first token comes from the row's own prefill; then two batched decode steps
LONGEST = 130  # the anchor row; the others are 1-64 tokens shorter


@pytest.fixture
def logits_by_params(monkeypatch):
    """Every row of logits a sampler sees, keyed by its SamplingParams object."""
    seen: dict[int, list[mx.array]] = {}
    call = sampling.Sampler.__call__

    def recording(self, logits):
        seen.setdefault(id(self.params), []).append(logits)
        return call(self, logits)

    monkeypatch.setattr(sampling.Sampler, "__call__", recording)
    return seen


def _base(model, tokenizer, tokens: list[int]) -> list:
    """The Q4 cache of ``tokens`` as a finished turn hands it back."""
    engine = Engine(model, tokenizer)
    sid = engine.add(tokens, SamplingParams(max_tokens=1))
    return drain(engine)[sid].cache


def _row(base_cache, tokens: list[int], length: int, cold: bool):
    """(prompt, cache, cached) for a row whose context is ``tokens[:length]``: cut from
    the base cache where every layer can be trimmed, else prefilled from scratch."""
    prompt = tokens[: length + 1]
    if cold:
        return prompt, None, 0
    cache = copy_cache(base_cache)
    for c in cache:
        c.trim(c.offset - length)
    return prompt, cache, length


def _run(model, tokenizer, rows, seen) -> list[list[mx.array]]:
    engine = Engine(model, tokenizer)
    seen.clear()  # ids of dead objects are reused
    params = [SamplingParams(max_tokens=STEPS) for _ in rows]  # one object per row: the recorder's key
    for (prompt, cache, cached), p in zip(rows, params):
        engine.add(prompt, p, copy_cache(cache) if cache else None, cached)
    drain(engine)
    return [seen.pop(id(p)) for p in params]


def assert_batch_invariant(model, tokenizer, seen):
    tokens = mx.random.randint(1, VOCAB, (LONGEST + 1,), key=mx.random.key(7)).tolist()
    base = _base(model, tokenizer, tokens)
    lengths = [LONGEST] + [LONGEST - p for p in range(1, 65)]
    cold = trimmable_tokens(base) < base[0].offset - min(lengths)  # a cache that cannot be cut back that far
    alone = {n: _run(model, tokenizer, [_row(base, tokens, n, cold)], seen)[0] for n in lengths}
    failures = []
    for q in range(8):
        # The anchor (longest) and 8 rows whose paddings under it are 8r + q + 1: every
        # padding 1-64 once over the q loop; rotated so each lands at many positions.
        batch = [LONGEST] + [LONGEST - (8 * r + q + 1) for r in range(8)]
        batch = batch[q:] + batch[:q]
        runs = _run(model, tokenizer, [_row(base, tokens, n, cold) for n in batch], seen)
        for position, (n, got) in enumerate(zip(batch, runs)):
            want = alone[n]
            assert len(got) == len(want) == STEPS
            steps = [k for k in range(STEPS) if not mx.array_equal(got[k], want[k]).item()]
            if steps:
                worst = max(mx.abs(got[k] - want[k]).max().item() for k in steps)
                failures.append(f"padding {LONGEST - n} at position {position}: steps {steps}, max |diff| {worst:.2e}")
    assert not failures, f"{len(failures)} of 72 rows differ from alone:\n" + "\n".join(failures)


@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_rows_are_bitwise_invariant_tiny(arch, logits_by_params):
    assert_batch_invariant(tiny_model(arch), ByteTokenizer(), logits_by_params)


@pytest.mark.model
def test_rows_are_bitwise_invariant_smollm2(smollm2, logits_by_params):
    assert_batch_invariant(smollm2.model, smollm2.tokenizer, logits_by_params)
