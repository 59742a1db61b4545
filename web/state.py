"""What the routes share: the server's settings (``ServerConfig``) and its
state (``Server``: the runtime, the chat core, the metrics, the dashboard);
and what a family of routes is (``Routes``)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

from semantic.actors import Agent, EngineOptions, Runtime, SemanticError, UnknownModel

from .chat import HEARTBEAT_S, ChatCore, turn_error
from .dashboard import Dashboard
from .events import EventHub
from .metrics import Metrics
from .protocols import ProtocolSpec

__all__ = ["Routes", "Server", "ServerConfig"]

log = logging.getLogger("semantic.web")


@dataclass(frozen=True)
class ServerConfig:
    """What a server runs and its limits (checked when the app is built)."""

    model: object = "smollm2"  # a name, NAME=MODEL, or a runtime.model.models.LoadedModel (tests share one)
    models: tuple = ()  # more models requests may name (as ``model``); the first is loaded at start
    model_idle_s: float | None = None  # unload the model after this long without turns (None: never)
    cache_dir: Path | None = None
    budget: int | None = None  # bytes of hot KV cache (None: the runtime's default)
    engine: EngineOptions = EngineOptions()  # the engine's settings (KV bits, prefill chunk, decode rows, ...)
    disk_budget: int | None = None  # bytes the cache directory may hold (None: no cap)
    conversation_ttl_s: float | None = None  # anonymous conv-* agents unused this long are removed (None: never)
    api_key: str | None = None  # required as x-api-key or "Authorization: Bearer" when set
    max_tokens_cap: int | None = None  # larger max_tokens are clamped to it (None: the model's context length)
    heartbeat_s: float = HEARTBEAT_S  # a stream with nothing new this long sends a keep-alive (ping)
    max_body_bytes: int = 32 << 20
    body_timeout_s: float = 60.0  # a client must send its whole body within this
    runtime_options: dict = field(default_factory=dict)  # more Runtime.open keywords

    def __post_init__(self):
        if self.max_tokens_cap is not None and self.max_tokens_cap < 1:
            raise ValueError("max_tokens_cap must be >= 1 (None: the model's context length)")
        if self.heartbeat_s <= 0:
            raise ValueError("heartbeat_s must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.body_timeout_s <= 0:
            raise ValueError("body_timeout_s must be > 0")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (None: no key)")
        if self.disk_budget is not None and self.disk_budget <= 0:
            raise ValueError("disk_budget must be more than 0 bytes (None: no cap)")
        if self.conversation_ttl_s is not None and self.conversation_ttl_s <= 0:
            raise ValueError("conversation_ttl_s must be more than 0 (None: never)")
        if self.model_idle_s is not None and self.model_idle_s <= 0:
            raise ValueError("model_idle_s must be more than 0 (None: never)")


class Server:
    """The routes' shared state: the runtime, the chat core, the metrics."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.rt: Runtime | None = None
        self.core: ChatCore | None = None
        self.metrics = Metrics()
        self.hub = EventHub()
        self.dashboard: Dashboard | None = None
        self.started = time.time()

    async def start(self, rt: Runtime) -> None:
        self.rt = rt
        self.dashboard = Dashboard(rt, self.hub)
        self.core = ChatCore(rt, self.metrics, self.config.heartbeat_s, observer=self.dashboard)
        rt.on_pruned(self._pruned)  # before the index is built: a prune may end while it is
        await self.core.load_index()
        log.info("%d agents on disk", len(self.core.index))

    def _pruned(self, agent_ids: list[str]) -> None:
        for agent_id in agent_ids:  # conversations whose files the disk budget or TTL removed
            self.core.index.forget(agent_id)
            self.dashboard.deleted(agent_id)

    @property
    def model(self) -> str:
        return self.rt.model or "unknown"

    def model_for(self, requested: str | None, strict: bool = False) -> str:
        """The model a request runs on: the one it names, else the first. A server
        of one model runs it whatever a request names (clients send their own
        names: claude-..., gpt-...) unless ``strict`` (the agent API); with more,
        a name it does not serve is a 404."""
        served = self.rt.models
        if requested in served:
            return requested
        if requested is None or (len(served) == 1 and not strict):
            return served[0]
        raise turn_error(UnknownModel(requested, served))

    @property
    def max_tokens_cap(self) -> int:
        return self.config.max_tokens_cap or self.rt.context_length or 1

    async def delete(self, agent: Agent) -> None:
        """Delete the agent (history and every cache file) and forget it; raises ``RequestError``."""
        try:
            await agent.delete()
        except SemanticError as e:
            raise turn_error(e) from None
        self.core.index.forget(agent.id)
        self.dashboard.deleted(agent.id)


class Routes:
    """A family of routes over the server's shared state (``routes()`` lists
    them), and the protocols they speak (``web.protocols``: the app's registry
    is every family's)."""

    protocols: tuple[ProtocolSpec, ...] = ()

    def __init__(self, server: Server):
        self.server = server
