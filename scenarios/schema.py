"""The scenario file format: YAML in, a frozen ``Scenario`` out, or a
``ScenarioError`` that names the file, the line and the field.

Reference: ``docs/scenarios.md``.  In short::

    id: gossip-network                 # [a-z0-9][a-z0-9_-]*
    title: Gossip Network
    sampling: {max_tokens: 48}         # optional: max_tokens, temperature, top_p, stop
    agents:
      alice: {name: Alice, system: "You are Alice ...", lifecycle: permanent, sampling: {...}}  # wins over a phase's
      bob: {name: Bob, system: [*briefing, "You are Bob ..."]}  # a list is joined by blank lines
    phases:
      - name: alice_bob                # an identifier, unique
        label: "Phase 1: Alice & Bob"
        agents: [alice, bob]
        order: [alice, bob]            # optional, default = agents
        rounds: 3                      # optional, default 1
        opening: "..."                 # shown to every agent of the phase
        prompts: {alice: "..."}        # per-agent text; may hold ${phase.messages[agent]}
        private:                       # shown only to visible_to
          - {visible_to: [alice], text: "..."}
        sampling: {max_tokens: 80}     # optional override
        judge: {payoff_matrix: {...}}  # optional, last phase only

Line numbers survive the YAML parser: ``yaml_lines`` reads mappings and
sequences that remember the line of every key and item.

(Long on purpose: the whole scenario schema, field by field, in one place
that its error messages and ``docs/scenarios.md`` follow.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal

import yaml

from semantic.runtime.errors import SemanticError

from .backend import Sampling
from .yaml_lines import YamlMap, YamlSeq, empty_map, located_list, read_yaml

__all__ = [
    "Agent", "Judge", "Phase", "Private", "Ref", "Scenario", "ScenarioError", "Template",
    "load", "loads",
]

PERMANENT, EPHEMERAL = "permanent", "ephemeral"
_ID = re.compile(r"[a-z0-9][a-z0-9_-]{0,63}\Z")
_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}\Z")  # agent keys and phase names (a subset of \w+)
_REF = re.compile(r"\$\{([^}]*)\}")
_REF_BODY = re.compile(r"(\w+)\.messages(?:\[(\w+)\])?\Z")


class ScenarioError(SemanticError):
    """A scenario file is wrong.  ``str()`` is ``file:line: field: message``."""

    def __init__(self, file: str, line: int, field: str, message: str):
        self.file, self.line, self.field, self.message = file, line, field, message
        super().__init__(f"{file}:{line}: {field + ': ' if field else ''}{message}")


# --- the model -----------------------------------------------------------------


@dataclass(frozen=True)
class Ref:
    """``${phase.messages[perspective]}``: phase's transcript, perspective's lines as "You".

    ``perspective`` is None for ``${phase.messages}``: every line under its speaker's name.
    """

    phase: str
    perspective: str | None


@dataclass(frozen=True)
class Template:
    """Text with references to earlier phases' transcripts, split at the references."""

    parts: tuple[str | Ref, ...] = ()

    @property
    def refs(self) -> tuple[Ref, ...]:
        return tuple(p for p in self.parts if isinstance(p, Ref))

    @property
    def literal(self) -> str:
        """The text without its references (what the file itself says)."""
        return "".join(p for p in self.parts if isinstance(p, str))

    def __bool__(self) -> bool:
        return bool(self.parts)


@dataclass(frozen=True)
class Agent:
    key: str
    name: str  # display name, unique; never "You"
    system: str
    lifecycle: Literal["permanent", "ephemeral"]
    sampling: Sampling  # the scenario's, with this agent's overrides (phases may change what the agent leaves unset)

    @property
    def permanent(self) -> bool:
        return self.lifecycle == PERMANENT


@dataclass(frozen=True)
class Private:
    """Context shown only to ``visible_to`` (all of them agents of the phase)."""

    visible_to: tuple[str, ...]
    text: Template


@dataclass(frozen=True)
class Judge:
    """Marks the final judging phase; its reply is the scenario's verdict."""

    payoff_matrix: tuple[tuple[str, str], ...] = ()  # (outcome, consequence), in file order


