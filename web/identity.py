"""Which agent a stateless request belongs to, found by its content.

Clients such as Claude Code send the whole conversation every time and name
no agent. The agent to use is the one whose stored conversation is the
longest *proper* message-level prefix of the request: the request is that
conversation plus the reply it got plus something new. Then the agent's
cache holds everything up to the new part, and the turn prefills only that.

Messages are compared by what a client sends back, not byte for byte: an
assistant message by its text with tool-call markup parsed out (``web.tools``)
and its calls by name and arguments (call ids are ours to invent, and the
stored reply is the raw text the model generated); other messages by role,
content and the tool they answer.

The index is built from every agent's history at start-up (so it survives
restarts) and updated after each turn. While an agent's turn runs it is
*claimed*: a second request with the same prefix gets another agent rather
than queueing behind the first and then overwriting its conversation.
One owner: the app, on the event loop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

from actors import Message

from .tools import ToolFormat, parse_tool_calls

__all__ = ["ConversationIndex", "message_key"]


def message_key(m: Message, fmt: ToolFormat | None) -> tuple:
    """What identifies ``m`` in a conversation a client sends back."""
    if m.role == "assistant":
        text, parsed = parse_tool_calls(m.content, fmt) if fmt else (m.content, [])
        calls = [(c.name, c.arguments) for c in parsed] + [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.tool_calls]
        return ("assistant", text.strip(), tuple((name, json.dumps(args, sort_keys=True)) for name, args in calls))
    return (m.role, m.content, m.name)


class ConversationIndex:
    """Agent id -> the keys of its stored conversation; a longest-prefix lookup."""

    def __init__(self, fmt: ToolFormat | None = None):
        self.fmt = fmt
        self._keys: dict[str, tuple[tuple, ...]] = {}
        self._claimed: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._keys)

    def keys(self, messages: Iterable[Message]) -> tuple[tuple, ...]:
        return tuple(message_key(m, self.fmt) for m in messages)

    def record(self, agent_id: str, history: Iterable[Message]) -> None:
        """Remember ``agent_id``'s conversation (after a turn, or at start-up)."""
        keys = self.keys(history)
        if keys:
            self._keys[agent_id] = keys
        else:
            self._keys.pop(agent_id, None)

    def forget(self, agent_id: str) -> None:
        self._keys.pop(agent_id, None)

    def match(self, messages: Iterable[Message]) -> str | None:
        """The unclaimed agent whose conversation is the longest proper prefix of ``messages``."""
        want = self.keys(messages)
        best, best_len = None, 0
        for agent_id, keys in self._keys.items():
            n = len(keys)
            if best_len < n < len(want) and want[:n] == keys and agent_id not in self._claimed:
                best, best_len = agent_id, n
        return best

    def claim(self, agent_id: str) -> None:
        self._claimed[agent_id] = self._claimed.get(agent_id, 0) + 1

    def release(self, agent_id: str) -> None:
        if (n := self._claimed.get(agent_id, 0)) <= 1:
            self._claimed.pop(agent_id, None)
        else:
            self._claimed[agent_id] = n - 1
