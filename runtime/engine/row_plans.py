"""How each matmul of a forward takes its rows, so that a row comes out the
same at every row count.

BLAS picks a kernel by the matmul's shape, and kernels sum in different
orders. Under OpenBLAS's SkylakeX and Cooperlake kernels a 576x576 matmul
computes its rows one way at M = 1-2 and another at M >= 3 (a small-matrix
kernel, then the packed one), so a lone agent's row at M = 1 is not its row
beside two neighbours. Padding the whole forward to the larger class costs a
lone agent every matmul's larger kernel; a plan per weight shape costs only
what that shape needs, one of three ways:

* ``tiles``: more rows than the small class holds run as column tiles (16
  columns wide or a multiple), each within the small kernel's size (a
  576x576 matmul at M = 8 runs as four 8x144 tiles, reading the weight once);
* ``pieces``: cut the rows into pieces of at most the largest count of the
  class that holds M = 1 (a 576x576 matmul at M = 5 runs as 2 + 2 + 1);
* ``floor``: pad fewer rows up to the smallest count from which every count
  agrees (a 576x1536 matmul at M = 1 runs at 2).

A prefill forward that holds several sequences' prompt chunks (``chunked``)
runs each linear layer's matmul once per chunk, on that chunk's rows alone:
the call its sequence makes when it prefills alone, so its rows are the
same by construction -- whatever the kernel does with the row count or a
row's place (OpenBLAS's Prescott kernels, picked on CPUs that OpenBLAS 0.3.21
does not know, run each thread's share of M in pairs of rows, and a row left
over its own way).

``ways`` finds each weight shape's classes with random rows (kernels are
picked by shape, never by the numbers), at every count 1..max and every
row, and keeps the ways under which the probe row then agrees at every
count. Which of them to take is for the whole decode forward to say
(``runtime.engine.calibration`` times it with each way and hands the
times to ``fastest``): a matmul timed alone runs from caches that a
forward's weights are not in, and its noise picked different ways from
one measurement to the next. ``apply`` installs plans on a model's linear
layers; the engine's whole-forward calibration (``Engine.calibrate``) then
checks the result, so a plan is never trusted alone.
"""

from __future__ import annotations

import functools
import itertools
import math
import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

__all__ = ["WAYS", "RowPlan", "apply", "chunked", "fastest", "shape_key", "ways"]

_PLANNED = (nn.Linear, nn.QuantizedLinear)  # exactly these classes: subclasses may compute otherwise
_ALIGN = 16  # column tiles are multiples of this wide: kernels handle a ragged tail their own way
WAYS = ("tiles", "pieces", "floor")


