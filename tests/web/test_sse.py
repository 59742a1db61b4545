"""SSE encoding, and an event stream that a disconnect cancels wherever its body waits."""

from __future__ import annotations

import anyio
import httpx
import pytest
from starlette.applications import Starlette
from starlette.routing import Route

from semantic.web.sse import EventStreamResponse, encode

from .canned import serve
from .sse_util import parse_sse

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]


def test_encode():
    assert encode({"type": "ping"}, "ping") == b'event: ping\ndata: {"type":"ping"}\n\n'
    assert encode({"t": "é\n"}) == 'data: {"t":"é\\n"}\n\n'.encode()
    assert encode("[DONE]") == b"data: [DONE]\n\n"
    assert encode("two\nlines", "x") == b"event: x\ndata: two\ndata: lines\n\n"
    assert parse_sse(encode({"a": 1}, "e") + encode("[DONE]")) == [("e", {"a": 1}), (None, "[DONE]")]


class FakeClient:
    """The ASGI side of a client: records what is sent; disconnects once
    ``disconnect_after`` body chunks have arrived (never, if None); a send
    of chunk number ``block_at`` never returns (a client that stopped reading)."""

    def __init__(self, disconnect_after: int | None = None, block_at: int | None = None):
        self.sent: list[dict] = []
        self.disconnect_after = disconnect_after
        self.block_at = block_at
        self._chunks = 0
        self._disconnect = anyio.Event()

    async def receive(self) -> dict:
        await self._disconnect.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.body" and message["more_body"]:
            if self._chunks == self.block_at:
                await anyio.sleep_forever()
            self._chunks += 1
        self.sent.append(message)
        if self._chunks == self.disconnect_after:
            self._disconnect.set()

    @property
    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


SCOPE = {"type": "http", "asgi": {"spec_version": "2.4"}}


async def test_a_finished_body_ends_the_response_and_stops_listening():
    client = FakeClient()

    async def body():
        yield b"a"
        yield b"b"

    await EventStreamResponse(body(), headers={"x-agent-id": "a1"})(SCOPE, client.receive, client.send)
    start = client.sent[0]
    assert start["status"] == 200
    assert dict(start["headers"]) == {b"content-type": b"text/event-stream; charset=utf-8",
                                      b"cache-control": b"no-cache", b"x-accel-buffering": b"no",
                                      b"x-agent-id": b"a1"}
    assert client.bodies == [b"a", b"b", b""]
    assert client.sent[-1]["more_body"] is False


async def test_a_disconnect_cancels_a_body_waiting_for_its_next_event():
    client = FakeClient(disconnect_after=1)
    closed = anyio.Event()

    async def body():
        try:
            yield b"a"
            await anyio.sleep_forever()  # a long prefill, say
        finally:
            closed.set()

    await EventStreamResponse(body())(SCOPE, client.receive, client.send)
    assert closed.is_set()
    assert client.bodies == [b"a"], "no end of body after a disconnect"


async def test_a_disconnect_closes_a_body_suspended_at_yield():
    client = FakeClient(disconnect_after=1, block_at=1)
    closed = anyio.Event()

    async def body():
        try:
            while True:
                yield b"x"
        finally:
            closed.set()

    await EventStreamResponse(body())(SCOPE, client.receive, client.send)
    assert closed.is_set(), "the generator was closed, not left to the GC"


async def test_any_async_iterable_may_be_the_body():
    class Events:
        def __aiter__(self):
            return self._gen()

        async def _gen(self):
            yield b"only"

    client = FakeClient()
    await EventStreamResponse(Events())(SCOPE, client.receive, client.send)
    assert client.bodies == [b"only", b""]


async def test_a_client_hanging_up_over_tcp_cancels_the_body():
    pytest.importorskip("hypercorn")
    closed = anyio.Event()
    started = anyio.Event()

    async def body():
        try:
            yield encode({"type": "ping"}, "ping")
            started.set()
            await anyio.sleep_forever()
        finally:
            closed.set()

    async def endpoint(request):
        return EventStreamResponse(body())

    app = Starlette(routes=[Route("/events", endpoint)])
    with anyio.fail_after(20):
        async with serve(app) as url, httpx.AsyncClient(base_url=url) as http:
            async with http.stream("GET", "/events") as response:
                assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
                async for line in response.aiter_lines():
                    assert line == "event: ping"
                    break
                await started.wait()
            await closed.wait()  # the server saw the hang-up and cancelled the body


async def test_a_body_that_fails_raises_its_own_exception():
    async def body():
        yield b"a"
        raise KeyError("bug")

    client = FakeClient()
    with pytest.raises(KeyError, match="bug"):
        await EventStreamResponse(body())(SCOPE, client.receive, client.send)
