"""The event hub: what happens in one server, for every subscriber of ``/v1/events``.

``publish(type, data)`` hands an event to every subscriber without waiting:
each has its own bounded queue, and one that falls ``queue_size`` events
behind is dropped (its stream ends; a client reconnects and starts from a
fresh snapshot) so a slow reader never holds the server up nor grows its
memory.  The hub also keeps a bounded ring of the most recent turns.

Everything here runs on the server's event loop; nothing blocks.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

__all__ = ["EventHub"]


class EventHub:
    """Bounded publish/subscribe of events (dicts with ``type`` and ``at``) and recent turns."""

    def __init__(self, queue_size: int = 512, recent_turns: int = 100):
        if queue_size < 1 or recent_turns < 1:
            raise ValueError("queue_size and recent_turns must be at least 1")
        self.queue_size = queue_size
        self._subscribers: set[MemoryObjectSendStream[dict]] = set()
        self._turns: deque[dict] = deque(maxlen=recent_turns)
        self.published = 0
        self.dropped = 0  # subscribers dropped for falling behind

    @property
    def subscribers(self) -> int:
        return len(self._subscribers)

    @property
    def turns(self) -> list[dict]:
        """The most recent turns, oldest first."""
        return list(self._turns)

    def publish(self, type: str, data: dict) -> dict:
        """Send ``{"type", "at", **data}`` to every subscriber now; never waits."""
        event = {"type": type, "at": round(time.time(), 3), **data}
        self.published += 1
        for send in list(self._subscribers):
            try:
                send.send_nowait(event)
            except anyio.WouldBlock:  # it fell behind: drop it rather than wait or grow
                self.dropped += 1
                self._subscribers.discard(send)
                send.close()
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._subscribers.discard(send)
        return event

    def turn(self, record: dict) -> dict:
        """Keep a finished turn among the recent ones and publish it (``turn_ended``)."""
        event = self.publish("turn_ended", record)
        self._turns.append(event)
        return event

    @asynccontextmanager
    async def subscribe(self) -> AsyncIterator[MemoryObjectReceiveStream[dict]]:
        """A stream of the events published from now on, until the block ends; it
        ends early (``EndOfStream`` after what was queued) if the subscriber is dropped."""
        send, receive = anyio.create_memory_object_stream[dict](self.queue_size)
        self._subscribers.add(send)
        try:
            async with receive:
                yield receive
        finally:
            self._subscribers.discard(send)
            send.close()
