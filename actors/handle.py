"""``Agent``: a handle on one agent, the in-process API's per-agent half.

A handle holds the agent's slot (``actors.agent``) and its runtime, and asks
the runtime only what ``AgentHost`` lists: public methods of ``Runtime``, so
that no other module reaches into the runtime's private parts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from anyio.streams.memory import MemoryObjectSendStream

from semantic.runtime.engine.engine import SamplingParams
from semantic.runtime.outcome import TurnResult

from .agent import AgentSlot, raise_failed, request
from .messages import AgentCommand, Delete, Message, Send, TurnEvent, TurnRequest
from .reply import Reply

__all__ = ["MAX_CHOICES", "Agent", "AgentHost"]

MAX_CHOICES = 16  # replies one turn may ask for (``Agent.send``'s ``choices``)


class AgentHost(Protocol):
    """What an ``Agent`` asks of its runtime (``Runtime`` is the one; the
    handle names it by this protocol, since the runtime imports the handle)."""

    def check_model(self, name: str) -> str: ...

    def check_open(self, unhealthy_ok: bool = False) -> None: ...

    def deliver(self, slot: AgentSlot, message: AgentCommand) -> None: ...

    def queue_turn(self, slot: AgentSlot,
                   message: Callable[[int, MemoryObjectSendStream[TurnEvent]], Send]) -> Reply: ...

    async def fork(self, source: AgentSlot, target: str) -> Agent: ...


class Agent:
    """A handle on one agent (cheap; many may exist for one agent)."""

    def __init__(self, runtime: AgentHost, slot: AgentSlot):
        self._rt = runtime
        self._slot = slot

    @property
    def id(self) -> str:
        return self._slot.agent_id

    @property
    def history(self) -> tuple[Message, ...]:
        """The conversation so far (system prompt, then user/assistant pairs)."""
        return self._slot.history or ()

    @property
    def last_result(self) -> TurnResult | None:
        """How the agent's last turn ended (token counts, timings), cancelled ones included."""
        return self._slot.last_result

    def send(self, text: str, *, use_cache: bool = True, model: str | None = None, choices: int = 1,
             **sampling) -> Reply:
        """Queue a turn now and return its stream: ``async for delta in agent.send(...)``.

        ``sampling``: ``SamplingParams`` fields (max_tokens, temperature, top_p,
        top_k, min_p, stop, seed, grammar, logprobs, prompt_logprobs: see
        ``complete``); greedy by default.
        ``grammar`` (``semantic.actors.grammar.json_schema(schema)``, say) makes
        the reply follow it; ``logprobs=n`` gives each delta its tokens'
        ``TokenLogprob`` (and the result all of them).  ``use_cache=False`` prefills
        the whole prompt and reuses nothing (to compare against caching).  ``model``:
        one of ``Runtime.models`` to run on (None: the loaded one); each model
        keeps its own cache of the agent.  ``choices`` (1 to ``MAX_CHOICES``):
        replies to the one prompt, prefilled once and decoded together, each
        sampled on its own (with a seed, choice ``i`` takes ``seed + i``);
        deltas say which they extend (``Delta.choice``), the result holds the
        others (``TurnResult.choices``), and the agent keeps choice 0.  Turns of one agent run in
        the order ``send`` was called; each sees the previous ones.  Closing the
        stream, breaking out of the loop, or cancelling the task that reads it
        cancels the turn within one engine step (see ``Reply``).

        Raises at once: ``TypeError``/``ValueError`` for bad sampling,
        ``UnknownModel``, ``RuntimeClosed``, ``RuntimeUnhealthy``, ``AgentGone``.  While streaming:
        ``TurnError`` (e.g. ``ContextTooLong``, ``OutOfMemory``) for this turn only.
        """
        return self._queue(text, None, None, use_cache, model, choices, sampling)

    def respond(self, messages: Iterable[Message], *, tools: Iterable[dict] | None = None,
                use_cache: bool = True, model: str | None = None, choices: int = 1, **sampling) -> Reply:
        """Queue a turn over a whole conversation and return its stream (as ``send``).

        For stateless clients that send everything each time: ``messages`` (a
        system message first, if any; ending with the message to answer)
        *replaces* the agent's history, and the reply is appended once the turn
        ends.  The agent's cache is matched to the new prompt by text, so a
        conversation that extends the cached one prefills only what is new, and
        one that diverges keeps the shared part.  ``tools``: tool definitions
        (``{"type": "function", "function": {...}}``) for chat templates that
        take them.  A cancelled turn leaves the history unchanged.

        Raises what ``send`` raises, and ``ValueError`` for an empty conversation.
        """
        messages = tuple(messages)
        if not messages:
            raise ValueError("a conversation needs at least one message")
        return self._queue("", messages, tuple(tools) if tools else None, use_cache, model, choices, sampling)

    def complete(self, prompt: str, *, use_cache: bool = True, model: str | None = None, choices: int = 1,
                 **sampling) -> Reply:
        """Queue a turn that continues the raw text ``prompt`` and return its
        stream (as ``send``): no chat template, the prompt tokenized as the
        tokenizer encodes text (with its BOS where it adds one). The history
        becomes ``prompt`` as a user message and the completion as the reply.

        ``prompt_logprobs=n``: each prompt token's log-probability given the
        tokens before it (the first's is None) and the ``n`` likeliest tokens'
        at its place, on each choice's first delta and in the result
        (``TurnResult.prompt_logprobs``). Such a turn prefills the whole
        prompt whatever ``use_cache`` says: the tokens scored must be
        computed. ``max_tokens=0`` prefills the prompt and generates nothing.

        Raises what ``send`` raises, and ``ValueError`` for an empty prompt.
        """
        if not prompt:
            raise ValueError("a completion needs a prompt")
        return self._queue("", (Message("user", prompt),), None, use_cache, model, choices, sampling, prompt)

    def _queue(self, text: str, messages: tuple[Message, ...] | None, tools: tuple[dict, ...] | None,
               use_cache: bool, model: str | None, choices: int, sampling: dict, prompt: str | None = None) -> Reply:
        params = SamplingParams(**sampling)
        use_cache = use_cache and params.prompt_logprobs is None  # scored tokens are prefilled (``Engine.add``)
        if not (isinstance(choices, int) and 1 <= choices <= MAX_CHOICES):
            raise ValueError(f"choices must be 1 to {MAX_CHOICES}, not {choices!r}")
        if model is not None:
            self._rt.check_model(model)
        self._rt.check_open()
        return self._rt.queue_turn(self._slot, lambda turn_id, reply: Send(
            TurnRequest(turn_id, params, text, messages, use_cache, tools, model, choices, prompt), reply))

    async def reply(self, text: str, *, use_cache: bool = True, **sampling) -> str:
        """Run a turn and return the whole reply text (``send`` without streaming).
        Raises what ``send`` raises; cancelling the caller cancels the turn."""
        async with self.send(text, use_cache=use_cache, **sampling) as stream:
            return await stream.text()

    async def fork(self, new_id: str) -> Agent:
        """A new agent with this agent's history and a copy of its cache (sharing
        memory until either grows).  Runs after this agent's queued turns.
        Raises ``AgentExists``, ``InvalidAgentId``, ``OutOfMemory`` (the copy does
        not fit the budget).  Cancelling the caller does not stop a fork under way."""
        return await self._rt.fork(self._slot, new_id)

    async def delete(self) -> None:
        """Delete the agent after its queued turns: its hot cache, every cache file
        and its history.  The handle is unusable afterwards (``AgentGone``).  Works on
        an unhealthy runtime too."""
        self._rt.check_open(unhealthy_ok=True)
        raise_failed(await request(lambda r: self._rt.deliver(self._slot, Delete(r))))

    def __repr__(self) -> str:
        return f"<Agent {self.id!r}: {len(self.history)} messages>"
