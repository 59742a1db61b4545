"""Decode steps evaluated on a thread of their own (``runtime.engine.evaluator``):
the next step is built on a step still computing, and nothing changes."""

from __future__ import annotations

import threading

import mlx.core as mx
import pytest

from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.evaluator import Evaluator
from tests.runtime.test_engine import ByteTokenizer, busy_batch_equals_alone, drain, prompts
from tests.tiny import tiny_model

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the evaluator's thread is for the CPU")


def test_the_next_graph_is_built_on_one_computing_and_both_come_out_exact():
    evaluator = Evaluator()
    with mx.stream(evaluator.stream):
        a = mx.random.normal((256, 256), key=mx.random.key(0))
        b = a @ a
        started = evaluator.start(b)
        assert started is not None  # on the evaluator's thread
        c = (b @ a).sum(axis=0)  # built while ``b`` computes there
        evaluator.start(c)
        evaluator.settle()
    assert started.done()
    expected = mx.random.normal((256, 256), key=mx.random.key(0))
    assert mx.array_equal(b, expected @ expected).item()
    assert mx.array_equal(c, ((expected @ expected) @ expected).sum(axis=0)).item()


def test_a_graph_holding_the_callers_own_arrays_starts_here():
    """MLX evaluates a graph on another thread only when it is on a stream any
    thread may use: an array of the caller's own default stream fails there
    (raised by ``settle``), and starts on the caller's thread with ``here``."""
    evaluator = Evaluator()
    mine = mx.arange(8) * 2  # the caller's default stream
    evaluator.start(mine)
    with pytest.raises(RuntimeError, match="Stream"):
        evaluator.settle()
    mine = mx.arange(8) * 2
    assert evaluator.start(mine, here=True).result() >= 0.0  # done: its ms
    assert mine.tolist() == list(range(0, 16, 2))


def test_steps_computed_on_the_evaluators_thread_change_no_token(monkeypatch):
    """Greedy tokens with steps built ahead and evaluated on the thread equal
    those of steps built and read one at a time, alone and in a busy batch."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    on_thread = []
    start = Evaluator.start

    def counted(self, *trees, here=False):
        started = start(self, *trees, here=here)
        on_thread.append(started is not None)
        return started

    monkeypatch.setattr(Evaluator, "start", counted)
    runs = []
    for ahead in (True, False):
        engine = Engine(model, tok, speculation=False)
        engine._decoder.pipelined = ahead
        ids = [engine.add(p, SamplingParams(max_tokens=12)) for p in prompts(3, seed=5)]
        done = drain(engine)
        runs.append([done[i].output_tokens for i in ids])
    assert runs[0] == runs[1]
    assert any(on_thread)
    busy_batch_equals_alone(model, tok)


def test_a_cache_resumed_lazy_on_the_callers_stream_decodes_on_its_thread():
    """A preempted sequence resumes straight into decoding: its next step is the
    first to read the cache given to ``resume``, which may be lazy on the
    caller's own stream, so that step (never built ahead) starts on the
    caller's thread -- on the evaluator's it fails (the test above) -- and
    the sequence says what it would have said uninterrupted."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    greedy = SamplingParams(max_tokens=16)
    expected = []
    for resumed in (False, True):
        engine = Engine(model, tok, speculation=False)
        ids = [engine.add(p, greedy) for p in prompts(2, seed=5)]
        out = {}

        def act(step):
            if resumed and step == 4:
                out["preempted"] = engine.preempt(ids[0])
            if resumed and step == 6:
                f = out["preempted"]
                for c in f.cache:  # each record a lazy copy, on this thread's default stream
                    for part in ("packed", "open", "sinks"):
                        if getattr(c, part) is not None:
                            setattr(c, part, tuple(x + 0 for x in getattr(c, part)))
                engine.resume(ids[0], f.cache, len(f.cache_tokens))

        done = drain(engine, act)
        expected.append([done[i].output_tokens for i in ids])
    assert expected[1] == expected[0]


def test_an_evaluators_stream_serves_the_next_once_it_is_gone():
    """MLX keeps a thread for every stream it made: engines made and dropped over
    a server's life (a model swapped, unloaded when idle and loaded again)
    take the streams of those gone, once their graphs are done."""
    import gc
    import time

    first = Evaluator()
    with mx.stream(first.stream):
        first.start(mx.random.normal((64, 64), key=mx.random.key(1)) @ mx.random.normal((64, 64)))
    stream = first.stream
    del first
    gc.collect()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        second = Evaluator()
        if second.stream == stream:
            break
        del second  # (its new stream is a spare now too)
        time.sleep(0.01)
    assert second.stream == stream


def test_a_graph_started_here_is_finished_here_before_the_thread_takes_the_next(monkeypatch):
    """The stream takes one thread at a time. A step started on the caller's
    thread (``here``) is evaluated to its end there (``mx.async_eval``
    returns with the graph's tail still running) before the step built on
    its tokens goes to the evaluator's thread; CI segfaulted once when the
    caller read the first step's tokens while the thread evaluated the
    second."""
    evaluator = Evaluator()
    calls = []
    real = mx.eval

    def recording(*trees):
        calls.append(threading.current_thread() is threading.main_thread())
        return real(*trees)

    with mx.stream(evaluator.stream):
        a = mx.random.normal((64, 64))
        first = a @ a
        second = first @ first
    monkeypatch.setattr(mx, "eval", recording)
    evaluator.start(first, here=True)
    evaluator.start(second).result()
    assert calls == [True, False]  # the first finished on the caller's thread, then the thread took the second


def test_a_prefill_step_with_none_pending_leaves_the_step_ahead_computing(monkeypatch):
    """A server asks for a prefill chunk every step: with none pending the
    engine answers at once, and the step built ahead goes on computing (had
    it waited for that step, each next one would be built with nothing
    computing beside it)."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    engine = Engine(model, tok, speculation=False)
    for p in prompts(2, seed=5):
        engine.add(p, SamplingParams(max_tokens=12))
    while engine.prefilling:
        engine.prefill_step()
    engine.step_once()  # reads the first step and starts the next on the evaluator's thread
    waits = []
    settle = Evaluator.settle
    monkeypatch.setattr(Evaluator, "settle", lambda self: (waits.append(self), settle(self)))
    assert engine.prefill_step() == []
    assert not waits


def test_an_evaluator_collected_inside_another_submit_gives_its_stream_back():
    """The garbage collector may finalize an evaluator anywhere -- inside a
    ``ThreadPoolExecutor.submit``, which holds the module's shutdown lock:
    giving its thread and stream back takes no lock of the module's."""
    import gc
    from concurrent.futures import thread

    def collect():
        with thread._global_shutdown_lock:  # as inside ``submit``
            gc.collect()

    gc.disable()  # only the collection below frees it
    try:
        evaluator = Evaluator()
        stream = evaluator.stream
        evaluator.cycle = evaluator
        del evaluator
        collector = threading.Thread(target=collect, daemon=True)
        collector.start()
        collector.join(timeout=30)
    finally:
        gc.enable()
    assert not collector.is_alive(), "finalizing an evaluator waited on the executor's lock"
    assert Evaluator().stream == stream  # taken back by the next
