"""The stateless chat routes: Anthropic's Messages (and its token count),
OpenAI's Chat Completions, Responses and legacy (raw-text) Completions. Each
parses its body with its protocol module, starts one turn on the chat core
and answers it in that protocol's shape; a Responses id names an agent's
state (``web.response_ids``)."""

from __future__ import annotations

from collections.abc import Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from semantic.actors import InvalidAgentId

from . import anthropic, completions, openai, responses
from .answer import answer
from .protocols import ProtocolSpec
from .schema import ChatRequest
from .state import Routes

__all__ = ["ChatRoutes"]


class ChatRoutes(Routes):
    protocols = (anthropic.PROTOCOL, openai.PROTOCOL, completions.PROTOCOL, responses.PROTOCOL)

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/chat/completions", self.completions, methods=["POST"]),
            Route("/v1/completions", self.text_completions, methods=["POST"]),
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
        ]

    async def messages(self, request: Request) -> Response:
        return await self._chat(request, anthropic.parse_request, anthropic.PROTOCOL)

    async def completions(self, request: Request) -> Response:
        return await self._chat(request, openai.parse_request, openai.PROTOCOL)

    async def text_completions(self, request: Request) -> Response:
        """OpenAI's legacy completions: raw text continued, no chat template (``web.completions``)."""
        req = completions.parse_request(await request.body(), _headers(request),
                                        max_tokens_cap=self.server.max_tokens_cap)
        turn = await self.server.core.complete(req, self.server.model_for(req.model), route=completions.PROTOCOL.name)
        return await answer(request, turn, req.stream, completions.PROTOCOL)

    async def _chat(self, request: Request, parse: Callable[..., ChatRequest], protocol: ProtocolSpec) -> Response:
        """A turn of a stateless chat protocol: ``parse`` (its ``parse_request``)
        reads the body and ``protocol`` answers the turn (``response_json``, or
        ``events`` when streaming)."""
        req = parse(await request.body(), _headers(request), max_tokens_cap=self.server.max_tokens_cap)
        turn = await self.server.core.start(req, self.server.model_for(req.model), route=protocol.name)
        return await answer(request, turn, req.stream, protocol)

    # -- the Responses API: response ids name agent states (web.response_ids) ---------

    async def _history(self, state: responses.ResponseState, param: str | None = None):
        """The history of the agent that holds ``state`` (it may have gone on), else 404."""
        response = state.id
        try:
            found = await self.server.rt.agents(only=state.agent_id)
        except InvalidAgentId:
            found = []
        if not found or not state.matches(found[0].history):
            raise responses.not_found(response, param)
        return found[0]

    async def create_response(self, request: Request) -> Response:
        """A turn; with ``previous_response_id``, on that response's agent when it
        is still at that state, else on a fork of it from there."""
        req = responses.parse_request(await request.body(), _headers(request),
                                      max_tokens_cap=self.server.max_tokens_cap)
        model = self.server.model_for(req.model)
        if req.previous_response_id is None:
            turn = await self.server.core.start(req, model, route=responses.PROTOCOL.name)
        else:
            state = responses.parse_response_id(req.previous_response_id, "previous_response_id")
            info = await self._history(state, "previous_response_id")
            req = responses.continued(req, info.history[:state.n])
            # a turn running on the agent will move it on: a fork keeps both
            at_state = len(info.history) == state.n and not self.server.core.index.busy(state.agent_id)
            turn = await self.server.core.start(req, model, agent_id=state.agent_id if at_state else None,
                                                fork_from=None if at_state else state.agent_id,
                                                route=responses.PROTOCOL.name)
        return await answer(request, turn, req.stream, responses.PROTOCOL)

    async def get_response(self, request: Request) -> Response:
        """The response rebuilt from its agent's history (usage unknown: null)."""
        response = request.path_params["response_id"]
        state = responses.parse_response_id(response)
        info = await self._history(state)
        body = responses.stored_json(state, info.history, model=self.server.model, created=int(info.last_use or 0),
                                     fmt=self.server.core.index.fmt)
        return JSONResponse(body, headers={"x-agent-id": state.agent_id})

    async def delete_response(self, request: Request) -> Response:
        """Deletes the response's agent -- the whole conversation, every response of it and its cache."""
        response = request.path_params["response_id"]
        state = responses.parse_response_id(response)
        await self._history(state)
        await self.server.delete(await self.server.rt.agent(state.agent_id))
        return JSONResponse(responses.deleted_json(response))

    async def count_tokens(self, request: Request) -> Response:
        req = anthropic.parse_count_tokens(await request.body())
        tokens = await self.server.core.count_tokens(req, self.server.model_for(req.model))
        return JSONResponse({"input_tokens": tokens})


def _headers(request: Request) -> dict[str, str]:
    return {k.lower(): v for k, v in request.headers.items()}
