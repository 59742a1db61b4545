"""Async iteration helpers shared by the web modules (private)."""

from __future__ import annotations

from collections.abc import AsyncIterable
from contextlib import aclosing, asynccontextmanager, nullcontext

import anyio

__all__ = ["closing", "collapsing_task_group"]


def closing(iterable: AsyncIterable):
    """``async with closing(it) as it``: closes ``it`` on the way out when it is
    an async generator (also when cancelled while it was suspended at a
    ``yield``; it would otherwise wait for the GC to run its ``finally``)."""
    return aclosing(iterable) if hasattr(iterable, "aclose") else nullcontext(iterable)


@asynccontextmanager
async def collapsing_task_group():
    """A task group whose lone exception comes out as itself, not in a group."""
    try:
        async with anyio.create_task_group() as tg:
            yield tg
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        raise group.exceptions[0] from None