@dataclass(frozen=True)
class Phase:
    name: str
    label: str
    agents: tuple[str, ...]
    order: tuple[str, ...]  # who speaks, in order, once per round; every agent at least once
    rounds: int
    opening: Template
    prompts: Mapping[str, Template]  # agent -> its own text at the phase's start
    private: tuple[Private, ...]
    sampling: Mapping[str, Sampling]  # per agent: the scenario's, then the phase's, then the agent's own settings
    judge: Judge | None = None

    @property
    def turns(self) -> int:
        return len(self.order) * self.rounds


@dataclass(frozen=True)
class Scenario:
    id: str
    title: str
    description: str
    agents: Mapping[str, Agent]  # in file order
    phases: tuple[Phase, ...]
    source: str = field(default="<string>", compare=False)

    @property
    def turns(self) -> int:
        return sum(p.turns for p in self.phases)

    def phase(self, name: str) -> Phase:
        return next(p for p in self.phases if p.name == name)

    def phases_of(self, agent: str) -> tuple[Phase, ...]:
        return tuple(p for p in self.phases if agent in p.agents)


# --- validation ------------------------------------------------------------------


def load(path: str | Path) -> Scenario:
    """Read and validate a scenario file.

    Raises ``ScenarioError`` (``file:line: field: message``) when the file is
    wrong, ``SemanticError`` when it cannot be read.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise SemanticError(f"{path}: cannot read scenario: {e}") from None
    return loads(text, str(path))


def loads(text: str, source: str = "<string>") -> Scenario:
    """Validate scenario YAML ``text``; ``source`` names it in errors."""
    try:
        doc = read_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise ScenarioError(source, mark.line + 1 if mark else 1, "", f"invalid YAML: {e.problem or e}") from None
    except yaml.YAMLError as e:
        raise ScenarioError(source, 1, "", f"invalid YAML: {e}") from None
    except RecursionError:  # PyYAML composes nested nodes recursively
        raise ScenarioError(source, 1, "", "invalid YAML: nested too deeply") from None
    return _Validator(source).scenario(doc)


_TOP = ("id", "title", "description", "sampling", "agents", "phases")
_AGENT = ("name", "system", "lifecycle", "sampling")
_PHASE = ("name", "label", "agents", "order", "rounds", "opening", "prompts", "private", "sampling", "judge")
_PRIVATE = ("visible_to", "text")
_JUDGE = ("payoff_matrix",)
_SAMPLING = ("max_tokens", "temperature", "top_p", "stop")


class _Validator:
    """Walks the loaded document once, in file order; the first problem raises."""

    def __init__(self, source: str):
        self.source = source
        self.agents: dict[str, Agent] = {}
        self.phases: list[Phase] = []
        self.phase_lines: dict[str, int] = {}
        self.agent_maps: dict[str, YamlMap] = {}  # for the agents' own sampling settings, applied last
        self.all_phases: set[str] = set()  # every phase name in the file, to tell "later" from "unknown"

    def fail(self, line: int, field: str, message: str):
        raise ScenarioError(self.source, line, field, message)

    # -- helpers: each takes the parent container, the key and the field path

    def mapping(self, value, line: int, path: str, allowed: tuple[str, ...]) -> YamlMap:
        if not isinstance(value, YamlMap):
            self.fail(line, path, f"expected a mapping, got {_kind(value)}")
        for key, dup_line in value.duplicates:
            self.fail(dup_line, path, f"duplicate key '{key}' (first at line {value.key_lines[key]})")
        for key in value:
            if key not in allowed:
                self.fail(value.key_lines[key], _join(path, key), f"unknown key (allowed: {', '.join(allowed)})")
        return value

    def need(self, m: YamlMap, key: str, path: str):
        if key not in m:
            self.fail(m.line, path, f"missing required key '{key}'")
        return m[key]

    def string(self, m: YamlMap, key: str, path: str, *, required: bool = False, default: str = "") -> str:
        if key not in m:
            return self.need(m, key, path) if required else default
        value = m[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            self.fail(m.key_lines[key], _join(path, key), f"expected text, got {_kind(value)}")
        if required and not value.strip():
            self.fail(m.key_lines[key], _join(path, key), "must not be empty")
        return value

    def integer(self, m: YamlMap, key: str, path: str, default: int, minimum: int = 1) -> int:
        value = m.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            self.fail(m.key_lines.get(key, m.line), _join(path, key),
                      f"expected an integer >= {minimum}, got {value!r}")
        return value

    def keys(self, m: YamlMap, key: str, path: str, universe: Mapping[str, object] | tuple[str, ...],
             *, phase: bool = False, unique: bool = True) -> tuple[str, ...]:
        """A non-empty list of agent keys drawn from ``universe`` (the phase's agents if ``phase``)."""
        seq = self.need(m, key, path)
        field = _join(path, key)
        if isinstance(seq, str):  # `agents: alice` is a likely slip for `[alice]`
            seq = located_list([seq], m.text_lines[key])
        if not isinstance(seq, YamlSeq):
            self.fail(m.key_lines[key], field, f"expected a list of agent keys, got {_kind(seq)}")
        if not seq:
            self.fail(m.key_lines[key], field, "needs at least one agent")
        seen: dict[str, int] = {}
        for item, line in zip(seq, seq.item_lines):
            if not isinstance(item, str):
                self.fail(line, field, f"expected agent keys, got {_kind(item)}")
            if item not in universe:
                if phase:
                    self.fail(line, field, f"'{item}' is not an agent of this phase ({', '.join(universe)})")
                self.fail(line, field, f"unknown agent '{item}' (known: {', '.join(universe)})")
            if unique and item in seen:
                self.fail(line, field, f"'{item}' is listed twice")
            seen[item] = line
        return tuple(seq)

    # -- the document

    def scenario(self, doc) -> Scenario:
        if doc is None:
            self.fail(1, "", "the file is empty")
        top = self.mapping(doc, 1, "", _TOP)
        sid = self.string(top, "id", "", required=True)
        if not _ID.match(sid):
            self.fail(top.key_lines["id"], "id", f"'{sid}' must match [a-z0-9][a-z0-9_-]* (at most 64 characters)")
        title = self.string(top, "title", "", required=True).strip()
        description = self.string(top, "description", "").strip()
        sampling = self.base_sampling = self.sampling(top, "sampling", Sampling())
        self.agent_map(top, sampling)
        phases = self.need(top, "phases", "")
        if not isinstance(phases, YamlSeq):
            self.fail(top.key_lines["phases"], "phases", f"expected a list of phases, got {_kind(phases)}")
        if not phases:
            self.fail(top.key_lines["phases"], "phases", "a scenario needs at least one phase")
        self.all_phases = {p["name"] for p in phases if isinstance(p, YamlMap) and isinstance(p.get("name"), str)}
        for i, (item, line) in enumerate(zip(phases, phases.item_lines)):
            self.phase(item, line, i, len(phases))
        for key in self.agents:
            if not any(key in p.agents for p in self.phases):
                agents = self.need(top, "agents", "")
                self.fail(agents.key_lines[key], f"agents.{key}", "takes part in no phase")
        return Scenario(sid, title, description, MappingProxyType(dict(self.agents)), tuple(self.phases), self.source)

    def sampling(self, parent: YamlMap, key: str, base: Sampling, path: str = "") -> Sampling:
        if key not in parent:
            return base
        field = _join(path, key)
        m = self.mapping(parent[key], parent.key_lines[key], field, _SAMPLING)
        max_tokens = self.integer(m, "max_tokens", field, base.max_tokens)
        out = {"max_tokens": max_tokens}
        for name, ok, rule in (("temperature", lambda x: x >= 0, ">= 0"), ("top_p", lambda x: 0 < x <= 1, "in (0, 1]")):
            value = m.get(name, getattr(base, name))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
                self.fail(m.key_lines.get(name, m.line), _join(field, name), f"expected a number {rule}, got {value!r}")
            out[name] = float(value)
        stop = m.get("stop", list(base.stop))
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            self.fail(m.key_lines.get("stop", m.line), _join(field, "stop"), "expected a list of non-empty strings")
        return Sampling(stop=tuple(stop), **out)

    def agent_map(self, top: YamlMap, sampling: Sampling) -> None:
        agents = self.need(top, "agents", "")
        if not isinstance(agents, YamlMap):
            self.fail(top.key_lines["agents"], "agents",
                      f"expected a mapping of agent key to agent, got {_kind(agents)}")
        for key, dup_line in agents.duplicates:
            self.fail(dup_line, "agents", f"duplicate agent '{key}' (first at line {agents.key_lines[key]})")
        if not agents:
            self.fail(top.key_lines["agents"], "agents", "a scenario needs at least one agent")
        names: dict[str, str] = {}
        for key, spec in agents.items():
            path = f"agents.{key}"
            if not _NAME.match(key):
                self.fail(agents.key_lines[key], path, "an agent key is a letter then letters, digits or '_'")
            m = self.mapping(spec, agents.key_lines[key], path, _AGENT)
            name = self.string(m, "name", path, required=True).strip()
            if name.lower() == "you":
                self.fail(m.key_lines["name"], f"{path}.name", "'You' is reserved for an agent's own lines")
            if name.lower() in names:
                self.fail(m.key_lines["name"], f"{path}.name",
                          f"duplicate name '{name}' (also agents.{names[name.lower()]})")
            names[name.lower()] = key
            system = self.system(m, path)
            if "${" in system:
                self.fail(m.text_lines["system"], f"{path}.system",
                          "a system prompt cannot hold ${...} references (it is sent before any phase)")
            lifecycle = self.string(m, "lifecycle", path, default=PERMANENT)
            if lifecycle not in (PERMANENT, EPHEMERAL):
                self.fail(m.key_lines["lifecycle"], f"{path}.lifecycle",
                          f"'{lifecycle}' is not a lifecycle (use permanent or ephemeral)")
            self.agents[key] = Agent(key, name, system, lifecycle, self.sampling(m, "sampling", sampling, path))
            self.agent_maps[key] = m

    def system(self, m: YamlMap, path: str) -> str:
        """Text, or a list of texts joined by blank lines (so YAML anchors can share a briefing)."""
        value = self.need(m, "system", path)
        if isinstance(value, YamlSeq):
            for item, line in zip(value, value.item_lines):
                if not isinstance(item, str) or not item.strip():
                    self.fail(line, f"{path}.system", f"expected non-empty texts, got {_kind(item)}")
            if not value:
                self.fail(m.key_lines["system"], f"{path}.system", "must not be empty")
            return "\n\n".join(item.strip() for item in value)
        return self.string(m, "system", path, required=True).strip()

    def phase(self, item, line: int, index: int, count: int) -> None:
        path = f"phases[{index}]"
        m = self.mapping(item, line, path, _PHASE)
        name = self.string(m, "name", path, required=True)
        if not _NAME.match(name):
            self.fail(m.key_lines["name"], f"{path}.name", f"'{name}' must be a letter then letters, digits or '_'")
        if name in self.phase_lines:
            self.fail(m.key_lines["name"], f"{path}.name",
                      f"duplicate phase name '{name}' (first at line {self.phase_lines[name]})")
        self.phase_lines[name] = m.key_lines["name"]
        label = self.string(m, "label", path, default=name).strip() or name
        agents = self.keys(m, "agents", path, self.agents)
        order = self.keys(m, "order", path, agents, phase=True, unique=False) if "order" in m else agents
        if "order" in m:
            for a in agents:
                if a not in order:
                    self.fail(m.key_lines["order"], f"{path}.order", f"agent '{a}' never speaks (add it to order)")
        rounds = self.integer(m, "rounds", path, 1)
        opening = self.template(m, "opening", path, audience=agents)
        prompts = {}
        if "prompts" in m:
            pm = self.mapping(m["prompts"], m.key_lines["prompts"], f"{path}.prompts", tuple(m["prompts"] or ()))
            for a in pm:
                if a not in agents:
                    self.fail(pm.key_lines[a], f"{path}.prompts.{a}",
                              f"'{a}' is not an agent of this phase ({', '.join(agents)})")
                prompts[a] = self.template(pm, a, f"{path}.prompts", audience=(a,))
        private = self.private(m, path, agents)
        phase_sampling = self.sampling(m, "sampling", self.base_sampling, path)
        sampling = {a: self.sampling(self.agent_maps[a], "sampling", phase_sampling, f"agents.{a}") for a in agents}
        judge = None
        if "judge" in m:
            judge = self.judge(m, path, index, count, agents, rounds)
        self.phases.append(Phase(name, label, agents, order, rounds, opening, MappingProxyType(prompts),
                                 private, MappingProxyType(sampling), judge))

    def private(self, m: YamlMap, path: str, agents: tuple[str, ...]) -> tuple[Private, ...]:
        if "private" not in m:
            return ()
        seq = m["private"]
        if not isinstance(seq, YamlSeq):
            self.fail(m.key_lines["private"], f"{path}.private",
                      f"expected a list of {{visible_to, text}}, got {_kind(seq)}")
        out = []
        for j, (item, line) in enumerate(zip(seq, seq.item_lines)):
            ipath = f"{path}.private[{j}]"
            pm = self.mapping(item, line, ipath, _PRIVATE)
            visible = self.keys(pm, "visible_to", ipath, agents, phase=True)
            self.need(pm, "text", ipath)
            out.append(Private(visible, self.template(pm, "text", ipath, audience=visible, private=True)))
        return tuple(out)

    def judge(self, m: YamlMap, path: str, index: int, count: int, agents: tuple[str, ...], rounds: int) -> Judge:
        field = f"{path}.judge"
        line = m.key_lines["judge"]
        value = m["judge"]
        if value is None or value is True:  # `judge:` or `judge: true`, no payoff matrix
            value = empty_map(line)
        jm = self.mapping(value, line, field, _JUDGE)
        if index != count - 1:
            self.fail(line, field, "only the last phase can be the judging phase")
        if len(agents) != 1 or rounds != 1:
            self.fail(line, field, "a judging phase has one agent and one round")
        matrix = ()
        if "payoff_matrix" in jm:
            pm, mfield = jm["payoff_matrix"], f"{field}.payoff_matrix"
            if not isinstance(pm, YamlMap) or not pm:
                self.fail(jm.key_lines["payoff_matrix"], mfield, "expected a mapping of outcome to consequence")
            for key, dup_line in pm.duplicates:
                self.fail(dup_line, mfield, f"duplicate outcome '{key}' (first at line {pm.key_lines[key]})")
            matrix = tuple((k, self.string(pm, k, mfield, required=True).strip()) for k in pm)
        return Judge(matrix)

    def template(self, m: YamlMap, key: str, path: str, *, audience: tuple[str, ...], private: bool = False) -> Template:
        """Parse ``m[key]`` and check its references against the phases so far.

        A reference shows phase P's transcript to ``audience``.  Outside a
        private block everyone in the audience must have taken part in P (or
        P would leak); a private block is the explicit way to share it.
        """
        text = self.string(m, key, path)
        field = _join(path, key)
        base = m.text_lines.get(key, m.line)
        done = {p.name: p for p in self.phases}  # only earlier phases are done
        parts: list[str | Ref] = []
        pos = 0
        for match in _REF.finditer(text):
            line = base + text.count("\n", 0, match.start())
            body = _REF_BODY.match(match.group(1).strip())
            if not body:
                self.fail(line, field, f"bad reference '{match.group(0)}' "
                          "(write ${phase.messages[agent]} or ${phase.messages})")
            phase, who = body.group(1), body.group(2)
            if phase not in done:
                if phase in self.all_phases:
                    self.fail(line, field, f"phase '{phase}' has not happened yet "
                              f"(a template can name only earlier phases: {', '.join(done) or 'none'})")
                self.fail(line, field, f"unknown phase '{phase}' (earlier phases: {', '.join(done) or 'none'})")
            if who is not None:
                if who not in self.agents:
                    self.fail(line, field, f"unknown agent '{who}' (known: {', '.join(self.agents)})")
                if who not in done[phase].agents:
                    self.fail(line, field, f"agent '{who}' did not take part in phase '{phase}' "
                              f"({', '.join(done[phase].agents)} did)")
            if not private:
                outsiders = [a for a in audience if a not in done[phase].agents]
                if outsiders:
                    self.fail(line, field, f"'{outsiders[0]}' did not take part in phase '{phase}'; "
                              "to show it that transcript, use a private block with visible_to")
            parts += [text[pos:match.start()], Ref(phase, who)]
            pos = match.end()
        parts.append(text[pos:])
        return Template(tuple(p for p in parts if p != ""))


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _kind(value) -> str:
    if value is None:
        return "nothing"
    return {dict: "a mapping", YamlMap: "a mapping", list: "a list", YamlSeq: "a list", str: "text",
            bool: "true/false", int: "a number", float: "a number"}.get(type(value), type(value).__name__)
