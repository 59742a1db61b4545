"""The GPU thread's way back to the event loop never waits for the loop."""

from __future__ import annotations

import threading
import time

import anyio
import pytest

from semantic.actors.gpu import _loop_call_soon


@pytest.mark.anyio
async def test_a_thread_schedules_callbacks_without_waiting_for_a_busy_loop():
    call_soon, ran = _loop_call_soon(), []
    waits = []

    def thread():
        for i in range(3):
            t = time.perf_counter()
            call_soon(lambda i=i: ran.append(i))
            waits.append(time.perf_counter() - t)

    worker = threading.Thread(target=thread)
    worker.start()
    time.sleep(1.0)  # the loop is busy (blocked) while the thread schedules
    worker.join()
    assert max(waits) < 0.5 and ran == []  # queued, not run: the thread did not wait for the loop
    await anyio.sleep(0.05)
    assert ran == [0, 1, 2]  # then run on the loop, in order


@pytest.mark.parametrize("backend", ["trio", "asyncio"])
def test_scheduling_after_the_loop_has_ended_is_a_runtime_error(backend):
    async def capture():
        return _loop_call_soon()

    call_soon = anyio.run(capture, backend=backend)
    with pytest.raises(RuntimeError):  # GpuActor.call_soon swallows it: nothing is left to deliver to
        call_soon(lambda: None)
