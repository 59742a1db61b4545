"""The batched engine, tested by equality: greedy tokens of a sequence in a
busy batch must equal the same sequence run alone."""

from __future__ import annotations

import mlx.core as mx
import pytest

from semantic.runtime.engine import row_counts
from semantic.runtime.engine.batch_cache import PrefillBatch
from semantic.runtime.cache_records import BLOCK_TOKENS
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.row_counts import RowCounts
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model


class ByteTokenizer:
    """Just enough tokenizer for random-weight models: ids are bytes of text."""

    eos_token_ids = {0}

    @property
    def detokenizer(self):
        from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer

        return NaiveStreamingDetokenizer(self)

    def decode(self, ids, **_):
        return bytes(i % 256 for i in ids).decode("utf-8", errors="replace")

    def encode(self, text, **_):
        return list(text.encode())


def drain(engine: Engine, until=None) -> dict:
    """Run the engine until idle; return {seq_id: Finished}; ``until(step)`` may act."""
    done, step = {}, 0
    while not engine.idle:
        for d in engine.prefill_step() + engine.step_once():
            if d.finished:
                done[d.seq_id] = d.finished
        step += 1
        if until:
            until(step)
    return done


def alone(model, tokenizer, prompt, sampling, prefix=None, **options) -> tuple[int, ...]:
    engine = Engine(model, tokenizer, **options)
    cache, cached = (None, 0) if prefix is None else (prefix_cache(engine, prompt[:prefix]), prefix)
    sid = engine.add(prompt, sampling, cache, cached)
    return drain(engine)[sid].output_tokens


def prefix_cache(engine: Engine, prefix: list[int]) -> list:
    """A Q4 cache of ``prefix`` as a finished turn hands it back (as if loaded)."""
    sid = engine.add(prefix, SamplingParams(max_tokens=1))
    finished = drain(engine)[sid]
    assert finished.cache_tokens == tuple(prefix)
    return finished.cache


def prompts(n: int, seed: int, long: bool = False) -> list[list[int]]:
    rng = mx.random.key(seed)
    lengths = [100, 7, 23, 90, 13][:n]  # A and D end in a long chunk: their last token joins a decode step
    if long:  # past two blocks; C's decode steps start its third
        lengths = [760, 7, 506, 640, 13][:n]
    return [mx.random.randint(1, VOCAB, (L,), key=mx.random.split(rng, n)[i]).tolist() for i, L in enumerate(lengths)]


def busy_batch_equals_alone(model, tokenizer, steps: int = 12, long: bool = False, **options):
    A, B, C, D, E = prompts(5, seed=1, long=long)
    greedy = SamplingParams(max_tokens=steps)
    short = SamplingParams(max_tokens=3)  # B finishes early
    expected = {
        "A": alone(model, tokenizer, A, greedy, **options),
        "B": alone(model, tokenizer, B, short, **options),
        "C": alone(model, tokenizer, C, greedy, prefix=15, **options),  # starts from a Q4 cache + suffix
        "D": alone(model, tokenizer, D, greedy, **options),  # joins while others decode
        "E": alone(model, tokenizer, E, greedy, **options),  # cancelled mid-way
    }
    engine = Engine(model, tokenizer, **options)
    ids = {
        "A": engine.add(A, greedy),
        "B": engine.add(B, short),
        "C": engine.add(C, greedy, prefix_cache(Engine(model, tokenizer), C[:15]), 15),
        "E": engine.add(E, greedy),
    }
    cancelled = {}

    def act(step):
        if step == 6:
            ids["D"] = engine.add(D, greedy)
        if step == 9:
            cancelled["E"] = engine.cancel(ids["E"]).finished

    done = drain(engine, act)
    for name in "ABCD":
        assert done[ids[name]].output_tokens == expected[name], name
    e = cancelled["E"]
    assert e.reason == "cancelled" and 0 < len(e.output_tokens) < steps
    assert e.output_tokens == expected["E"][: len(e.output_tokens)]
    assert done[ids["B"]].reason == "length" and len(done[ids["B"]].output_tokens) == 3
    assert done[ids["C"]].reused_tokens == 15 and done[ids["C"]].prefilled_tokens == len(C) - 15


