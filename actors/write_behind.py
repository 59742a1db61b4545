"""(GPU thread) Hot caches leave for disk as bytes, behind the turns.

``WriteBehind`` is the ``CacheDisk`` of the GPU actor's hot set: when a turn
ends, the hot set copies out the blocks of its cache that are not on disk
yet (``AgentCaches.hand_over``: no hashing, no file I/O) and this posts them
to the persistence actor (``CacheBlocks``), numbered.  The cache is dirty
until that write is durable (``CacheWritten``, which the GPU thread passes
to ``AgentCaches.written``).  A dirty cache that must leave memory (demoted
to make room) is handed over the same way and dropped: the persistence actor
holds its bytes until they are written, and reads an agent only after its
queued writes, so nothing here waits for the disk.

It reads nothing itself: a waiting turn's file is read ahead by the
persistence actor (``ReadCache``), and a checkout that finds none read
starts cold.  It deletes nothing either: the persistence actor's ``Forget``
does, in line with the writes queued before it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from semantic.runtime.store.cache_codec import HostCache
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import BlockUpdate

from .messages import CacheBlocks

__all__ = ["WriteBehind"]


class WriteBehind:
    def __init__(self, store: CacheStore, send: Callable[[CacheBlocks], None]):
        self.store = store  # only to say whether a file is there (a stat)
        self.send = send  # posts to the persistence actor
        self.numbers = itertools.count(1)  # one sequence for every model: an answer never matches another's

    def exists(self, agent_id: str, model_id: str) -> bool:
        return self.store.exists(agent_id, model_id)

    def read(self, agent_id: str, model_id: str, spec_hash: str) -> HostCache | None:
        return None

    def write(self, update: BlockUpdate) -> int:
        number = next(self.numbers)
        self.send(CacheBlocks(update.agent_id, update.model_id, number, update))
        return number

    def delete(self, agent_id: str, model_id: str) -> None:
        pass
