"""Log-probabilities of the tokens drawn: float32 log-softmax of the row drawn
from (after a grammar's mask, before temperature), the same in any batch."""

from __future__ import annotations

import math
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.text.grammar import Grammars, json_schema
from semantic.runtime.text.reply_text import reply_detokenizer
from semantic.runtime.engine.row_counts import RowCounts
from semantic.runtime.engine.sampling import Sampler, TokenLogprob
from tests.runtime.test_engine import drain, prefix_cache
from tests.tiny import embedded_tokenizer, tiny_model_with_tokenizer


PIECES = lambda t: b"%d" % t  # noqa: E731  (any token -> bytes map will do here)


def log_softmax(row: np.ndarray) -> np.ndarray:
    row = row.astype(np.float64)
    return row - (row.max() + np.log(np.exp(row - row.max()).sum()))


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_a_draws_logprobs_are_the_rows_log_softmax(temperature):
    logits = mx.random.normal((300,), key=mx.random.key(1)) * 4
    draw = Sampler(SamplingParams(temperature=temperature, top_k=5, seed=2, logprobs=4))(logits)
    mx.eval(draw)
    lp = TokenLogprob.read(draw.token.item(), draw.logprobs, PIECES)
    want = log_softmax(np.array(logits))
    assert lp.logprob == pytest.approx(want[lp.token], abs=1e-5) and lp.piece == PIECES(lp.token)
    assert [t.token for t in lp.top] == list(np.argsort(-want)[:4])
    assert [t.logprob for t in lp.top] == pytest.approx(sorted(want, reverse=True)[:4], abs=1e-5)
    if temperature == 0:
        assert lp.top[0] == TokenLogprob(lp.token, lp.piece, lp.logprob)
    none = Sampler(SamplingParams(logprobs=0))(logits)
    assert TokenLogprob.read(none.token.item(), none.logprobs, PIECES).top == ()
    assert Sampler(SamplingParams())(logits).logprobs is None
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)


def test_under_a_grammar_the_logprobs_are_of_the_masked_row():
    tok = embedded_tokenizer()
    constraint = Grammars(tok, tok.eos_token_ids).constraint(json_schema({"enum": ["red", "green"]}))
    vocab = len(tok.get_vocab())
    logits = mx.random.normal((vocab,), key=mx.random.key(3))
    allowed = np.array(constraint.allowed(vocab))
    draw = Sampler(SamplingParams(logprobs=3), constraint)(logits)
    mx.eval(draw)
    lp = TokenLogprob.read(draw.token.item(), draw.logprobs, PIECES)
    want = log_softmax(np.where(allowed, np.array(logits), -np.inf))
    assert lp.logprob == pytest.approx(want[lp.token], abs=1e-5)
    assert 0 < len(lp.top) <= 3 and all(allowed[t.token] and t.logprob > -math.inf for t in lp.top)


@pytest.mark.slow
def test_logprobs_stream_with_their_tokens_and_do_not_depend_on_the_batch():
    model, tok = tiny_model_with_tokenizer("llama")
    prompts = [tok.encode(t) for t in ("Once upon a time", "Colour?", "A list:")]
    samplings = [SamplingParams(max_tokens=10, logprobs=3), SamplingParams(max_tokens=10),
                 SamplingParams(max_tokens=10, temperature=0.8, seed=4, logprobs=0)]

    def run(pairs):
        engine = Engine(model, tok)
        ids = [engine.add(p, s) for p, s in pairs]
        streamed = {i: [] for i in ids}
        done = {}
        while not engine.idle:
            for d in engine.prefill_step() + engine.step_once():
                assert len(d.logprobs) in (0, len(d.tokens)) and [lp.token for lp in d.logprobs] in ([], list(d.tokens))
                streamed[d.seq_id] += d.logprobs
                if d.finished:
                    done[d.seq_id] = d.finished
        for i in ids:
            assert tuple(streamed[i]) == done[i].logprobs
        return [(done[i].output_tokens, done[i].logprobs) for i in ids]

    alone = [run([pair])[0] for pair in zip(prompts, samplings)]
    assert run(list(zip(prompts, samplings))) == alone  # tokens and logprobs, bit for bit
    tokens, logprobs = alone[0]
    assert [lp.token for lp in logprobs] == list(tokens) and all(len(lp.top) == 3 for lp in logprobs)
    assert all(lp.top[0] == TokenLogprob(lp.token, lp.piece, lp.logprob) for lp in logprobs)  # greedy: the likeliest
    assert b"".join(lp.piece for lp in logprobs).decode("utf-8", "replace") == tok.decode(list(tokens))
    assert alone[1][1] == () and all(lp.top == () for lp in alone[2][1])


