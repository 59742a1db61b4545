"""The dashboard's data: one snapshot of the server, and the live events after it.

Every number comes from the runtime -- ``Runtime.agents()`` (tokens, bytes,
tier, last use), ``memory()``, ``disk()``, ``stats()`` (the same calls
``/health`` and ``/metrics`` make), ``hot()`` and ``batch()`` (immutable
snapshots the GPU thread publishes) -- and from the turns' own
``TurnResult``; the page only formats them.

``Dashboard`` is the chat core's observer (``turn_started``/``turn_ended``
with the route each turn came by) and the runtime's (``on_turn``: turns of
the in-process API, which no route saw, are "in-process").  Its ``run`` task
samples the GPU actor's snapshots at most ``TICK_S`` apart (sooner when a
turn ends or an agent changes) and publishes, while anyone subscribes:

    agent          a row of the agents table changed (after a turn, a create, a fork, a tier change)
    tier           an agent's cache moved: {"agent", "tier", "previous"}
    agent_deleted  {"agent"}
    memory         {"memory", "disk"} when they change (checked after changes, and every MEMORY_S)
    batch          the batch (``batch_json``) at most every BATCH_S while it changes

``stream()`` is the body of ``GET /v1/events``: a ``snapshot`` event first,
then the hub's events (``web.events``).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import AsyncIterator

import anyio

from semantic.actors import AgentInfo, BatchSnapshot, InvalidAgentId, Runtime, TurnResult

from .events import EventHub
from .sse import KEEP_ALIVE, encode

__all__ = ["Dashboard", "agent_row", "batch_json", "turn_record"]

log = logging.getLogger("semantic.web")

TICK_S = 0.5  # the sampler's longest sleep
BATCH_S = 0.5  # batch events at most this often (2 Hz)
MEMORY_S = 5.0  # memory and disk looked at at least this often while someone subscribes
THROUGHPUT_S = 1.0  # one tokens/s sample a second...
THROUGHPUT_SAMPLES = 300  # ...for the last five minutes
ROW_LOOKUPS = 16  # more changed agents than this: list them all at once


def _r(x: float | None, digits: int = 4) -> float | None:
    return None if x is None else round(x, digits)


def turn_record(agent_id: str, route: str, turn_id: int, result: TurnResult, cache: str | None) -> dict:
    """One finished turn as ``turn_ended`` and the recent turns show it.
    ``cache``: where the agent's cache was when it began (hot, warm, None)."""
    prompt = result.prompt_tokens
    return {"agent": agent_id, "route": route, "turn_id": turn_id, "reason": result.reason,
            "prompt_tokens": prompt, "prefilled_tokens": result.prefilled_tokens,
            "reused_tokens": result.reused_tokens, "output_tokens": result.output_tokens,
            "reuse": _r(result.reused_tokens / prompt) if prompt else None,
            "ttft_s": _r(result.ttft_s), "decode_tps": _r(result.decode_tps, 2), "cache": cache,
            "drafted_tokens": result.drafted_tokens, "accepted_tokens": result.accepted_tokens}


def agent_row(info: AgentInfo, last: dict | None) -> dict:
    """One row of the agents table: the runtime's numbers and the agent's last turn
    (since this server started; None before)."""
    return {"id": info.id, "model": info.model, "tier": info.tier, "tokens_cached": info.tokens,
            "bytes": info.bytes, "last_use": info.last_use,
            "turns": sum(m.role == "assistant" for m in info.history), "messages": len(info.history),
            "reuse": last and last["reuse"], "ttft_s": last and last["ttft_s"], "route": last and last["route"]}


def batch_json(batch: BatchSnapshot, tokens_per_s: float | None = None) -> dict:
    """The batch: each turn the GPU thread holds, by phase; the queue depth; the output
    tokens generated so far and (sampled) the tokens/s of the last second."""
    out: dict = {"decoding": [], "prefilling": [], "queued": []}
    lists = {"decode": out["decoding"], "prefill": out["prefilling"], "queued": out["queued"]}
    for s in batch.sequences:
        lists[s.phase].append({"agent": s.agent_id, "turn_id": s.turn_id, "prompt_tokens": s.prompt_tokens,
                               "tokens": s.tokens, "tokens_per_s": _r(s.tokens_per_s, 2)})
    return {**out, "queue_depth": batch.queue_depth, "generated_tokens": batch.generated,
            "tokens_per_s": _r(tokens_per_s, 2)}


