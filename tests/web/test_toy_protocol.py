"""A whole protocol in one test module: "plain", a chat of plain text, added to
a real app on a tiny random-weight model with no change to ``web/``. What
``CONTRIBUTING.md`` ("A protocol") says a new one is -- its declaration
(``web.protocols``) and its routes (a ``Routes`` family) -- is all it takes:
its turns run, streamed and not, and its refusals (the route's, the turn's,
the guard's) come in its own error shape.

The protocol: ``POST /v1/plain`` takes ``{"agent", "text", "stream"?}`` and
answers ``{"agent", "text", "stop"}``, or streams each piece of the reply as
an SSE ``data`` line and then an ``end`` event; an error is
``{"problem": {"status", "says"}}``."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator

import httpx
import pytest
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from semantic.actors import Delta
from semantic.web.answer import answer
from semantic.web.app import FAMILIES, ServerConfig, create_app
from semantic.web.chat import Answers, ChatTurn
from semantic.web.protocols import Protocols, ProtocolSpec
from semantic.web.schema import ChatRequest, ChatResult, Heartbeat, RequestError, StreamItem
from semantic.web.sse import KEEP_ALIVE, encode
from semantic.web.state import Routes

from .live import CONTEXT, tiny_loaded
from .sse_util import parse_sse

pytestmark = pytest.mark.anyio

KEY = "toy-key"
MAX_TOKENS = 8

# -- the protocol: its module ------------------------------------------------------------


def parse_request(body: bytes) -> ChatRequest:
    """The ``ChatRequest`` in a ``/v1/plain`` body."""
    try:
        data = json.loads(body)
    except ValueError:
        raise RequestError(400, "the body is not JSON") from None
    if not isinstance(data, dict) or not isinstance(data.get("text"), str) or not isinstance(data.get("agent"), str):
        raise RequestError(400, "the body must be {\"agent\": a string, \"text\": a string}")
    return ChatRequest(messages=({"role": "user", "content": data["text"]},), max_tokens=MAX_TOKENS,
                       agent_id=data["agent"], stream=data.get("stream") is True)


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    return {"agent": turn.agent_id, "text": result.text, "stop": result.stop_reason}


async def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    async for item in items:
        if isinstance(item, Heartbeat):
            yield KEEP_ALIVE
        elif isinstance(item, Delta):
            yield encode(json.dumps(item.text))  # one line, whatever the text holds
        elif isinstance(item, ChatResult):
            yield encode(response_json(turn, item), "end")


def error_json(err: RequestError) -> dict:
    return {"problem": {"status": err.status, "says": err.message}}


PROTOCOL = ProtocolSpec("plain", ("/v1/plain",), response_json, events, error_json)

# -- the protocol: its route -------------------------------------------------------------


class PlainRoutes(Routes):
    protocols = (PROTOCOL,)

    def routes(self) -> list[Route]:
        return [Route("/v1/plain", self.turn, methods=["POST"])]

    async def turn(self, request: Request) -> Response:
        req = parse_request(await request.body())
        turn = await self.server.core.start(req, self.server.model_for(None), route=PROTOCOL.name)
        return await answer(request, turn, req.stream, PROTOCOL)


# -- the tests ----------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()  # load once, outside any test's timing


def test_each_path_is_refused_in_its_protocols_shape():
    from semantic.web import agents, anthropic, completions, openai, responses

    protocols = Protocols(spec for family in FAMILIES for spec in family.protocols)
    for module in (agents, anthropic, completions, openai, responses):
        assert isinstance(module.PROTOCOL, Answers) and module.PROTOCOL.error_json is module.error_json
    shapes = {"/v1/messages": anthropic, "/v1/messages/count_tokens": anthropic, "/v1/chat/completions": openai,
              "/v1/completions": openai, "/v1/responses": responses, "/v1/responses/resp_a_2_x": responses,
              "/v1/agents": agents, "/v1/agents/a/fork": agents, "/v1/models": anthropic, "/health": anthropic,
              "/v1/nothing-here": anthropic}
    assert {path: protocols.for_path(path).error_json for path in shapes} == \
        {path: module.error_json for path, module in shapes.items()}


def test_the_declaration_is_what_the_core_asks_for():
    assert isinstance(PROTOCOL, Answers)  # a route answers a turn with it
    protocols = Protocols(spec for family in (*FAMILIES, PlainRoutes) for spec in family.protocols)
    assert protocols.for_path("/v1/plain").name == "plain"
    assert protocols.for_path("/v1/plainly").name == "anthropic"  # a prefix is whole segments
    with pytest.raises(ValueError, match="'plain' and 'again' both claim '/v1/plain'"):
        Protocols([PROTOCOL, ProtocolSpec("again", ("/v1/plain/",), response_json, events, error_json)])
    with pytest.raises(ValueError, match="claim '/'"):
        Protocols([PROTOCOL])


async def test_a_protocol_is_its_module_and_its_route(tmp_path):
    config = ServerConfig(model=tiny_loaded(), cache_dir=tmp_path, budget=256 << 20, api_key=KEY)
    app = create_app(config, families=(*FAMILIES, PlainRoutes))
    transport = httpx.ASGITransport(app=app)
    async with app.router.lifespan_context(app), \
            httpx.AsyncClient(transport=transport, base_url="http://toy", headers={"x-api-key": KEY}) as http:
        # a turn, whole
        r = await http.post("/v1/plain", json={"agent": "toy-a", "text": "Hello there"})
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["agent"] == r.headers["x-agent-id"] == "toy-a" and whole["stop"] in ("stop", "length")
        # a turn, streamed: the same reply (greedy, the same prompt), piece by piece
        r = await http.post("/v1/plain", json={"agent": "toy-b", "text": "Hello there", "stream": True})
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
        got = parse_sse(r.content)
        *pieces, (name, end) = got
        assert name == "end" and end == {**whole, "agent": "toy-b"}
        assert all(name is None for name, _ in pieces) and "".join(p for _, p in pieces) == whole["text"]
        # the core saw the protocol's name
        routes = {t["agent"]: t["route"] for t in app.state.server.hub.turns}
        assert routes == {"toy-a": "plain", "toy-b": "plain"}

        # refusals, each in the toy's shape: the route's (a malformed body) ...
        for body in (b"{nope", b'{"agent": "toy-a"}', b"[]"):
            r = await http.post("/v1/plain", content=body)
            assert r.status_code == 400 and set(r.json()) == {"problem"}, r.text
            assert r.json()["problem"]["status"] == 400
        # ... the turn's (a prompt over the context), streamed or not ...
        for stream in (False, True):
            r = await http.post("/v1/plain", json={"agent": "toy-c", "text": "word " * (CONTEXT + 100),
                                                   "stream": stream})
            assert r.status_code == 400, r.text
            assert f"{CONTEXT}-token context" in r.json()["problem"]["says"]
        # ... and the guard's (no key)
        r = await http.post("/v1/plain", json={"agent": "toy-a", "text": "Hi"}, headers={"x-api-key": ""})
        assert r.status_code == 401 and r.json()["problem"]["status"] == 401
        # while the other protocols keep theirs
        r = await http.post("/v1/chat/completions", content=b"{nope")
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        r = await http.post("/v1/messages", content=b"{nope")
        assert r.status_code == 400 and r.json()["type"] == "error"
