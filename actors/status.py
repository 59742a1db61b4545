"""What a runtime reports: ``RuntimeStatus``, the base class of ``Runtime``
that holds its queries -- health, the models and their tokenizers, memory
and disk, the GPU thread's snapshots, the agents and counters.  None of them
changes what the actors hold; ``Runtime`` (``actors.runtime``) wires the
actors they read.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import anyio

from semantic.runtime.store import disk
from semantic.runtime.cache_records import validate_agent_id
from semantic.runtime.errors import SemanticError
from semantic.runtime.model.models import LoadedModel, load_tokenizer
from semantic.runtime.text.prefix import encode
from semantic.runtime.memory.turns import render

from .agent import AgentSlot
from .errors import RuntimeClosed, UnknownModel
from .eviction import EvictionActor
from .gpu import BatchSnapshot, GpuActor, HotSnapshot
from .listing import AgentInfo, agent_infos
from .messages import Message
from .persistence import PersistenceActor

__all__ = ["RuntimeStatus"]


class RuntimeStatus:
    """``Runtime``'s queries, over the actors and state it wires (the attributes below)."""

    cache_dir: Path
    _gpu: GpuActor
    _persistence: PersistenceActor
    _eviction: EvictionActor
    _histories: Path
    _slots: dict[str, AgentSlot]
    _closing: bool
    _tokenizers: dict[str, object]

    @property
    def healthy(self) -> bool:
        """False once the GPU actor failed (every turn in flight failed; reopen the runtime)."""
        return self._gpu.healthy and not self._closing

    @property
    def error(self) -> SemanticError | None:
        """Why the GPU actor failed (None while it has not)."""
        return self._gpu.error

    @property
    def model(self) -> str | None:
        """The name of the loaded model (or the one an idle unload will bring back)."""
        return self._gpu.model_name

    @property
    def row_counts(self) -> dict | None:
        """The token slots decode forwards may have on the loaded model, and what
        measuring them found (``runtime.engine.row_counts``); None while unloaded."""
        counts = self._gpu.row_counts
        return None if counts is None else counts.describe()

    @property
    def speculation(self) -> bool | None:
        """Whether decoding agents verify drafts from their own history
        (``runtime.engine.speculation``); None while unloaded."""
        return self._gpu.speculation

    @property
    def models(self) -> tuple[str, ...]:
        """The models turns may ask for by name; the first is the one loaded at start."""
        return tuple(self._gpu.catalogue)

    def check_model(self, name: str) -> str:
        """``name`` if turns may ask for it, else raise ``UnknownModel``."""
        if name not in self._gpu.catalogue:
            raise UnknownModel(name, self.models)
        return name

    async def tokenizer(self, model: str | None = None):
        """The tokenizer of ``model`` (a name in ``models``; None: the loaded one),
        read without its weights when it is not loaded.  Raises ``UnknownModel``,
        ``ModelError``, ``RuntimeClosed`` (None while nothing is loaded)."""
        loaded = self._gpu.loaded
        if model is None or (loaded is not None and loaded.name == model):
            if loaded is None:
                raise RuntimeClosed("no model is loaded")
            return loaded.tokenizer
        source = self._gpu.catalogue[self.check_model(model)]
        if isinstance(source, LoadedModel):
            return source.tokenizer
        if model not in self._tokenizers:
            self._tokenizers[model] = await anyio.to_thread.run_sync(load_tokenizer, source)
        return self._tokenizers[model]

    @property
    def context_length(self) -> int:
        """Tokens the loaded model's context holds (0 while it is unloaded)."""
        loaded = self._gpu.loaded
        return loaded.context_length if loaded else 0

    @property
    def chat_template(self) -> str | None:
        """The loaded model's chat template (None while unloaded or if it has none)."""
        loaded = self._gpu.loaded
        return getattr(loaded.tokenizer, "chat_template", None) if loaded else None

    async def prompt(self, messages: Iterable[Message], tools: Iterable[dict] | None = None,
                     model: str | None = None) -> tuple[str, int]:
        """The prompt ``messages`` (and ``tools``) render to on ``model`` (None: the
        loaded one), and its length in tokens: what a turn over them prefills
        with an empty cache."""
        tokenizer = await self.tokenizer(model)
        dicts = [m.as_dict() for m in messages]
        tools = tuple(tools) if tools else None

        def run() -> tuple[str, int]:
            text = render(tokenizer, dicts, tools)
            return text, len(encode(tokenizer, text))

        return await anyio.to_thread.run_sync(run)

    def memory(self) -> dict:
        """Hot KV cache bytes against the budget (shared prefixes' share of them),
        MLX's active and peak memory, demotions, preemptions and prefix drops so
        far, and bytes of every file in the cache directory."""
        hot, stats = self._gpu.hot, self._gpu.stats()
        return {"hot_bytes": hot.used_bytes, "budget_bytes": hot.budget_bytes, "prefix_bytes": hot.prefix_bytes,
                "mlx_active_bytes": stats["mlx_active_bytes"], "mlx_peak_bytes": stats["mlx_peak_bytes"],
                "demotions": hot.demotions, "prefix_drops": hot.prefix_drops, "preemptions": stats["preemptions"],
                "disk_bytes": self._persistence.store.disk_bytes()}

    def disk(self) -> dict:
        """The cache directory's disk budget (None: no cap), its filesystem's free
        bytes, files removed by pruning and writes refused or failed so far.
        Asks the filesystem: call it on a worker thread."""
        p = self._persistence
        return {"budget_bytes": p.disk_budget, "free_bytes": disk.free_bytes(self.cache_dir),
                "pruned_files": p.pruned, "failed_writes": p.failed}

    def hot(self) -> HotSnapshot:
        """The hot set as the GPU thread last published it (agent id -> tokens, bytes,
        last use; budget, shared prefixes): an immutable snapshot; cheap."""
        return self._gpu.hot

    def batch(self) -> BatchSnapshot:
        """The batch as the GPU thread last published it: each turn it holds (queued,
        prefilling, decoding: agent, tokens so far, tokens/s), the queue depth and
        the output tokens generated so far.  An immutable snapshot; cheap."""
        return self._gpu.batch

    async def agents(self, only: str | None = None) -> list[AgentInfo]:
        """Every agent that has a history (in memory or on disk), or only the one
        named ``only`` (if it exists), with its cache for the loaded model: a
        snapshot, read partly from disk on a worker thread.  Raises ``InvalidAgentId``."""
        if only is not None:
            validate_agent_id(only)
        hot = self._gpu.hot
        live = {i: s.history for i, s in self._slots.items()
                if s.exists and not s.deleted and s.history is not None and only in (None, i)}
        return await anyio.to_thread.run_sync(agent_infos, self._histories, self._persistence.store, hot, live, only)

    def cache_tier(self, agent_id: str) -> str | None:
        """Where the agent's cache for the loaded model is now: "hot", "warm" (disk) or None."""
        hot = self._gpu.hot
        if agent_id in hot.agents:
            return "hot"
        if hot.model_id is not None and self._persistence.store.exists(agent_id, hot.model_id):
            return "warm"
        return None

    def stats(self) -> dict:
        """Counters for tests, benchmarks and monitoring (a snapshot)."""
        return {
            **self._gpu.stats(),
            "agent_actors": sum(s.mailbox is not None for s in self._slots.values()),
            "writes": self._persistence.writes,
            "coalesced_writes": self._persistence.coalesced,
            "failed_writes": self._persistence.failed,
            "pruned_files": self._persistence.pruned,
            "demotions_requested": self._eviction.requested,
        }
