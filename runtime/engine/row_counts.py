"""Which row counts a decode forward may use, measured when a model loads.

A decode forward runs every decoding sequence's next token as one row of the
projections, norms and MLP (attention runs per sequence: ``runtime.engine.rowwise``).
BLAS picks a kernel by the matmul's shape and kernels sum in different
orders, so a row may come out differently at M = 3 than at M = 1 -- or not:
it depends on the machine. ``runtime.engine.row_plans`` first gives each weight
shape whose rows differ a way to take them that agrees at every count; then
nothing more is assumed: ``Engine.calibrate`` runs a probe sequence through
the real decode forward alone and beside random neighbours at every count
1..max and at every position, and compares its logits bitwise. Counts
whose rows agree form a class; the server decodes only at the counts of one
class (``choose``), padding a forward up to the next count of the class or
splitting the batch. Within a class a sequence's logits do not depend on how
many neighbours it has or where it sits. The result, plans included, is kept
per model, machine and library versions (``kept``, ``keep``), so a restart
does not measure again.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import platform
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten

from ..model import blas
from ..files import write_atomic
from ..text.json_reader import read_json
from ..paths import cache_home
from .row_plans import RowPlan

__all__ = ["KEPT", "RowCounts", "cached", "choose", "keep", "kept", "key"]

log = logging.getLogger("semantic.runtime")


@dataclass(frozen=True)
class RowCounts:
    """The token slots a decode forward may have, ascending (``counts``), the
    way each weight shape's matmul takes its rows (``plans``), and what
    measuring them found: ``classes`` (counts whose rows agree, with those
    plans; a count in none gave a row that depends on its position), ``ms`` (a
    forward's time at 1..max rows) and ``seconds`` (what measuring cost).
    ``fixed(n)``: one count, not measured."""

    counts: tuple[int, ...]
    classes: tuple[tuple[int, ...], ...] = ()
    ms: tuple[float, ...] = ()
    seconds: float = 0.0
    plans: tuple[RowPlan, ...] = ()  # how each weight shape's matmul takes its rows (``runtime.engine.row_plans``)
    prefill_from: int | None = None  # the fewest tokens a prompt chunk needs to share a forward (None: never)

    def __post_init__(self):
        if not self.counts or sorted(set(self.counts)) != list(self.counts) or self.counts[0] < 1:
            raise ValueError(f"row counts must be distinct positive counts in ascending order, not {self.counts}")

    @classmethod
    def fixed(cls, rows: int) -> "RowCounts":
        return cls((rows,))

    @property
    def measured(self) -> bool:
        return bool(self.classes)

    def forwards(self, n: int) -> list[tuple[int, int]]:
        """How ``n`` decoding sequences are run: (sequences, token slots) a
        forward, in order. Full forwards of the largest count, then the rest
        padded up to the next count."""
        top, out = self.counts[-1], []
        while n > 0:
            take = min(n, top)
            out.append((take, next(c for c in self.counts if c >= take)))
            n -= take
        return out

    def pack(self, widths: list[int]) -> list[tuple[int, int]]:
        """How sequences taking ``widths`` token slots each (one, or more to
        verify drafts) are run: (sequences, token slots) a forward, in order.
        A sequence's slots stay in one forward; each forward takes sequences
        while they fit the largest count, padded up to the next count. With
        a slot each, ``forwards``."""
        top, out, n, used = self.counts[-1], [], 0, 0
        for w in widths:
            if w > top:
                raise ValueError(f"a sequence of {w} token slots in forwards of at most {top}")
            if used + w > top:
                out.append((n, next(c for c in self.counts if c >= used)))
                n = used = 0
            n, used = n + 1, used + w
        if n:
            out.append((n, next(c for c in self.counts if c >= used)))
        return out

    def describe(self) -> dict:
        return asdict(self)


def choose(classes: list[tuple[int, ...]], ms: list[float]) -> tuple[int, ...]:
    """The class to decode with: the least worst slowdown, over every number of
    decoding sequences 1..max, against one forward at exactly that many rows
    (what a batch that may change answers would cost). Ties go to the class
    with the smaller counts. ``ms[m - 1]``: a forward's time at m rows."""

    def worst(counts: tuple[int, ...]) -> float:
        rows = RowCounts(counts)
        return max(sum(ms[slots - 1] for _, slots in rows.forwards(n)) / ms[n - 1] for n in range(1, len(ms) + 1))

    return min(classes, key=lambda c: (round(worst(c), 3), c))


KEPT = 32  # measurements kept (the newest): one per model shape, device and library versions in use


def kept(home: Path | None = None) -> dict[str, RowCounts]:
    """Every measurement kept under the cache home, by ``key``; a file that
    cannot be read is left out (logged): its model is measured again. One
    that is not a measurement of this version's form (damaged, or written
    by another version) is removed, so it is logged once, not at every start."""
    machine()
    found = {}
    for path in sorted((home or cache_home()).joinpath("row-counts").glob("*.json")):
        try:
            fields = {k: _tuples(v) for k, v in read_json(path.read_bytes(), path.name).items()}
            plans = tuple(RowPlan(**p) for p in fields.pop("plans", ()))
            found[path.stem] = RowCounts(**fields, plans=plans)
        except OSError as e:
            log.warning("row counts in %s unreadable (%s): measured again when that model loads", path, e)
        except (ValueError, TypeError, AttributeError) as e:  # AttributeError: JSON, not an object
            log.warning("row counts in %s unreadable (%s): removed, measured again when that model loads", path, e)
            path.unlink(missing_ok=True)
    return found


def keep(key: str, counts: RowCounts, home: Path | None = None) -> None:
    """Write a measurement under the cache home, atomically; the ``KEPT`` newest
    stay. Raises ``OSError``."""
    folder = (home or cache_home()) / "row-counts"
    folder.mkdir(parents=True, exist_ok=True)
    write_atomic(folder / f"{key}.json", json.dumps(counts.describe()).encode())
    for old in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-KEPT]:
        old.unlink(missing_ok=True)


