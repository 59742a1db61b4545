"""The chat core every protocol shares: which agent a request continues, its
turn, and the errors a client sees.

A protocol module (``web.anthropic``, ``web.openai``, ``web.responses``) only
translates: its request body into a ``ChatRequest``, and a ``ChatTurn``'s
items into its own JSON or events. ``ChatCore.start`` does the rest:

* **identity**: the agent named (``X-Agent-Id``, ``session_id``, a response
  id), else the one whose stored conversation the request continues
  (``web.identity``), else a new anonymous ``conv-*`` agent;
* **the turn**: the conversation as the model's template can take it
  (``web.prepare``, which also decides how its tools are shown and its
  calls read), the agent claimed in the index while it runs, the index and
  metrics updated when it ends;
* **errors**: every runtime error becomes a ``RequestError``.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterable, AsyncIterator, Callable, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Protocol, runtime_checkable

from semantic.actors import (Agent, AgentExists, AgentGone, ContextTooLong, Delta, FinishReason, InvalidAgentId,
                             Message, ModelError, OutOfMemory, Reply, Runtime, RuntimeClosed, RuntimeUnhealthy,
                             SemanticError, TurnCancelled, TurnResult, UnknownModel, validate_agent_id)

from ._aio import closing
from .harmony import Harmony, speaks_harmony
from .identity import ConversationIndex, as_generated, forked_conversation_id, new_conversation_id
from .metrics import Metrics
from .prepare import Prepared, prepare
from .reasoning import CLOSE, OPEN, ThinkTags
from .schema import (ChatRequest, ChatResult, CompletionRequest, Heartbeat, LogprobsDelta, PromptLogprobs,
                     ReasoningDelta, RequestError, StopReason, StreamItem, Usage)
from .tools import ToolCallFilter, added_tokens, finish_result, library_format, reply_format

__all__ = ["Answers", "ChatCore", "ChatProtocol", "ChatTurn", "chat_result", "checked_agent_id", "sampling",
           "turn_error"]

HEARTBEAT_S = 2.0  # a stream with nothing new for this long sends its keep-alive


@dataclass(frozen=True)
class ChatTurn:
    """A turn under way, for a protocol to answer: its items are ``Delta``
    and ``Heartbeat`` items and then one ``ChatResult``."""

    agent_id: str
    model: str
    request: ChatRequest | CompletionRequest | None  # None: an agent API turn
    messages: tuple[Message, ...]  # the conversation the reply answers
    items: AsyncIterator[StreamItem]
    created: int


@runtime_checkable
class Answers(Protocol):
    """How a protocol module answers a turn (``web.anthropic``, ``web.openai``,
    ``web.responses``, ``web.agents``): its JSON, its events, its errors."""

    def response_json(self, turn: ChatTurn, result: ChatResult) -> dict: ...

    def events(self, turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]: ...

    def error_json(self, err: RequestError) -> dict: ...


@runtime_checkable
class ChatProtocol(Answers, Protocol):
    """A stateless chat API's module, which also reads its requests."""

    def parse_request(self, body: bytes, headers: Mapping[str, str] | None = None, *,
                      max_tokens_cap: int) -> ChatRequest: ...


def sampling(req: ChatRequest | CompletionRequest) -> dict:
    """The runtime's sampling arguments; greedy unless the client set a temperature."""
    out: dict = {"max_tokens": req.max_tokens, "stop": req.stop}
    for key in ("temperature", "top_p", "top_k", "seed", "logprobs"):
        if (value := getattr(req, key)) is not None:
            out[key] = value
    return out


def chat_result(result: TurnResult) -> ChatResult:
    usage = Usage(result.prefilled_tokens, result.reused_tokens, result.output_tokens,
                  result.drafted_tokens, result.accepted_tokens)
    stop = getattr(result, "stop_sequence", None)
    if result.reason == FinishReason.STOP:
        reason = StopReason.STOP_SEQUENCE if stop else StopReason.STOP
        return ChatResult(result.text, reason, usage, stop or None, turn=result)
    reason = StopReason.LENGTH if result.reason == FinishReason.LENGTH else StopReason.CANCELLED
    return ChatResult(result.text, reason, usage, turn=result)


def turn_error(e: Exception) -> RequestError:
    """The client's view of a runtime error that ended a turn (or refused it)."""
    if isinstance(e, ContextTooLong):
        return RequestError(400, str(e))
    if isinstance(e, OutOfMemory):
        return RequestError(503, f"the server's KV cache budget is full: {e}")
    if isinstance(e, (RuntimeClosed, TurnCancelled)):
        return RequestError(503, "the server is shutting down; try again")
    if isinstance(e, RuntimeUnhealthy):
        return RequestError(503, "the model failed and the server must be restarted; see its log")
    if isinstance(e, (AgentExists, AgentGone)):
        return RequestError(409, str(e))
    if isinstance(e, UnknownModel):
        return RequestError(404, str(e), param="model")
    if isinstance(e, ModelError):
        return RequestError(503, f"the model could not be loaded: {e}")
    return RequestError(500, f"the turn failed: {e}")


