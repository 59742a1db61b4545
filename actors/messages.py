"""Every message between actors: small frozen dataclasses, one union per mailbox.

A request that needs an answer carries its own reply stream (``reply``): an
anyio memory object send stream the requester reads once (or, for a turn,
until a final event).  Who reads what:

    mailbox                     carried by                       union
    GPU actor inbox             thread-safe queue (its thread)   GpuCommand
    agent actor mailbox         memory object stream             AgentCommand
    persistence actor mailbox   memory object stream             PersistCommand
    eviction actor mailbox      memory object stream             EvictCommand
    a turn's reply stream       memory object stream             TurnEvent
    a turn's end (agent actor)  memory object stream             TurnEnd

No MLX array ever travels in a message: the GPU actor turns caches into bytes
(``CacheBlocks``) before they leave its thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Union

from semantic.runtime.engine.engine import Delta, SamplingParams  # Delta re-exported: a turn's deltas, engine to protocols
from semantic.runtime.errors import SemanticError
from semantic.runtime.outcome import TurnResult  # re-exported: a turn's reply stream ends with it

if TYPE_CHECKING:
    from pathlib import Path

    from anyio.streams.memory import MemoryObjectSendStream as Sink

    from semantic.runtime.store.cache_codec import HostCache
    from semantic.runtime.cache_records import BlockUpdate
    from semantic.runtime.model.models import LoadedModel
    from semantic.runtime.engine.row_counts import RowCounts

__all__ = [
    "AgentCommand", "BeginTurn", "CacheBlocks", "CacheRead", "CacheWritten", "CancelTurn", "Delta", "Demote",
    "DropCache", "Done", "EvictCommand", "Failed", "FlushCaches", "ForkCache", "Forget", "Fork",
    "Flush", "GpuCommand", "GpuDown", "HistoryBytes", "HotAgent", "HotSet", "ImportArchive", "Message", "Open",
    "PersistCommand", "ReadCache", "ReadHistory", "Send", "StopGpu", "Stop", "SwapModel", "TurnEnd", "TurnEnded",
    "TurnEvent", "TurnFailed", "TurnRequest", "TurnResult", "Delete",
]


# -- data that outlives a message ------------------------------------------


@dataclass(frozen=True)
class Message:
    """One entry of an agent's conversation (model-independent).

    Tool turns (for chat templates that know tools) carry a little more: an
    assistant message may hold the ``tool_calls`` it made (``{"id", "type":
    "function", "function": {"name", "arguments": dict}}``), and a ``tool``
    message answers ``tool_call_id`` (from the tool ``name``).
    """

    role: str  # "system", "user", "assistant" or "tool"
    content: str
    tool_calls: tuple[dict, ...] = field(default=(), hash=False)
    tool_call_id: str | None = None
    name: str | None = None

    def as_dict(self) -> dict:
        """The message as a chat template takes it (optional keys only when set)."""
        out = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [dict(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out

    @classmethod
    def from_dict(cls, d: dict) -> Message:
        """The inverse of ``as_dict``; raises ``KeyError``/``TypeError`` on a malformed dict."""
        return cls(str(d["role"]), str(d["content"]), tuple(d.get("tool_calls") or ()),
                   d.get("tool_call_id"), d.get("name"))


@dataclass(frozen=True)
class TurnRequest:
    """What a turn asks for, as ``Agent.send`` (``respond``, ``complete``) builds
    it: carried to the agent actor (``Send``) and on to the GPU actor
    (``BeginTurn``) as it is.

    ``text`` is the new user message, appended to the history; or, when
    ``messages`` is given, the turn's whole conversation, which replaces the
    history (stateless clients send everything each time). With ``prompt``,
    the model continues that raw text instead of the rendered conversation
    (``messages`` then holds it as the user's message)."""

    turn_id: int
    sampling: SamplingParams
    text: str = ""
    messages: tuple[Message, ...] | None = None
    use_cache: bool = True  # False: prefill the whole prompt, reuse nothing (for comparisons)
    tools: tuple[dict, ...] | None = None  # tool definitions for the chat template
    model: str | None = None  # the catalogue's model to run on (None: the one loaded)
    choices: int = 1  # replies to the prompt, prefilled once; choice 0's is the agent's
    prompt: str | None = None  # raw text to continue as it is (no chat template: ``Agent.complete``)


# -- generic replies ---------------------------------------------------------


@dataclass(frozen=True)
class Done:
    """A request succeeded; ``value`` is its answer, if it has one."""

    value: object = None


@dataclass(frozen=True)
class Failed:
    """A request failed with an error fit to raise to the caller."""

    error: SemanticError


# -- a turn's reply stream: deltas GPU actor -> consumer; the end GPU actor -> agent actor -> consumer


@dataclass(frozen=True)
class TurnEnded:
    turn_id: int
    result: TurnResult


@dataclass(frozen=True)
class TurnFailed:
    turn_id: int
    error: SemanticError


TurnEnd = Union[TurnEnded, TurnFailed]  # how a turn ended
TurnEvent = Union[Delta, TurnEnded, TurnFailed]  # Delta*, then exactly one of the others


# -- the GPU actor's inbox -----------------------------------------------------


@dataclass(frozen=True)
class BeginTurn:
    """A turn for the GPU actor: its request, and what the agent actor adds."""

    request: TurnRequest
    agent_id: str
    messages: tuple[Message, ...]  # the whole conversation, ending with the new user message
    reply: Sink[TurnEvent]  # the consumer's: the GPU actor posts the deltas here, straight
    end: Sink[TurnEnd]  # the agent actor's: the turn's end, which it forwards once the history is updated

    @property
    def turn_id(self) -> int:
        return self.request.turn_id


@dataclass(frozen=True)
class CancelTurn:
    """Cancel a turn wherever it is (waiting, prefilling, decoding); unknown ids are ignored."""

    turn_id: int
    at_step: int = 0  # the GPU actor's step count when the cancel was requested


@dataclass(frozen=True)
class CacheWritten:
    """Persistence wrote ``version`` of an agent's cache (the newest it had), or
    failed to (``ok`` False; ``stale``: blocks it left out are not on disk, so
    the GPU actor should hand over the whole cache)."""

    agent_id: str
    version: int
    ok: bool = True
    stale: bool = False


@dataclass(frozen=True)
class CacheRead:
    """An agent's cache for ``model_id`` as the persistence actor read it (``ReadCache``):
    in host memory, checked; None when there is none (or it was unusable: quarantined)."""

    agent_id: str
    model_id: str
    cache: HostCache | None


@dataclass(frozen=True)
class Demote:
    """Move these agents' caches to disk if they are hot, idle and clean (written);
    drop these shared prefixes."""

    agent_ids: tuple[str | tuple, ...]


@dataclass(frozen=True)
class ForkCache:
    source: str
    target: str
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class DropCache:
    """Forget an agent's hot cache without writing it (the agent is being deleted)."""

    agent_id: str
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class FlushCaches:
    """Hand every dirty hot cache to persistence; answers ``Done(count)``."""

    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class SwapModel:
    """Drain the batch, flush and drop the caches, unload, load ``model``; answers
    ``Done(name)`` (no ``reply``: the GPU thread's own swap for a waiting turn)."""

    model: str | LoadedModel
    reply: Sink[Done | Failed] | None


@dataclass(frozen=True)
class StopGpu:
    """Cancel every turn, hand every dirty cache to persistence, end the thread."""


GpuCommand = Union[
    BeginTurn, CancelTurn, CacheWritten, CacheRead, Demote, ForkCache, DropCache, FlushCaches, SwapModel, StopGpu,
]


@dataclass(frozen=True)
class GpuDown:
    """The GPU actor hit a fatal error (posted to itself, on the event loop)."""

    error: SemanticError


# -- the agent actor's mailbox ---------------------------------------------------


@dataclass(frozen=True)
class Open:
    """Create the agent (with ``system`` as its first message) or check it matches
    (``Runtime.agent``; a turn needs none: its ``Send`` creates the agent if new)."""

    system: str | None
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class Send:
    """A turn (the one message that starts it): the agent is created if new (as
    ``Open`` with no system prompt), then the turn runs after the agent's
    earlier ones."""

    request: TurnRequest
    reply: Sink[TurnEvent]

    @property
    def turn_id(self) -> int:
        return self.request.turn_id


@dataclass(frozen=True)
class Fork:
    target: str
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class Delete:
    reply: Sink[Done | Failed]


AgentCommand = Union[Open, Send, Fork, Delete]


# -- the persistence actor's mailbox ---------------------------------------------


@dataclass(frozen=True)
class CacheBlocks:
    """A version of an agent's cache as bytes (``runtime.store.cache_codec.snapshot``):
    the blocks from ``update.first`` on.  A newer version of the same agent
    replaces a pending older one, taking over the blocks only the older one
    carried."""

    agent_id: str
    model_id: str
    version: int
    update: BlockUpdate


@dataclass(frozen=True)
class ReadCache:
    """Read an agent's cache for a model into host memory, after any write of it
    already queued; answer the GPU actor with ``CacheRead``."""

    agent_id: str
    model_id: str
    spec_hash: str


@dataclass(frozen=True)
class ReadHistory:
    """Read an agent's history, after any write or delete of it already queued;
    answers ``Done(messages)``, ``Done(None)`` (none) or ``Failed``."""

    agent_id: str
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class HistoryBytes:
    """An agent's history file; the latest pending one wins."""

    agent_id: str
    data: bytes


@dataclass(frozen=True)
class Forget:
    """Drop an agent's pending writes, wait for one in progress, delete its files."""

    agent_id: str
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class ImportArchive:
    """Put the agent in ``archive`` (``actors.archive``, ``size`` bytes) into the
    cache directory, in line with the writes and within the disk budget:
    ``Done(Summary)``, or ``Failed`` with ``ArchiveError``, ``AgentExists`` or
    ``NoRoom`` (pruning could not make room for ``size`` bytes)."""

    archive: Path
    agent_id: str
    size: int
    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class Flush:
    """Answer once everything pending when it arrived is on disk."""

    reply: Sink[Done | Failed]


@dataclass(frozen=True)
class KeepRowCounts:
    """A model's decode row counts, measured when it loaded (``runtime.engine.row_counts``):
    kept under the cache home for the next start."""

    key: str
    counts: RowCounts


@dataclass(frozen=True)
class Stop:
    """Finish the pending work, then end (persistence, eviction)."""


PersistCommand = Union[CacheBlocks, ReadCache, HistoryBytes, ReadHistory, Forget, ImportArchive, Flush, KeepRowCounts,
                       Stop]


# -- the eviction actor's mailbox -------------------------------------------------


@dataclass(frozen=True)
class HotAgent:
    agent_id: str | tuple  # an agent, or a shared prefix's owner ("prefix", n)
    bytes: int
    clean: bool  # its latest version is on disk: demoting it is free


@dataclass(frozen=True)
class HotSet:
    """The idle hot caches, least recently used first, and the budget they live in."""

    budget_bytes: int
    used_bytes: int  # every hot cache, turns in progress included
    agents: tuple[HotAgent, ...]


EvictCommand = Union[HotSet, Stop]
