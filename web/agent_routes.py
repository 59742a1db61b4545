"""The agent API (``/v1/agents``): agents created, read, forked, demoted,
imported and deleted by id, and their turns. It never creates an agent
implicitly: an unknown id is a 404."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator

import anyio
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from semantic.actors import Agent, AgentExists, AgentGone, ArchiveError, NoRoom, SemanticError, TurnError

from . import agents
from .answer import answer
from .chat import checked_agent_id, turn_error
from .schema import RequestError
from .state import Routes

__all__ = ["AgentRoutes", "IMPORT_PATH"]

IMPORT_PATH = r"/v1/agents/[^/]+/import"  # reads its own body: an archive may be any size


class AgentRoutes(Routes):
    protocols = (agents.PROTOCOL,)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/agents", self.create_agent, methods=["POST"]),
            Route("/v1/agents", self.list_agents, methods=["GET"]),
            Route("/v1/agents/{agent_id:path}/messages", self.agent_turn, methods=["POST"]),
            Route("/v1/agents/{agent_id:path}/fork", self.fork_agent, methods=["POST"]),
            Route("/v1/agents/{agent_id:path}/demote", self.demote_agent, methods=["POST"]),
            Route("/v1/agents/{agent_id:path}/import", self.import_agent, methods=["POST"]),
            Route("/v1/agents/{agent_id:path}", self.get_agent, methods=["GET"]),
            Route("/v1/agents/{agent_id:path}", self.delete_agent, methods=["DELETE"]),
        ]

    async def _known(self, agent_id: str) -> Agent:
        """An existing agent, else 404 (the agent API never creates one implicitly)."""
        agent_id = checked_agent_id(agent_id, "agent id")
        if not await self.server.rt.agents(only=agent_id):
            raise RequestError(404, f"no agent {agent_id!r}; create it with POST /v1/agents")
        try:
            return await self.server.rt.agent(agent_id)
        except AgentGone as e:
            raise RequestError(404, str(e)) from None

    async def create_agent(self, request: Request) -> Response:
        new = agents.parse_new_agent(await request.body())
        agent_id = checked_agent_id(new.id, "id")
        if new.model is not None:
            self.server.model_for(new.model, strict=True)  # 404 for one this server does not run
        existed = bool(await self.server.rt.agents(only=agent_id))
        try:
            agent = await self.server.rt.agent(agent_id, system=new.system)
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        [info] = await self.server.rt.agents(only=agent.id)
        self.server.core.index.record(agent.id, agent.history)
        self.server.dashboard.changed(agent.id)
        return JSONResponse(agents.agent_json(info), status_code=200 if existed else 201)

    async def list_agents(self, request: Request) -> Response:
        return JSONResponse({"agents": [agents.agent_json(i) for i in await self.server.rt.agents()]})

    async def get_agent(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        [info] = await self.server.rt.agents(only=agent.id)
        return JSONResponse(agents.agent_json(info, history=True))

    async def delete_agent(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        await self.server.delete(agent)
        return JSONResponse({"id": agent.id, "deleted": True})

    async def fork_agent(self, request: Request) -> Response:
        source = await self._known(request.path_params["agent_id"])
        target = checked_agent_id(agents.parse_fork(await request.body()), "id")
        try:
            forked = await source.fork(target)
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        except (TurnError, SemanticError) as e:
            raise turn_error(e) from None
        [info] = await self.server.rt.agents(only=forked.id)
        self.server.core.index.record(forked.id, forked.history)
        self.server.dashboard.changed(forked.id)
        return JSONResponse({**agents.agent_json(info), "forked_from": source.id}, status_code=201)

    async def demote_agent(self, request: Request) -> Response:
        """Move the agent's cache to disk (written first); 202: the tier changes once
        the GPU actor served it (a ``tier`` event on ``/v1/events``)."""
        agent = await self._known(request.path_params["agent_id"])
        try:
            await self.server.rt.demote(agent.id)
        except SemanticError as e:
            raise turn_error(e) from None
        self.server.dashboard.changed(agent.id)
        return JSONResponse({"id": agent.id, "demote": "requested"}, status_code=202)

    async def import_agent(self, request: Request) -> Response:
        """An agent from another server: the body is its archive (``semantic cache
        export``), which the runtime receives and puts in place (checked whole
        first, within the disk budget); then indexed, so stateless clients find
        its conversation at once. Never replaces an agent."""
        agent_id = checked_agent_id(request.path_params["agent_id"], "agent id")
        size = request.headers.get("content-length", "")
        try:
            summary = await self.server.rt.import_archive(self._body(request), agent_id,
                                                   size=int(size) if size.isdigit() else None)
        except ArchiveError as e:
            raise RequestError(400, str(e)) from None
        except AgentExists as e:
            raise RequestError(409, str(e)) from None
        except ClientDisconnect:
            raise RequestError(400, "the client went away before the whole archive arrived") from None
        except OSError as e:
            raise _disk_error(e) from None
        [info] = await self.server.rt.agents(only=agent_id)
        self.server.core.index.record(agent_id, info.history)
        self.server.dashboard.changed(agent_id)
        caches = [{"model": model, "tokens": tokens} for model, tokens in summary.caches]
        return JSONResponse({**agents.agent_json(info), "imported": {"caches": caches, "bytes": summary.bytes}},
                            status_code=201)

    async def _body(self, request: Request) -> AsyncIterator[bytes]:
        """The request's body as it arrives; each piece must come within the body timeout."""
        timeout = self.server.config.body_timeout_s
        chunks = request.stream()
        while True:
            with anyio.move_on_after(timeout) as timer:
                chunk = await anext(chunks, None)
            if timer.cancelled_caught:
                raise RequestError(408, f"the archive stopped arriving for {timeout:g} s")
            if chunk is None:
                return
            yield chunk

    async def agent_turn(self, request: Request) -> Response:
        agent = await self._known(request.path_params["agent_id"])
        turn_req = agents.parse_turn(await request.body(), max_tokens_cap=self.server.max_tokens_cap)
        model = self.server.model_for(turn_req.model, strict=True)
        turn = await self.server.core.send(agent, turn_req.content, model=model,
                                           use_cache=turn_req.use_cache, sampling=turn_req.sampling,
                                           route=agents.PROTOCOL.name)
        return await answer(request, turn, turn_req.stream, agents.PROTOCOL)


def _disk_error(e: OSError) -> RequestError:
    """An archive that could not be written or unpacked: 507 when the disk is full."""
    if isinstance(e, NoRoom) or e.errno == errno.ENOSPC:
        return RequestError(507, f"no room for the archive: {e}")
    return RequestError(500, f"the archive could not be written here: {e}")
