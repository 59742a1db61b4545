"""Answering a turn, and refusing a request, in the shape its route's clients
expect: a turn's JSON once it ended, or its events streamed as SSE (begun only
once the turn produced its first item, so a turn refused at the start is a
plain HTTP error); a ``RequestError`` as the protocol of its path writes errors
(``web.protocols``)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ._aio import closing
from .chat import Answers, ChatTurn
from .protocols import Protocols
from .schema import ChatResult, RequestError, StreamItem
from .sse import EventStreamResponse

__all__ = ["answer", "error_response", "request_errors"]


def error_response(err: RequestError, error_json: Callable[[RequestError], dict],
                   headers: dict | None = None) -> JSONResponse:
    """``err`` as ``error_json`` writes it, with its status."""
    return JSONResponse(error_json(err), status_code=err.status, headers=headers)


def request_errors(protocols: Protocols) -> Callable[[Request, RequestError], Awaitable[JSONResponse]]:
    """What every route answers a ``RequestError`` with: its status, in the
    error shape of the protocol its path belongs to."""

    async def request_error(request: Request, err: RequestError) -> JSONResponse:
        return error_response(err, protocols.for_path(request.url.path).error_json)

    return request_error


async def answer(request: Request, turn: ChatTurn, stream: bool, protocol: Answers) -> Response:
    """The turn's answer in ``protocol``'s shape: its events, or its JSON once the turn ended."""
    headers = {"x-agent-id": turn.agent_id}
    if stream:
        return EventStreamResponse(_primed(turn, protocol.events), headers=headers, error_body=protocol.error_json)
    try:
        return JSONResponse(protocol.response_json(turn, await _final(turn.items)), headers=headers)
    except RequestError as err:
        return error_response(err, protocol.error_json, headers)


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
