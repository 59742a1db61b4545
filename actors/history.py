"""An agent's history file: model-independent JSON of its messages
(``<cache_dir>/histories/<id>.json``).  Only the persistence actor reads and
writes them; the runtime's listing reads them without moving any."""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

from semantic.runtime.store.disk import history_path
from semantic.runtime.text.json_reader import read_json

from .messages import Message

__all__ = ["HISTORY_FORMAT", "encode_history", "parse_history", "read_history"]

log = logging.getLogger("semantic.actors")

HISTORY_FORMAT = "semantic-agent-history"


def encode_history(agent_id: str, history: tuple[Message, ...]) -> bytes:
    doc = {
        "format": HISTORY_FORMAT,
        "version": 1,
        "agent_id": agent_id,
        "messages": [m.as_dict() for m in history],
        "updated": time.time(),
    }
    return json.dumps(doc, ensure_ascii=False, indent=1).encode()


def read_history(histories: Path, agent_id: str, move_aside: bool = True) -> tuple[Message, ...] | None:
    """An agent's history from disk; None if it has none.  A file that cannot be
    read as a history is moved aside (``.bad-<time>``, unless not ``move_aside``)
    with a warning: the agent starts afresh rather than failing."""
    path = history_path(histories, agent_id)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        return parse_history(raw, agent_id)
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        if not move_aside:
            return None
        aside = path.with_name(f"{path.name}.bad-{time.strftime('%Y%m%dT%H%M%S')}")
        os.replace(path, aside)
        log.warning("history of agent %r is unreadable (%r); moved to %s, the agent starts afresh",
                    agent_id, e, aside)
        return None


def parse_history(raw: bytes, agent_id: str) -> tuple[Message, ...]:
    """A history file's messages; raises ``ValueError`` (and the like) when it is not ``agent_id``'s history."""
    doc = read_json(raw, "history")
    assert doc["format"] == HISTORY_FORMAT and doc["version"] == 1 and doc["agent_id"] == agent_id
    return tuple(Message.from_dict(m) for m in doc["messages"])
