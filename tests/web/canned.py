"""A tiny app that answers both APIs with a canned reply, wired from the web
protocol modules the way the real routes will be (parse, run, stream or not,
errors), and a loopback server to drive it with the official SDKs."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import anyio
import anyio.lowlevel
import sniffio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from semantic.actors import Delta
from semantic.web import anthropic, openai
from semantic.web.schema import ChatRequest, ChatResult, RequestError, StreamItem, Usage
from semantic.web.sse import EventStreamResponse
from semantic.web.tools import ToolCallFilter, ToolFormat, finish_result

LIMIT = 4096  # the server's max_tokens limit
MODEL = "canned-model"


@dataclass
class Canned:
    """What the fake engine generates: raw text in the pieces it streams them."""

    pieces: list[str]
    stop_reason: str = "stop"
    stop_sequence: str | None = None
    usage: Usage = Usage(input_tokens=12, cache_read_input_tokens=30, output_tokens=5)
    tool_format: ToolFormat | None = None
    fail_after: int | None = None  # raise a RequestError after this many pieces
    seen: list[ChatRequest] = field(default_factory=list)  # requests as parsed

    async def items(self) -> AsyncIterator[StreamItem]:
        for i, piece in enumerate(self.pieces):
            if i == self.fail_after:
                raise RequestError(500, "the engine failed mid-turn")
            await anyio.lowlevel.checkpoint()
            yield Delta(piece)
        yield ChatResult("".join(self.pieces), self.stop_reason, self.usage, self.stop_sequence)


async def _final(items: AsyncIterator[StreamItem]) -> ChatResult:
    async for item in items:
        if isinstance(item, ChatResult):
            return item
    raise AssertionError("no result")


async def split_tool_calls(items: AsyncIterator[StreamItem], fmt: ToolFormat | None,
                           tool_names) -> AsyncIterator[StreamItem]:
    """``items`` with calls held out of the text and parsed into the result (as ``web.chat`` does)."""
    hold = ToolCallFilter(fmt) if fmt else None
    async for item in items:
        if isinstance(item, Delta) and hold is not None:
            if text := hold.feed(item.text):
                yield Delta(text)
        elif isinstance(item, ChatResult):
            yield finish_result(item, fmt, tool_names)
        else:
            yield item


def canned_app(canned: Canned) -> Starlette:
    def route(protocol):
        async def endpoint(request: Request):
            try:
                req = protocol.parse_request(await request.body(), {k.lower(): v for k, v in request.headers.items()},
                                             max_tokens_cap=LIMIT)
                canned.seen.append(req)
                fmt = canned.tool_format if req.tools else None
                items = split_tool_calls(canned.items(), fmt, req.tool_names)
                if req.stream:
                    if protocol is anthropic:
                        body = anthropic.message_events(items, model=MODEL)
                    else:
                        body = openai.completion_chunks(items, model=MODEL, include_usage=req.include_usage)
                    return EventStreamResponse(body)
                result = finish_result(await _final(items), fmt, req.tool_names)
                build = anthropic.message_json if protocol is anthropic else openai.completion_json
                return JSONResponse(build(result, model=MODEL))
            except RequestError as err:
                return JSONResponse(protocol.error_json(err), status_code=err.status)

        return endpoint

    return Starlette(routes=[
        Route("/v1/messages", route(anthropic), methods=["POST"]),
        Route("/v1/chat/completions", route(openai), methods=["POST"]),
    ])


@asynccontextmanager
async def serve(app) -> AsyncIterator[str]:
    """Serve ``app`` with hypercorn on a free loopback port for the duration;
    yields its base URL. The socket listens before the server starts, so
    clients may connect at once (no waiting for readiness)."""
    from hypercorn.config import Config

    if sniffio.current_async_library() == "trio":
        from hypercorn.trio import serve as run
    else:
        from hypercorn.asyncio import serve as run
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    config = Config()
    config.bind = [f"fd://{sock.detach()}"]
    config.graceful_timeout = 1
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: run(app, config, shutdown_trigger=stop.wait))
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()
