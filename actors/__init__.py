"""The actor runtime: many agents, one model, one GPU thread.

Layout (each module one job; only this file's names are public):

* ``runtime``     -- ``Runtime`` (opens and shuts down everything), ``Agent``
                     handles and ``Reply`` streams: the in-process API;
* ``agent``       -- agent actors: one mailbox per agent serialises its turns
                     and owns its history;
* ``gpu``         -- the GPU actor: the only code touching MLX, on its own
                     thread; continuous batching over ``runtime.engine``;
* ``registry``    -- the model registry (load, swap, idle unload), on the GPU thread;
* ``lockstep``    -- a model sharded over ranks: rank 0's GPU thread broadcasts its
                     inputs, the other ranks' threads follow them;
* ``persistence`` -- writes caches and histories behind the turns;
* ``eviction``    -- keeps hot caches under the budget's high watermark;
* ``messages``    -- every message, one union per mailbox;
* ``errors``      -- what callers may catch;
* ``archive``     -- one agent's files as one archive, to move it to another
                     server (``semantic cache export`` / ``import``).

See ``docs/architecture.md`` ("The actor runtime") for who owns what.
"""

from runtime.outcome import TurnResult  # what Reply.result holds

from .errors import (
    AgentExists,
    AgentGone,
    ContextTooLong,
    RuntimeClosed,
    RuntimeUnhealthy,
    TurnCancelled,
    TurnError,
    UnknownModel,
)
from .messages import Delta, Message
from .runtime import MAX_CHOICES, Agent, AgentInfo, Reply, Runtime

__all__ = [
    "Agent",
    "AgentExists",
    "AgentInfo",
    "AgentGone",
    "ContextTooLong",
    "Delta",
    "MAX_CHOICES",
    "Message",
    "Reply",
    "Runtime",
    "RuntimeClosed",
    "RuntimeUnhealthy",
    "TurnCancelled",
    "TurnError",
    "TurnResult",
    "UnknownModel",
]
