"""What each agent is told, and when: pure functions and one owned object, no I/O.

Every agent is a conversation that only grows.  At its turn an agent gets ONE
new user message holding everything it has witnessed since it last spoke, in
the order it happened, then a cue.  Its reply becomes its next assistant
message.  Worked example (prisoner's dilemma, the warden's conversation)::

    system     You are the Warden ...
    user       --- Phase 1: Interrogation Room A ---       <- phase header:
               Marco sits alone ... (opening)                 opening, private
               Your turn, Warden.                             blocks, own prompt
    assistant  Marco, your partner already talked.         <- warden's turn 1
    user       Marco: I have nothing to say.               <- what was said since
               Your turn, Warden.
    assistant  ...                                         <- warden's turn 2
    ...
    user       Marco: Fine, I'll think about it.           <- Room A's last line,
               --- Phase 2: Interrogation Room B ---          then Room B's header
               ...

Nothing is ever inserted before what the agent has already seen, so a
permanent agent's prompt for turn n+1 starts with its prompt and reply of
turn n, and a caching backend EXTENDs its cache every turn.

Who hears what (the leakage rule): a line said in phase P is queued for the
agents of P only; a phase header is queued for the agents of that phase only,
and holds the private blocks whose ``visible_to`` names that agent and that
agent's own prompt.  ``${P.messages...}`` references render P's transcript;
the schema lets them reach only agents of P, except through private blocks.
An ephemeral agent's queue is emptied when its phase ends: the next phase
gets a new agent that remembers nothing.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from .schema import Phase, Ref, Scenario, Template

__all__ = ["Line", "Prompts", "Slot", "cache_key", "cue", "render_template", "render_transcript", "schedule"]


@dataclass(frozen=True)
class Line:
    """One thing said, in the transcript."""

    phase: str
    agent: str
    round: int  # 1-based
    text: str


@dataclass(frozen=True)
class Slot:
    """One scheduled turn."""

    index: int  # 0-based over the whole scenario
    phase: Phase
    phase_index: int
    round: int  # 1-based
    agent: str


def schedule(scenario: Scenario) -> Iterator[Slot]:
    """Every turn of the scenario in order: phase by phase, round by round, ``order`` within a round."""
    index = 0
    for pi, phase in enumerate(scenario.phases):
        for r in range(1, phase.rounds + 1):
            for agent in phase.order:
                yield Slot(index, phase, pi, r, agent)
                index += 1


def cache_key(scenario: Scenario, run_id: str, agent: str, phase: str) -> str:
    """The engine-side identity of an agent's conversation.

    Permanent agents keep one key for the whole run; ephemeral agents get a
    new one per phase.  ``run_id`` keeps runs apart, so every run starts cold
    and its reuse numbers measure only itself.
    """
    if scenario.agents[agent].permanent:
        return f"scn.{scenario.id}.{run_id}.{agent}"
    return f"scn.{scenario.id}.{run_id}.{phase}.{agent}"


def cue(name: str) -> str:
    """Ends every user message.  Short on purpose: it is new text in every turn."""
    return f"Your turn, {name}."


def render_transcript(lines: Sequence[Line], names: Mapping[str, str], perspective: str | None = None) -> str:
    """``Name: text`` per line; ``perspective``'s own lines read ``You: text``."""
    return "\n".join(f"{'You' if ln.agent == perspective else names[ln.agent]}: {_said(ln.text)}" for ln in lines)


def render_template(template: Template, said: Mapping[str, Sequence[Line]], names: Mapping[str, str]) -> str:
    """Fill each ``${phase.messages[agent]}`` with that finished phase's transcript."""
    out = []
    for part in template.parts:
        if isinstance(part, Ref):
            assert part.phase in said, f"template names unfinished phase {part.phase!r}: the schema should refuse it"
            out.append(render_transcript(said[part.phase], names, part.perspective))
        else:
            out.append(part)
    return "".join(out)


class Prompts:
    """What each agent has witnessed since it last spoke.

    Owned by the runner's loop, the only writer: ``start_phase``, ``said``
    and ``end_phase`` queue text, ``take`` empties an agent's queue into its
    next user message.
    """

    def __init__(self, scenario: Scenario):
        self._scenario = scenario
        self._names = {k: a.name for k, a in scenario.agents.items()}
        self._queue: dict[str, list[str]] = {k: [] for k in scenario.agents}
        self._said: dict[str, list[Line]] = {}  # finished and current phases' transcripts

    @property
    def transcript(self) -> Mapping[str, Sequence[Line]]:
        return self._said

    def start_phase(self, phase: Phase) -> None:
        self._said[phase.name] = []
        for agent in phase.agents:
            self._queue[agent].append(self.header(phase, agent))

    def header(self, phase: Phase, agent: str) -> str:
        """The phase's opening as ``agent`` sees it: label, opening, payoff
        matrix (judging phase), private blocks visible to it, its own prompt."""
        parts = [f"--- {phase.label} ---"]
        if phase.opening:
            parts.append(self._render(phase.opening))
        if phase.judge and phase.judge.payoff_matrix:
            parts.append("Payoff matrix:\n" + "\n".join(f"- {k}: {v}" for k, v in phase.judge.payoff_matrix))
        parts += [self._render(p.text) for p in phase.private if agent in p.visible_to]
        if agent in phase.prompts:
            parts.append(self._render(phase.prompts[agent]))
        return "\n".join(p.strip() for p in parts if p.strip())

    def said(self, phase: Phase, line: Line) -> None:
        """``line`` was said in ``phase``: everyone else in the phase hears it."""
        assert line.phase == phase.name and line.agent in phase.agents, "a line belongs to its phase and its agents"
        self._said[phase.name].append(line)
        text = f"{self._names[line.agent]}: {_said(line.text)}"
        for agent in phase.agents:
            if agent != line.agent:
                self._queue[agent].append(text)

    def end_phase(self, phase: Phase) -> None:
        """Ephemeral agents end with their phase; what they had not heard yet is dropped."""
        for agent in phase.agents:
            if not self._scenario.agents[agent].permanent:
                self._queue[agent].clear()

    def take(self, agent: str) -> str:
        """``agent``'s next user message: everything queued for it, then the cue."""
        parts, self._queue[agent] = self._queue[agent], []
        return "\n".join([*parts, cue(self._names[agent])])

    def _render(self, template: Template) -> str:
        return render_template(template, self._said, self._names)


def _said(text: str) -> str:
    text = " ".join(text.split())  # one line per speaker in transcripts and prompts
    return text or "(says nothing)"
