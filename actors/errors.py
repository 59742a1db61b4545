"""Errors the actor runtime raises to its callers; each message says what to do."""

from __future__ import annotations

from semantic.runtime.errors import ContextTooLong, SemanticError  # ContextTooLong: raised by runtime.memory.turns

__all__ = [
    "AgentExists",
    "AgentGone",
    "ContextTooLong",
    "RuntimeClosed",
    "RuntimeUnhealthy",
    "TurnCancelled",
    "TurnError",
    "UnknownModel",
]


class TurnError(SemanticError):
    """One turn failed; the agent, its history and the runtime are unaffected."""


class TurnCancelled(TurnError):
    """The turn was cancelled by someone other than its consumer (the runtime shut down)."""


class RuntimeClosed(SemanticError):
    """The runtime is shutting down or shut down: no new work is taken."""


class RuntimeUnhealthy(SemanticError):
    """The GPU actor failed; every turn in flight failed with this error and new
    turns are refused.  Close the runtime and open a new one."""


class AgentExists(SemanticError):
    """An agent id is taken (fork target), or exists with another system prompt."""


class AgentGone(SemanticError):
    """The agent was deleted; open it again with ``Runtime.agent`` to start afresh."""


class UnknownModel(SemanticError):
    """A turn named a model the runtime was not opened with."""

    def __init__(self, name: str, available: tuple[str, ...]):
        self.name, self.available = name, available
        super().__init__(f"model {name!r} is not served here; available: {', '.join(available)}")
