"""Server-sent events: encoding one event, and an ASGI response that streams
them and stops the work as soon as the client goes away.

An event is ``event:`` and ``data:`` lines and a blank line:

    event: content_block_delta
    data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"Hi"}}

Starlette's ``StreamingResponse`` listens for the client's disconnect only
on servers older than ASGI 2.4 and otherwise notices it at the next send,
which during a long prefill may be a minute away. ``EventStreamResponse``
always runs the body and a disconnect listener in one task group, so a
disconnect cancels the body wherever it waits. It sends the response head
with the body's first event, so a request the body refuses before that (a
``RequestError``) can still get a plain HTTP error with its status.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, Callable, Mapping

from starlette.types import Receive, Scope, Send

from ._aio import closing, collapsing_task_group
from .schema import RequestError

__all__ = ["EventStreamResponse", "KEEP_ALIVE", "encode"]

KEEP_ALIVE = b": keep-alive\n\n"  # an SSE comment: clients skip it, idle timeouts see bytes

_HEADERS = {
    "cache-control": "no-cache",
    "x-accel-buffering": "no",  # tell nginx-style proxies not to buffer the stream
}


def encode(data: Mapping | str, event: str | None = None) -> bytes:
    """One SSE event: ``data`` as compact JSON (or a string as it is, one
    ``data:`` line per line), after an ``event:`` line when ``event`` is given."""
    if isinstance(data, str):
        lines = data.split("\n")
    else:
        lines = [json.dumps(data, ensure_ascii=False, separators=(",", ":"))]
    head = f"event: {event}\n" if event is not None else ""
    return (head + "".join(f"data: {line}\n" for line in lines) + "\n").encode()


class EventStreamResponse:
    """An ASGI response streaming ``body`` (encoded events) as ``text/event-stream``.

    The body runs in a task group beside a listener for ``http.disconnect``:
    when the client disconnects, the body is cancelled where it waits and, if
    it is an async generator, closed before this returns (its ``finally``
    blocks run, so it can give its turn back). The body's own exceptions
    propagate (the protocol streams turn failures into error events first),
    except a ``RequestError`` raised before the first event when
    ``error_body`` is given: that is answered as JSON ``error_body(err)``
    with the error's status instead of a stream.
    """

    media_type = "text/event-stream; charset=utf-8"

    def __init__(self, body: AsyncIterable[bytes], status_code: int = 200,
                 headers: Mapping[str, str] | None = None,
                 error_body: Callable[[RequestError], dict] | None = None):
        self.body = body
        self.status_code = status_code
        self.headers = {**_HEADERS, **(headers or {}), "content-type": self.media_type}
        self.error_body = error_body

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert scope["type"] == "http", "an event stream answers HTTP requests only"
        async with collapsing_task_group() as tg:

            async def listen() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(listen)
            await self._stream(send)
            tg.cancel_scope.cancel()  # the body is done: stop listening

    async def _stream(self, send: Send) -> None:
        started = False

        async def start(status: int, headers: Mapping[str, str]) -> None:
            nonlocal started
            started = True
            raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]
            await send({"type": "http.response.start", "status": status, "headers": raw})

        try:
            async with closing(self.body) as chunks:
                async for chunk in chunks:
                    if not started:
                        await start(self.status_code, self.headers)
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except RequestError as err:
            if started or self.error_body is None:
                raise
            body = json.dumps(self.error_body(err), ensure_ascii=False).encode()
            keep = {k: v for k, v in self.headers.items() if k not in _HEADERS and k != "content-type"}
            await start(err.status, {**keep, "content-type": "application/json"})
            await send({"type": "http.response.body", "body": body, "more_body": False})
            return
        if not started:
            await start(self.status_code, self.headers)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

