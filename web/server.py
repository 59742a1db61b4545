"""Serving the app with hypercorn, on trio (default) or asyncio.

The listening socket is bound before the model loads, so a busy port fails
at once, and it listens before the app is ready, so a client that connects
early waits rather than being refused. SIGINT or SIGTERM stops the server
gracefully: requests in flight end, then the lifespan closes the runtime,
which writes every cache to disk.
"""

from __future__ import annotations

import signal
import socket
from collections.abc import Callable

import anyio

from semantic.actors import Runtime, SemanticError

from .app import ServerConfig, create_app

__all__ = ["bind", "run", "serve"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0: any free one). Raises ``SemanticError``."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
        sock.listen(128)
    except OSError as e:
        raise SemanticError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


async def serve(config: ServerConfig, sock: socket.socket, *, on_ready: Callable[[Runtime], None] | None = None,
                shutdown: Callable | None = None) -> None:
    """Serve until ``shutdown()`` returns (default: SIGINT or SIGTERM). Takes over ``sock``."""
    from hypercorn.config import Config

    if _backend() == "trio":
        from hypercorn.trio import serve as hypercorn_serve
    else:
        from hypercorn.asyncio import serve as hypercorn_serve
    hc = Config()
    hc.bind = [f"fd://{sock.detach()}"]
    hc.loglevel = "WARNING"  # our own line says where we listen
    hc.accesslog = None
    hc.startup_timeout = 24 * 3600  # loading a large model may take long
    hc.shutdown_timeout = 3600  # writing every dirty cache may too
    hc.graceful_timeout = 5
    await hypercorn_serve(create_app(config, on_ready), hc, shutdown_trigger=shutdown or _signalled)


def run(config: ServerConfig, sock: socket.socket, *, backend: str = "trio",
        on_ready: Callable[[Runtime], None] | None = None) -> None:
    """``serve`` on a new event loop of ``backend`` ("trio" or "asyncio").  A
    ``SemanticError`` that stopped it (the model would not load) is raised
    as itself, not inside the task groups' exception groups."""
    try:
        anyio.run(lambda: serve(config, sock, on_ready=on_ready), backend=backend)
    except BaseExceptionGroup as group:
        leaves = _leaves(group)
        error = _semantic(leaves[0]) if len(leaves) == 1 else None
        if error is None:
            raise
        raise error from None


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    return [leaf for e in group.exceptions
            for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


def _semantic(error: BaseException | None) -> SemanticError | None:
    """The ``SemanticError`` behind ``error`` (hypercorn reports a failed startup
    as its own error, raised while handling ours)."""
    while error is not None and not isinstance(error, SemanticError):
        error = error.__cause__ or error.__context__
    return error


async def _signalled() -> None:
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            return


def _backend() -> str:
    import sniffio

    return sniffio.current_async_library()
