"""Agent actors: one per active agent; its mailbox serialises the agent's turns.

An agent is a named conversation.  Its actor owns the history (the messages,
model-independent) and handles its mailbox one message at a time, so a turn
starts only after the previous one ended and its cache was checked in by the
GPU actor -- the second of two sends sees the first's reply in its prompt.
Different agents' actors run side by side; the GPU actor batches their turns.

A turn: the actor sends ``BeginTurn`` (the history plus the new user message)
to the GPU actor with the consumer's stream, where the GPU actor posts each
``Delta`` straight, and a stream of its own for the end: on ``TurnEnded`` it
appends the user message and the reply to the history, hands the history
file to the persistence actor, and only then forwards the end -- so a
consumer that saw the end sees the new history.
A turn that brings its whole conversation (``Agent.respond``, for stateless
HTTP clients) replaces the history with that conversation plus the reply.

**A cancelled turn** (its consumer stopped reading or was cancelled, or the
runtime shut down) leaves the history unchanged: neither the user message nor
the partial reply is added.  Its cache is still consistent: the engine's
``Finished(cancelled)`` cache covers exactly the tokens it fed (prompt so far,
plus the reply so far) and is stored as the agent's cache; the next turn's
prefix match keeps the part its prompt shares (the history) and trims the rest.

Retirement: an actor whose mailbox stayed empty for ``idle_s`` retires (its
task ends; the runtime keeps the agent's slot with its history) and a new one
starts when the next message arrives.  Messages are taken with
``receive_nowait`` only; waiting is on a wake-up event, so a timeout can never
lose a message.

History file (``<cache dir>/histories/<agent id>.json``, written atomically):
``{"format": "semantic-agent-history", "version": 1, "agent_id": ...,
"messages": [{"role": ..., "content": ...}, ...], "updated": <unix time>}``; a tool
turn's message also has ``tool_calls``, ``tool_call_id`` or ``name`` (see ``Message``).
History and cache are written separately: after a crash they may disagree,
which is safe, because a cache is matched to a prompt by its own text.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from semantic.runtime.errors import SemanticError
from semantic.runtime.outcome import FinishReason, TurnResult

from .errors import AgentExists, AgentGone, RuntimeClosed, TurnError
from .history import encode_history
from .messages import (
    AgentCommand,
    BeginTurn,
    Delete,
    Done,
    DropCache,
    Failed,
    Fork,
    ForkCache,
    Forget,
    HistoryBytes,
    Message,
    Open,
    ReadHistory,
    Send,
    TurnEnd,
    TurnEnded,
    TurnFailed,
)

__all__ = ["AgentActor", "AgentContext", "AgentSlot", "raise_failed", "request"]

log = logging.getLogger("semantic.actors")


@dataclass(eq=False)
class AgentSlot:
    """The runtime's entry for one agent id.

    ``history`` and ``last_result`` are written only by the agent's actor (or,
    before any actor exists, by whoever creates the slot: ``Runtime`` for a fork
    target); everyone else reads them.  ``mailbox`` is set by the runtime when it
    starts an actor and cleared by that actor when it retires.
    """

    agent_id: str
    history: tuple[Message, ...] | None = None  # None until loaded from disk
    exists: bool = False  # has a history file (or is about to)
    mailbox: MemoryObjectSendStream[AgentCommand] | None = None
    wakeup: anyio.Event | None = None
    stopped: anyio.Event | None = None  # set when the current actor has ended
    reserved: bool = False  # a fork is creating it: no messages yet
    deleted: bool = False
    last_result: TurnResult | None = None


@dataclass
class AgentContext:
    """What agent actors need from the runtime."""

    gpu: object  # GpuActor
    persistence: MemoryObjectSendStream  # the persistence actor's mailbox
    histories: Path
    idle_s: float
    closing: Callable[[], bool]
    release: Callable[[AgentSlot], None]  # the runtime forgets a deleted agent's slot
    turn_ended: Callable[[str, int, TurnResult], None] = lambda agent_id, turn_id, result: None  # observers


class AgentActor:
    def __init__(self, slot: AgentSlot, mailbox: MemoryObjectReceiveStream[AgentCommand], ctx: AgentContext):
        self.slot = slot
        self.mailbox = mailbox
        self.ctx = ctx

    @property
    def agent_id(self) -> str:
        return self.slot.agent_id

    async def run(self) -> None:
        slot = self.slot
        self._unusable: SemanticError | None = None
        try:
            if slot.history is None:
                answer = await request(lambda r: self.ctx.persistence.send_nowait(ReadHistory(slot.agent_id, r)))
                if isinstance(answer, Failed):  # fail this agent's requests, not the runtime
                    self._unusable = answer.error
                    return
                history = answer.value
                slot.exists = history is not None
                slot.history = history or ()
            while not slot.deleted:
                try:
                    message = self.mailbox.receive_nowait()
                except anyio.EndOfStream:
                    return
                except anyio.WouldBlock:
                    slot.wakeup = wakeup = anyio.Event()
                    with anyio.move_on_after(self.ctx.idle_s):
                        await wakeup.wait()
                    if not wakeup.is_set() and self.mailbox.statistics().current_buffer_used == 0:
                        return  # idle: retire (nothing can arrive between this check and the close below)
                    continue
                await self._handle(message)
        finally:
            if slot.mailbox is not None:
                slot.mailbox.close()
                slot.mailbox = None
            self._refuse_rest()
            self.mailbox.close()
            slot.stopped.set()
            if slot.deleted:
                self.ctx.release(slot)

    def _refuse_rest(self) -> None:
        """Answer whatever is left in the mailbox (the runtime shut down, or the agent was deleted)."""
        if self.slot.deleted:
            error = AgentGone(f"agent {self.agent_id!r} was deleted")
        else:
            error = self._unusable or RuntimeClosed("the runtime is closed")
        while True:
            try:
                message = self.mailbox.receive_nowait()
            except (anyio.WouldBlock, anyio.EndOfStream):
                return
            if isinstance(message, Send):
                _final(message.reply, TurnFailed(message.turn_id, error))
            else:
                _final(message.reply, Failed(error))

    async def _handle(self, message: AgentCommand) -> None:
        try:
            if isinstance(message, Send):
                await self._turn(message)
            elif isinstance(message, Open):
                self._open(message)
            elif isinstance(message, Fork):
                await self._fork(message)
            elif isinstance(message, Delete):
                await self._delete(message)
            else:
                raise AssertionError(f"unknown agent message {message!r}")
        except Exception as e:  # a bug here fails this request, not the agent or the runtime
            log.exception("agent %s: %s failed", self.agent_id, type(message).__name__)
            error = TurnError(f"internal error in agent {self.agent_id!r}: {e!r}")
            _final(message.reply, TurnFailed(message.turn_id, error) if isinstance(message, Send) else Failed(error))

    # -- handlers ----------------------------------------------------------------

    def _open(self, message: Open) -> None:
        slot, system = self.slot, message.system
        history = slot.history
        if system is not None:
            if not history:
                history = (Message("system", system),)
            elif history[0].role != "system" or history[0].content != system:
                _final(message.reply, Failed(AgentExists(
                    f"agent {self.agent_id!r} exists with another system prompt; "
                    "open it without system=, or delete it first"
                )))
                return
        if not slot.exists or history != slot.history:
            slot.exists = True
            self._set_history(history)
        _final(message.reply, Done())

    async def _turn(self, message: Send) -> None:
        consumer, ask, slot = message.reply, message.request, self.slot
        if not slot.exists:  # a turn creates its agent, as ``Open`` with no system prompt does
            slot.exists = True
            self._set_history(slot.history)
        if consumer.statistics().open_receive_streams == 0:
            return  # the consumer stopped before the turn started: nothing to run
        if self.ctx.closing():
            _final(consumer, TurnFailed(ask.turn_id, RuntimeClosed("the runtime is shutting down")))
            return
        if ask.messages is not None:  # the whole conversation: it replaces the history
            messages = ask.messages
        else:
            messages = (*slot.history, Message("user", ask.text))
        send, ends = anyio.create_memory_object_stream[TurnEnd](math.inf)
        gpu = self.ctx.gpu
        # The deltas go from the GPU actor to the consumer straight; only the end comes here.
        gpu.submit(BeginTurn(ask, self.agent_id, messages, consumer, send))
        async with ends:
            try:
                end = await ends.receive()
            except anyio.EndOfStream:  # the GPU actor ended without answering
                end = TurnFailed(ask.turn_id, gpu.error or RuntimeClosed("the runtime shut down during this turn"))
        if isinstance(end, TurnEnded):
            self.slot.last_result = _kept(end.result)
            if end.result.reason != FinishReason.CANCELLED:
                self._set_history((*messages, Message("assistant", end.result.text)))
            self.ctx.turn_ended(self.agent_id, ask.turn_id, end.result)
        _final(consumer, end)

    async def _fork(self, message: Fork) -> None:
        """Copy this agent's cache to ``message.target``; answer with the history to give it."""
        reply = await request(lambda r: self.ctx.gpu.submit(ForkCache(self.agent_id, message.target, r)))
        _final(message.reply, Done(self.slot.history) if isinstance(reply, Done) else reply)

    async def _delete(self, message: Delete) -> None:
        """Forget the hot cache, delete every file of the agent, then retire for good."""
        dropped = await request(lambda r: self.ctx.gpu.submit(DropCache(self.agent_id, r)))
        forgotten = await request(lambda r: self.ctx.persistence.send_nowait(Forget(self.agent_id, r)))
        failed = next((x for x in (dropped, forgotten) if isinstance(x, Failed)), None)
        if failed is None:
            self.slot.deleted = True
            self.slot.history = ()
        _final(message.reply, failed or Done())

    def _set_history(self, history: tuple[Message, ...]) -> None:
        self.slot.history = history
        data = encode_history(self.agent_id, history)
        try:
            self.ctx.persistence.send_nowait(HistoryBytes(self.agent_id, data))
        except (anyio.BrokenResourceError, anyio.ClosedResourceError):
            log.error("the history of %s could not be handed to persistence (it has stopped)", self.agent_id)


