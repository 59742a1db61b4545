"""The actor runtime: many agents, one model, one GPU thread.

Layout (each module one job; only this file's names are public):

* ``runtime``     -- ``Runtime`` (opens and shuts down everything): the
                     in-process API;
* ``status``      -- ``RuntimeStatus``, its base class: what it reports
                     (health, models, memory, snapshots, agents, counters);
* ``handle``      -- ``Agent``: a handle on one agent, which asks the runtime
                     only for the public methods ``AgentHost`` lists;
* ``reply``       -- ``Reply``: a turn's stream of deltas;
* ``listing``     -- ``AgentInfo``: every agent with a history, and where its
                     cache is (``Runtime.agents``);
* ``agent``       -- agent actors: one mailbox per agent serialises its turns
                     and owns its history;
* ``gpu``         -- the GPU actor: the event-loop half (mailbox, health, the
                     thread's lifetime) of the one thread that touches MLX;
                     ``follow`` for the other ranks of a sharded model;
* ``gpu_thread``  -- that thread's loop (continuous batching over
                     ``runtime.engine.engine``; the model's life, stop and failure)
                     and the input words it acts on;
* ``scheduler``   -- (GPU thread) the turns: read ahead, admitted, stepped,
                     reserved for and preempted;
* ``write_behind`` -- (GPU thread) the hot set's disk: cache bytes posted to
                     persistence, numbered;
* ``cache_commands`` -- (GPU thread) fork, drop and demote a hot cache;
* ``snapshots``   -- (GPU thread) what it publishes for other threads: the hot
                     set, the batch, the idle caches;
* ``registry``    -- the model registry (load, swap, idle unload), on the GPU thread;
* ``lockstep``    -- a model sharded over ranks: rank 0's GPU thread broadcasts its
                     inputs, the other ranks' threads follow them;
* ``persistence`` -- writes caches and histories behind the turns;
* ``history``     -- an agent's history file (model-independent JSON);
* ``eviction``    -- keeps hot caches under the budget's high watermark;
* ``messages``    -- every message, one union per mailbox;
* ``errors``      -- what callers may catch;
* ``archive``     -- one agent's files as one archive, to move it to another
                     server (``semantic cache export`` / ``import``).

See ``docs/architecture.md`` ("The actor runtime") for who owns what.
"""

# The runtime's names its users need (web imports nothing else of actors or runtime:
# pyproject.toml's import contracts)
from semantic.runtime.text import grammar  # Agent.send's grammar=: grammar.json_schema(schema), ...
from semantic.runtime.memory.agent_cache import OutOfMemory
from semantic.runtime.cache_records import AGENT_CHARS, InvalidAgentId, validate_agent_id
from semantic.runtime.store.disk import NoRoom
from semantic.runtime.engine.engine_options import EngineOptions  # Runtime.open(engine=...)
from semantic.runtime.errors import ModelError, SemanticError
from semantic.runtime.text.grammar import GrammarError
from semantic.runtime.outcome import FinishReason, TurnResult  # what Reply.result holds, and why it ended
from semantic.runtime.engine.sampling import MAX_LOGPROBS, TokenLogprob

from .archive import ArchiveError
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
from .gpu import BatchSnapshot
from .handle import MAX_CHOICES, Agent
from .listing import AgentInfo
from .messages import Delta, Message
from .reply import Reply
from .runtime import Runtime

__all__ = [
    "AGENT_CHARS",
    "Agent",
    "AgentExists",
    "AgentInfo",
    "AgentGone",
    "ArchiveError",
    "BatchSnapshot",
    "ContextTooLong",
    "Delta",
    "EngineOptions",
    "FinishReason",
    "GrammarError",
    "InvalidAgentId",
    "MAX_CHOICES",
    "MAX_LOGPROBS",
    "Message",
    "ModelError",
    "NoRoom",
    "OutOfMemory",
    "Reply",
    "Runtime",
    "RuntimeClosed",
    "RuntimeUnhealthy",
    "SemanticError",
    "TokenLogprob",
    "TurnCancelled",
    "TurnError",
    "TurnResult",
    "UnknownModel",
    "grammar",
    "validate_agent_id",
]
