"""The guard in front of every route: the API key, the body size limit, and
how long a client may take to send its body."""

from __future__ import annotations

import re
import secrets

import anyio
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .answer import error_response
from .protocols import Protocols
from .schema import RequestError

__all__ = ["Guard"]


class Guard:
    """In front of every route: the API key, the body size limit, and how long
    a client may take to send its body. The body is read here whole and
    replayed to the route (but an import's, which the route streams to disk).
    An answer that starts before the whole body has arrived (a refusal before
    the upload) first reads the rest and drops it, up to twice the body limit
    and within the body timeout, so the connection stays usable; past that it
    closes the connection (``Connection: close``). A body declared larger
    than that (``Content-Length``) is not waited for: the answer goes out at
    once, and the connection closes (hypercorn closes a connection whose
    request is still coming once its response has gone). A refusal here is in
    the error shape of the protocol its path belongs to (``protocols``)."""

    def __init__(self, app: ASGIApp, *, api_key: str | None, max_body_bytes: int, body_timeout_s: float,
                 open_paths: tuple[str, ...], open_prefix: str, streamed_path: str, protocols: Protocols):
        self.app = app
        self.protocols = protocols  # whose error shape a path's refusals take
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self.open_paths = open_paths  # no key needed there
        self.open_prefix = open_prefix  # nor under it
        self.streamed_path = re.compile(streamed_path)  # POSTs whose route reads the body itself

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = {k.lower(): v for k, v in scope["headers"]}
        receive, send = self._draining(scope, headers, receive, send)
        path = scope["path"]
        streamed = scope["method"] == "POST" and self.streamed_path.fullmatch(path)  # the route reads it, to disk
        try:
            self._authorize(path, headers)
            body = b"" if streamed else await self._body(headers, receive)
        except RequestError as err:
            return await error_response(err, self.protocols.for_path(path).error_json)(scope, receive, send)
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
        stream ends on its own); at once where the body declared is more than
        would be drained."""
        length = headers.get(b"content-length", b"0")
        declared = int(length) if length.isdigit() else 0
        pending = declared > 0 or b"transfer-encoding" in headers
        if not pending or not scope.get("http_version", "1.1").startswith("1"):
            return receive, send
        limit = 2 * self.max_body_bytes  # what is drained at most

        async def receiving() -> Message:
            nonlocal pending
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                pending = False
            return message

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.start" and pending:
                if declared <= limit:  # (a body declared larger is not waited for)
                    size = 0
                    with anyio.move_on_after(self.body_timeout_s):
                        while pending and size <= limit:
                            size += len((await receiving()).get("body", b""))
                if pending:
                    message = {**message, "headers": [*message.get("headers", []), (b"connection", b"close")]}
            await send(message)

        return receiving, sending

    def _authorize(self, path: str, headers: dict) -> None:
        key = self.api_key
        if key is None or path in self.open_paths or path.startswith(self.open_prefix + "/"):
            return
        given = headers.get(b"x-api-key", b"")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            given = given or auth[7:].strip()
        if not secrets.compare_digest(given, key.encode()):
            raise RequestError(401, "invalid or missing API key: send it as 'x-api-key' or 'Authorization: Bearer'")

    async def _body(self, headers: dict, receive: Receive) -> bytes:
        limit = self.max_body_bytes
        too_big = RequestError(413, f"request body is over this server's limit of {limit} bytes")
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            raise too_big
        chunks, size = [], 0
        with anyio.move_on_after(self.body_timeout_s) as timer:
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
            raise RequestError(408, f"the request body did not arrive within {self.body_timeout_s:g} s")
        return b"".join(chunks)
