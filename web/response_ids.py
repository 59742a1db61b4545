"""Response ids of the Responses API (``web.responses``): **a response id
names an agent state.** A response is the reply of an agent's turn, and its
id says which agent and which point of its conversation:

    resp_<agent id>_<n>_<h>

``n`` is the number of messages in the agent's history once the reply is in
(the reply is message ``n``), ``h`` 12 hex digits of a hash of the ``n - 1``
messages before it (the prompt, system prompt first). The agent id may hold
``_`` itself; ``n`` and ``h`` never do, so the id splits from the right. No
store is kept beside the agents: an id stays valid as long as its agent's
history starts with that prompt and a reply -- across restarts, and until the
agent is deleted, pruned or rewritten by another conversation.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from semantic.actors import AGENT_CHARS, Message

from .identity import state_hash
from .schema import RequestError

__all__ = ["ResponseState", "not_found", "parse_response_id", "response_id"]

_ID = re.compile(rf"resp_({AGENT_CHARS.pattern})_([1-9][0-9]{{0,8}})_([0-9a-f]{{12}})")  # the agent-id rule's characters


@dataclass(frozen=True)
class ResponseState:
    """What a response id names: message ``n`` of ``agent_id``'s history,
    the reply to a prompt whose hash is ``prompt_hash``."""

    agent_id: str
    n: int
    prompt_hash: str

    @property
    def id(self) -> str:
        return f"resp_{self.agent_id}_{self.n}_{self.prompt_hash}"

    def matches(self, history: tuple[Message, ...]) -> bool:
        """Whether ``history`` holds this state (it may have gone on since)."""
        return (len(history) >= self.n and history[self.n - 1].role == "assistant"
                and state_hash(history[:self.n - 1]) == self.prompt_hash)


def response_id(agent_id: str, prompt: tuple[Message, ...]) -> str:
    """The id of the reply of ``agent_id`` to ``prompt`` (its whole conversation)."""
    return ResponseState(agent_id, len(prompt) + 1, state_hash(prompt)).id


def not_found(response: str, param: str | None = None) -> RequestError:
    """A response id this server does not know (OpenAI's 404)."""
    if param == "previous_response_id":
        return RequestError(404, f"Previous response with id {response!r} not found.", param,
                            "previous_response_not_found")
    return RequestError(404, f"Response with id {response!r} not found.", param)


def parse_response_id(response: str, param: str | None = None) -> ResponseState:
    """The state a response id names; a 404 for one this server cannot have made."""
    if not (m := _ID.fullmatch(response)):
        raise not_found(response, param)
    return ResponseState(m[1], int(m[2]), m[3])