@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_a_long_prompts_last_token_rides_the_next_decode_step(arch):
    model, tok = tiny_model(arch), ByteTokenizer()
    (prompt,) = prompts(1, seed=3)
    sampling = SamplingParams(max_tokens=5)
    engine = Engine(model, tok)
    sid = engine.add(prompt, sampling)
    assert engine.prefill_step() == [] and (engine.prefilling, engine.decoding) == (0, 1)
    (first,) = engine.step_once()
    assert first.seq_id == sid and len(first.tokens) == 1
    finished = drain(engine)[sid]
    assert finished.prompt_tokens == finished.prefilled_tokens == len(prompt)
    assert finished.cache_tokens == tuple(prompt) + finished.output_tokens[:-1]
    assert all(c.offset == len(finished.cache_tokens) for c in finished.cache if not hasattr(c, "max_size"))
    # The same tokens as with 32-token chunks, whose last chunk computes the first token itself.
    small = Engine(model, tok, prefill_chunk=32, min_chunk=32)
    sid = small.add(prompt, sampling)
    assert drain(small)[sid].output_tokens == finished.output_tokens


def measured(model, tokenizer):
    """The row counts this machine's decode forward may use for ``model``: measured
    once a run for its parameters' shapes (``row_counts.cached``, under the run's home)."""
    return row_counts.cached(Engine(model, tokenizer))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_busy_batch_equals_alone_tiny(arch):
    """Forwards of every measured row count: five sequences, then four, ... as they come and go."""
    model, tok = tiny_model(arch), ByteTokenizer()
    busy_batch_equals_alone(model, tok, row_counts=measured(model, tok))


@pytest.mark.parametrize("decode_rows", [1, 3])
def test_busy_batch_equals_alone_at_other_decode_rows(decode_rows):
    """One fixed count (not measured): one slot a forward (each sequence its own
    forward) and 3 (the five sequences take two forwards a step, and move
    between them as others finish)."""
    busy_batch_equals_alone(tiny_model("llama"), ByteTokenizer(), decode_rows=decode_rows)


@pytest.mark.slow
@pytest.mark.model
def test_busy_batch_equals_alone_smollm2(smollm2):
    busy_batch_equals_alone(smollm2.model, smollm2.tokenizer, steps=10,
                            row_counts=measured(smollm2.model, smollm2.tokenizer))


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in TINY_CONFIGS if a != "gpt_oss"])  # (learned sinks: all in float)
def test_busy_batch_equals_alone_attending_over_q4(arch):
    """Attention over the Q4 records themselves past the first block (Metal's
    path; MLA and gated attention get them unpacked for their own call): a
    step computed ahead and dropped (the cancel, the sequences that join) is
    cut back out of the records, and recurrent states go back."""
    model, tok = tiny_model(arch), ByteTokenizer()
    busy_batch_equals_alone(model, tok, float_head=BLOCK_TOKENS, row_counts=measured(model, tok), long=True)


@pytest.mark.parametrize("arch", ["llama", "gpt_oss"])
def test_quantized_and_float_attention_agree(arch):
    """Decode attends over Q4 packed past the first block (Metal) or over a
    dequantized working copy (CPU, and sinks): the same tokens either way."""
    model, tok = tiny_model(arch), ByteTokenizer()
    runs = []
    for float_head in (BLOCK_TOKENS, None):
        engine = Engine(model, tok, float_head=float_head)
        ids = [engine.add(p, SamplingParams(max_tokens=10)) for p in prompts(3, seed=9)]
        done = drain(engine)
        runs.append([done[i].output_tokens for i in ids])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("leave", ["finish", "cancel", "preempt"])
def test_decoded_tokens_reach_the_record_exactly(leave):
    """A decode step's new rows wait in the forward's batch cache and go to the
    records every ``ROWS`` steps and whenever a sequence leaves: the record a
    sequence hands back holds exactly the K/V its attention read."""
    from semantic.runtime.engine.batch_cache import BatchQuantizedKVCache

    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, float_head=None)
    steps = 2 * BatchQuantizedKVCache.ROWS + 5  # two flushes of full rows, then a partial one
    long_, short = (engine.add(p, SamplingParams(max_tokens=steps + 10)) for p in prompts(2, seed=4))
    while engine.prefilling:
        engine.prefill_step()
    views = {seq.id: seq.view for seq in engine._decoder.rows}
    finished = {}
    for step in range(steps):
        if step == 20:
            finished[short] = engine.cancel(short).finished  # leaves mid-rows
        for d in engine.step_once():
            finished.update({d.seq_id: d.finished} if d.finished else {})
    assert long_ not in finished, "the sequence must still be decoding"
    finished[long_] = {"finish": lambda: engine.cancel(long_, "length").finished,
                       "cancel": lambda: engine.cancel(long_).finished,
                       "preempt": lambda: engine.preempt(long_)}[leave]()
    for sid, f in finished.items():
        assert len(f.cache_tokens) > (steps if sid == long_ else 20)
        for record, view in zip(f.cache, views[sid]):
            n = record.offset
            assert n == len(f.cache_tokens) and view.unwritten == 0
            for kept, seen in zip(record.floats(), view._float):
                assert mx.array_equal(kept, seen[..., :n, :]).item()


