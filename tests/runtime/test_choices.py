"""Several replies to one prompt (``Engine.add_choices``): the prompt is
prefilled once, and each choice is bitwise what a lone sequence would say --
greedy, the same reply; sampled with a seed, the reply of that seed plus the
choice's number -- for every family (a copied cache must hold what the
sequence's own prefill would have written)."""

from __future__ import annotations

import random

import pytest

from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.sequence import CANCELLED
from tests.runtime.test_engine import ByteTokenizer, drain, measured
from tests.runtime.test_speculation import assert_same
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model


def lone(model, tok, counts, prompt, params):
    engine = Engine(model, tok, row_counts=counts)
    sid = engine.add(prompt, params)
    return drain(engine)[sid]


def prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, VOCAB) for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
@pytest.mark.parametrize("length", [20, 150])  # its first token drawn in prefill; or in the first decode step
def test_each_choice_is_a_lone_reply_and_the_prompt_is_prefilled_once(arch, length):
    model, tok = tiny_model(arch), ByteTokenizer()
    counts = measured(model, tok)
    p = prompt(length, length)
    for params in (SamplingParams(max_tokens=12, logprobs=2),
                   SamplingParams(max_tokens=12, temperature=1.0, seed=7, logprobs=2)):
        engine = Engine(model, tok, row_counts=counts)
        first = engine.add(p, params)
        ids = [first, *engine.add_choices(first, 2)]
        other = engine.add(prompt(1, 30), SamplingParams(max_tokens=5))  # a neighbour, as in a server
        done = drain(engine)
        assert other in done
        for i, sid in enumerate(ids):
            seed = None if params.seed is None else params.seed + i
            want = lone(model, tok, counts, p, SamplingParams(max_tokens=12, temperature=params.temperature,
                                                              seed=seed, logprobs=2))
            assert_same(want, done[sid])
            assert done[sid].prompt_tokens == length
        assert done[first].prefilled_tokens == length
        assert all(done[sid].prefilled_tokens <= 1 for sid in ids[1:])  # at most the last prompt token
    if params.temperature:
        assert len({done[sid].output_tokens for sid in ids}) > 1  # (three seeds over 12 tokens of 512)


def test_choices_start_from_a_cached_prompt():
    """A follow-up turn: the cache covers most of the prompt; its choices fork after the rest."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    counts = measured(model, tok)
    engine = Engine(model, tok, row_counts=counts)
    head = prompt(3, 40)
    sid = engine.add(head, SamplingParams(max_tokens=1))
    cached = drain(engine)[sid]
    p = list(cached.cache_tokens) + prompt(4, 10)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=3)
    first = engine.add(p, params, cached.cache, len(cached.cache_tokens))
    ids = [first, *engine.add_choices(first, 3)]
    done = drain(engine)
    for i, sid in enumerate(ids):
        want = lone(model, tok, counts, p, SamplingParams(max_tokens=8, temperature=0.8, seed=3 + i))
        assert done[sid].output_tokens == want.output_tokens


def test_choices_cancelled_before_the_prompt_is_in():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, prefill_chunk=32, min_chunk=8)
    first = engine.add(prompt(5, 200), SamplingParams(max_tokens=4))
    ids = [first, *engine.add_choices(first, 2)]
    engine.prefill_step()
    for sid in reversed(ids):
        delta = engine.cancel(sid)
        assert delta.finished.reason == CANCELLED
    assert engine.idle and drain(engine) == {} and not engine._choices  # nothing left behind
    with pytest.raises(ValueError, match="not prefilling"):
        engine.add_choices(first, 1)
