"""One model sharded over the ranks of an ``mx.distributed`` group (tensor
parallel), every rank's GPU thread acting in lockstep.

Rank 0 runs the whole runtime (actors, HTTP).  Its GPU thread is a state
machine driven by inputs: the commands it takes from its inbox and the ticks
of its own loop (``actors.gpu_thread``: ``PROGRESS``, ``STEP``, ``IDLE``,
``Failure``).  Before it acts on one, rank 0 broadcasts it over the group
(``Lockstep.send``); every other rank runs only a GPU thread
(``actors.gpu.follow``) that acts on the same inputs in the same order.  So
each rank's engine runs the same forwards (the sharded layers meet in their
all-reduces), and its hot caches, budget and writes follow rank 0's, for its
own shard of every agent's KV cache (its KV heads), kept in its own files
(``cache_model_id`` names the rank).

What would differ between ranks is made the same on the wire:

* a warm cache is each rank's own file: rank 0 sends the tokens it read,
  every rank reads its own, and they use them only if every rank has them
  (``agree``); otherwise the agent starts cold everywhere;
* a sampler seed left to chance is drawn on rank 0 and sent;
* replies and the other actors' mailboxes exist only on rank 0: a follower
  drops what its thread posts, except cache writes, which go to its own
  store at once.

A rank that fails ends its process; ``mlx.launch`` then ends every rank.
A collective whose peer died never returns, so rank 0 cannot fail over:
``watch`` marks rank 0 unhealthy and then ends it (and so the group) when one
input takes longer than ``rank_timeout_s``, with a message that says why.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import random
import threading
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np
from anyio.streams.memory import MemoryObjectSendStream

from semantic.runtime.memory.model_caches import shard_suffix
from semantic.runtime.store.cache_codec import HostCache

from .errors import RuntimeUnhealthy
from .messages import BeginTurn, CacheRead, GpuDown

__all__ = ["Lockstep", "watch"]

log = logging.getLogger("semantic.actors")

_FRAME = 4096  # bytes of the first all-reduce of a broadcast: most inputs fit in one


@dataclass(frozen=True)
class _Tokens:
    """A warm cache on the wire: the tokens rank 0 read (each rank reads its own shard)."""

    tokens: tuple[int, ...]


class Lockstep:
    """Broadcasts the GPU thread's inputs from rank 0 to the other ranks of ``group``."""

    def __init__(self, group: mx.distributed.Group):
        self.group = group

    @property
    def rank(self) -> int:
        return self.group.rank()

    def send(self, event):
        """(Rank 0) Broadcast an input; return it as every rank will act on it."""
        if isinstance(event, BeginTurn) and event.request.sampling.seed is None:
            sampling = replace(event.request.sampling, seed=random.getrandbits(32))
            event = replace(event, request=replace(event.request, sampling=sampling))
        self._broadcast(_dumps(event))
        if isinstance(event, CacheRead) and event.cache is not None and not self.agree(True):
            log.warning("a rank lacks its shard of %s's cache: the agent starts cold", event.agent_id)
            event = replace(event, cache=None)
        return event

    def receive(self, read_own):
        """(Other ranks) The next input, with this rank's own shard of a warm cache
        (``read_own(agent_id)``: a ``HostCache`` or None)."""
        event = pickle.loads(self._broadcast(None))
        if isinstance(event, CacheRead):  # rank 0's model id names rank 0's files: this rank reads its own
            ranks = self.group.size()
            model_id = event.model_id.removesuffix(shard_suffix(0, ranks)) + shard_suffix(self.rank, ranks)
            own = None
            if event.cache is not None:
                own = read_own(event.agent_id)
                own = own if self.agree(own is not None and tuple(own.tokens) == event.cache.tokens) else None
            event = replace(event, model_id=model_id, cache=own)
        return event

    def rank0_tokens(self, tokens: mx.array) -> mx.array:
        """(Every rank, in the engine's graph) The tokens rank 0 sampled: a rank on
        another CPU may round its logits differently and pick another in a near tie."""
        # Multiplied, not replaced by zeros: every rank's graph must reach this all-reduce only
        # after the model's own, or the ranks would enter their collectives in different orders.
        mine = tokens * mx.array(1 if self.rank == 0 else 0, dtype=tokens.dtype)
        return mx.distributed.all_sum(mine, group=self.group)

    def agree(self, ok: bool) -> bool:
        """(Every rank) True when ``ok`` on every rank."""
        votes = mx.distributed.all_sum(mx.array([int(ok)], dtype=mx.int32), group=self.group)
        return int(votes.item()) == self.group.size()

    def _broadcast(self, data: bytes | None) -> bytes:
        """Rank 0's ``data``, on every rank: all-reduces where the other ranks add zeros."""
        frame = np.zeros(_FRAME, np.uint8)
        if data is not None:
            head = len(data).to_bytes(8, "little") + data[: _FRAME - 8]
            frame[: len(head)] = np.frombuffer(head, np.uint8)
        frame = self._sum(frame)
        size = int.from_bytes(frame[:8].tobytes(), "little")
        rest = np.zeros(max(0, size - (_FRAME - 8)), np.uint8)
        if rest.size:
            if data is not None:
                rest[:] = np.frombuffer(data[_FRAME - 8:], np.uint8)
            rest = self._sum(rest)
        return frame[8: 8 + size].tobytes() + rest.tobytes()

    def _sum(self, buffer: np.ndarray) -> np.ndarray:
        return np.array(mx.distributed.all_sum(mx.array(buffer), group=self.group))


def watch(thread, rank_timeout_s: float, grace_s: float = 5.0) -> threading.Thread:
    """(Rank 0) Start a daemon thread that ends this process when the GPU thread has
    acted on one input for longer than ``rank_timeout_s``: a rank died or hangs, and
    the collective it left waiting never returns.  First the runtime is marked
    unhealthy with the reason (``/health`` answers 503 with it) for ``grace_s``.
    Caches are on disk as of their last write (files are replaced atomically)."""

    def run() -> None:
        while True:
            time.sleep(min(5.0, rank_timeout_s / 4))
            since = thread.acting_since
            if since is not None and time.monotonic() - since > rank_timeout_s:
                break
        reason = (f"rank 0: the other ranks have not answered for {rank_timeout_s:.0f} s (a rank died or hangs); "
                  "ending the group -- relaunch it, agents' caches are on disk")
        log.critical(reason)
        thread.post(None, GpuDown(RuntimeUnhealthy(reason)))
        time.sleep(grace_s)
        os._exit(70)

    watcher = threading.Thread(target=run, name="semantic-rank-watch", daemon=True)
    watcher.start()
    return watcher


class _Pickler(pickle.Pickler):
    """Replies stay on rank 0 (a follower has no one to answer); a warm cache travels as its tokens."""

    def reducer_override(self, obj):
        if isinstance(obj, HostCache):
            return _Tokens, (tuple(obj.tokens),)
        if isinstance(obj, MemoryObjectSendStream):
            return _no_reply, ()
        return NotImplemented


def _no_reply() -> None:
    return None


def _dumps(event) -> bytes:
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(event)
    return out.getvalue()
