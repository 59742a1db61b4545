"""Reading SSE back in tests."""

from __future__ import annotations

import json
from collections.abc import AsyncIterable


def parse_sse(raw: bytes) -> list[tuple[str | None, object]]:
    """(event name or None, data as JSON or the raw string) for each event."""
    events = []
    text = raw.decode()
    assert text.endswith("\n\n"), "an SSE stream ends with a blank line"
    for block in text[:-2].split("\n\n"):
        name, data = None, []
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "event":
                name = value
            else:
                assert field == "data", f"unexpected SSE line {line!r}"
                data.append(value)
        joined = "\n".join(data)
        try:
            events.append((name, json.loads(joined)))
        except json.JSONDecodeError:
            events.append((name, joined))
    return events


async def collect(chunks: AsyncIterable[bytes]) -> bytes:
    return b"".join([c async for c in chunks])