class Dashboard:
    """The dashboard's state and sampler for one server (event loop only)."""

    def __init__(self, rt: Runtime, hub: EventHub):
        self.rt = rt
        self.hub = hub
        self.throughput: deque[tuple[float, float]] = deque(maxlen=THROUGHPUT_SAMPLES)  # (unix time, tokens/s)
        self._last: dict[str, dict] = {}  # agent -> its last turn's record
        self._web_turns: set[int] = set()  # turns a route started (the rest are in-process)
        self._tiers: dict[str, str | None] = {}  # agent -> the tier last published
        self._hot: dict = {}  # the hot set last seen
        self._dirty: set[str] = set()  # agents whose rows to publish
        self._memory_due = True
        self._wake = anyio.Event()
        rt.on_turn(self._runtime_turn)

    # -- observers -----------------------------------------------------------------

    def turn_started(self, agent_id: str, route: str, turn_id: int) -> None:
        self._web_turns.add(turn_id)
        self.hub.publish("turn_started", {"agent": agent_id, "route": route, "turn_id": turn_id})

    def turn_ended(self, agent_id: str, route: str, turn_id: int, result: TurnResult | None,
                   tier: str | None) -> None:
        self._web_turns.discard(turn_id)
        if result is not None:
            self._record(turn_record(agent_id, route, turn_id, result, tier))

    def _runtime_turn(self, agent_id: str, turn_id: int, result: TurnResult) -> None:
        if turn_id not in self._web_turns:  # the web layer reports its own, with their routes
            self._record(turn_record(agent_id, "in-process", turn_id, result, None))

    def _record(self, record: dict) -> None:
        self._last[record["agent"]] = record
        self.hub.turn(record)
        self.changed(record["agent"])

    def changed(self, agent_id: str) -> None:
        """The agent's row changed (created, forked, a turn ended): publish it soon."""
        self._dirty.add(agent_id)
        self._memory_due = True
        self._wake.set()

    def deleted(self, agent_id: str) -> None:
        self._last.pop(agent_id, None)
        self._tiers.pop(agent_id, None)
        self._dirty.discard(agent_id)
        self._memory_due = True
        self.hub.publish("agent_deleted", {"agent": agent_id})
        self._wake.set()

    # -- the snapshot and the stream ---------------------------------------------------

    async def snapshot(self) -> dict:
        """Everything the page shows, now (``GET /v1/dashboard``; the first event of a stream)."""
        rt = self.rt
        infos = await rt.agents()
        memory, disk = await anyio.to_thread.run_sync(memory_and_disk, rt)
        stats = rt.stats()
        rows = [agent_row(i, self._last.get(i.id)) for i in infos]
        for row in rows:
            self._tiers[row["id"]] = row["tier"]
        return {"type": "snapshot", "at": round(time.time(), 3), "model": rt.model, "healthy": rt.healthy,
                "context_length": rt.context_length, "agents": rows, "memory": memory, "disk": disk,
                "queue_depth": stats.get("waiting", 0), "decoding": stats.get("decoding", 0),
                "batch": batch_json(rt.batch(), self.throughput[-1][1] if self.throughput else None),
                "turns": self.hub.turns, "throughput": [list(s) for s in self.throughput]}

    async def stream(self, heartbeat_s: float) -> AsyncIterator[bytes]:
        """``snapshot``, then every event as it is published (an SSE comment when
        nothing came for ``heartbeat_s``); ``dropped`` last if this reader fell behind."""
        async with self.hub.subscribe() as events:
            self._wake.set()
            yield encode(await self.snapshot(), "snapshot")
            while True:
                event = None
                with anyio.move_on_after(heartbeat_s):
                    try:
                        event = await events.receive()
                    except anyio.EndOfStream:
                        yield encode({"type": "dropped", "reason": "this reader fell behind; reconnect"},
                                     "dropped")
                        return
                yield KEEP_ALIVE if event is None else encode(event, event["type"])

    # -- the sampler --------------------------------------------------------------------

    async def run(self) -> None:
        """Sample the runtime's snapshots and publish what changed (see the module docstring)."""
        rt = self.rt
        sampled_at, generated = time.monotonic(), rt.batch().generated
        batch_at, batch_seen, batch_tps = 0.0, None, None
        memory_at, memory_seen = 0.0, None
        while True:
            with anyio.move_on_after(TICK_S):
                await self._wake.wait()
            self._wake = anyio.Event()
            now = time.monotonic()
            batch = rt.batch()
            if now - sampled_at >= THROUGHPUT_S:
                tps = (batch.generated - generated) / (now - sampled_at)
                self.throughput.append((round(time.time(), 3), round(tps, 2)))
                sampled_at, generated = now, batch.generated
            hot = dict(rt.hot().agents)
            moved = {a for a in hot.keys() | self._hot.keys() if hot.get(a) != self._hot.get(a)}
            self._hot = hot
            if not self.hub.subscribers:
                self._dirty.clear()
                self._memory_due = True
                continue
            latest_tps = self.throughput[-1][1] if self.throughput else None
            if (batch is not batch_seen or latest_tps != batch_tps) and now - batch_at >= BATCH_S:
                batch_at, batch_seen, batch_tps = now, batch, latest_tps
                self.hub.publish("batch", batch_json(batch, latest_tps))
            self._dirty |= moved
            if self._dirty:
                await self._publish_rows()
            if self._memory_due or now - memory_at >= MEMORY_S:
                self._memory_due, memory_at = False, now
                memory, disk = await anyio.to_thread.run_sync(memory_and_disk, rt)
                if (memory, disk) != memory_seen:
                    memory_seen = (memory, disk)
                    self.hub.publish("memory", {"memory": memory, "disk": disk})

    async def _publish_rows(self) -> None:
        ids, self._dirty = self._dirty, set()
        ids = {i for i in ids if isinstance(i, str)}  # (shared prefixes are keyed otherwise)
        if len(ids) > ROW_LOOKUPS:
            infos = [i for i in await self.rt.agents() if i.id in ids]
        else:
            infos = []
            for agent_id in ids:
                try:
                    infos += await self.rt.agents(only=agent_id)
                except InvalidAgentId:
                    pass
        found = {i.id for i in infos}
        for info in infos:
            row = agent_row(info, self._last.get(info.id))
            previous = self._tiers.get(info.id, row["tier"])
            self._tiers[info.id] = row["tier"]
            if previous != row["tier"]:
                self.hub.publish("tier", {"agent": info.id, "tier": row["tier"], "previous": previous})
            self.hub.publish("agent", {"agent": row})
        for agent_id in ids - found:
            if agent_id in self._tiers:  # gone without a delete route (pruned)
                self.deleted(agent_id)


def memory_and_disk(rt: Runtime) -> tuple[dict, dict]:
    """(worker thread: both ask the filesystem)"""
    return rt.memory(), rt.disk()
