"""The eviction actor: keeps the hot caches inside the memory budget with headroom.

``AgentCaches`` already demotes the least recently used caches when a turn
needs room, but that happens on the GPU thread in the middle of admitting a
turn, and a dirty cache must first reach the disk.  This actor works ahead of
it: whenever the GPU actor reports its hot set (after a turn ends, a cache is
written, a fork...) and the hot bytes are above ``high`` of the budget, it asks
the GPU actor to demote least-recently-used idle caches that are already
*clean* (durable on disk, so demotion frees memory without writing) until the
bytes would be under ``low``.  Dirty ones are skipped: they become clean when
the persistence actor writes them, which triggers a new report.

It decides only; the GPU actor owns the caches and demotes them (and ignores a
request for a cache that meanwhile became busy, dirty or cold).
"""

from __future__ import annotations

import math

import anyio

from .messages import Demote, EvictCommand, HotSet, Stop

__all__ = ["EvictionActor"]


class EvictionActor:
    def __init__(self, high: float = 0.9, low: float = 0.75, *, gpu=None, channel=None):
        """``gpu``: the ``GpuActor`` demotions go to; ``channel``: the (send,
        receive) ends of this actor's mailbox, when others need the send end
        before this actor exists (default: a new one)."""
        if not 0 < low <= high <= 1:
            raise ValueError(f"eviction watermarks must satisfy 0 < low <= high <= 1, not low={low}, high={high}")
        self.high, self.low = high, low
        self.gpu = gpu
        self.mailbox, self._inbox = channel or anyio.create_memory_object_stream[EvictCommand](math.inf)
        self.requested = 0  # demotions asked for (for tests and benchmarks)

    async def run(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with self.mailbox:  # once this actor ends, sending to it raises ClosedResourceError
            async with self._inbox:
                await self._serve()

    async def _serve(self) -> None:
        async for message in self._inbox:
            latest = message
            while isinstance(latest, HotSet):  # only the newest report matters
                try:
                    latest = self._inbox.receive_nowait()
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            if isinstance(latest, Stop):
                return
            if isinstance(latest, HotSet):
                self._consider(latest)

    def victims(self, report: HotSet) -> tuple[str, ...]:
        """Clean idle caches to demote, least recently used first, to get under ``low``."""
        if report.used_bytes <= self.high * report.budget_bytes:
            return ()
        excess = report.used_bytes - self.low * report.budget_bytes
        chosen = []
        for agent in report.agents:
            if excess <= 0:
                break
            if agent.clean:
                chosen.append(agent.agent_id)
                excess -= agent.bytes
        return tuple(chosen)

    def _consider(self, report: HotSet) -> None:
        if chosen := self.victims(report):
            self.requested += len(chosen)
            self.gpu.submit(Demote(chosen))
