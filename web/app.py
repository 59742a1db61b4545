"""The Starlette app: every route, wired to one ``Runtime``.

``create_app(config)`` builds it; its lifespan opens the runtime (the root
task group of the server lives there), builds the conversation index from the
agents on disk, and shuts the runtime down -- flushing every cache -- when the
server stops.

Routes are thin: parse the body into one request (``web.anthropic``,
``web.openai``, ``web.responses``, ``web.agents``), start one agent turn
(``web.chat``; a Responses request's ``previous_response_id`` names the agent
and the point of its history to go on from), and answer JSON or stream SSE.
A request refused before its first event gets a
plain HTTP error in its protocol's shape, streaming or not; a failure later
in a stream is an error event. The guard in front of the routes checks the
API key, caps the body size and the time a client may take to send it (an
agent's import reads its archive itself, to disk: it may be any size).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import anyio
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from actors import Agent, AgentExists, AgentGone, Runtime, TurnError, UnknownModel
from actors import archive
from runtime.cache_records import InvalidAgentId
from runtime.disk import NoRoom, check_room, human_bytes
from runtime.models import catalogue
from runtime.errors import SemanticError

from . import agents, anthropic, openai, responses
from ._aio import closing
from .chat import HEARTBEAT_S, Answers, ChatCore, ChatProtocol, ChatTurn, checked_agent_id, turn_error
from .dashboard import Dashboard, memory_and_disk
from .events import EventHub
from .metrics import CONTENT_TYPE_LATEST, Metrics
from .schema import ChatResult, RequestError, StreamItem
from .sse import EventStreamResponse

__all__ = ["ServerConfig", "create_app"]

log = logging.getLogger("semantic.web")

STATIC_DIR = Path(__file__).parent / "static"  # the dashboard page (package data)
STATIC_PREFIX = "/dashboard/static"
_OPEN_PATHS = ("/health", "/")  # no key needed: no data there (the page asks for the key itself)
_IMPORT_PATH = re.compile(r"/v1/agents/[^/]+/import")  # reads its own body: an archive may be any size
EVENTS_KEEP_ALIVE_S = 15.0


@dataclass(frozen=True)
class ServerConfig:
    """What a server runs and its limits (checked when the app is built)."""

    model: object = "smollm2"  # a name, NAME=MODEL, or a runtime.models.LoadedModel (tests share one)
    models: tuple = ()  # more models requests may name (as ``model``); the first is loaded at start
    model_idle_s: float | None = None  # unload the model after this long without turns (None: never)
    cache_dir: Path | None = None
    budget: int | None = None  # bytes of hot KV cache (None: the runtime's default)
    kv_bits: int = 4  # the agents' KV caches are quantized to 4 or 8 bits
    disk_budget: int | None = None  # bytes the cache directory may hold (None: no cap)
    conversation_ttl_s: float | None = None  # anonymous conv-* agents unused this long are removed (None: never)
    api_key: str | None = None  # required as x-api-key or "Authorization: Bearer" when set
    max_tokens_cap: int | None = None  # larger max_tokens are clamped to it (None: the model's context length)
    heartbeat_s: float = HEARTBEAT_S  # a stream with nothing new this long sends a keep-alive (ping)
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 60.0  # a client must send its whole body within this
    runtime_options: dict = field(default_factory=dict)  # more Runtime.open keywords

    def __post_init__(self):
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1 (None: the model's context length)")
        if self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.body_timeout_s <= 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if self.disk_budget is not None and self.disk_budget <= 0:
            raise ValueError("disk_budget must be more than 0 bytes (None: no cap)")
        if self.conversation_ttl_s is not None and self.conversation_ttl_s <= 0:
            raise ValueError("conversation_ttl_s must be more than 0 (None: never)")
        if self.model_idle_s is not None and self.model_idle_s <= 0:
            raise ValueError("model_idle_s must be more than 0 (None: never)")
        catalogue([self.model, *self.models])  # ValueError for a repeated name


def create_app(config: ServerConfig, on_ready: Callable[[Runtime], None] | None = None) -> Starlette:
    """The app; ``on_ready(runtime)`` runs once the model is loaded and the index built."""
    server = _Server(config)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with Runtime.open(config.model, config.cache_dir, config.budget, models=config.models,
                                model_idle_s=config.model_idle_s, kv_bits=config.kv_bits,
                                disk_budget=config.disk_budget,
                                conversation_ttl_s=config.conversation_ttl_s, **config.runtime_options) as rt:
            await server.start(rt)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.dashboard.run)
                if on_ready is not None:
                    on_ready(rt)
                yield
                tg.cancel_scope.cancel()

    s = server
    app = Starlette(lifespan=lifespan, exception_handlers={RequestError: _request_error}, routes=[
        Route("/v1/messages", s.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", s.count_tokens, methods=["POST"]),
        Route("/v1/chat/completions", s.completions, methods=["POST"]),
        Route("/v1/responses", s.create_response, methods=["POST"]),
        Route("/v1/responses/{response_id}", s.get_response, methods=["GET"]),
        Route("/v1/responses/{response_id}", s.delete_response, methods=["DELETE"]),
        Route("/v1/agents", s.create_agent, methods=["POST"]),
        Route("/v1/agents", s.list_agents, methods=["GET"]),
        Route("/v1/agents/{agent_id:path}/messages", s.agent_turn, methods=["POST"]),
        Route("/v1/agents/{agent_id:path}/fork", s.fork_agent, methods=["POST"]),
        Route("/v1/agents/{agent_id:path}/demote", s.demote_agent, methods=["POST"]),
        Route("/v1/agents/{agent_id:path}/import", s.import_agent, methods=["POST"]),
        Route("/v1/agents/{agent_id:path}", s.get_agent, methods=["GET"]),
        Route("/v1/agents/{agent_id:path}", s.delete_agent, methods=["DELETE"]),
        Route("/v1/models", s.models, methods=["GET"]),
        Route("/health", s.health, methods=["GET"]),
        Route("/", s.page, methods=["GET"]),
        Mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static"),
        Route("/v1/dashboard", s.dashboard_state, methods=["GET"]),
        Route("/v1/events", s.events, methods=["GET"]),
        Route("/metrics", s.metrics_text, methods=["GET"]),
    ])
    app.add_middleware(_Guard, config=config)
    app.state.server = server
    return app


def error_shape(path: str) -> Callable[[RequestError], dict]:
    """The error JSON a route's clients expect."""
    if path.startswith("/v1/responses"):
        return responses.error_json
    if path.startswith("/v1/chat/"):
        return openai.error_json
    if path.startswith("/v1/agents"):
        return agents.error_json
    return anthropic.error_json