def test_the_first_tokens_logprobs_match_a_direct_forward_of_the_prompt():
    """The prompt through the model over a fresh Q4 cache, as the engine's one
    chunk runs it: the log-softmax of its last row is what the engine reports."""

    model, tok = tiny_model_with_tokenizer("qwen3")
    prompt = tok.encode("The weather in Oslo is")
    engine = Engine(model, tok)  # (makes the model's norms and MLPs the engine's, in place)
    sid = engine.add(prompt, SamplingParams(max_tokens=1, logprobs=5))
    first = drain(engine)[sid].logprobs[0]
    view = engine.new_cache().view(engine.float_head)
    want = log_softmax(np.array(model(mx.array(prompt)[None], cache=view)[0, -1]))
    # (the engine's log-softmax is float32, this one float64: they part at ~1e-5 of logits this large)
    assert first.logprob == pytest.approx(want[first.token], abs=1e-4)
    assert [t.token for t in first.top] == list(np.argsort(-want)[:5])
    assert [t.logprob for t in first.top] == pytest.approx(sorted(want, reverse=True)[:5], abs=1e-4)


def test_a_tokenizer_llguidance_cannot_read_still_gets_logprobs():
    from tests.runtime.test_engine import ByteTokenizer
    from tests.tiny import tiny_model

    tok = ByteTokenizer()
    engine = Engine(tiny_model("llama"), tok)
    sid = engine.add([5, 6, 7], SamplingParams(max_tokens=4, logprobs=1))
    done = drain(engine)[sid]
    assert [lp.piece for lp in done.logprobs] == [tok.decode([t]).encode() for t in done.output_tokens]


# -- the prompt's tokens (SamplingParams.prompt_logprobs) ------------------------

TEXT = (Path(__file__).parents[2] / "bench" / "data" / "lighthouses.txt").read_text()


def direct_prompt_logprobs(engine: Engine, prompt: list[int], chunks: list[int]) -> np.ndarray:
    """The float32 log-softmax of each row of a direct forward of the engine's
    model over a fresh cache of the engine's kind, in ``chunks``: row ``i`` the
    distribution of prompt token ``i + 1``. (A float64 log-softmax of the same
    logits is up to 1.2e-4 away on this model's wide rows: float32 sums 49K exps.)"""
    view, rows, at = engine.new_cache().view(engine.float_head), [], 0
    for n in chunks:
        rows.append(engine.model(mx.array(prompt[at : at + n])[None], cache=view)[0])
        at += n
    rows = mx.concatenate(rows)[:-1].astype(mx.float32)
    return np.array(rows - mx.logsumexp(rows, axis=-1, keepdims=True))


