"""The one HTTP client ``semantic bench compare`` uses for both servers:
streaming OpenAI chat completions, greedy, timed on the client side.

TTFT is the time from sending the request to the first chunk that carries
content; end-to-end is the time to ``[DONE]``.  SSE comment lines (the peer's
``: keepalive`` during prefill) are skipped.  Token counts come from the
usage chunk (``stream_options.include_usage``), which both servers send; the
number of content chunks stands in where a server sends none.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import httpx

from semantic.runtime.outcome import decode_rate

__all__ = ["Turn", "chat"]


@dataclass
class Turn:
    """A turn as the client saw it: its own clock, and whatever usage the server sent
    (a peer may send none).  The server-side view of a turn is ``runtime.outcome.TurnResult``."""

    ttft: float  # seconds from send to the first content chunk
    e2e: float  # seconds from send to the end of the stream
    text: str
    completion_tokens: int
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    start: float = 0.0  # perf_counter at send
    first: float = 0.0  # perf_counter at the first content chunk
    end: float = 0.0

    @property
    def decode_tps(self) -> float | None:
        """This stream's tokens/s after its first token (None: fewer than two)."""
        return decode_rate(self.completion_tokens, self.end - self.first)


def chat(client: httpx.Client, url: str, agent: str, messages: list[dict], max_tokens: int,
         model: str | None = None, temperature: float = 0.0) -> Turn:
    """One streamed chat completion, greedy unless a ``temperature`` is given
    (then top-p 0.95); raises RuntimeError on an HTTP or stream error."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": temperature,
        **({"top_p": 0.95} if temperature else {}),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        body["model"] = model
    headers = {"X-Agent-Id": agent}
    text, usage, first, chunks = [], None, None, 0
    start = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue  # blank separators and ": keepalive" comments
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: stream error: {event['error']}")
            if event.get("usage"):
                usage = event["usage"]
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if first is None:
                        first = time.perf_counter()
                    chunks += 1
                    text.append(piece)
    end = time.perf_counter()
    first = first or end  # an empty reply: its "first token" is its end
    details = (usage or {}).get("prompt_tokens_details") or {}
    return Turn(
        ttft=first - start,
        e2e=end - start,
        text="".join(text),
        completion_tokens=int((usage or {}).get("completion_tokens") or chunks),
        prompt_tokens=(usage or {}).get("prompt_tokens"),
        cached_tokens=details.get("cached_tokens"),
        start=start,
        first=first,
        end=end,
    )
