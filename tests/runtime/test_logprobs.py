"""Log-probabilities of the tokens drawn: float32 log-softmax of the row drawn
from (after a grammar's mask, before temperature), the same in any batch."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from semantic.runtime.engine import Engine, SamplingParams
from semantic.runtime.grammar import Grammars, json_schema
from semantic.runtime.sampling import Sampler, TokenLogprob
from tests.runtime.test_engine import drain
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
    view = engine.new_cache().view(engine.float_attention)
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