@pytest.mark.parametrize("kv_bits", [4, 8, 16])
def test_each_prompt_tokens_logprob_is_the_log_softmax_of_the_row_before_it(kv_bits):
    """Scored in the forwards that prefill it (three chunks; the last prompt
    token joins the decode step), each prompt token's logprob and likeliest
    alternatives are those of a direct forward over a cache of the same kind,
    within 1e-4; the first token has none. They come with the sequence's first
    delta, and the first generated token's are the draw's as ever."""
    model, tok = tiny_model_with_tokenizer("llama")
    prompt = tok.encode(TEXT)[:198]
    engine = Engine(model, tok, kv_bits=kv_bits, prefill_chunk=64, min_chunk=16)
    sid = engine.add(prompt, SamplingParams(max_tokens=2, logprobs=1, prompt_logprobs=3))
    deltas = []
    while not engine.idle:
        deltas += [d for d in engine.prefill_step() + engine.step_once() if d.seq_id == sid]
    done = deltas[-1].finished
    entries = done.prompt_logprobs
    assert [e.token for e in entries] == prompt
    assert entries[0] == TokenLogprob(prompt[0], entries[0].piece, None, ())
    assert b"".join(e.piece for e in entries).decode() == tok.decode(prompt)
    want = direct_prompt_logprobs(engine, prompt, [64, 64, 70])
    got = np.array([e.logprob for e in entries[1:]])
    assert np.abs(got - want[np.arange(len(prompt) - 1), prompt[1:]]).max() < 1e-4
    for e, row in zip(entries[1:], want):
        assert [t.token for t in e.top] == list(np.argsort(-row)[:3])
        assert [t.logprob for t in e.top] == pytest.approx(list(np.sort(row)[::-1][:3]), abs=1e-4)
    assert deltas[0].prompt_logprobs == entries and all(d.prompt_logprobs == () for d in deltas[1:])
    assert len(done.logprobs) == len(done.output_tokens) == 2


def test_a_scored_prompt_prefills_alone_and_whole():
    """Beside prompts whose chunks share forwards, a scored prompt's chunks run
    alone: its values are those it has alone, bit for bit. ``max_tokens`` 0
    prefills the whole prompt and generates nothing; choices get the prompt's
    values; a scored prompt takes no cache (its tokens must be fed)."""
    model, tok = tiny_model_with_tokenizer("llama")
    prompt = tok.encode(TEXT)[:150]
    scored = SamplingParams(max_tokens=0, prompt_logprobs=1)
    options = dict(prefill_chunk=32, min_chunk=32, row_counts=RowCounts((1,), prefill_from=9))

    def run(others: int):
        engine = Engine(model, tok, **options)
        for n in range(others):
            engine.add(tok.encode(TEXT)[n * 7 : n * 7 + 120], SamplingParams(max_tokens=1))
        sid = engine.add(prompt, scored)
        choices = engine.add_choices(sid, 1)
        done = drain(engine)
        return done[sid], done[choices[0]]

    alone, choice = run(0)
    beside, _ = run(2)
    assert (alone.reason, alone.output_tokens, alone.text, alone.cache_tokens) == ("length", (), "", tuple(prompt))
    assert len(alone.prompt_logprobs) == len(prompt) and beside.prompt_logprobs == alone.prompt_logprobs
    assert choice.prompt_logprobs == alone.prompt_logprobs and choice.output_tokens == ()
    engine = Engine(model, tok)
    with pytest.raises(ValueError, match="prefilled whole"):
        engine.add(prompt, scored, prefix_cache(engine, prompt[:10]), 10)


def test_a_reply_that_continues_its_prompt_keeps_its_first_space():
    """mlx-lm's detokenizers drop the space a text begins with, as a chat reply
    wants; a raw completion's reply (``continues``) keeps it: its text is its
    tokens' decoded."""
    _, tok = tiny_model_with_tokenizer("llama")
    ids = tok.encode(" openly and", add_special_tokens=False)
    assert tok.decode(ids) == " openly and"
    for continues, want in ((False, "openly and"), (True, " openly and")):
        detokenizer, text = reply_detokenizer(tok, continues), ""
        for t in ids:  # what the engine reads of it: each token's segment
            detokenizer.add_token(t)
            text += detokenizer.last_segment
        detokenizer.finalize()
        assert text + detokenizer.last_segment == want
