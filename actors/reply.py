"""``Reply``: one turn's stream of deltas, as the in-process API hands it out
(``Agent.send``); closing it, or dropping it mid-stream, cancels the turn."""

from __future__ import annotations

import math
import threading

import anyio

from semantic.runtime.outcome import FinishReason, TurnResult

from .errors import RuntimeClosed, TurnCancelled
from .gpu import GpuActor
from .messages import Delta, TurnEnded

__all__ = ["Reply"]


class Reply:
    """One turn's stream of ``Delta``\\ s; ``result`` once it ended.

    Cancelling: ``close()``/``aclose()``, leaving ``async with``, breaking out of
    ``async for`` (the stream is dropped), or cancelling the task that awaits it
    asks the GPU actor to cancel the turn before its next step.  A cancelled
    turn leaves the agent's history unchanged; its cache keeps what was
    computed (see ``actors.agent``).  Iterating raises ``TurnError`` if the turn
    failed and ``TurnCancelled`` if the runtime cancelled it (shutdown).
    """

    def __init__(self, turn_id: int, events, gpu: GpuActor):
        self.turn_id = turn_id
        self.result: TurnResult | None = None
        self._events = events
        self._gpu = gpu
        self._loop_thread = threading.get_ident()
        self._done = False

    def __aiter__(self) -> Reply:
        return self

    async def __anext__(self) -> Delta:
        delta = await self.poll(math.inf)
        assert delta is not None
        return delta

    async def poll(self, timeout: float) -> Delta | None:
        """The next delta, or None when none came within ``timeout`` seconds
        (the turn goes on: a prompt still prefilling, or waiting for room).
        Ends like ``__anext__``; cancelling the caller cancels the turn."""
        if self._done:
            raise StopAsyncIteration
        event = None
        try:
            with anyio.move_on_after(timeout):
                event = await self._events.receive()  # a timeout loses nothing: receive is cancel-safe
        except anyio.EndOfStream:
            self._finish()
            raise RuntimeClosed("the runtime closed during this turn") from None
        except BaseException:
            self.close()
            raise
        return None if event is None else self._take(event)

    def _take(self, event) -> Delta:
        if isinstance(event, Delta):
            return event
        self._finish()
        if isinstance(event, TurnEnded):
            self.result = event.result
            if event.result.reason == FinishReason.CANCELLED:
                raise TurnCancelled("the turn was cancelled: the runtime shut down")
            raise StopAsyncIteration
        raise event.error

    async def text(self) -> str:
        """Read the rest of the stream; return the whole reply (choice 0's)."""
        async for _ in self:
            pass
        return self.result.text

    def close(self) -> None:
        """Stop reading; cancel the turn if it has not ended.  Never blocks."""
        if not getattr(self, "_done", True):
            self._done = True
            self._events.close()
            self._gpu.cancel(self.turn_id)

    async def aclose(self) -> None:
        self.close()

    async def __aenter__(self) -> Reply:
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_done", True):
            return
        if threading.get_ident() == self._loop_thread:
            self.close()  # dropped mid-stream (e.g. ``break``): CPython frees it right here
        else:  # freed by the cycle collector on another thread: streams belong to the loop
            self._gpu.call_soon(self.close)

    def _finish(self) -> None:
        self._done = True
        self._events.close()
