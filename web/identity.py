"""Which agent a stateless request belongs to, found by its content.

Clients such as Claude Code send the whole conversation every time and name
no agent. The agent to use is the one whose stored conversation is the
longest *proper* message-level prefix of the request that ends with a reply:
the request is that conversation and the reply it got, plus something new
(an agent with no reply yet -- only its system prompt -- is nobody's
conversation to continue). Then the agent's
cache holds everything up to the new part, and the turn prefills only that.

Messages are compared by what a client sends back, not byte for byte: an
assistant message by its answer (reasoning cut, ``web.reasoning``) with
tool-call markup parsed out (``web.tools``) and its calls by name and arguments (call ids are ours to invent, and the
stored reply is the raw text the model generated); other messages by role,
content and the tool they answer.

A client's session key (Claude Code's ``X-Claude-Code-Session-Id``,
OpenAI's ``prompt_cache_key`` or ``user``) is a *hint*, never an agent id: one
Claude Code session holds several conversations (the main one, each
sub-agent, the title request), each with its own agent. The hint goes into
the ids of the agents its conversations create (``conv-<hint hash>-<n>``; a
load balancer routes by that hash, ``route_scope``),
and when no stored conversation is a prefix of the request (the client edited
or compacted its history), the request takes over the session's agent whose
conversation shares the most leading messages with it -- at least the first,
the system prompt -- so its cache keeps the shared part. A conversation with
a system prompt of its own starts its own agent.

The index is built from every agent's history at start-up (so it survives
restarts) and updated after each turn. While an agent's turn runs it is
*claimed*: a second request with the same prefix gets another agent rather
than queueing behind the first and then overwriting its conversation.
One owner: the app, on the event loop.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterable

from semantic.actors import Message

from .harmony import HARMONY, read_harmony
from .reasoning import answer_text
from .tools import ToolFormat, parse_tool_calls

__all__ = ["ConversationIndex", "as_generated", "forked_conversation_id", "message_key", "new_conversation_id",
           "route_scope", "state_hash"]


_SCOPED = re.compile(r"conv-([0-9a-f]{12})-[0-9a-f]{8}")
_UNSCOPED = re.compile(r"conv-[0-9a-f]{16}")


def _scope(hint: str) -> str:
    return hashlib.sha256(hint.encode()).hexdigest()[:12]


def new_conversation_id(hint: str | None = None) -> str:
    """A fresh id for an anonymous conversation (carrying its session hint's scope)."""
    return _scoped_id(_scope(hint)) if hint else "conv-" + secrets.token_hex(8)


def route_scope(agent_id: str) -> str | None:
    """What a load balancer hashes to route ``agent_id``'s requests
    (``scripts/haproxy.cfg``): a session's conversation by its scope, as its
    session hint routes; an anonymous conversation without one (``conv-<16
    hex>``) by nothing here (None: the balancer uses the client's address);
    any other agent by the scope of its id."""
    if m := _SCOPED.fullmatch(agent_id):
        return m[1]
    return None if _UNSCOPED.fullmatch(agent_id) else _scope(agent_id)


def forked_conversation_id(source: str) -> str:
    """A fresh id for a fork of ``source`` (an older response id continued):
    routed as ``source`` is, so the fork's next turns reach the server that holds it."""
    scope = route_scope(source)
    return _scoped_id(scope) if scope else new_conversation_id()


def _scoped_id(scope: str) -> str:
    return f"conv-{scope}-{secrets.token_hex(4)}"


def state_hash(messages: Iterable[Message]) -> str:
    """A short digest of a conversation, exactly as stored: 12 hex digits."""
    canonical = json.dumps([m.as_dict() for m in messages], sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()[:12]


def message_key(m: Message, fmt: ToolFormat | None) -> tuple:
    """What identifies ``m`` in a conversation a client sends back."""
    if m.role == "assistant":
        if HARMONY in m.content:  # a GPT-OSS reply as generated
            _, text, parsed = read_harmony(m.content)
        else:
            content = answer_text(m.content)  # clients send reasoning back apart, if at all
            text, parsed = parse_tool_calls(content, fmt) if fmt else (content, [])
        calls = [(c.name, c.arguments) for c in parsed] + [
            (c["function"]["name"], c["function"]["arguments"]) for c in m.tool_calls]
        return ("assistant", text.strip(), tuple((name, _arguments_key(args)) for name, args in calls))
    return (m.role, m.content, m.name)


def as_generated(messages: tuple[Message, ...], history: Iterable[Message],
                 fmt: ToolFormat | None) -> tuple[Message, ...]:
    """``messages`` with each reply that made calls taken as ``history`` holds it
    at its place -- the text the model generated, markup, spacing and number
    literals as it wrote them -- where the two read as the same message
    (``message_key``) and every message before it does too. A reply that
    reasoned is left as the client sent it."""
    out = list(messages)
    for i, (m, h) in enumerate(zip(messages, history)):
        key = message_key(m, fmt)
        if key != message_key(h, fmt):
            break
        if m.role == "assistant" and key[2] and m != h and answer_text(h.content) == h.content:
            out[i] = h
    return tuple(out)


def _arguments_key(args: dict) -> str:
    """A call's arguments, read as a client sends them back: some formats'
    parsers give every value as the text the model wrote (Qwen3-Coder's
    without the tools' types: ``"3"``, ``"True"``), where the client has the
    typed value, so a value that reads as a literal counts as that literal."""
    return json.dumps({k: _literal(v) for k, v in args.items()} if isinstance(args, dict) else args, sort_keys=True)


_PYTHON = {"True": True, "False": False, "None": None}  # how a template's ``| string`` writes these


def _literal(value):
    if not isinstance(value, str) or len(value) > 4096:
        return value
    if value in _PYTHON:
        return _PYTHON[value]
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


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

    def match(self, messages: Iterable[Message], hint: str | None = None) -> str | None:
        """The unclaimed agent whose conversation -- ending with a reply -- is the
        longest proper prefix of ``messages``; else, with a ``hint``, the
        unclaimed agent of that session sharing the most leading messages with
        it (at least the first)."""
        want = self.keys(messages)
        best, best_len = None, 0
        for agent_id, keys in self._keys.items():
            n = len(keys)
            if (best_len < n < len(want) and keys[-1][0] == "assistant" and want[:n] == keys
                    and agent_id not in self._claimed):
                best, best_len = agent_id, n
        if best is not None or hint is None:
            return best
        scope = _scope(hint)
        for agent_id, keys in self._keys.items():
            if agent_id in self._claimed or not (m := _SCOPED.fullmatch(agent_id)) or m[1] != scope:
                continue
            if (n := _shared(keys, want)) > best_len:
                best, best_len = agent_id, n
        return best

    def busy(self, agent_id: str) -> bool:
        """Whether a turn of ``agent_id`` runs now."""
        return agent_id in self._claimed

    def claim(self, agent_id: str) -> None:
        self._claimed[agent_id] = self._claimed.get(agent_id, 0) + 1

    def release(self, agent_id: str) -> None:
        if (n := self._claimed.get(agent_id, 0)) <= 1:
            self._claimed.pop(agent_id, None)
        else:
            self._claimed[agent_id] = n - 1


def _shared(a: tuple, b: tuple) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n
