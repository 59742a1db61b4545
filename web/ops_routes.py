"""The operator's routes: the models, health, Prometheus metrics, and the
dashboard (its static page, its state and its live event stream)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from .dashboard import memory_and_disk
from .metrics import CONTENT_TYPE_LATEST
from .sse import EventStreamResponse
from .state import Routes

__all__ = ["OPEN_PATHS", "OpsRoutes", "STATIC_PREFIX"]

STATIC_DIR = Path(__file__).parent / "static"  # the dashboard page (package data)
STATIC_PREFIX = "/dashboard/static"
OPEN_PATHS = ("/health", "/")  # no key needed: no data there (the page asks for the key itself)
EVENTS_KEEP_ALIVE_S = 15.0


class OpsRoutes(Routes):
    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/", self.page, methods=["GET"]),
            Mount(STATIC_PREFIX, StaticFiles(directory=STATIC_DIR), name="static"),
            Route("/v1/dashboard", self.dashboard_state, methods=["GET"]),
            Route("/v1/events", self.events, methods=["GET"]),
            Route("/metrics", self.metrics_text, methods=["GET"]),
        ]

    async def models(self, request: Request) -> Response:
        """Every model requests may name, in OpenAI's and Anthropic's list shape at
        once; ``loaded``: the one in memory now (its ``context_length`` is known)."""
        created = int(self.server.started)
        loaded = self.server.model if self.server.rt.context_length else None
        data = [{"id": name, "object": "model", "created": created, "owned_by": "semantic",
                 "type": "model", "display_name": name,
                 "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created)),
                 "loaded": name == loaded, "context_length": self.server.rt.context_length if name == loaded else None}
                for name in self.server.rt.models]
        return JSONResponse({"object": "list", "data": data, "has_more": False,
                             "first_id": data[0]["id"], "last_id": data[-1]["id"]})

    async def health(self, request: Request) -> Response:
        rt = self.server.rt
        stats = rt.stats()
        memory, disk = await anyio.to_thread.run_sync(memory_and_disk, rt)
        body = {"status": "ok" if rt.healthy else "unhealthy", "ready": rt.healthy,
                "error": None if rt.error is None else str(rt.error), "model": rt.model,
                "context_length": rt.context_length, "row_counts": rt.row_counts,
                "speculation": rt.speculation, "memory": memory,
                "disk": {"bytes": memory["disk_bytes"], **disk},
                "queue_depth": stats.get("waiting", 0), "decoding": stats.get("decoding", 0),
                "agents": len(self.server.core.index)}
        return JSONResponse(body, status_code=200 if rt.healthy else 503)

    # -- the dashboard ------------------------------------------------------------------

    async def page(self, request: Request) -> Response:
        """The dashboard (static: it holds no data, so it loads without the key)."""
        return FileResponse(STATIC_DIR / "index.html", headers={"cache-control": "no-cache"})

    async def dashboard_state(self, request: Request) -> Response:
        return JSONResponse(await self.server.dashboard.snapshot())

    async def events(self, request: Request) -> Response:
        return EventStreamResponse(self.server.dashboard.stream(EVENTS_KEEP_ALIVE_S))

    async def metrics_text(self, request: Request) -> Response:
        memory, disk = await anyio.to_thread.run_sync(memory_and_disk, self.server.rt)
        text = self.server.metrics.render(self.server.rt.stats(), memory, disk)
        return Response(text, media_type=CONTENT_TYPE_LATEST)
