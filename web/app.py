"""The Starlette app: every route, wired to one ``Runtime``.

``create_app(config)`` builds it; its lifespan opens the runtime (the root
task group of the server lives there), builds the conversation index from the
agents on disk, and shuts the runtime down -- flushing every cache -- when the
server stops.

The routes come in three families, each a module: the stateless chat
protocols (``web.chat_routes``), the agent API (``web.agent_routes``) and the
operator's (``web.ops_routes``); ``families`` may name others. Each family
lists the protocols it speaks, and the app's registry of them
(``web.protocols``) says whose error shape a path's refusals take. They
share one ``Server`` (``web.state``): the runtime, the chat core, the metrics
and the dashboard. Routes are thin: parse the body into one request (``web.anthropic``, ``web.openai``,
``web.completions``, ``web.responses``, ``web.agents``), start one agent turn (``web.chat``), and
answer JSON or stream SSE (``web.answer``). A request refused before its first event gets a
plain HTTP error in its protocol's shape, streaming or not (one exception
handler for ``RequestError``); a failure later in a stream is an error event.
The guard in front of the routes (``web.guard``) checks the API key, caps the
body size and the time a client may take to send it (an agent's import reads
its archive itself: it may be any size).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager

import anyio
from starlette.applications import Starlette

from semantic.actors import Runtime

from .agent_routes import IMPORT_PATH, AgentRoutes
from .answer import request_errors
from .chat_routes import ChatRoutes
from .guard import Guard
from .ops_routes import OPEN_PATHS, STATIC_PREFIX, OpsRoutes
from .protocols import Protocols
from .schema import RequestError
from .state import Routes, Server, ServerConfig

__all__ = ["FAMILIES", "ServerConfig", "create_app"]

FAMILIES: tuple[type[Routes], ...] = (ChatRoutes, AgentRoutes, OpsRoutes)  # the server's routes


def create_app(config: ServerConfig, on_ready: Callable[[Runtime], None] | None = None,
               families: Sequence[type[Routes]] = FAMILIES) -> Starlette:
    """The app of ``families``' routes; ``on_ready(runtime)`` runs once the model
    is loaded and the index built."""
    server = Server(config)
    route_families = [family(server) for family in families]
    protocols = Protocols(spec for family in route_families for spec in family.protocols)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with Runtime.open(config.model, config.cache_dir, config.budget, models=config.models,
                                model_idle_s=config.model_idle_s, engine=config.engine,
                                disk_budget=config.disk_budget,
                                conversation_ttl_s=config.conversation_ttl_s, **config.runtime_options) as rt:
            await server.start(rt)
            async with anyio.create_task_group() as tg:
                tg.start_soon(server.dashboard.run)
                if on_ready is not None:
                    on_ready(rt)
                yield
                tg.cancel_scope.cancel()

    routes = [route for family in route_families for route in family.routes()]
    app = Starlette(lifespan=lifespan, exception_handlers={RequestError: request_errors(protocols)}, routes=routes)
    app.add_middleware(Guard, api_key=config.api_key, max_body_bytes=config.max_body_bytes,
                       body_timeout_s=config.body_timeout_s, open_paths=OPEN_PATHS, open_prefix=STATIC_PREFIX,
                       streamed_path=IMPORT_PATH, protocols=protocols)
    app.state.server = server
    return app