def checked_agent_id(agent_id: str, where: str) -> str:
    """``agent_id`` if it may name an agent, else a 400 naming ``where``."""
    try:
        return validate_agent_id(agent_id)
    except InvalidAgentId as e:
        shown = agent_id if len(agent_id) <= 64 else agent_id[:64] + "..."
        raise RequestError(400, f"{where}: {e} (got {shown!r})", param=where) from None


class ChatCore:
    """Identity, turns and errors for every route that runs a turn. One owner:
    the app, on the event loop."""

    def __init__(self, rt: Runtime, metrics: Metrics, heartbeat_s: float = HEARTBEAT_S, observer=None):
        self.rt = rt
        self.metrics = metrics
        self.observer = observer or _NoObserver()  # told when each turn starts and ends (web.dashboard)
        self.heartbeat_s = heartbeat_s
        self.index = ConversationIndex()
        # model -> its generation prompt opens <think> (None: closes it, as DeepSeek-V3.1's does: no reasoning)
        self._opens_thinking: dict[str | None, bool | None] = {}
        self._added_tokens: dict[str, dict[str, int]] = {}  # model -> its tokenizer's (read once: thousands in some)

    async def load_index(self) -> None:
        """Index every agent on disk (at start-up, so conversations survive
        restarts), reading the calls in their replies as the loaded model writes them."""
        try:
            self.index.fmt = reply_format(await self.rt.tokenizer())
        except SemanticError:  # no model loaded
            pass
        for info in await self.rt.agents():
            self.index.record(info.id, info.history)

    async def start(self, req: ChatRequest, model: str, agent_id: str | None = None, fork_from: str | None = None,
                    route: str = "api") -> ChatTurn:
        """Start the turn ``req`` asks for, on ``model``, on the agent it names or continues.

        ``agent_id`` (a response id's agent) overrides the request's; with
        ``fork_from`` the turn runs on a new agent forked from that one.
        ``route`` names the API it came by for observers ("anthropic", ...).
        Raises ``RequestError`` before anything runs."""
        prepared = await self._prepare(req, model)
        agent_id = agent_id or req.agent_id
        if agent_id is not None:
            checked_agent_id(agent_id, "X-Agent-Id" if agent_id == req.agent_id else "agent")
        if fork_from is not None:
            agent_id = forked_conversation_id(fork_from)  # routed as its source (docs/scaling.md)
        else:
            agent_id = agent_id or self.index.match(prepared.messages, req.hint) or new_conversation_id(req.hint)
        with self._claimed(agent_id) as release:  # before any await: no other request takes it meanwhile
            # (the history is read first only when its calls stand in for the client's)
            agent = await (self._fork(fork_from, agent_id) if fork_from is not None
                           else self._open(agent_id, read=prepared.calls_as_text))
            messages = prepared.messages
            if prepared.calls_as_text:  # its calls as it wrote them: their text is what its cache holds
                messages = as_generated(messages, agent.history, self.index.fmt)
            return await self._run(agent, model, req, messages, prepared, release, route,
                                   lambda: agent.respond(messages, tools=prepared.tools, model=model,
                                                         choices=req.choices, **sampling(req),
                                                         grammar=prepared.grammar))

    async def complete(self, req: CompletionRequest, model: str, route: str = "completions") -> ChatTurn:
        """Start the raw-text completion ``req`` asks for, on ``model``: on the
        agent it names, else on a new anonymous one (a prompt is one text, not
        a conversation of messages the index could find a prefix of: as a chat
        request of one message, each is a new conversation). The prompt's
        tokens are scored when it asks (``req.prompt_logprobs``: that turn
        prefills the whole prompt, ``Agent.complete``). Raises
        ``RequestError`` before anything runs."""
        if req.agent_id is not None:
            checked_agent_id(req.agent_id, "X-Agent-Id")
        agent_id = req.agent_id or new_conversation_id(req.hint)
        options = sampling(req) | {"prompt_logprobs": req.prompt_logprobs}
        prepared = Prepared((), None, None, frozenset())  # no template, no tools
        with self._claimed(agent_id) as release:
            agent = await self._open(agent_id)
            return await self._run(agent, model, req, (Message("user", req.prompt),), prepared, release, route,
                                   lambda: agent.complete(req.prompt, model=model, choices=req.choices, **options),
                                   raw=True)

    async def send(self, agent: Agent, content: str, *, model: str, use_cache: bool, sampling: dict,
                   route: str = "agent") -> ChatTurn:
        """A turn of the agent API on ``model``: ``content`` is the new user message."""
        prepared = Prepared((), None, None, frozenset())
        with self._claimed(agent.id) as release:
            return await self._run(agent, model, None, agent.history, prepared, release, route,
                                   lambda: agent.send(content, use_cache=use_cache, model=model, **sampling))

    @contextmanager
    def _claimed(self, agent_id: str):
        """Claim ``agent_id`` in the index; the claim goes with the turn's items
        (released when they are closed), or now if the turn does not start."""
        self.index.claim(agent_id)
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self.index.release(agent_id)

        try:
            yield release
        except BaseException:
            release()
            raise

    async def count_tokens(self, req: ChatRequest, model: str) -> int:
        prepared = await self._prepare(req, model)
        try:
            return (await self.rt.prompt(prepared.messages, prepared.tools, model=model))[1]
        except SemanticError as e:
            raise turn_error(e) from None

    async def _prepare(self, req: ChatRequest, model: str) -> Prepared:
        tokenizer = await self._tokenizer(model)
        try:
            reasoning = await self._reasoning(model)
        except SemanticError as e:
            raise turn_error(e) from None
        if model not in self._added_tokens:
            self._added_tokens[model] = added_tokens(tokenizer)
        template, library = getattr(tokenizer, "chat_template", None), library_format(tokenizer)
        prepared = prepare(req, template, library, self._added_tokens[model], reasoning)
        if prepared.tools_told and req.tool_choice != "required" and not await self._fits(prepared, model):
            # (tools a small context cannot hold, Claude Code's 8K tokens of them: left out, as a template without
            # tools leaves them, rather than a prompt refused as too long)
            prepared = prepare(req, template, library, self._added_tokens[model], reasoning, tell_tools=False)
        return prepared

    async def _fits(self, prepared: Prepared, model: str) -> bool:
        """Whether ``prepared``'s prompt leaves room in ``model``'s context (unknown: yes)."""
        if self.rt.model != model or not self.rt.context_length:
            return True
        try:
            return (await self.rt.prompt(prepared.messages, prepared.tools, model=model))[1] < self.rt.context_length
        except SemanticError as e:
            raise turn_error(e) from None

    async def _template(self, model: str) -> str | None:
        return getattr(await self._tokenizer(model), "chat_template", None)

    async def _tokenizer(self, model: str):
        try:
            return await self.rt.tokenizer(model)
        except SemanticError as e:
            raise turn_error(e) from None

    async def _reasoning(self, model: str) -> ThinkTags | Harmony | None:
        """How ``model``'s replies keep reasoning apart: GPT-OSS's harmony
        channels, or ``<think>`` tags (opened by its generation prompt, or
        not); None when its template has neither, or its generation prompt
        closes the tag (DeepSeek-V3.1 out of thinking mode)."""
        template = await self._template(model)
        if speaks_harmony(template):
            return Harmony()
        if not template or (OPEN not in template and CLOSE not in template):
            return None
        if model not in self._opens_thinking:
            text, _ = await self.rt.prompt((Message("user", "hi"),), model=model)
            self._opens_thinking[model] = None if text.rstrip().endswith(CLOSE) else text.rstrip().endswith(OPEN)
        opened = self._opens_thinking[model]
        return None if opened is None else ThinkTags(opened)

    async def _open(self, agent_id: str, read: bool = False) -> Agent:
        """A handle on ``agent_id``; with ``read``, once its actor has its history
        (a round trip), else at once: the turn's one message creates the agent."""
        try:
            return await (self.rt.agent(agent_id) if read else self.rt.handle(agent_id))
        except SemanticError as e:
            raise turn_error(e) from None

    async def _fork(self, source_id: str, target_id: str) -> Agent:
        source = await self._open(source_id, read=True)
        try:
            return await source.fork(target_id)
        except SemanticError as e:
            raise turn_error(e) from None

    async def _run(self, agent: Agent, model: str, req: ChatRequest | CompletionRequest | None,
                   messages: tuple[Message, ...], prepared: Prepared, release: Callable[[], None], route: str,
                   start: Callable[[], Reply], raw: bool = False) -> ChatTurn:
        """The turn ``start`` begins, as a ``ChatTurn``; ``raw``: its reply is
        raw text (a completion), read for neither reasoning nor tool calls."""
        try:
            reasoning = None if raw else await self._reasoning(model)
        except SemanticError as e:
            raise turn_error(e) from None
        choices = req.choices if req is not None else 1
        items = _Releasing(self._items(agent, prepared, reasoning, choices, route, start), release)
        return ChatTurn(agent.id, model, req, messages, items, int(time.time()))

    async def _items(self, agent: Agent, prepared: Prepared, reasoning: ThinkTags | Harmony | None, choices: int,
                     route: str, start: Callable[[], Reply]) -> AsyncIterator[StreamItem]:
        """One turn's items, and the index and metrics updated when it ends."""
        tier = self.rt.cache_tier(agent.id)
        reply = None
        try:
            try:
                reply = start()
            except (TypeError, ValueError) as e:
                raise RequestError(400, str(e)) from None
            except SemanticError as e:
                raise turn_error(e) from None
            self.observer.turn_started(agent.id, route, reply.turn_id)
            async with closing(_run_turn(reply, prepared, reasoning, choices, self.heartbeat_s)) as items:
                async for item in items:
                    yield item
        finally:
            if reply is not None and reply.result is not None:  # else its history is as the index has it
                self.index.record(agent.id, agent.history)
            if reply is not None:
                self.metrics.turn(reply.result, tier)
                self.observer.turn_ended(agent.id, route, reply.turn_id, reply.result, tier)