def test_a_one_token_prompt_preempted_before_its_prefill_resumes_as_a_decode_input():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, float_head=None)
    sid = engine.add([42], SamplingParams(max_tokens=6))
    assert engine.preempt(sid).cache_tokens == ()
    engine.resume(sid)  # no cache: its one token is the next decode input, over an empty record
    assert (engine.prefilling, engine.decoding) == (0, 1)
    f = drain(engine)[sid]
    assert f.cache_tokens == (42, *f.output_tokens[:-1]) and all(c.offset == len(f.cache_tokens) for c in f.cache)


def test_finished_cache_covers_exactly_its_tokens():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok)
    prompt = prompts(1, seed=2)[0]
    sid = engine.add(prompt, SamplingParams(max_tokens=5))
    f = drain(engine)[sid]
    assert f.cache_tokens == tuple(prompt) + f.output_tokens[:-1]
    assert all(c.offset == len(f.cache_tokens) for c in f.cache)
    # Continuing from that cache gives what a cold run of the same tokens gives.
    follow = list(f.cache_tokens) + [f.output_tokens[-1], 5, 6, 7]
    warm = Engine(model, tok)
    sid = warm.add(follow, SamplingParams(max_tokens=6), f.cache, len(f.cache_tokens))
    assert drain(warm)[sid].output_tokens == alone(model, tok, follow, SamplingParams(max_tokens=6))


def test_fully_cached_prompt_still_prefills_one_token():
    model, tok = tiny_model("qwen2"), ByteTokenizer()
    prompt = prompts(1, seed=3)[0]
    engine = Engine(model, tok)
    sid = engine.add(prompt, SamplingParams(max_tokens=4), prefix_cache(engine, prompt), len(prompt))
    f = drain(engine)[sid]
    assert (f.reused_tokens, f.prefilled_tokens) == (len(prompt) - 1, 1)
    assert f.output_tokens == alone(model, tok, prompt, SamplingParams(max_tokens=4))


def test_seeded_sampling_does_not_depend_on_the_batch():
    model, tok = tiny_model("llama"), ByteTokenizer()
    A, B, C = prompts(3, seed=4)
    hot = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=7, max_tokens=10)
    engine = Engine(model, tok)
    ids = [engine.add(p, hot) for p in (A, B, C)]
    done = drain(engine)
    assert done[ids[1]].output_tokens == alone(model, tok, B, hot)
    other_seed = SamplingParams(temperature=0.9, seed=8, max_tokens=10)
    assert alone(model, tok, B, other_seed) != done[ids[1]].output_tokens


