"""The protocols a server speaks, each declared once, and the registry the web
core asks about them.

A protocol module (``web.anthropic``, ``web.openai``, ...) ends with its
``PROTOCOL``, a ``ProtocolSpec``: its name (the route its turns came by, as
the dashboard shows it), the paths of its routes, and how it answers a turn
and writes an error. A family of routes (``web.state``'s ``Routes``) lists
the protocols it speaks; the app gathers them into one ``Protocols``, which
says whose error shape a path's refusals take (the guard's and the routes'
alike). No other code branches on a protocol: a new one is its module and
its routes. Pure: no route, no I/O.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .schema import ChatResult, RequestError, StreamItem

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["Protocols", "ProtocolSpec"]


@dataclass(frozen=True)
class ProtocolSpec:
    """What the web core knows of a protocol; an ``Answers`` (``web.chat``),
    so a route answers a turn with it (``web.answer``)."""

    name: str  # the route its turns came by ("anthropic", "openai", ...: the dashboard's names)
    paths: tuple[str, ...]  # its routes' path prefixes, whole segments; "/": every path no other claims
    response_json: Callable[[ChatTurn, ChatResult], dict]  # a turn's JSON once it ended
    events: Callable[[ChatTurn, AsyncIterable[StreamItem]], AsyncIterator[bytes]]  # a turn's SSE events
    error_json: Callable[[RequestError], dict]  # a refusal's body

    def __post_init__(self):
        if not self.name:
            raise ValueError("a protocol needs a name")
        if not self.paths or any(not p.startswith("/") for p in self.paths):
            raise ValueError(f"protocol {self.name!r}: its paths must start with '/', not {self.paths!r}")

    def claim(self, path: str) -> int:
        """How long the longest of its paths that ``path`` is under is (-1: none is)."""
        under = [len(p) for p in map(_trimmed, self.paths) if path == p or path.startswith(p + "/")]
        return max(under, default=-1)


class Protocols:
    """The protocols of one app, by their paths: each path belongs to the
    protocol that claims the longest prefix of it."""

    def __init__(self, specs: Iterable[ProtocolSpec]):
        self.specs = tuple(specs)
        names = [s.name for s in self.specs]
        if len(set(names)) < len(names):
            raise ValueError(f"two protocols of one name: {sorted(names)}")
        claimed: dict[str, str] = {}
        for spec in self.specs:
            for path in map(_trimmed, spec.paths):
                if path in claimed:
                    raise ValueError(f"protocols {claimed[path]!r} and {spec.name!r} both claim {path or '/'!r}")
                claimed[path] = spec.name
        if "" not in claimed:
            raise ValueError("no protocol answers the paths no other claims: one must claim '/'")

    def for_path(self, path: str) -> ProtocolSpec:
        """The protocol whose shape a refusal of a request to ``path`` takes."""
        return max(self.specs, key=lambda spec: spec.claim(path))

    def error_json(self, path: str, err: RequestError) -> dict:
        return self.for_path(path).error_json(err)


def _trimmed(path: str) -> str:
    """A path prefix without its trailing "/" ("/" itself: "", under which every path is)."""
    return path.rstrip("/")