class _NoObserver:
    def turn_started(self, agent_id: str, route: str, turn_id: int) -> None:
        pass

    def turn_ended(self, agent_id: str, route: str, turn_id: int, result, tier: str | None) -> None:
        pass


class _Releasing:
    """Async iterator ``items``, calling ``release`` once it is exhausted or
    closed -- also when it was never started (a client gone before the first byte)."""

    def __init__(self, items: AsyncIterator[StreamItem], release: Callable[[], None]):
        self._items = items
        self._release = release

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamItem:
        try:
            return await self._items.__anext__()
        except BaseException:
            self._release()
            raise

    async def aclose(self) -> None:
        try:
            await self._items.aclose()
        finally:
            self._release()


async def _run_turn(reply: Reply, prepared: Prepared, reasoning: ThinkTags | Harmony | None, choices: int,
                    heartbeat_s: float) -> AsyncIterator[StreamItem]:
    """The items of one turn: ``ReasoningDelta`` items (when the model reasons:
    ``reasoning`` reads it apart, and a harmony reply's calls) and ``Delta`` items
    (tool-call markup held back), each delta's ``LogprobsDelta`` after its
    text and a choice's ``PromptLogprobs`` before its first (when the turn
    asked), each item of the reply ``choice`` it extends,
    a ``Heartbeat`` whenever nothing came for ``heartbeat_s``, then its
    ``ChatResult`` (the other choices' in it) with reasoning and tool calls
    parsed out.  Runtime errors become ``RequestError``.  Closing the
    iterator, or cancelling its reader, cancels the turn (the agent's history
    stays as it was)."""
    holds = [ToolCallFilter(prepared.fmt) if prepared.fmt else None for _ in range(choices)]
    splitters = [reasoning.splitter() for _ in range(choices)] if reasoning is not None else None

    def items(choice: int, text: str, end: bool = False):
        parts = [("text", text)] if splitters is None else (
            splitters[choice].end() if end else splitters[choice].feed(text))
        for kind, text in parts:
            if kind == "thinking":
                yield ReasoningDelta(text, choice)
            elif text := holds[choice].feed(text) if holds[choice] else text:
                yield Delta(text, choice=choice)

    try:
        while True:
            try:
                delta = await reply.poll(heartbeat_s)
            except StopAsyncIteration:
                break
            if delta is None:
                yield Heartbeat()
            else:
                if delta.prompt_logprobs:
                    yield PromptLogprobs(delta.prompt_logprobs, delta.choice)
                for item in items(delta.choice, delta.text):
                    yield item
                if delta.logprobs:
                    yield LogprobsDelta(delta.logprobs, delta.choice)
    except TurnCancelled:
        pass  # the runtime shut down under it: a "cancelled" result
    except SemanticError as e:  # TurnError, OutOfMemory, RuntimeClosed, ...: the turn did not run
        raise turn_error(e) from None
    finally:
        reply.close()
    results = []
    for choice, turn in enumerate((reply.result, *reply.result.choices)):
        result = chat_result(turn)
        if splitters is not None:
            for item in items(choice, "", end=True):
                yield item
            thought, text, calls = reasoning.read(turn.text)
            result = replace(result, text=text, reasoning=thought)
            stopped, cut = result.stop_reason == StopReason.STOP, result.stop_reason == StopReason.LENGTH
            if calls and (stopped or prepared.holds_calls and cut):
                result = replace(result, stop_reason=StopReason.TOOL_USE if stopped else StopReason.LENGTH,
                                 tool_calls=tuple(calls))
        results.append(finish_result(result, prepared.fmt, prepared.tool_names, prepared.tools, prepared.holds_calls))
    yield replace(results[0], choices=tuple(results[1:]))