@dataclass(frozen=True)
class RowPlan:
    """How a weight shape's matmul takes 1..``upto`` rows (``way``):

    * ``tiles``: more than ``rows`` rows run as column tiles, each no larger
      than ``rows`` full rows (the small kernel's size);
    * ``pieces``: rows in pieces of at most ``rows``;
    * ``floor``: fewer than ``rows`` rows padded up to ``rows``.
    """

    shape: str  # ``shape_key`` of the layers it applies to
    way: str
    rows: int
    upto: int

    def __post_init__(self):
        if self.way not in WAYS or not 1 <= self.rows <= self.upto:
            raise ValueError(f"not a row plan: {self}")

    def whole(self, m: int) -> bool:
        """Whether ``m`` rows run as one call, as they are."""
        return m > self.upto or (m >= self.rows if self.way == "floor" else m <= self.rows)

    def calls(self, m: int, n: int) -> list[tuple[int, int, int, int, int]]:
        """The matmul calls for ``m`` rows of an ``n``-column output: rows
        ``a:b`` computed as ``rows`` rows (zeros after them), columns ``c:d``."""
        if self.whole(m):
            return [(0, m, m, 0, n)]
        if self.way == "floor":
            return [(0, m, self.rows, 0, n)]
        if self.way == "pieces":
            return [(a, min(a + self.rows, m), min(self.rows, m - a), 0, n) for a in range(0, m, self.rows)]
        width = max(_ALIGN, self.rows * n // m // _ALIGN * _ALIGN)
        return [(0, m, m, c, min(c + width, n)) for c in range(0, n, width)]


def shape_key(layer: nn.Module) -> str:
    """What picks a layer's kernel: its class, weight shape and type, bias,
    quantization."""
    weight = layer["weight"]
    extra = f" q{layer.bits}g{layer.group_size}" if isinstance(layer, nn.QuantizedLinear) else ""
    return (f"{type(layer).__name__} {'x'.join(map(str, weight.shape))} {weight.dtype}"
            f"{' bias' if 'bias' in layer else ''}{extra}".replace("mlx.core.", ""))


def apply(model: nn.Module, plans: tuple[RowPlan, ...]) -> None:
    """Give each linear layer of ``model`` the plan of its shape (none: its rows
    run as mlx-lm's) and its matmuls per chunk in a ``chunked`` forward. In
    place; the layer keeps its parameters and names."""
    by_shape = {p.shape: p for p in plans}
    for layer in _linears(model):
        layer.__class__ = _planned_class(_base(type(layer)))
        object.__setattr__(layer, "row_plan", by_shape.get(shape_key(layer)))
        layer.__dict__.pop("_tiles", None)


_chunks: ContextVar[tuple[int, ...]] = ContextVar("prefill_chunks", default=())


@contextmanager
def chunked(lengths: Sequence[int]) -> Iterator[None]:
    """Within it, a forward's rows (1, sum(lengths), width) are these prompt
    chunks one after another: each linear layer (given a plan by ``apply``)
    runs its matmul once per chunk."""
    token = _chunks.set(tuple(lengths))
    try:
        yield
    finally:
        _chunks.reset(token)


def ways(model: nn.Module, max_rows: int, seed: int = 0) -> dict[str, list[RowPlan]]:
    """The ways each weight shape of ``model``'s linear layers may take
    1..``max_rows`` rows, by shape, for the shapes whose rows differ between
    counts (shapes whose rows all agree need none): those under which the
    probe row was measured to agree at every count and position (none: the
    whole-forward calibration sees it)."""
    rng = random.Random(seed)
    layers: dict[str, nn.Module] = {}
    for layer in _linears(model):
        layers.setdefault(shape_key(layer), layer)
    found = {}
    for key, layer in layers.items():
        x = _inputs(layer, max_rows, rng)
        rows = {m: _rows(layer, None, x, m) for m in range(1, max_rows + 1)}
        if not _agree(rows):
            found[key] = [plan for plan in _candidates(key, rows)
                          if _agree({m: _rows(layer, plan, x, m) for m in rows})]
    return found


def fastest(ways: dict[str, list[RowPlan]], plain: Sequence[float],
            added: dict[RowPlan, Sequence[float]]) -> tuple[RowPlan, ...]:
    """Of one way for each shape that has one (``ways``), the set whose
    forward slows down least at its worst count against the forward with
    no plan: ``plain[m - 1]`` is that forward's time at m rows and
    ``added[plan][m - 1]`` what ``plan`` alone added to it (the ways' costs
    are added up). Ties go to the ways listed first."""

    def worst(chosen: tuple[RowPlan, ...]) -> float:
        return max((t + sum(added[p][m] for p in chosen)) / t for m, t in enumerate(plain))

    return min(itertools.product(*(w for w in ways.values() if w)), key=worst)


def _candidates(key: str, rows: dict[int, list[mx.array]]) -> list[RowPlan]:
    """The ways to try, from the probe's ``rows`` at each count: the counts
    that agree with one row (``small``) and the smallest count from which
    every count agrees."""
    max_rows, one = len(rows), rows[1][0]
    small = next(m for m in range(1, max_rows + 2) if m > max_rows or not _same(rows[m], one)) - 1
    floor = next((b for b in range(2, max_rows + 1) if all(_same(rows[m], rows[b][0]) for m in range(b, max_rows + 1))),
                 None)
    ways = [RowPlan(key, "tiles", small, max_rows), RowPlan(key, "pieces", small, max_rows)]
    return ways + ([RowPlan(key, "floor", floor, max_rows)] if floor else [])


def _agree(rows: dict[int, list[mx.array]]) -> bool:
    """Whether the probe's row (``_rows`` at each count) is the same at every count and position."""
    return all(_same(seen, rows[1][0]) for seen in rows.values())


def _rows(layer: nn.Module, plan: RowPlan | None, x: mx.array, m: int) -> list[mx.array]:
    """The probe's (``x[0]``) output row at each place of ``m`` rows, the
    others ``x[1:]``."""
    probe, others = x[:1], x[1:]
    outs = [_call(layer, plan, mx.concatenate([others[:at], probe, others[at : m - 1]]))[at]
            for at in range(m)]
    mx.eval(outs)
    return outs


def _same(rows: list[mx.array], row: mx.array) -> bool:
    return all(mx.array_equal(r, row).item() for r in rows)


def _inputs(layer: nn.Module, rows: int, rng: random.Random) -> mx.array:
    """``rows`` random inputs for ``layer``, of the type its activations have."""
    if isinstance(layer, nn.QuantizedLinear):
        width, dtype = layer["weight"].shape[-1] * 32 // layer.bits, layer["scales"].dtype
    else:
        width, dtype = layer["weight"].shape[-1], layer["weight"].dtype
    return mx.random.normal((rows, width), key=mx.random.key(rng.randrange(2**31))).astype(dtype)


def _linears(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if type(m) in _PLANNED or isinstance(m, _Planned)]


def _base(cls: type) -> type:
    return cls.__mro__[2] if issubclass(cls, _Planned) else cls


def _call(layer: nn.Module, plan: RowPlan | None, x: mx.array) -> mx.array:
    """``layer(x)`` for rows ``x`` (m, width), its matmuls as ``plan`` says."""
    m, width = x.shape
    call = _base(type(layer)).__call__
    if plan is None or plan.whole(m):
        return call(layer, x)
    n, outs = layer["weight"].shape[0], []
    calls = plan.calls(m, n)
    for a, b, rows, c, d in calls:
        piece = x[a:b] if rows == b - a else mx.concatenate([x[a:b], mx.zeros((rows - b + a, width), x.dtype)])
        out = call(layer, piece) if (c, d) == (0, n) else _columns(layer, piece, c, d)
        outs.append(out if rows == b - a else out[: b - a])
    if len(outs) == 1:
        return outs[0]
    return mx.concatenate(outs, axis=-1 if plan.way == "tiles" else 0)


def _columns(layer: nn.Module, x: mx.array, c: int, d: int) -> mx.array:
    """Output columns ``c:d`` of ``layer(x)``: the same call on those rows of its weight."""
    bias, weight, scales, biases = _tile(layer, c, d)
    if isinstance(layer, nn.QuantizedLinear):
        out = mx.quantized_matmul(x, weight, scales=scales, biases=biases, transpose=True,
                                  group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
        return out if bias is None else out + bias
    return x @ weight if bias is None else mx.addmm(bias, x, weight)


def _tile(layer: nn.Module, c: int, d: int) -> tuple:
    """Rows ``c:d`` of the layer's bias, weight (transposed, unless quantized),
    scales and biases: views of its own arrays, made once (two ops a tile a
    call otherwise) and evaluated with the first forward that takes them
    (never here: a forward may be built while another thread evaluates the
    last, ``runtime.engine.evaluator``)."""
    tiles = layer.__dict__.setdefault("_tiles", {})
    if (c, d) not in tiles:
        part = {name: layer[name][c:d] if name in layer else None for name in ("bias", "weight", "scales", "biases")}
        if not isinstance(layer, nn.QuantizedLinear):
            part["weight"] = part["weight"].T
        tiles[c, d] = tuple(part.values())
    return tiles[c, d]


class _Planned:
    """Marks linear classes that ``apply`` derived."""


@functools.cache
def _planned_class(cls: type) -> type:
    def rows(self, x):
        *lead, width = x.shape
        m = math.prod(lead)
        if self.row_plan is None or self.row_plan.whole(m):
            return cls.__call__(self, x)
        out = _call(self, self.row_plan, x.reshape(m, width))
        return out.reshape(*lead, out.shape[-1])

    def __call__(self, x):
        lengths = _chunks.get()
        if len(lengths) < 2 or x.ndim != 3 or x.shape[:2] != (1, sum(lengths)):
            return rows(self, x)
        starts = itertools.accumulate(lengths, initial=0)
        return mx.concatenate([rows(self, x[:, a : a + n]) for a, n in zip(starts, lengths)], axis=1)

    return type(cls.__name__, (_Planned, cls), {"__call__": __call__, "__module__": cls.__module__})