def test_every_sampled_token_goes_through_shared_tokens():
    """A sharded model's ranks all go on with rank 0's tokens (``actors.lockstep``):
    the engine takes what ``shared_tokens`` gives, at the first token and in decode."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, shared_tokens=lambda tokens: mx.full(tokens.shape, 65, tokens.dtype))
    ids = [engine.add(p, SamplingParams(max_tokens=5)) for p in prompts(2, seed=5)]
    done = drain(engine)
    assert all(done[i].output_tokens == (65,) * 5 for i in ids)


def test_cancel_while_prefilling_returns_a_consistent_partial_cache():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, prefill_chunk=32, min_chunk=32)
    prompt = (prompts(4, seed=5)[3] * 3)[:150]
    sid = engine.add(prompt, SamplingParams(max_tokens=4))
    assert engine.prefill_step() == [] and engine.prefill_step() == []
    f = engine.cancel(sid).finished
    assert f.reason == "cancelled" and f.output_tokens == ()
    assert f.cache_tokens == tuple(prompt[:64]) and all(c.offset == 64 for c in f.cache)
    assert engine.idle and engine.cancel(sid) is None


def test_round_robin_prefill_lets_a_short_prompt_finish_first():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, prefill_chunk=32, min_chunk=32)
    engine.add(list(range(1, 300)), SamplingParams(max_tokens=2))  # the long one, first in line
    short = engine.add([5, 6, 7], SamplingParams(max_tokens=2))
    first = []
    while not first:
        first = engine.prefill_step()
    assert first[0].seq_id == short


def test_prompt_chunks_share_forwards_in_turn_within_the_row_budget(monkeypatch):
    """Chunks the measured counts let batch share a forward, in queue order,
    up to ``prefill_rows`` tokens; a prompt whose last chunk needs its logits
    runs alone, and a short one still finishes first."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    batches = []  # one a layer and forward

    class Recording(PrefillBatch):
        def __init__(self, caches, lengths):
            super().__init__(caches, lengths)
            batches.append(tuple(lengths))

    monkeypatch.setattr("semantic.runtime.engine.prefill.PrefillBatch", Recording)
    engine = Engine(model, tok, prefill_chunk=32, min_chunk=32, prefill_rows=80,
                    row_counts=RowCounts((1,), prefill_from=9))
    engine.add(list(range(1, 200)), SamplingParams(max_tokens=2))
    engine.add(list(range(1, 150)), SamplingParams(max_tokens=2))
    engine.add(list(range(1, 100)), SamplingParams(max_tokens=2))
    short = engine.add([5, 6, 7], SamplingParams(max_tokens=2))
    first = []
    while not first:
        first = engine.prefill_step()
    assert first[0].seq_id == short
    forwards = batches[:: len(model.layers)]
    assert forwards == [(32, 32)], forwards  # a third chunk would pass 80 rows; the short one needs logits
    drain(engine)
    forwards = batches[:: len(model.layers)]
    assert all(sum(f) <= 80 and len(f) > 1 for f in forwards) and len(forwards) >= 3, forwards


def test_a_short_rest_of_a_prompt_comes_along_with_its_chunk():
    """A prompt a few tokens over the chunk size prefills in one forward, not
    a chunk and then a forward for the rest; a rest of ``min_chunk`` or more
    waits for its own."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, prefill_chunk=64, min_chunk=16)
    for length, forwards in ((64 + 15, 1), (64 + 16, 2)):
        engine.add(list(range(1, length + 1)), SamplingParams(max_tokens=1))
        steps = 0
        while engine.prefilling:
            engine.prefill_step()
            steps += 1
        assert steps == forwards, length
        drain(engine)


def test_memory_does_not_grow_with_steps():
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok)
    for p in prompts(2, seed=6):
        engine.add(p[:20], SamplingParams(max_tokens=200))
    while engine.prefilling:
        engine.prefill_step()
    readings = []
    for step in range(180):  # 20 + 180 < 256: no cache growth step is crossed
        engine.step_once()
        if step in (30, 179):
            mx.clear_cache()
            readings.append(mx.get_active_memory())
    assert readings[1] - readings[0] < 256 << 10, readings


@pytest.mark.slow
@pytest.mark.model
def test_stop_strings_and_multibyte_text_stream_safely(smollm2):
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    ask = lambda text: tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    counting = engine.add(ask("Count from 1 to 10, separated by commas."), SamplingParams(max_tokens=40, stop=("5",)))
    french = engine.add(ask("Write one sentence in French about a café."), SamplingParams(max_tokens=30))
    shown: dict[int, str] = {counting: "", french: ""}
    done = {}
    while not engine.idle:
        for d in engine.prefill_step() + engine.step_once():
            shown[d.seq_id] += d.text
            assert "\ufffd" not in d.text, "no broken multi-byte characters"
            if d.finished:
                done[d.seq_id] = d.finished
    assert "5" not in shown[counting] and "4" in shown[counting]
    assert done[counting].reason == "stop" and shown[counting] == done[counting].text
    assert shown[french] == done[french].text == tok.decode(list(done[french].output_tokens))


def test_bad_arguments():
    engine = Engine(tiny_model("llama"), ByteTokenizer())
    with pytest.raises(ValueError, match="at least one token"):
        engine.add([])
    with pytest.raises(ValueError, match="without a cache"):
        engine.add([1, 2], cached_tokens=1)
    cache = prefix_cache(engine, [1, 2, 3])
    with pytest.raises(ValueError, match="holds 3 tokens"):
        engine.add([1, 2, 3, 4], cached_tokens=2, cache=cache)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)  # (0: prefill only)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0)


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
@pytest.mark.parametrize("via", ["memory", "file"])
def test_a_preempted_sequence_goes_on_as_if_it_never_left(arch, via, tmp_path):
    """Preempted mid-decode (its cache handed out, kept in memory or saved to a
    file and read back) and resumed later beside others: the same greedy tokens
    as never interrupted, and its neighbours' too."""
    from semantic.runtime.store import cache_file
    from semantic.runtime.cache_records import CacheRecord

    model, tok = tiny_model(arch), ByteTokenizer()
    greedy = SamplingParams(max_tokens=20)
    runs = [(alone(model, tok, p, greedy), p) for p in prompts(3, seed=5)]
    runs.sort(key=lambda run: -len(run[0]))  # the first runs longest: it is still decoding at step 6
    expected = [out for out, _ in runs]
    A, B, C = (p for _, p in runs)
    engine = Engine(model, tok)
    ids = [engine.add(p, greedy) for p in (A, B, C)]
    out = {}

    def act(step):
        if step == 6:
            out["preempted"] = engine.preempt(ids[0])
        if step == 10:
            f = out["preempted"]
            cache = f.cache
            if via == "file":
                record = CacheRecord("a", "tiny", "hash", list(f.cache_tokens), "", 0.0, 0.0, f.cache)
                saved = cache_file.CacheStore(tmp_path).save(record)
                cache = cache_file.load(saved, model_id="tiny", spec_hash="hash").cache
            engine.resume(ids[0], cache, len(f.cache_tokens))

    done = drain(engine, act)
    f = out["preempted"]
    assert f.reason == "preempted" and 0 < len(f.output_tokens) < 20
    assert f.cache_tokens == tuple(A) + f.output_tokens[:-1]
    assert [done[i].output_tokens for i in ids] == expected
    assert done[ids[0]].prompt_tokens == len(A) and done[ids[0]].prefilled_tokens == len(A)


