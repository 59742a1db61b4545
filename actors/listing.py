"""The agent listing: every agent with a history, and where its cache is.

``Runtime.agents`` reads it on a worker thread: the histories on disk and in
memory, merged with the GPU thread's hot set and the cache files' manifests.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import validate_agent_id

from .history import read_history
from .messages import Message

__all__ = ["AgentInfo", "agent_infos"]


@dataclass(frozen=True)
class AgentInfo:
    """One agent as ``Runtime.agents`` lists it."""

    id: str
    history: tuple[Message, ...]
    model: str | None  # whose cache the numbers below describe (the loaded model)
    tokens: int  # tokens its cache holds (0: none)
    bytes: int  # hot: its share of the KV budget; warm: its file's size
    tier: str | None  # "hot" (in memory), "warm" (on disk) or None (no cache for this model)
    last_use: float | None  # unix time its cache was last updated


def agent_infos(histories: Path, store: CacheStore, hot, live: dict, only: str | None) -> list[AgentInfo]:
    """(worker thread) Merge histories on disk and in memory with the hot set and cache files."""
    found = dict(live)
    if only is not None:
        paths = [histories / f"{only}.json"] if only not in found else []
    else:
        paths = histories.glob("*.json") if histories.is_dir() else ()
    for path in paths:
        agent_id = path.name[: -len(".json")]
        if agent_id in found:
            continue
        try:
            validate_agent_id(agent_id)
            history = read_history(histories, agent_id, move_aside=False)  # the persistence actor's job
        except (ValueError, OSError):
            continue
        if history is not None:
            found[agent_id] = history
    if only is not None:
        info = store.info(only, hot.model_id) if hot.model_id is not None else None
        entries = [info] if info is not None else []
    else:
        entries = store.entries()
    files = {e["agent"]: e for e in entries if e["model"] == hot.model_id}
    out = []
    for agent_id in sorted(found):
        if agent_id in hot.agents:
            tokens, size, used = hot.agents[agent_id]
            tier = "hot"
        elif (e := files.get(agent_id)) is not None:
            tokens, size, used, tier = e["tokens"], e["bytes"], e["updated"], "warm"
        else:
            tokens, size, used, tier = 0, 0, None, None
        out.append(AgentInfo(agent_id, found[agent_id], hot.model_id, tokens, size, tier, used))
    return out
