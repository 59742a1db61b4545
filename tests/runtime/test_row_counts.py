"""Decode row counts: how a batch splits into forwards, which class is chosen,
and the measurement kept across restarts (the measuring itself is tested by
equality in test_invariance.py)."""

from __future__ import annotations

import json
import os

import pytest

from semantic.runtime.engine import row_counts
from semantic.runtime.engine.engine import Engine
from semantic.runtime.engine.row_counts import RowCounts, cached, choose
from tests.runtime.test_engine import ByteTokenizer
from tests.tiny import tiny_model


def test_a_batch_takes_full_forwards_then_pads_the_rest_to_the_next_count():
    assert RowCounts((1, 2, 3, 4)).forwards(3) == [(3, 3)]
    assert RowCounts((1, 2, 3, 4)).forwards(6) == [(4, 4), (2, 2)]
    assert RowCounts((3, 4, 5, 6, 7, 8)).forwards(1) == [(1, 3)]
    assert RowCounts((7, 8)).forwards(10) == [(8, 8), (2, 7)]
    assert RowCounts.fixed(8).forwards(9) == [(8, 8), (1, 8)]
    assert RowCounts((2,)).forwards(0) == []
    for bad in [(), (0, 1), (3, 2), (2, 2)]:
        with pytest.raises(ValueError):
            RowCounts(bad)


def test_the_class_with_the_least_worst_slowdown_is_chosen():
    cpu = [62, 75, 77, 78, 79, 80, 80, 81]  # ms a forward at 1..8 rows: gemv at 1, then nearly flat
    assert choose([(1,), (2,), (3, 4, 5, 6, 7, 8)], cpu) == (3, 4, 5, 6, 7, 8)
    assert choose([(1, 2, 3, 4, 5, 6, 7, 8)], cpu) == (1, 2, 3, 4, 5, 6, 7, 8)
    linear = [1, 2, 3, 4, 5, 6, 7, 8]  # cost grows with every row: padding a lone agent is dear
    assert choose([(1,), (8,)], linear) == (1,)
    assert choose([(1, 2), (3, 4)], [1, 1, 1, 1]) == (3, 4)  # 4 agents: one forward, not two


@pytest.mark.slow
def test_the_measurement_is_kept_and_read_back(tmp_path, monkeypatch):
    engine = Engine(tiny_model("llama"), ByteTokenizer())
    calls = []
    measure = engine.calibrate
    monkeypatch.setattr(engine, "calibrate", lambda: calls.append(1) or measure())
    first = cached(engine, home=tmp_path)
    (kept,) = (tmp_path / "row-counts").iterdir()
    assert first.measured and json.loads(kept.read_text())["counts"] == list(first.counts)
    assert cached(engine, home=tmp_path) == first and len(calls) == 1  # a restart reads it
    kept.write_text('{"counts": [2, 1]')  # torn or edited: measured again, and rewritten
    again = cached(engine, home=tmp_path)
    assert len(calls) == 2 and again.measured  # (its classes may differ: ties are broken by the times measured)
    assert json.loads(kept.read_text())["counts"] == list(again.counts)
    kept.write_text("[1, 2]")  # JSON, but not a measurement: measured again too
    assert cached(engine, home=tmp_path).measured and len(calls) == 3
    other = Engine(tiny_model("qwen3"), ByteTokenizer())  # another model shape: its own file
    cached(other, home=tmp_path)
    assert len(list((tmp_path / "row-counts").iterdir())) == 2


def test_a_cache_home_that_cannot_be_written_still_measures(tmp_path):
    (tmp_path / "row-counts").write_text("a file where the folder would be")
    found = cached(Engine(tiny_model("llama"), ByteTokenizer()), home=tmp_path)
    assert found.measured


def test_only_the_newest_measurements_are_kept(tmp_path):
    folder = tmp_path / "row-counts"
    folder.mkdir()
    for i in range(row_counts.KEPT + 5):
        old = folder / f"{i:016x}.json"
        old.write_text(json.dumps(RowCounts((1,)).describe()))
        os.utime(old, (i, i))
    cached(Engine(tiny_model("llama"), ByteTokenizer()), home=tmp_path)
    assert len(list(folder.iterdir())) == row_counts.KEPT
    assert not (folder / f"{0:016x}.json").exists()
