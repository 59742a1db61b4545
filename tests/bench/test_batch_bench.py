"""``semantic bench batch`` end to end on a tiny random-weight model: each side
decodes every batch size, and the prefill peak is measured per chunk size."""

import random
from types import SimpleNamespace

from semantic.bench.batch import ours, peer, prefill_peak
from semantic.runtime.model_spec import ModelCacheSpec
from tests.runtime.test_engine import ByteTokenizer
from tests.tiny import VOCAB, tiny_model


def test_batch_bench_runs_both_sides_and_the_prefill_peak():
    model = tiny_model("llama")
    loaded = SimpleNamespace(model=model, tokenizer=ByteTokenizer(), spec=ModelCacheSpec.from_model(model))
    rng = random.Random(0)
    ctxs = [[rng.randrange(1, VOCAB) for _ in range(100)] for _ in range(2)]  # long enough to ride a decode step
    tps, per_stream, kv_ratio, counts = ours(loaded, ctxs, (1, 2), steps=3, repeats=1)
    assert set(tps) == set(per_stream) == {1, 2} and all(v > 0 for v in tps.values())
    assert 0.2 < kv_ratio < 0.3  # Q4 group 64 against fp16
    assert counts["classes"] and set(counts["counts"]) <= set(range(1, 9))  # measured, within 1..decode_rows
    assert set(peer(loaded, ctxs, (1, 2), steps=3, repeats=1)) == {1, 2}
    peaks = prefill_peak(loaded, 200, chunks=(32, None))
    assert set(peaks) == {32, 200} and all(p > 0 for p in peaks.values())
