"""The runtime and its in-process API for orchestrators.

::

    async with Runtime.open(model="smollm2", cache_dir=..., budget=...) as rt:
        alice = await rt.agent("alice", system="You are terse.")
        async for delta in alice.send("Hello!", max_tokens=64):
            print(delta.text, end="")
        answer = await alice.reply("And now?")
        bob = await alice.fork("bob")      # shares alice's cached prefix
        await bob.delete()

``Runtime.open`` starts, under one task group: the persistence actor, the
eviction actor and the GPU actor (which loads the model; a ``ModelError``
comes out of ``open``).  Agent actors start on demand and retire when idle.

Shutdown is leaving the ``async with`` -- normally, by an exception, or by
cancellation of the enclosing scope.  The actors run shielded from that
cancellation and are stopped in order: the GPU actor cancels every turn in
flight (their caches are kept) and hands every dirty cache to persistence;
agent actors refuse queued turns and end; the persistence actor writes
everything pending and ends; then the eviction actor.  No task or thread
outlives the block, and every file is written whole or not at all.

Here: the wiring, start and shutdown, the agents' slots and mailboxes, and
what changes state (agents, forks, swaps, flushes, demotions, imports).  Its
queries are its base class's (``RuntimeStatus``, ``actors.status``); the
``Agent`` handles it gives out (``actors.handle``) ask it only what
``AgentHost`` lists, all public methods.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
from anyio.streams.memory import MemoryObjectSendStream

from semantic.runtime.engine import row_counts
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import validate_agent_id
from semantic.runtime.engine.engine_options import EngineOptions
from semantic.runtime.model.models import LoadedModel
from semantic.runtime.model.models import catalogue as models_catalogue
from semantic.runtime.outcome import TurnResult
from semantic.runtime.paths import agents_dir

from .agent import AgentActor, AgentContext, AgentSlot, raise_failed, request
from .archive import Summary, agent_files, receive_upload
from .errors import AgentExists, AgentGone, RuntimeClosed
from .eviction import EvictionActor
from .gpu import GpuActor, follow
from .handle import Agent
from .history import encode_history
from .messages import (
    AgentCommand,
    Demote,
    EvictCommand,
    Flush,
    FlushCaches,
    Fork,
    HistoryBytes,
    ImportArchive,
    Open,
    PersistCommand,
    ReadHistory,
    Send,
    Stop,
    SwapModel,
    TurnEvent,
)
from .persistence import PersistenceActor
from .reply import Reply
from .status import RuntimeStatus

if TYPE_CHECKING:
    import mlx.core as mx

__all__ = ["Runtime"]

log = logging.getLogger("semantic.actors")


class Runtime(RuntimeStatus):
    """Agents, each a conversation with a persistent KV cache, batched on one model.

    Create it with ``Runtime.open``.  All methods must be called from the event
    loop the runtime was opened on.
    """

    def __init__(self, tg, store: CacheStore, root: Path, agent_idle_s: float, *, gpu: dict, persistence: dict,
                 eviction_watermarks: tuple[float, float]):
        """The actors, each given its collaborators (``gpu``, ``persistence``: their
        settings); the mailboxes come first, so that each actor can be handed the
        send end of those it talks to. ``open`` starts them."""
        self._tg = tg
        to_persistence = anyio.create_memory_object_stream[PersistCommand](math.inf)
        to_eviction = anyio.create_memory_object_stream[EvictCommand](math.inf)
        self._gpu = gpu = GpuActor(store=store, persistence=to_persistence[0], eviction=to_eviction[0], **gpu)
        self._persistence = PersistenceActor(store, root / "histories", gpu=gpu, live=self._live_agents,
                                             hot=lambda: gpu.hot.agents.keys(), on_pruned=self._forget_pruned,
                                             channel=to_persistence, **persistence)
        self._eviction = EvictionActor(*eviction_watermarks, gpu=gpu, channel=to_eviction)
        self.cache_dir = root
        self._histories = root / "histories"
        self._slots: dict[str, AgentSlot] = {}
        self._turn_ids = itertools.count(1)
        self._closing = False
        self._started: list[object] = []  # actors whose run() has started
        self._prune_listeners: list = []
        self._turn_listeners: list = []
        self._tokenizers: dict[str, object] = {}  # models not loaded: their tokenizers, read once
        self._importing = anyio.Lock()
        self._ctx = AgentContext(gpu, self._persistence.mailbox, self._histories, agent_idle_s,
                                 lambda: self._closing, self._release, self._turn_ended)

    @classmethod
    @asynccontextmanager
    async def open(
        cls,
        model: str | LoadedModel = "smollm2",
        cache_dir: str | Path | None = None,
        budget: int | None = None,
        *,
        models: Iterable[str | LoadedModel] = (),
        agent_idle_s: float = 60.0,
        model_idle_s: float | None = None,
        engine: EngineOptions = EngineOptions(),
        eviction_watermarks: tuple[float, float] = (0.9, 0.75),
        disk_budget: int | None = None,
        conversation_ttl_s: float | None = None,
        prune_interval_s: float = 60.0,
        group: mx.distributed.Group | None = None,
        rank_timeout_s: float = 120.0,
    ) -> AsyncIterator[Runtime]:
        """Open a runtime; leaving the block shuts it down (see the module docstring).

        ``model``: ``"smollm2"`` (embedded), an mlx-lm model directory or Hugging
        Face repo id, or a ``LoadedModel`` already loaded (tests share one);
        ``NAME=MODEL`` names it.  ``models``: more models a turn may ask for by
        name (``Agent.send(model=...)``), in the same forms; a turn for a model
        that is not loaded waits until the batch drains, then swaps to it.
        ``cache_dir``: where agents' caches and histories live (default
        ``~/.cache/semantic/agents``).  ``budget``: bytes of hot KV cache (default:
        device memory less the weights less headroom).  ``agent_idle_s``: an idle
        agent actor retires after this long.  ``model_idle_s``: unload the model
        after this long without turns (None: never).  ``engine``: the engine's
        settings (``EngineOptions``): ``prefill_chunk``, the most prompt tokens
        one prefill step runs, which bounds how long decoding streams wait for
        another agent's prefill; ``kv_bits``, the agents' KV caches quantized
        to 4 (default) or 8 bits, or kept in float (16), each setting with its
        own cache files; ``decode_rows``, the most token slots of a decode
        forward (more decoding agents take more forwards; which counts up to
        it give a sequence the same logits is measured when a model loads,
        ``row_counts``, and forwards use only those); ``batch_prefill``,
        several agents' prompt chunks share a forward (up to twice
        ``prefill_chunk`` tokens) where that measurement found it leaves every
        chunk as alone; ``speculation``, decoding agents verify drafts from
        their own history in the same forwards (``runtime.engine.speculation``: no
        reply changes; not when sharded).  ``eviction_watermarks``:
        (high, low) fractions of the budget for the eviction actor.
        ``disk_budget``: bytes the cache directory may hold; the least recently
        written cache files are removed to stay within it (None: no cap).
        ``conversation_ttl_s``: anonymous agents (ids starting ``conv-``) unused
        this long are removed with their history (None: never).  Both are
        checked at start, at most every ``prune_interval_s`` after writes, and
        at once when writes go over the budget (``runtime.store.disk``,
        ``actors.persistence``).  ``group``: this process is rank 0 of an
        ``mx.distributed`` group whose ranks each hold a tensor-parallel shard
        of the model and follow this one's GPU thread (``actors.lockstep``);
        when one engine input waits longer than ``rank_timeout_s`` for them (a
        rank died), this process ends.

        Raises ``ModelError`` when the model cannot be loaded, ``ValueError`` for
        bad settings.
        """
        if disk_budget is not None and disk_budget <= 0:
            raise ValueError(f"disk_budget must be > 0 bytes (None: no cap), not {disk_budget}")
        if conversation_ttl_s is not None and conversation_ttl_s <= 0:
            raise ValueError(f"conversation_ttl_s must be > 0 (None: never), not {conversation_ttl_s}")
        catalogue = models_catalogue([model, *models])  # ValueError for a repeated name
        root = Path(cache_dir) if cache_dir is not None else agents_dir()
        store = await anyio.to_thread.run_sync(CacheStore, root)  # creates it; clears dead writers' temp files
        measured = await anyio.to_thread.run_sync(row_counts.kept)  # the GPU thread reads no file
        gpu = dict(model=next(iter(catalogue)), budget_bytes=budget, model_idle_s=model_idle_s, catalogue=catalogue,
                   options=engine,
                   group=group, rank_timeout_s=rank_timeout_s, row_counts=measured)
        persistence = dict(disk_budget=disk_budget, conversation_ttl_s=conversation_ttl_s,
                           prune_interval_s=prune_interval_s)
        try:
            async with anyio.create_task_group() as tg:
                rt = cls(tg, store, root, agent_idle_s, gpu=gpu, persistence=persistence,
                         eviction_watermarks=eviction_watermarks)
                try:
                    for actor in (rt._persistence, rt._eviction, rt._gpu):
                        await tg.start(_shielded, actor.run)
                        rt._started.append(actor)
                    yield rt
                finally:
                    with anyio.CancelScope(shield=True):
                        await rt._shutdown()
        except BaseExceptionGroup as errors:
            # Task groups wrap even a lone error (the caller's own, or ModelError at start): unwrap it.
            lone = errors
            while isinstance(lone, BaseExceptionGroup) and len(lone.exceptions) == 1:
                lone = lone.exceptions[0]
            if isinstance(lone, BaseExceptionGroup):
                raise
            raise lone from None

    @staticmethod
    def follow(
        group: mx.distributed.Group,
        model: str = "smollm2",
        cache_dir: str | Path | None = None,
        budget: int | None = None,
        *,
        models: Iterable[str] = (),
        engine: EngineOptions = EngineOptions(),
    ) -> None:
        """Serve as a rank other than 0 of a sharded model, until rank 0's runtime
        closes: this rank's shard of the weights, and its shard of every agent's
        KV cache in its own files under ``cache_dir``.  Give the settings rank 0's
        ``open`` got.  Raises ``ModelError``, or ``SemanticError`` when this rank
        cannot follow rank 0."""
        catalogue = models_catalogue([model, *models])
        root = Path(cache_dir) if cache_dir is not None else agents_dir()
        follow(group, next(iter(catalogue)), catalogue, CacheStore(root), budget, engine)

    # -- the API -------------------------------------------------------------------

    def on_pruned(self, callback) -> None:
        """Call ``callback(agent_ids)`` on the event loop whenever pruning removes
        anonymous conversations whole (their ids are free again)."""
        self._prune_listeners.append(callback)

    def on_turn(self, callback) -> None:
        """Call ``callback(agent_id, turn_id, result)`` on the event loop whenever a
        turn of any agent ends (cancelled ones included; failed ones not), before
        its reader sees the end.  ``turn_id`` is its ``Reply.turn_id``.  Callbacks
        must be quick and must not raise."""
        self._turn_listeners.append(callback)

    async def demote(self, agent_id: str) -> None:
        """Move the agent's hot cache to disk: written first if it is dirty, then
        dropped from memory once idle (a turn running keeps it; the eviction
        actor's rules apply).  Returns once the GPU actor has the request; the
        hot set changes when it has been served.  Raises ``InvalidAgentId``,
        ``RuntimeClosed``."""
        validate_agent_id(agent_id)
        self.check_open()
        await self.flush()  # a clean cache is the only kind demoted (the written version stays)
        self._gpu.submit(Demote((agent_id,)))

    async def agent(self, agent_id: str, system: str | None = None) -> Agent:
        """Open an agent, creating it if new (with ``system`` as its system prompt).

        An existing agent keeps its history; ``system`` must then match its
        system prompt or be None.  Raises ``InvalidAgentId``, ``AgentExists``
        (another system prompt), ``RuntimeClosed``.  Cancelling the caller does not
        undo the creation once the agent's actor has it.
        """
        validate_agent_id(agent_id)
        self.check_open()
        slot = await self._slot(agent_id)
        raise_failed(await request(lambda r: self.deliver(slot, Open(system, r))))
        return Agent(self, slot)

    async def handle(self, agent_id: str) -> Agent:
        """A handle on ``agent_id`` without a message to its actor: its first turn
        creates the agent if it is new (as ``agent`` with no system prompt does),
        so a turn takes one message.  Its ``history`` is what the agent's actor
        last loaded or wrote (empty before); open the agent with ``agent`` to
        read it first.  Raises ``InvalidAgentId``, ``RuntimeClosed``."""
        validate_agent_id(agent_id)
        self.check_open()
        return Agent(self, await self._slot(agent_id))

    async def swap_model(self, model: str | LoadedModel) -> str:
        """Swap the model: turns in flight finish, new ones wait; every dirty cache
        is written; the old model is unloaded and ``model`` loaded.  Agents keep
        their histories; each model keeps its own caches on disk.  Returns the new
        model's name.  Raises ``ModelError`` (the old model is back), ``RuntimeClosed``."""
        self.check_open()
        return raise_failed(await request(lambda r: self._gpu.submit(SwapModel(model, r))))

    async def flush(self) -> None:
        """Return once every cache and history of every turn ended so far is on disk
        (works on an unhealthy runtime too)."""
        self.check_open(unhealthy_ok=True)
        raise_failed(await request(lambda r: self._gpu.submit(FlushCaches(r))))
        raise_failed(await request(lambda r: self._persistence.mailbox.send_nowait(Flush(r))))

    async def check_new(self, agent_id: str) -> None:
        """Raise ``AgentExists`` unless this runtime holds nothing of ``agent_id``:
        no agent, and no file (a crash between a first cache and its history)."""
        if await self.agents(only=agent_id):
            raise AgentExists(f"agent {agent_id!r} exists on this server; delete it first to replace it")
        if await anyio.to_thread.run_sync(agent_files, self.cache_dir, agent_id):
            raise AgentExists(f"this server holds cache files of {agent_id!r} but no history; remove them first "
                              f"('semantic cache rm {agent_id}', the server stopped)")

    async def import_archive(self, archive: str | os.PathLike | AsyncIterable[bytes], agent_id: str, *,
                             size: int | None = None) -> Summary:
        """Put the agent in ``archive`` -- a file (``semantic cache export``), or
        its bytes as they arrive (``size`` of them, when known) -- into the cache
        directory; ``agent_id`` must be the one it holds, and new here
        (``check_new``). Bytes are received into a temp file outside the cache
        directory first, within the disk budget. The archive goes in through the
        persistence actor: in line with its writes, checked whole first, within
        the disk budget. Raises ``ArchiveError``, ``AgentExists``, ``NoRoom``,
        ``OSError``, ``RuntimeClosed``; on any of them the directory is as it was."""
        self.check_open()
        if isinstance(archive, (str, os.PathLike)):
            return await self._import(Path(archive), agent_id)
        await self.check_new(agent_id)  # before the upload: no need to wait for it to say no
        upload = await receive_upload(archive, size, self._persistence.disk_budget)
        try:
            return await self._import(upload, agent_id)
        finally:
            upload.unlink(missing_ok=True)

    async def _import(self, archive: Path, agent_id: str) -> Summary:
        async with self._importing:  # one at a time: its check that the agent is new holds until it is in
            await self.check_new(agent_id)
            size = (await anyio.Path(archive).stat()).st_size
            return raise_failed(await request(
                lambda r: self._persistence.mailbox.send_nowait(ImportArchive(archive, agent_id, size, r))))

    # -- for Agent handles: with check_model, all they ask of the runtime --------------

    def check_open(self, unhealthy_ok: bool = False) -> None:
        """Raise ``RuntimeClosed`` once the runtime is closing, and the GPU actor's
        error once it failed (unless ``unhealthy_ok``)."""
        if self._closing:
            raise RuntimeClosed("the runtime is closed")
        if self._gpu.error is not None and not unhealthy_ok:
            raise self._gpu.error

    def deliver(self, slot: AgentSlot, message: AgentCommand) -> None:
        """Put a message in the agent's mailbox, starting its actor if none runs.
        Raises ``AgentGone``, ``AgentExists`` (a fork is creating it), ``RuntimeClosed``."""
        if slot.deleted:
            raise AgentGone(f"agent {slot.agent_id!r} was deleted; open it again with Runtime.agent")
        if slot.reserved:
            raise AgentExists(f"agent {slot.agent_id!r} is being created by a fork")
        if self._closing:
            raise RuntimeClosed("the runtime is closed")
        if slot.mailbox is None:
            send, receive = anyio.create_memory_object_stream(math.inf)
            slot.mailbox, slot.stopped, slot.wakeup = send, anyio.Event(), None
            self._tg.start_soon(_shielded_agent, AgentActor(slot, receive, self._ctx), name=f"agent {slot.agent_id}")
        slot.mailbox.send_nowait(message)
        if slot.wakeup is not None:
            slot.wakeup.set()

    def queue_turn(self, slot: AgentSlot,
                   message: Callable[[int, MemoryObjectSendStream[TurnEvent]], Send]) -> Reply:
        """Number a new turn of the agent in ``slot``, deliver the ``Send`` that
        ``message(turn_id, reply)`` builds for it, and return the turn's stream."""
        turn_id = next(self._turn_ids)
        reply, events = anyio.create_memory_object_stream[TurnEvent](math.inf)
        try:
            self.deliver(slot, message(turn_id, reply))
        except BaseException:
            reply.close()
            events.close()
            raise
        return Reply(turn_id, events, self._gpu)

    async def fork(self, source: AgentSlot, target: str) -> Agent:
        """A new agent ``target`` with the history of the agent in ``source`` and a
        copy of its cache (``Agent.fork`` says what it raises)."""
        validate_agent_id(target)
        self.check_open()
        slot = await self._slot(target)
        if slot.reserved or slot.exists or slot.mailbox is not None:
            raise AgentExists(f"agent {target!r} exists; fork to a new id")
        slot.reserved = True
        try:
            if raise_failed(await request(lambda r: self._persistence.mailbox.send_nowait(ReadHistory(target, r)))):
                raise AgentExists(f"agent {target!r} exists; fork to a new id")
            history = raise_failed(await request(lambda r: self.deliver(source, Fork(target, r))))
            slot.history, slot.exists = history, True  # no actor owns it yet: we create it
            self._persistence.mailbox.send_nowait(HistoryBytes(target, encode_history(target, history)))
        except BaseException:
            self._release(slot)
            raise
        finally:
            slot.reserved = False
        return Agent(self, slot)

    # -- internals ---------------------------------------------------------------------

    async def _slot(self, agent_id: str) -> AgentSlot:
        while (slot := self._slots.get(agent_id)) is not None and slot.deleted:
            await slot.stopped.wait()  # its files are being deleted: start afresh after
        if slot is None:
            slot = self._slots[agent_id] = AgentSlot(agent_id)
        return slot

    def _turn_ended(self, agent_id: str, turn_id: int, result: TurnResult) -> None:
        for callback in self._turn_listeners:
            try:
                callback(agent_id, turn_id, result)
            except Exception:  # an observer's bug must not end the agent's actor
                log.exception("a turn observer failed")

    def _release(self, slot: AgentSlot) -> None:
        if self._slots.get(slot.agent_id) is slot:
            del self._slots[slot.agent_id]

    def _live_agents(self) -> set[str]:
        """Agents whose files pruning leaves alone: an actor runs for them (a turn, or
        idle for less than ``agent_idle_s``) or a fork is creating them."""
        return {i for i, s in self._slots.items() if s.mailbox is not None or s.reserved}

    def _forget_pruned(self, agent_ids: list[str]) -> None:
        """Pruning removed these conversations' files: drop their retired slots too, so
        their histories leave memory and a later ``agent()`` starts them afresh."""
        for agent_id in agent_ids:
            slot = self._slots.get(agent_id)
            if slot is not None and slot.mailbox is None and not slot.reserved:
                slot.deleted, slot.history = True, ()  # old handles get AgentGone
                del self._slots[agent_id]
        for callback in self._prune_listeners:
            callback(agent_ids)

    async def _shutdown(self) -> None:
        self._closing = True
        gpu, persistence, eviction = self._gpu, self._persistence, self._eviction
        if gpu in self._started:
            await gpu.stop()  # turns in flight end (cancelled); dirty caches go to persistence
        for slot in list(self._slots.values()):
            if slot.mailbox is not None:
                slot.mailbox.close()  # the actor refuses what is queued, then ends
                if slot.wakeup is not None:
                    slot.wakeup.set()
        for slot in list(self._slots.values()):
            if slot.stopped is not None:
                await slot.stopped.wait()
        for actor in (persistence, eviction):
            if actor in self._started:
                try:
                    actor.mailbox.send_nowait(Stop())  # it ends after the pending work, closing its mailbox
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass  # it has ended already


async def _shielded(run, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
    """Run an actor out of reach of outside cancellation: the runtime stops it in order."""
    with anyio.CancelScope(shield=True):
        await run(task_status=task_status)


async def _shielded_agent(actor: AgentActor) -> None:
    with anyio.CancelScope(shield=True):
        await actor.run()
