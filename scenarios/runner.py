"""Run a scenario against a ``Backend``, turn by turn, and record what happened.

``run`` is the only public entry point.  It owns all run state (the open
handles, the ``Prompts`` queues, the records) inside one call; observers get
immutable events and cannot change it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import anyio

from semantic.runtime.outcome import TurnResult

from .backend import AgentHandle, Backend, Delta
from .plan import Line, Prompts, Slot, cache_key, schedule
from .schema import Phase, Scenario

__all__ = [
    "Event", "PhaseFinished", "PhaseStarted", "Result", "TurnFinished", "TurnRecord", "TurnStarted", "TurnText", "run",
]


@dataclass(frozen=True)
class TurnRecord:
    """One turn of the scenario: where it stands in the run, and its result (reply, tokens, times)."""

    index: int
    phase: str
    agent: str
    name: str
    round: int
    lifecycle: str
    cache_key: str
    agent_turn: int  # 1 for the first turn on this cache key, 2 for the next, ...
    prompt: str  # the new user message of this turn
    result: TurnResult


@dataclass(frozen=True)
class Result:
    scenario: Scenario
    run_id: str
    use_cache: bool
    seed: int | None
    turns: tuple[TurnRecord, ...]
    transcript: dict[str, tuple[Line, ...]]  # phase name -> its lines, in phase order
    verdict: str | None  # the judging phase's reply


@dataclass(frozen=True)
class PhaseStarted:
    phase: Phase
    index: int


@dataclass(frozen=True)
class TurnStarted:
    index: int
    phase: str
    agent: str
    name: str
    round: int
    reopened: bool  # a new conversation starts here (first turn on its cache key)


@dataclass(frozen=True)
class TurnText:
    agent: str
    text: str  # the next piece of the reply


@dataclass(frozen=True)
class TurnFinished:
    record: TurnRecord


@dataclass(frozen=True)
class PhaseFinished:
    phase: Phase


Event = PhaseStarted | TurnStarted | TurnText | TurnFinished | PhaseFinished


async def run(
    scenario: Scenario,
    backend: Backend,
    *,
    run_id: str,
    seed: int | None = None,
    use_cache: bool = True,
    on_event: Callable[[Event], None] | None = None,
) -> Result:
    """Play every turn of ``scenario`` in order and return the transcript and per-turn numbers.

    Guarantees: each permanent agent has one conversation (one cache key) for
    the whole run and each ephemeral agent one per phase; every prompt only
    appends to the agent's conversation; a line reaches only the agents of
    its phase, private blocks only their ``visible_to``.  ``seed`` (if any)
    gives turn i the seed ``seed + i``; ``use_cache`` is passed to every
    ``open_agent``.  ``on_event`` is called synchronously, in order.

    Raises what the backend raises.  Cancelled, or failing, it closes every
    handle it opened (shielded) and re-raises; nothing is returned.
    """
    r = _Run(scenario, backend, run_id, seed, use_cache, on_event or (lambda event: None))
    try:
        current: Phase | None = None
        for slot in schedule(scenario):
            if slot.phase is not current:
                if current is not None:
                    await r.end_phase(current)
                current = slot.phase
                r.prompts.start_phase(current)
                r.emit(PhaseStarted(current, slot.phase_index))
            await r.turn(slot)
        assert current is not None, "a validated scenario has at least one phase"
        await r.end_phase(current)
        for key in list(r.handles):  # the permanent agents
            await r.handles[key].close()
            del r.handles[key]
    finally:
        if r.handles:  # failed or cancelled: close the rest, and report the first error only
            with anyio.CancelScope(shield=True):
                for handle in r.handles.values():
                    with contextlib.suppress(Exception):
                        await handle.close()
    said = r.prompts.transcript
    verdict = r.records[-1].result.text if scenario.phases[-1].judge is not None else None
    return Result(scenario, run_id, use_cache, seed, tuple(r.records),
                  {p.name: tuple(said[p.name]) for p in scenario.phases}, verdict)


@dataclass
class _Run:
    """One run's state; only ``run`` (through these methods) changes it."""

    scenario: Scenario
    backend: Backend
    run_id: str
    seed: int | None
    use_cache: bool
    emit: Callable[[Event], None]
    prompts: Prompts = field(init=False)
    handles: dict[str, AgentHandle] = field(default_factory=dict)  # cache key -> open conversation
    turns_on: dict[str, int] = field(default_factory=dict)  # cache key -> turns taken
    records: list[TurnRecord] = field(default_factory=list)

    def __post_init__(self):
        self.prompts = Prompts(self.scenario)

    async def turn(self, slot: Slot) -> None:
        agent = self.scenario.agents[slot.agent]
        key = cache_key(self.scenario, self.run_id, slot.agent, slot.phase.name)
        reopened = key not in self.handles
        if reopened:
            self.handles[key] = await self.backend.open_agent(slot.agent, agent.system, key, use_cache=self.use_cache)
        self.emit(TurnStarted(slot.index, slot.phase.name, slot.agent, agent.name, slot.round, reopened))
        sampling = slot.phase.sampling[slot.agent]
        if self.seed is not None:
            sampling = replace(sampling, seed=self.seed + slot.index)
        result = None
        prompt = self.prompts.take(slot.agent)
        async with contextlib.aclosing(self.handles[key].turn(prompt, sampling)) as events:
            async for event in events:
                match event:
                    case Delta(text=text):
                        self.emit(TurnText(slot.agent, text))
                    case TurnResult():
                        result = event
        assert result is not None, "a backend's turn must end with a TurnResult"
        assert result.prompt_tokens == result.reused_tokens + result.prefilled_tokens, \
            "backend token counts do not add up"
        self.turns_on[key] = self.turns_on.get(key, 0) + 1
        record = TurnRecord(slot.index, slot.phase.name, slot.agent, agent.name, slot.round, agent.lifecycle, key,
                            self.turns_on[key], prompt, result)
        self.records.append(record)
        self.prompts.said(slot.phase, Line(slot.phase.name, slot.agent, slot.round, result.text.strip()))
        self.emit(TurnFinished(record))

    async def end_phase(self, phase: Phase) -> None:
        self.prompts.end_phase(phase)
        for agent in phase.agents:
            if not self.scenario.agents[agent].permanent:
                key = cache_key(self.scenario, self.run_id, agent, phase.name)
                if key in self.handles:
                    await self.handles[key].close()  # still listed if this fails: run()'s finally tries again
                    del self.handles[key]
        self.emit(PhaseFinished(phase))