def test_a_preempted_sequence_whose_cache_was_lost_recomputes_it():
    """Resumed without a cache, a sequence prefills what it had fed again and goes on:
    it finishes with all its tokens, and its cache covers them."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    (A,) = prompts(1, seed=6)
    engine = Engine(model, tok)
    sid = engine.add(A, SamplingParams(max_tokens=12))
    out = {}

    def act(step):
        if step == 4:
            out["f"] = engine.preempt(sid)
            engine.resume(sid)  # nothing cached: recompute

    done = drain(engine, act)[sid]
    assert len(done.output_tokens) == 12 and done.output_tokens[:len(out["f"].output_tokens)] == out["f"].output_tokens
    assert done.cache_tokens == tuple(A) + done.output_tokens[:-1]
    assert all(c.offset == len(done.cache_tokens) for c in done.cache if not hasattr(c, "max_size"))
    with pytest.raises(KeyError):
        engine.resume(sid)  # not preempted any more


@pytest.mark.parametrize("arch", ["llama", "deepseek_v2"])  # standard and other attention
def test_a_prompt_cut_anywhere_into_turns_leaves_the_same_cache(arch):
    """Prefilled at once, or as turns that end inside a block, at its end, or just
    past it: the same tokens leave the same cache -- the same blocks closed, and
    every key and value as a token at its position sees it (a chunk across a
    block's end attends a piece a block). Within float rounding: chunks of
    other lengths compute in other orders (~1e-6), which may move a value
    across a 4-bit step here and there (under 0.2% of them, on Haswell's
    kernels); a chunk attended whole across a block's end puts 30-70% of them
    off."""
    from semantic.runtime.kv import SequenceQuantizedKVCache

    model, tok = tiny_model(arch), ByteTokenizer()
    prompt = [1 + (i * 7919) % 250 for i in range(700)]

    def cache_after(cuts):
        engine, cache, at = Engine(model, tok, speculation=False), None, 0
        for cut in [*cuts, len(prompt)]:
            sid = engine.add(prompt[:cut], SamplingParams(max_tokens=1), cache, at)
            f = drain(engine)[sid]
            assert list(f.cache_tokens) == prompt[:cut]  # (its one reply token is never fed)
            cache, at = f.cache, cut
        return cache

    whole = cache_after([])
    for cuts in ([300], [256, 513], [257, 600]):
        cut = cache_after(cuts)
        for a, b in zip(whole, cut):
            assert isinstance(a, SequenceQuantizedKVCache) and (a.offset, a.closed) == (b.offset, b.closed)
            off = max((mx.abs(x - y) > 1e-4).mean().item() for x, y in zip(a.floats(), b.floats()))
            assert off < 0.01, (cuts, off)
