"""Row plans: how each weight shape's matmul takes its rows so a row comes out
the same at every count (``runtime.engine.row_plans``). The whole forward's check is
in test_invariance.py."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import pytest

from semantic.runtime.engine import row_counts, row_plans
from semantic.runtime.engine.engine import Engine
from semantic.runtime.engine.row_counts import RowCounts
from semantic.runtime.engine.row_plans import RowPlan
from tests.runtime.test_engine import ByteTokenizer, busy_batch_equals_alone
from tests.tiny import TINY_CONFIGS, tiny_model


def test_a_plan_cuts_rows_or_columns_or_pads():
    tiles = RowPlan("s", "tiles", 2, 8)
    assert tiles.calls(2, 576) == [(0, 2, 2, 0, 576)]  # within the small class: as it is
    assert tiles.calls(8, 576) == [(0, 8, 8, c, c + 144) for c in range(0, 576, 144)]
    assert tiles.calls(7, 576) == [(0, 7, 7, 0, 160), (0, 7, 7, 160, 320), (0, 7, 7, 320, 480), (0, 7, 7, 480, 576)]
    assert tiles.calls(9, 576) == [(0, 9, 9, 0, 576)]  # past ``upto``: never measured, never planned
    assert RowPlan("s", "tiles", 1, 8).calls(8, 40) == [(0, 8, 8, 0, 16), (0, 8, 8, 16, 32), (0, 8, 8, 32, 40)]
    assert RowPlan("s", "pieces", 2, 8).calls(5, 10) == [(0, 2, 2, 0, 10), (2, 4, 2, 0, 10), (4, 5, 1, 0, 10)]
    assert RowPlan("s", "floor", 3, 8).calls(1, 10) == [(0, 1, 3, 0, 10)]
    assert RowPlan("s", "floor", 3, 8).calls(5, 10) == [(0, 5, 5, 0, 10)]
    for bad in [("s", "halves", 2, 8), ("s", "tiles", 0, 8), ("s", "floor", 9, 8)]:
        with pytest.raises(ValueError):
            RowPlan(*bad)


@pytest.mark.parametrize("way", row_plans.WAYS)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "q4"])
def test_every_way_computes_what_the_layer_computes(quantized, way):
    """Each way is the same matmul cut differently: equal to the layer's own
    call within float32 rounding, for every count, on any machine. (200
    columns: the last tile is ragged.)"""
    layer = nn.QuantizedLinear(128, 200, bias=True, group_size=64, bits=4) if quantized else nn.Linear(128, 200)
    x = mx.random.normal((8, 128), key=mx.random.key(0))
    plan = RowPlan(row_plans.shape_key(layer), way, 2 if way != "floor" else 5, 8)
    for m in range(1, 9):
        want = layer(x[:m])
        got = row_plans._call(layer, plan, x[:m])
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-5, rtol=1e-5).item(), (m, way)


def test_applied_plans_run_through_the_model_and_come_off_again():
    model = tiny_model("qwen2")  # biases on q/k/v
    x = mx.random.normal((1, 5, 128), key=mx.random.key(1))
    layer = model.layers[0].self_attn.q_proj
    want = layer(x)
    plan = RowPlan(row_plans.shape_key(layer), "tiles", 1, 8)
    row_plans.apply(model, (plan,))
    assert type(layer).__name__ == "Linear" and isinstance(layer, nn.Linear) and layer.row_plan == plan
    assert mx.allclose(layer(x), want, atol=1e-5).item()
    assert set(dict(model.parameters()).keys()) == set(dict(tiny_model("qwen2").parameters()).keys())
    tiles = layer.__dict__["_tiles"]  # each tile's weight rows, made once: views of the layer's own arrays
    assert len(tiles) == len(plan.calls(5, layer.weight.shape[0]))
    assert all(w.shape[0] == 128 for _, w, _, _ in tiles.values())  # transposed: (in, tile's columns)
    assert mx.array_equal(layer(x), layer(x)).item() and layer.__dict__["_tiles"] is tiles
    row_plans.apply(model, ())  # no plan: its rows run as mlx-lm's (per chunk in a ``chunked`` forward)
    assert isinstance(layer, nn.Linear) and layer.row_plan is None and "_tiles" not in layer.__dict__
    assert mx.array_equal(layer(x), nn.Linear.__call__(layer, x)).item()


def test_a_shape_whose_rows_depend_on_the_count_gets_a_plan_that_makes_them_agree(monkeypatch):
    """A linear layer whose rows shift from three rows up (as a small-matrix
    kernel hands over to a packed one): the measurement sees it and offers
    only ways under which the probe row is the same at every count and
    position."""
    call = nn.Linear.__call__
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: call(self, x) + (1e-3 if x.shape[0] >= 3 else 0))
    model = tiny_model("llama")
    ways = row_plans.ways(model, 8)
    assert ways and all(found for found in ways.values()), ways
    plans = row_plans.fastest(ways, [1.0] * 8, {p: [0.0] * 8 for found in ways.values() for p in found})
    assert len(plans) == len(ways) and all(p.upto == 8 for p in plans), plans
    row_plans.apply(model, plans)
    layer = model.layers[0].mlp.down_proj
    x = mx.random.normal((8, 256), key=mx.random.key(3))
    rows = [layer(x[:m])[0] for m in range(1, 9)]  # the probe row first, at every count
    assert all(mx.array_equal(r, rows[0]).item() for r in rows[1:])


def test_the_ways_are_chosen_by_the_whole_forwards_worst_slowdown():
    """Of one way a shape, the set whose forward is slowest least at its
    worst count, each way's measured cost added: padding a lone agent's
    rows that costs it little beats pieces that cost eight rows a lot (the
    choice SmolLM2's forwards made on this project's 2-core EPYC); where
    padding costs a lone agent more than a shape's pieces cost eight rows,
    that shape takes pieces; ties go to the ways listed first."""
    gate, down = "Linear 1536x576 float32", "Linear 576x1536 float32"
    floor_gate, pieces_gate = RowPlan(gate, "floor", 2, 8), RowPlan(gate, "pieces", 1, 8)
    floor_down, pieces_down = RowPlan(down, "floor", 2, 8), RowPlan(down, "pieces", 1, 8)
    ways = {gate: [pieces_gate, floor_gate], down: [pieces_down, floor_down], "Linear 576x576 float32": []}
    plain = [80, 85, 93, 107, 115, 116, 110, 110]
    added = {floor_gate: [3] + [0] * 7, pieces_gate: [0, 10, 15, 20, 28, 33, 40, 47],
             floor_down: [2] + [0] * 7, pieces_down: [0, 3, 6, 9, 11, 14, 17, 20]}
    assert row_plans.fastest(ways, plain, added) == (floor_gate, floor_down)
    added[floor_gate] = [30] + [0] * 7  # worst 1.375 with the down projection's pieces, 1.4 with its floor
    assert row_plans.fastest(ways, plain, added) == (floor_gate, pieces_down)
    assert row_plans.fastest(ways, plain, {p: [0] * 8 for p in added}) == (pieces_gate, pieces_down)
    assert row_plans.fastest({}, plain, {}) == ()


@pytest.mark.parametrize("slow", row_plans.WAYS)
def test_calibration_takes_the_ways_that_slow_its_forwards_least(monkeypatch, slow):
    """Matmuls whose rows change from three rows on, each way made slow in
    turn (a sleep a call where it changes how the rows run): the plans the
    calibration keeps avoid the slow way, measured through the whole
    forward."""
    call, planned = nn.Linear.__call__, row_plans._call
    # (rows (m, width) as a plan passes them, (1, m, width) in a forward's own call)
    monkeypatch.setattr(nn.Linear, "__call__", lambda self, x: call(self, x) + (1e-3 if x.shape[-2] >= 3 else 0))

    def timed(layer, plan, x):
        if plan is not None and plan.way == slow and not plan.whole(x.shape[0]):
            time.sleep(0.002)
        return planned(layer, plan, x)

    monkeypatch.setattr(row_plans, "_call", timed)
    counts = Engine(tiny_model("llama"), ByteTokenizer(), speculation=False).calibrate()
    assert counts.plans and all(p.way != slow for p in counts.plans), counts.plans


def test_plans_are_kept_with_the_counts_and_read_back(tmp_path):
    plans = (RowPlan("Linear 576x576 float32", "tiles", 2, 8), RowPlan("Linear 576x1536 float32", "floor", 2, 8))
    counts = RowCounts((1, 2, 3), ((1, 2, 3),), (1.0, 2.0, 3.0), 0.5, plans)
    row_counts.keep("k", counts, home=tmp_path)
    assert row_counts.kept(tmp_path)["k"] == counts
    bad = tmp_path / "row-counts" / "k.json"
    bad.write_text('{"counts": [1], "plans": [{"shape": "s", "way": "halves"}]}')
    assert "k" not in row_counts.kept(tmp_path)  # unreadable: measured again
    assert not bad.exists()  # and removed: warned of once, not at every start
    bad.write_text('{"counts": [1], "plans": [{"shape": "s", "way": "tiles", "rows": 1, "upto": 8, "cells": 64}]}')
    assert "k" not in row_counts.kept(tmp_path) and not bad.exists()  # another version's form


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_forwards_with_every_shape_planned_stay_invariant(arch):
    """Plans on every linear layer (latent attention's included; MoE experts
    are not ``nn.Linear``), in pieces of one row: replies alone and in a
    changing batch are bitwise the same."""
    model, tok = tiny_model(arch), ByteTokenizer()
    shapes = {row_plans.shape_key(layer) for layer in row_plans._linears(model)}
    counts = RowCounts(tuple(range(1, 9)), plans=tuple(RowPlan(s, "pieces", 1, 8) for s in sorted(shapes)))
    Engine(model, tok, row_counts=counts)  # the engine installs them
    assert all(getattr(layer, "row_plan", None) for layer in row_plans._linears(model))
    busy_batch_equals_alone(model, tok, row_counts=counts)