def cached(engine, home: Path | None = None) -> RowCounts:
    """``engine.calibrate()``, or what was kept for it (``kept``, ``keep``): for
    a process that runs an engine itself (benchmarks, ``semantic doctor``); a
    server's GPU thread gets them from the runtime instead. A measurement that
    cannot be kept is logged and used."""
    k = key(engine)
    found = kept(home).get(k)
    if found is None:
        found = engine.calibrate()
        try:
            keep(k, found, home)
        except OSError as e:
            log.warning("could not keep the row counts measured: %s", e)
    return found


def _tuples(value):
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def key(engine) -> str:
    """What the measurement depends on: the model's parameter shapes and types
    (kernels are picked by shape, never by the numbers: the probe's random
    neighbours check that), how the engine attends, the most rows, the device,
    the BLAS kernel, the CPU, the libraries."""
    parts = {
        "model": [(name, v.shape, str(v.dtype)) for name, v in tree_flatten(engine.model.parameters())],
        "class": type(engine.model).__module__,
        "kv": [engine.kv_bits, engine.kv_group_size, engine.float_head],
        "max_rows": engine.decode_rows,
        "measured": ("per weight shape, its ways timed in the decode forward; the decode forward at every slot, "
                     "again for the counts chosen, prompt chunks together; CPU attention, RoPE tables, lean norms, "
                     "weights laid out"),  # older: less
        "device": str(mx.default_device()),
        "machine": machine(),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


@functools.cache
def machine() -> dict:
    """The BLAS kernel set, the CPU and the libraries, read once a process
    (``kept`` reads them, so a GPU thread computing ``key`` later opens no file)."""
    return {"blas": blas.kernel(), "cpu": [platform.machine(), _cpu()],
            "versions": [_version("mlx"), _version("mlx-lm")]}


def _cpu() -> str:
    info = blas.cpu_info()
    return json.dumps(info, sort_keys=True) if info else platform.processor()


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return ""
