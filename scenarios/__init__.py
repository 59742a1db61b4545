"""Multi-agent, multi-phase scenarios written in YAML, and their runner.

Layout (dependencies point down; nothing here but ``local`` imports MLX):

* ``schema``  the YAML format -> frozen ``Scenario`` (or ``ScenarioError`` with file:line)
* ``yaml_lines`` YAML whose mappings and sequences remember the line of each key and item
* ``backend`` the seam: ``Backend`` / ``AgentHandle`` protocols, ``Sampling``, ``Delta``
* ``local``   the in-process backend: scenario agents are agents of an actor ``Runtime``
* ``remote``  the HTTP backend: agents of a running ``semantic serve`` (its agent API)
* ``plan``    who hears what and when: the schedule, cache keys, each agent's next prompt
* ``runner``  ``run(scenario, backend)``: plays the turns, emits events, returns a ``Result``
* ``report``  the per-turn report (JSON) and the transcript (JSON, Markdown)
* ``compare`` a cached run against a ``--no-cache`` run: which replies differ, and why
* ``view``    the live terminal view (rich), plain lines when not a terminal
* ``cli``     ``semantic scenario run|compare|validate``
* ``library/`` the shipped scenarios

The names below are re-exported lazily, so importing ``scenarios.cli`` for
``semantic --help`` stays instant.
"""

import importlib

__all__ = [
    "AgentHandle", "Backend", "Delta", "Result", "Sampling", "Scenario", "ScenarioError", "load", "loads",
    "run",
]

_HOME = {
    "AgentHandle": "backend", "Backend": "backend", "Delta": "backend", "Sampling": "backend",
    "Scenario": "schema", "ScenarioError": "schema", "load": "schema", "loads": "schema",
    "Result": "runner", "run": "runner",
}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module 'scenarios' has no attribute {name!r}")