def _error(path: str, err: RequestError, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_shape(path)(err), status_code=err.status, headers=headers)


async def _request_error(request: Request, err: RequestError) -> JSONResponse:
    """What every route answers a ``RequestError`` with: its status, in the route's error shape."""
    return _error(request.url.path, err)


def _headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}


class _Server:
    """The routes' shared state: the runtime, the chat core, the metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.rt: Runtime | None = None
        self.core: ChatCore | None = None
        self.metrics = Metrics()
        self.hub = EventHub()
        self.dashboard: Dashboard | None = None
        self.started = time.time()
        self.importing = anyio.Lock()  # one import at a time: its check that the agent is new holds until it is in

    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        self.dashboard = Dashboard(rt, self.hub)
        self.core = ChatCore(rt, self.metrics, self.config.heartbeat_s, observer=self.dashboard)
        rt.on_pruned(self._pruned)  # before the index is built: a prune may end while it is
        await self.core.load_index()
        log.info("%d agents on disk", len(self.core.index))

    def _pruned(self, agent_ids: list[str]) -> None:
        for agent_id in agent_ids:  # conversations whose files the disk budget or TTL removed
            self.core.index.forget(agent_id)
            self.dashboard.deleted(agent_id)

    @property
    def model(self) -> str:
        return self.rt.model or "unknown"

    def model_for(self, requested: str | None, strict: bool = False) -> str:
        """The model a request runs on: the one it names, else the first. A server
        of one model runs it whatever a request names (clients send their own
        names: claude-..., gpt-...) unless ``strict`` (the agent API); with more,
        a name it does not serve is a 404."""
        served = self.rt.models
        if requested in served:
            return requested
        if requested is None or (len(served) == 1 and not strict):
            return served[0]
        raise turn_error(UnknownModel(requested, served))

    @property
    def max_tokens_cap(self) -> int:
        return self.config.max_tokens_cap or self.rt.context_length or 1

    # -- the chat routes -------------------------------------------------------------

    async def messages(self, request: Request) -> Response:
        return await self._chat(request, anthropic, "anthropic")

    async def completions(self, request: Request) -> Response:
        return await self._chat(request, openai, "openai")

    async def _chat(self, request: Request, protocol: ChatProtocol, route: str) -> Response:
        """A turn of a stateless chat protocol: ``protocol`` parses the body and
        answers the turn (``response_json``, or ``events`` when streaming)."""
        req = protocol.parse_request(await request.body(), _headers(request), max_tokens_cap=self.max_tokens_cap)
        turn = await self.core.start(req, self.model_for(req.model), route=route)
        return await _answer(request, turn, req.stream, protocol)

    # -- the Responses API: response ids name agent states (web.responses) ------------

    async def _history(self, state: responses.ResponseState, param: str | None = None):
        """The history of the agent that holds ``state`` (it may have gone on), else 404."""
        response = state.id
        try:
            found = await self.rt.agents(only=state.agent_id)
        except InvalidAgentId:
            found = []
        if not found or not state.matches(found[0].history):
            raise responses.not_found(response, param)
        return found[0]

    async def create_response(self, request: Request) -> Response:
        """A turn; with ``previous_response_id``, on that response's agent when it
        is still at that state, else on a fork of it from there."""
        req = responses.parse_request(await request.body(), _headers(request), max_tokens_cap=self.max_tokens_cap)
        model = self.model_for(req.model)
        if req.previous_response_id is None:
            turn = await self.core.start(req, model, route="responses")
        else:
            state = responses.parse_response_id(req.previous_response_id, "previous_response_id")
            info = await self._history(state, "previous_response_id")
            req = responses.continued(req, info.history[:state.n])
            # a turn running on the agent will move it on: a fork keeps both
            at_state = len(info.history) == state.n and not self.core.index.busy(state.agent_id)
            turn = await self.core.start(req, model, agent_id=state.agent_id if at_state else None,
                                         fork_from=None if at_state else state.agent_id, route="responses")
        return await _answer(request, turn, req.stream, responses)

    async def get_response(self, request: Request) -> Response:
        """The response rebuilt from its agent's history (usage unknown: null)."""
        response = request.path_params["response_id"]
        state = responses.parse_response_id(response)
        info = await self._history(state)
        body = responses.stored_json(state, info.history, model=self.model, created=int(info.last_use or 0),
                                     fmt=self.core.index.fmt)
        return JSONResponse(body, headers={"x-agent-id": state.agent_id})

    async def delete_response(self, request: Request) -> Response:
        """Deletes the response's agent -- the whole conversation, every response of it and its cache."""
        response = request.path_params["response_id"]
        state = responses.parse_response_id(response)
        await self._history(state)
        await self._delete(await self.rt.agent(state.agent_id))
        return JSONResponse(responses.deleted_json(response))

    async def count_tokens(self, request: Request) -> Response:
        req = anthropic.parse_count_tokens(await request.body())
        return JSONResponse({"input_tokens": await self.core.count_tokens(req, self.model_for(req.model))})

    # -- the agent API --------------------------------------------------------------

    async def _known(self, agent_id: str) -> Agent:
        """An existing agent, else 404 (the agent API never creates one implicitly)."""
        agent_id = checked_agent_id(agent_id, "agent id")
        if not await self.rt.agents(only=agent_id):
            raise RequestError(404, f"no agent {agent_id!r}; create it with POST /v1/agents")
        try:
            return await self.rt.agent(agent_id)
        except AgentGone as e:
            raise RequestError(404, str(e)) from None

    async def create_agent(self, request: Request) -> Response:
        new = agents.parse_new_agent(await request.body())
        agent_id = checked_agent_id(new.id, "id")
        if new.model is not None:
            self.model_for(new.model, strict=True)  # 404 for one this server does not run
        existed = bool(await self.rt.agents(only=agent_id))
        try:
            agent = await self.rt.agent(agent_id, system=new.system)
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        [info] = await self.rt.agents(only=agent.id)
        self.core.index.record(agent.id, agent.history)
        self.dashboard.changed(agent.id)
        return JSONResponse(agents.agent_json(info), status_code=200 if existed else 201)

    async def list_agents(self, request: Request) -> Response:
        return JSONResponse({"agents": [agents.agent_json(i) for i in await self.rt.agents()]})

    async def get_agent(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        [info] = await self.rt.agents(only=agent.id)
        return JSONResponse(agents.agent_json(info, history=True))

    async def delete_agent(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        await self._delete(agent)
        return JSONResponse({"id": agent.id, "deleted": True})

    async def _delete(self, agent: Agent) -> None:
        """Delete the agent (history and every cache file) and forget it; raises ``RequestError``."""
        try:
            await agent.delete()
        except SemanticError as e:
            raise turn_error(e) from None
        self.core.index.forget(agent.id)
        self.dashboard.deleted(agent.id)

    async def fork_agent(self, request: Request) -> Response:
        source = await self._known(request.path_params["agent_id"])
        target = checked_agent_id(agents.parse_fork(await request.body()), "id")
        try:
            forked = await source.fork(target)
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        except (TurnError, SemanticError) as e:
            raise turn_error(e) from None
        [info] = await self.rt.agents(only=forked.id)
        self.core.index.record(forked.id, forked.history)
        self.dashboard.changed(forked.id)
        return JSONResponse({**agents.agent_json(info), "forked_from": source.id}, status_code=201)

    async def demote_agent(self, request: Request) -> Response:
        """Move the agent's cache to disk (written first); 202: the tier changes once
        the GPU actor served it (a ``tier`` event on ``/v1/events``)."""
        agent = await self._known(request.path_params["agent_id"])
        try:
            await self.rt.demote(agent.id)
        except SemanticError as e:
            raise turn_error(e) from None
        self.dashboard.changed(agent.id)
        return JSONResponse({"id": agent.id, "demote": "requested"}, status_code=202)

    async def import_agent(self, request: Request) -> Response:
        """An agent from another server: the body is its archive (``semantic cache
        export``), received into a temp file outside the cache directory, then
        put in place by the persistence actor (checked whole first, within the
        disk budget); then indexed, so stateless clients find its conversation
        at once. Never replaces an agent."""
        agent_id = checked_agent_id(request.path_params["agent_id"], "agent id")
        await self._check_new(agent_id)  # before the upload: no need to wait for it to say no
        upload = await self._receive_archive(request)
        try:
            async with self.importing:
                await self._check_new(agent_id)
                summary = await self.rt.import_archive(upload, agent_id)
        except archive.ArchiveError as e:
            raise RequestError(400, str(e)) from None
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        except OSError as e:
            raise _disk_error(e) from None
        finally:
            upload.unlink(missing_ok=True)
        [info] = await self.rt.agents(only=agent_id)
        self.core.index.record(agent_id, info.history)
        self.dashboard.changed(agent_id)
        caches = [{"model": model, "tokens": tokens} for model, tokens in summary.caches]
        return JSONResponse({**agents.agent_json(info), "imported": {"caches": caches, "bytes": summary.bytes}},
                            status_code=201)

    async def _check_new(self, agent_id: str) -> None:
        """409 unless this server has nothing of ``agent_id``: no agent, no file."""
        if await self.rt.agents(only=agent_id):
            raise RequestError(409, f"agent {agent_id!r} exists on this server; delete it first to replace it")
        if archive.agent_files(self.rt.cache_dir, agent_id):  # a crash between a first cache and its history
            raise RequestError(409, f"this server holds cache files of {agent_id!r} but no history; remove them "
                                    f"first ('semantic cache rm {agent_id}', the server stopped)")

    async def _receive_archive(self, request: Request) -> Path:
        """The request's body, written to a temp file as it arrives (outside the
        cache directory, which holds only what the persistence actor puts there);
        each piece must come within the body timeout, and all of it within the
        disk budget."""
        timeout, budget = self.config.body_timeout_s, self.config.disk_budget
        folder = Path(tempfile.gettempdir())
        await anyio.to_thread.run_sync(archive.remove_abandoned, folder)  # uploads of a server that died
        path = folder / f"{archive.UPLOAD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.tar"
        too_big = RequestError(507, f"the archive is larger than this server's disk budget, "
                                    f"{human_bytes(budget or 0)}")
        size = request.headers.get("content-length", "")
        received = 0
        try:
            if size.isdigit():
                if budget is not None and int(size) > budget:
                    raise too_big
                check_room(folder, int(size))
            async with await anyio.open_file(path, "xb") as f:
                chunks = request.stream()
                while True:
                    with anyio.move_on_after(timeout) as timer:
                        chunk = await anext(chunks, None)
                    if timer.cancelled_caught:
                        raise RequestError(408, f"the archive stopped arriving for {timeout:g} s")
                    if chunk is None:
                        return path
                    received += len(chunk)
                    if budget is not None and received > budget:
                        raise too_big
                    await f.write(chunk)
        except BaseException as e:
            path.unlink(missing_ok=True)
            if isinstance(e, ClientDisconnect):
                raise RequestError(400, "the client went away before the whole archive arrived") from None
            if isinstance(e, OSError):
                raise _disk_error(e) from None
            raise

    async def agent_turn(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        turn_req = agents.parse_turn(await request.body(), max_tokens_cap=self.max_tokens_cap)
        turn = await self.core.send(agent, turn_req.content, model=self.model_for(turn_req.model, strict=True),
                                    use_cache=turn_req.use_cache, sampling=turn_req.sampling, route="agent")
        return await _answer(request, turn, turn_req.stream, agents)

    # -- operations -------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        """Every model requests may name, in OpenAI's and Anthropic's list shape at
        once; ``loaded``: the one in memory now (its ``context_length`` is known)."""
        created = int(self.started)
        loaded = self.model if self.rt.context_length else None
        data = [{"id": name, "object": "model", "created": created, "owned_by": "semantic",
                 "type": "model", "display_name": name,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                 "loaded": name == loaded, "context_length": self.rt.context_length if name == loaded else None}
                for name in self.rt.models]
        return JSONResponse({"object": "list", "data": data, "has_more": False,
                             "first_id": data[0]["id"], "last_id": data[-1]["id"]})

    async def health(self, request: Request) -> Response:
        rt = self.rt
        stats = rt.stats()
        memory, disk = await anyio.to_thread.run_sync(memory_and_disk, rt)
        body = {"status": "ok" if rt.healthy else "unhealthy", "ready": rt.healthy,
                "error": None if rt.error is None else str(rt.error), "model": rt.model,
                "context_length": rt.context_length, "row_counts": rt.row_counts,
                "speculation": rt.speculation, "memory": memory,
                "disk": {"bytes": memory["disk_bytes"], **disk},
                "queue_depth": stats.get("waiting", 0), "decoding": stats.get("decoding", 0),
                "agents": len(self.core.index)}
        return JSONResponse(body, status_code=200 if rt.healthy else 503)

    # -- the dashboard ------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        """The dashboard (static: it holds no data, so it loads without the key)."""
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})

    async def dashboard_state(self, request: Request) -> Response:
        return JSONResponse(await self.dashboard.snapshot())

    async def events(self, request: Request) -> Response:
        return EventStreamResponse(self.dashboard.stream(EVENTS_KEEP_ALIVE_S))

    async def metrics_text(self, request: Request) -> Response:
        memory, disk = await anyio.to_thread.run_sync(memory_and_disk, self.rt)
        return Response(self.metrics.render(self.rt.stats(), memory, disk), media_type=CONTENT_TYPE_LATEST)


def _disk_error(e: OSError) -> RequestError:
    """An archive that could not be written or unpacked: 507 when the disk is full."""
    if isinstance(e, NoRoom) or e.errno == errno.ENOSPC:
        return RequestError(507, f"no room for the archive: {e}")
    return RequestError(500, f"the archive could not be written here: {e}")


async def _answer(request: Request, turn: ChatTurn, stream: bool, protocol: Answers) -> Response:
    """The turn's answer in ``protocol``'s shape: its events, or its JSON once the turn ended."""
    headers = {"x-agent-id": turn.agent_id}
    if stream:
        return EventStreamResponse(_primed(turn, protocol.events), headers=headers, error_body=protocol.error_json)
    try:
        return JSONResponse(protocol.response_json(turn, await _final(turn.items)), headers=headers)
    except RequestError as err:
        return _error(request.url.path, err, headers)


class _Peeked:
    """An async iterator that yields ``head`` and then the rest of ``items``."""

    def __init__(self, head: StreamItem, items: AsyncIterator[StreamItem]):
        self.head = head
        self._items = items
        self._first = True

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamItem:
        if self._first:
            self._first = False
            return self.head
        return await self._items.__anext__()

    async def aclose(self) -> None:
        await self._items.aclose()


async def _primed(turn: ChatTurn, events) -> AsyncIterator[bytes]:
    """``events(turn, items)`` once the turn has produced its first item (a
    heartbeat at the latest), so that a turn refused at the start raises its
    ``RequestError`` before any byte."""
    async with closing(turn.items) as items:
        head = await items.__anext__()
        async with closing(events(turn, _Peeked(head, items))) as chunks:
            async for chunk in chunks:
                yield chunk


async def _final(items: AsyncIterator[StreamItem]) -> ChatResult:
    async with closing(items) as stream:
        async for item in stream:
            if isinstance(item, ChatResult):
                return item
    raise AssertionError("a turn's items ended without a result")


class _Guard:
    """In front of every route: the API key, the body size limit, and how long
    a client may take to send its body. The body is read here whole and
    replayed to the route (but an import's, which the route streams to disk).
    An answer that starts before the whole body has arrived (a refusal before
    the upload) first reads the rest and drops it, up to twice the body limit
    and within the body timeout, so the connection stays usable; past that it
    closes the connection (``Connection: close``)."""

    def __init__(self, app: ASGIApp, config: ServerConfig):
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        receive, send = self._draining(scope, headers, receive, send)
        path = scope["path"]
        streamed = scope["method"] == "POST" and _IMPORT_PATH.fullmatch(path)  # the route reads it, to disk
        try:
            self._authorize(path, headers)
            body = b"" if streamed else await self._body(headers, receive)
        except RequestError as err:
            return await _error(path, err)(scope, receive, send)
        if streamed:
            return await self.app(scope, receive, send)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def _draining(self, scope: Scope, headers: dict, receive: Receive, send: Send) -> tuple[Receive, Send]:
        """``receive`` and a ``send`` that, on a response begun while the request's
        body is still coming, drain the body first or close (HTTP/1: an HTTP/2
        stream ends on its own)."""
        length = headers.get(b"content-length", b"0")
        pending = (length.isdigit() and int(length) > 0) or b"transfer-encoding" in headers
        if not pending or not scope.get("http_version", "1.1").startswith("1"):
            return receive, send

        async def receiving() -> Message:
            nonlocal pending
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                pending = False
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and pending:
                size, limit = 0, 2 * self.config.max_body_bytes
                with anyio.move_on_after(self.config.body_timeout_s):
                    while pending and size <= limit:
                        size += len((await receiving()).get("body", b""))
                if pending:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        return receiving, sending

    def _authorize(self, path: str, headers: dict) -> None:
        key = self.config.api_key
        if key is None or path in _OPEN_PATHS or path.startswith(STATIC_PREFIX + "/"):
            return
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = given or auth[7:].strip()
        if not secrets.compare_digest(given, key.encode()):
            raise RequestError(401, "invalid or missing API key: send it as 'x-api-key' or 'Authorization: Bearer'")

    async def _body(self, headers: dict, receive: Receive) -> bytes:
        limit = self.config.max_body_bytes
        too_big = RequestError(413, f"request body is over this server's limit of {limit} bytes")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        with anyio.move_on_after(self.config.body_timeout_s) as timer:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    break
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > limit:
                    chunks = None  # over: read on (up to twice the limit) so the client can read our 413
                    if size > 2 * limit:
                        break
                elif chunks is not None:
                    chunks.append(chunk)
                if not message.get("more_body", False):
                    break
        if chunks is None:
            raise too_big
        if timer.cancelled_caught:
            raise RequestError(408, f"the request body did not arrive within {self.config.body_timeout_s:g} s")
        return b"".join(chunks)
