"""(GPU thread) Requests about agents' hot caches that are not turns: fork,
drop (the agent is deleted) and demote (the eviction actor's choice)."""

from __future__ import annotations

from semantic.runtime.memory.agent_cache import AgentMemory

from .messages import ForkCache

__all__ = ["CacheCommands"]


class CacheCommands:
    def __init__(self, registry, reads, on_hot_changed):
        self.registry = registry
        self.reads = reads  # the scheduler's ``ReadAhead``
        self.on_hot_changed = on_hot_changed
        self.forks: list[ForkCache] = []  # waiting for their source's cache to be read

    def ready_forks(self, every: bool = False) -> list[ForkCache]:
        """Take the forks whose source cache is in memory (hot, or read ahead) and
        ask for the others' sources (with the model loaded); ``every``: take them all."""
        ready = []
        for cmd in list(self.forks):
            if not every:
                self.reads.want(cmd.source)
            if every or not self.reads.reading(cmd.source):
                self.forks.remove(cmd)
                ready.append(cmd)
        return ready

    def fork(self, source: str, target: str) -> bool:
        """Copy ``source``'s cache to ``target`` (sharing arrays until either grows).
        True if there was a cache to copy."""
        caches = self.registry.caches
        caches.delete(target)  # a stale cache under the new id: the fork's files replace its files
        memory = caches.checkout(source)
        if memory is None:
            caches.abandon(source)
            return False
        copy = AgentMemory(target, list(memory.tokens), memory.text, memory.cache.clone(), memory.created)
        caches.putback(source, memory)  # unchanged
        caches.checkin(copy)
        caches.hand_over(target)
        self.on_hot_changed()
        return True

    def drop(self, agent_id: str) -> None:
        """Forget an agent's hot cache (the agent is deleted; the persistence actor's
        ``Forget`` deletes its files, after the writes queued before it)."""
        caches = self.registry.caches
        if caches is not None:
            assert not caches.busy(agent_id), "delete during a turn: the agent actor serialises them"
            caches.delete(agent_id)
            self.on_hot_changed()

    def demote(self, agent_ids) -> None:
        """Move these idle, clean caches to disk (drop these shared prefixes)."""
        caches = self.registry.caches
        if caches is None:
            return
        idle = {o.owner: o for o in caches.idle_owners()}
        for owner in agent_ids:
            if owner in idle and not idle[owner].dirty:
                caches.demote(owner)
        self.on_hot_changed()
