"""Which batches leave a sequence's logits bitwise as alone, measured
through an engine's real forwards: the decode row counts that agree
(``runtime.engine.row_counts``: each weight's matmul first taking its rows as
``runtime.engine.row_plans`` measures), and from which size prompt chunks may share
a prefill forward. The engine runs what this finds (``Engine.calibrate``,
``Engine.use_row_counts``); nothing here touches its queues."""

from __future__ import annotations

import itertools
import random
import time
from dataclasses import replace

import mlx.core as mx
from mlx.utils import tree_flatten

from . import row_plans
from .batch_cache import BatchQuantizedKVCache, PrefillBatch
from ..kv import SequenceCache
from .row_counts import RowCounts, choose
from .row_plans import RowPlan

__all__ = ["calibrate"]


def calibrate(engine, max_rows: int, seed: int = 0) -> RowCounts:
    """Measure which decode row counts 1..``max_rows`` give a sequence of
    ``engine`` the same logits, bit for bit: first
    how each weight shape's matmul takes its rows (``_plans``), then, with
    those plans, a probe sequence through the real decode
    forward alone and beside random neighbours at every count and every
    slot; and from which size prompt chunks may share a prefill forward
    (``_prefill_from``). Returns the class ``choose`` picks, with what was
    measured; does not change the engine (``use_row_counts`` does) and
    leaves its sequences alone.

    Where the class stops short of ``max_rows``, both are measured again
    for its counts alone: a plan that makes counts agree which the
    forward as a whole never will costs the counts in use for nothing
    (under OpenBLAS's Prescott kernels, SmolLM2's 576x1536 matmul padded
    a lone agent's row to 8 for counts 5-8 that its logits rule out). The
    second measurement is kept where it finds the same counts."""
    start = time.perf_counter()
    upto, found = max_rows, None
    before = engine.row_counts
    try:
        while True:
            engine.use_row_counts(RowCounts((upto,), plans=_plans(engine, upto, seed)))
            again = _classes(engine, upto, random.Random(seed))
            if found is not None and again.counts != found.counts:
                break
            found = again
            if found.counts[-1] == upto:
                break
            upto = found.counts[-1]
        engine.use_row_counts(found)
        prefill_from = _prefill_from(engine, random.Random(seed))
        return replace(found, seconds=round(time.perf_counter() - start, 3), prefill_from=prefill_from)
    finally:
        engine.use_row_counts(before)


def _plans(engine, max_rows: int, seed: int) -> tuple[RowPlan, ...]:
    """The ways the weight shapes take 1..``max_rows`` rows under which
    their rows agree (``row_plans.ways``), one a shape, as
    ``row_plans.fastest`` picks them from the real decode forward's time at
    every count with no plan and with each way alone (the least of three
    rounds over every count, so a load that comes and goes weighs on all
    alike). A count at which a way runs its rows whole costs it nothing."""
    ways, rng = row_plans.ways(engine.model, max_rows, seed), random.Random(seed)
    each = [plan for found in ways.values() for plan in found]
    if not each:
        return ()
    prompt = lambda n: [rng.randrange(1, 256) for _ in range(n)]  # every vocabulary has 255 ids after 0
    records = [engine.prefilled(prompt(24)) for _ in range(max_rows)]
    caches = {m: _batch(engine, records[:m]) for m in range(1, max_rows + 1)}
    timed = {plan: [float("inf")] * max_rows for plan in (None, *each)}

    def step(batch: list[BatchQuantizedKVCache]) -> float:  # the same step each time: its rows are dropped
        t0 = time.perf_counter()
        _forward(engine, batch, 0, rng)
        for c in batch:
            if c.held:  # (a recurrent layer's state holds no rows: it just goes on)
                c.drop_last()
        return time.perf_counter() - t0

    for batch in caches.values():
        step(batch)  # makes the working copies: a step's second forward is what decode pays
    for _ in range(3):
        for m, batch in caches.items():
            for plan in (None, *(p for p in each if not p.whole(m))):
                engine.use_row_counts(RowCounts((max_rows,), plans=() if plan is None else (plan,)))
                timed[plan][m - 1] = min(timed[plan][m - 1], step(batch))
    plain = timed.pop(None)
    added = {plan: [0.0 if plan.whole(m + 1) else t - plain[m] for m, t in enumerate(ts)] for plan, ts in timed.items()}
    return row_plans.fastest(ways, plain, added)


def _batch(engine, records: list[SequenceCache]) -> list[BatchQuantizedKVCache]:
    """A decode batch of copies of ``records``, as attention sees them."""
    return [BatchQuantizedKVCache(layer) for layer in zip(*(r.clone().view(engine.float_head) for r in records))]


def _forward(engine, caches: list[BatchQuantizedKVCache], at: int, rng: random.Random) -> mx.array:
    """A decode forward of random tokens (token 7 at slot ``at``), evaluated: slot ``at``'s logits."""
    fed = [rng.randrange(1, 256) for _ in caches[0].caches]
    fed[at] = 7
    row = engine.forward(caches, fed, len(fed))[at]
    mx.eval(row, [c.arrays for c in caches], [x.arrays for c in caches for x in c.caches])
    return row


