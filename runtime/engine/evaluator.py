"""Decode steps evaluated on a thread of their own, so the next is built meanwhile.

On the CPU, ``mx.async_eval`` returns only when about a hundred operations of
its graph are left to run (MLX lets at most ten tasks of ten dispatches wait),
and a decode step has thousands: the engine's step ahead was built while only
the last of them ran, and its graph building (a tenth of a step or more) was
mostly in the open (docs/benchmarks.md, "A step ahead evaluated on its own
thread"). An ``Evaluator`` runs ``mx.eval``, which releases the GIL, on its
own thread while the engine's thread builds the next step.

MLX's terms for this (``mx.new_thread_unsafe_stream``): graphs on such a stream
may be evaluated on any thread, one thread at a time. So the engine builds
every graph on ``stream`` and evaluates on its own thread only once
``settle`` returned. The evaluator's thread reads the step's Python arrays
when it starts on them, under the GIL: if the engine's thread has updated one
in place by then (``x[a:b] = y``, building the next step), it evaluates that
newer node, made on the step's, with it -- the step's values are the same.
(Copies taken at ``start`` would avoid that, at several milliseconds a step:
docs/benchmarks.md, "Figures that were in the code's comments".) Off the
CPU, ``async_eval`` is asynchronous already: a step starts there, on the
caller's thread.
"""

from __future__ import annotations

import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

__all__ = ["Evaluator"]


# Evaluators gone: their threads and streams, for the next (MLX keeps a thread for each stream).
_retired: list[tuple[ThreadPoolExecutor, mx.Stream]] = []


def _release(thread: ThreadPoolExecutor, stream: mx.Stream) -> None:
    """An evaluator is gone. This may run wherever the garbage collector does,
    even inside another executor's ``submit``, holding its locks: so it takes
    none but the thread's own (never joined here: this may run on that thread)."""
    thread.shutdown(wait=False)
    _retired.append((thread, stream))


def _stream() -> mx.Stream:
    """A stream no graph runs on: a retired evaluator's once its thread is done, or a new one."""
    if not _retired:
        return mx.new_thread_unsafe_stream(mx.cpu)
    thread, stream = _retired.pop()
    thread.shutdown(wait=True)
    return stream


def _evaluate(trees: tuple) -> float:
    """Evaluate ``trees``; the ms it took."""
    start = time.perf_counter()
    mx.eval(*trees)
    return (time.perf_counter() - start) * 1e3


class Evaluator:
    """One graph at a time evaluated on a thread of its own (on the CPU), on a
    stream of its own: MLX's thread-unsafe streams share one command encoder
    between threads, so two evaluators (two engines, two threads) never share
    one."""

    def __init__(self):
        self._running: Future | None = None
        if mx.default_device() != mx.cpu:
            self.stream, self._thread = mx.default_stream(mx.default_device()), None
            return
        self.stream = _stream()
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="semantic-eval")
        weakref.finalize(self, _release, self._thread, self.stream)

    def start(self, *trees, here: bool = False) -> Future | None:
        """Begin evaluating the arrays in ``trees``: on this evaluator's thread,
        after the graph running there (queued now, so that thread goes on at
        once, without waiting for the GIL), or (``here``: a graph that may hold
        arrays of the caller's own streams) on the caller's, once that graph
        finished: to its end on the CPU, with ``mx.async_eval`` elsewhere.
        Returns what to wait on before reading them, whose result is the ms
        the evaluation took (None, off the CPU: read them as usual)."""
        if self._thread is None:
            mx.async_eval(*trees)
            return None
        if here:
            self.settle()
            # On the CPU ``async_eval`` returns with the graph's tail still running, and the step
            # built on it would go to this thread meanwhile: the stream takes one thread at a time.
            done = Future()
            done.set_result(_evaluate(trees))
            return done
        self._running = self._thread.submit(_evaluate, trees)
        return self._running

    def settle(self) -> None:
        """Wait for the graphs started on this evaluator's thread, if any (an
        error of theirs is raised here)."""
        running, self._running = self._running, None
        if running is not None:
            running.result()
