"""The HTTP backend: scenario agents are agents of a running ``semantic serve``,
driven through its agent API (``POST /v1/agents``, ``POST /v1/agents/{id}/messages``
streamed, ``DELETE /v1/agents/{id}``; see ``docs/api.md``).

The server keeps each conversation's history and cache; the numbers in each
turn's ``done`` event are the server engine's own.  ``SEMANTIC_API_KEY`` is
sent as the API key when set.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import asynccontextmanager

import httpx

from semantic.runtime.errors import SemanticError
from semantic.runtime.outcome import FinishReason, TurnResult

from .backend import Delta, Sampling, TurnEvent

__all__ = ["RemoteAgent", "RemoteBackend", "remote_backend"]

TIMEOUT = httpx.Timeout(10.0, read=600.0)  # a turn may wait behind others' prefills


@asynccontextmanager
async def remote_backend(url: str) -> AsyncIterator[RemoteBackend]:
    headers = {"x-api-key": key} if (key := os.environ.get("SEMANTIC_API_KEY")) else {}
    async with httpx.AsyncClient(base_url=url.rstrip("/"), headers=headers, timeout=TIMEOUT) as client:
        await _call(client, "GET", "/health")  # fail early, with the URL in the message
        yield RemoteBackend(client)


class RemoteBackend:
    def __init__(self, client: httpx.AsyncClient):
        self.client = client

    async def open_agent(self, agent: str, system: str, cache_key: str, *, use_cache: bool = True) -> RemoteAgent:
        await _call(self.client, "POST", "/v1/agents", json={"id": cache_key, "system": system})
        return RemoteAgent(self.client, cache_key, use_cache)


class RemoteAgent:
    def __init__(self, client: httpx.AsyncClient, agent_id: str, use_cache: bool):
        self.client = client
        self.agent_id = agent_id
        self.use_cache = use_cache
        self.closed = False

    async def turn(self, prompt: str, sampling: Sampling) -> AsyncGenerator[TurnEvent, None]:
        body = {"content": prompt, "stream": True, "use_cache": self.use_cache, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "top_p": sampling.top_p, "stop": list(sampling.stop)}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        path = f"/v1/agents/{self.agent_id}/messages"
        try:
            async with self.client.stream("POST", path, json=body) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error(response)
                async for event, data in _events(response):
                    if event == "delta":
                        yield Delta(data["text"])
                    elif event == "done":
                        yield _result(data)
                        return
                    elif event == "error":
                        raise SemanticError(f"the server failed the turn: {data['error']['message']}")
        except httpx.HTTPError as e:
            raise SemanticError(f"{self.client.base_url}: {e!r}") from e
        raise SemanticError(f"the server ended the turn of {self.agent_id!r} without a 'done' event")

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await _call(self.client, "DELETE", f"/v1/agents/{self.agent_id}")


async def _call(client: httpx.AsyncClient, method: str, path: str, **kwargs) -> dict:
    try:
        response = await client.request(method, path, **kwargs)
    except httpx.HTTPError as e:
        raise SemanticError(f"cannot reach semantic serve at {client.base_url}: {e!r}") from e
    if response.status_code >= 400:
        raise _error(response)
    return response.json()


def _error(response: httpx.Response) -> SemanticError:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text[:500]
    return SemanticError(f"{response.request.method} {response.request.url.path}: {response.status_code}: {message}")


async def _events(response: httpx.Response) -> AsyncIterator[tuple[str, dict]]:
    """(event, data) pairs of a server-sent event stream."""
    event, data = "message", []
    async for line in response.aiter_lines():
        if not line:
            if data:
                yield event, json.loads("\n".join(data))
            event, data = "message", []
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))


def _result(done: dict) -> TurnResult:
    """The turn as the server's ``done`` event reports it (ms there, seconds here; None: not measured)."""
    usage, timing = done["usage"], done["timing"]

    def seconds(name: str) -> float | None:
        ms = timing[f"{name}_ms"]
        return None if ms is None else ms / 1000

    return TurnResult(
        # (a cancelled turn is an error there)
        reason=FinishReason.LENGTH if done["stop_reason"] == "max_tokens" else FinishReason.STOP,
        text=done["content"],
        prompt_tokens=usage["prompt_tokens"],
        reused_tokens=usage["reused_tokens"],
        prefilled_tokens=usage["prefilled_tokens"],
        output_tokens=usage["output_tokens"],
        queued_s=seconds("queued"),
        ttft_s=seconds("ttft"),
        prefill_s=seconds("prefill"),
        decode_s=seconds("decode"),
        stop_sequence=done["stop_sequence"],
    )