def _classes(engine, max_rows: int, rng: random.Random) -> RowCounts:
    """The classes of counts 1..``max_rows`` with the plans in use, and the one ``choose`` picks."""
    prompt = lambda n: [rng.randrange(1, 256) for _ in range(n)]  # every vocabulary has 255 ids after 0
    probe, neighbours = engine.prefilled(prompt(24)), [engine.prefilled(prompt(rng.randrange(1, 48)))
                                                       for _ in range(max_rows - 1)]

    def batch(m: int, at: int) -> list[BatchQuantizedKVCache]:  # the probe at slot ``at`` of ``m``
        others = rng.sample(neighbours, m - 1)
        return _batch(engine, others[:at] + [probe] + others[at:])

    def forward(caches: list[BatchQuantizedKVCache], at: int) -> mx.array:  # the probe's logits
        return _forward(engine, caches, at, rng)

    # Every slot: a kernel may treat one inside row its own way (Prescott's 9 rows: the third).
    rows = {m: [forward(batch(m, at), at) for at in range(m)] for m in range(1, max_rows + 1)}
    ms = [float("inf")] * max_rows
    for _ in range(3):  # rounds over every count, so a load that comes and goes weighs on all alike
        for m in range(1, max_rows + 1):
            caches = batch(m, 0)
            forward(caches, 0)  # makes the working copies: a step's second forward is what decode pays
            t0 = time.perf_counter()
            forward(caches, 0)
            ms[m - 1] = min(ms[m - 1], (time.perf_counter() - t0) * 1e3)
    classes: list[tuple[int, ...]] = []
    for m, seen in rows.items():
        if not all(mx.array_equal(seen[0], r).item() for r in seen[1:]):
            continue  # the row depends on where it sits: never used
        same = next((i for i, c in enumerate(classes) if mx.array_equal(rows[c[0]][0], seen[0]).item()), None)
        if same is None:
            classes.append((m,))
        else:
            classes[same] += (m,)
    counts = choose(classes, ms)  # (1,) is always a class: one row sits in one place
    return RowCounts(counts, tuple(classes), tuple(round(t, 2) for t in ms), plans=engine.row_counts.plans)


def _prefill_from(engine, rng: random.Random) -> int | None:
    """The fewest tokens from which a prompt chunk writes its sequence's
    caches bitwise as alone when other sequences' chunks share its forward.

    A chunk of at most ``decode_rows`` tokens is decode-shaped (row plans
    take its matmuls: ``runtime.engine.row_plans``) and never shares one. Above
    that a kernel may still change with the row count, from some count
    on, or a row's place among the forward's rows may matter (a kernel's
    full row tiles and its remainder): chunks of each size of a doubling
    ladder from ``decode_rows`` + 1 run alone, between neighbours' chunks
    that put them at an odd row and make the forward more than twice as
    large (the largest: ``prefill_rows``), and first, before an odd-sized
    one; the answer is the smallest size from which every larger one
    agrees -- None when the largest does not: chunks never share a
    forward."""
    tokens = lambda n: [rng.randrange(1, 256) for _ in range(n)]  # every vocabulary has 255 ids after 0
    prefixes = [engine.prefilled(tokens(n)) for n in (3, 17, 38)]  # what sequences have cached

    def view(cache: SequenceCache) -> SequenceCache:  # a copy, as attention sees it
        return cache.clone().view(engine.float_head)

    ladder = list(itertools.takewhile(lambda n: 2 * n <= engine.prefill_chunk,
                                      (engine.decode_rows + 1 << i for i in itertools.count())))
    agree = {}
    for n in ladder:
        cached, chunk = rng.choice(prefixes), tokens(n)
        alone = view(cached)
        engine.model(mx.array(chunk)[None], cache=alone)
        mx.eval(alone.arrays())
        want = [x for _, x in tree_flatten(alone.arrays())]
        room = (engine.prefill_rows if n == ladder[-1] else min(engine.prefill_rows, 2 * n + 32)) - n
        before = rng.randrange(0, room // 2) * 2 + 1  # odd: the chunk's rows off any tile boundary
        # Between two neighbours, and first before one (its last rows beside another's).
        layouts = [(before, room - before)] + ([(0, rng.randrange(1, 17) * 2 - 1)] if n != ladder[-1] else [])
        agree[n] = True
        for first, last in layouts:
            sizes = [m for m in (first, last) if m]
            at = 1 if first else 0
            chunks = [tokens(m) for m in sizes]
            views = [view(rng.choice(prefixes)) for _ in sizes]
            chunks.insert(at, chunk)
            views.insert(at, view(cached))
            lengths = [len(c) for c in chunks]
            with row_plans.chunked(lengths):
                engine.model(mx.array([t for c in chunks for t in c])[None],
                           cache=[PrefillBatch(layer, lengths) for layer in zip(*views)])
            mx.eval(views[at].arrays())
            agree[n] &= all(mx.array_equal(a, b).item() for a, (_, b) in
                            zip(want, tree_flatten(views[at].arrays())))
    if not agree or not agree[ladder[-1]]:
        return None
    return min(n for n in ladder if all(agree[m] for m in ladder if m >= n))