async def request(send: Callable[[MemoryObjectSendStream], None]) -> Done | Failed:
    """Send a request carrying a fresh one-shot reply stream; return the answer.
    An actor that ends without answering closes the stream: that reads as a failure."""
    reply, answer = anyio.create_memory_object_stream[Done | Failed](1)
    async with answer:
        send(reply)
        try:
            return await answer.receive()
        except anyio.EndOfStream:
            return Failed(RuntimeClosed("the runtime closed before answering"))


def raise_failed(answer: Done | Failed):
    """The value of a request's answer; its error raised if it failed."""
    if isinstance(answer, Failed):
        raise answer.error
    return answer.value


def _kept(result: TurnResult) -> TurnResult:
    """What an agent's slot keeps of its last turn (``Agent.last_result``): all
    but the prompt's log-probabilities, which only the turn's reader needs
    (a few hundred bytes a prompt token: a slot lives as long as its agent, and
    a harness scores thousands of prompts, each on an agent of its own)."""
    if not result.prompt_logprobs:
        return result
    return replace(result, prompt_logprobs=(), choices=tuple(replace(c, prompt_logprobs=()) for c in result.choices))


def _final(reply: MemoryObjectSendStream, item) -> None:
    try:
        reply.send_nowait(item)
    except (anyio.BrokenResourceError, anyio.ClosedResourceError, anyio.WouldBlock):
        pass
    reply.close()
