"""``semantic bench batch`` end to end on a tiny random-weight model: the sides
take turns decoding every batch size, and the prefill peak is measured per
chunk size."""

import random
from types import SimpleNamespace

import pytest

from semantic.bench.batch import Ours, Peer, measure, prefill_peak
from semantic.runtime.model.lean import _Lean
from semantic.runtime.model.model_spec import ModelCacheSpec
from tests.runtime.test_engine import ByteTokenizer
from tests.tiny import VOCAB, tiny_model


@pytest.mark.slow
def test_batch_bench_runs_both_sides_and_the_prefill_peak():
    model = tiny_model("llama")
    loaded = SimpleNamespace(model=model, tokenizer=ByteTokenizer(), spec=ModelCacheSpec.from_model(model))
    rng = random.Random(0)
    ctxs = [[rng.randrange(1, VOCAB) for _ in range(100)] for _ in range(2)]  # long enough to ride a decode step
    ours, peer = Ours(loaded, ctxs), Peer(loaded, ctxs)
    order = []

    def logged(side, run):
        def logged_run(B, steps):
            lean = any(isinstance(m, _Lean) for _, m in model.named_modules())
            order.append((side.name, B, lean))
            return run(B, steps)
        return logged_run

    for side in (ours, peer):
        side.run = logged(side, side.run)
    tps = measure([ours, peer], (1, 2), steps=3, repeats=2)
    assert set(tps) == {"ours", "mlx-lm"} and all(set(v) == {1, 2} for v in tps.values())
    assert all(v > 0 for by_size in tps.values() for v in by_size.values())
    # The first side of one repeat goes last in the next; each runs the model in its own form.
    assert order == [("ours", 1, True), ("mlx-lm", 1, False), ("mlx-lm", 1, False), ("ours", 1, True),
                     ("ours", 2, True), ("mlx-lm", 2, False), ("mlx-lm", 2, False), ("ours", 2, True)]
    assert ours.kv_bytes_ratio == pytest.approx(2.0)  # 101 tokens: all in the open block, float32 against fp16
    counts = ours.engine.row_counts.describe()
    assert counts["classes"] and set(counts["counts"]) <= set(range(1, 9))  # measured, within 1..decode_rows
    peaks = prefill_peak(loaded, 200, chunks=(32, None))
    assert set(peaks) == {32, 200} and all(p > 0 for p in peaks.values())
