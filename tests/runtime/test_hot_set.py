"""The hot set's one record per agent (``runtime.memory.agent_cache.AgentEntry``) through
its life on the GPU thread's disk, which writes behind and reads ahead: a write
is durable only when its own answer comes, a newer version supersedes it, a
dirty cache that must leave memory goes with its write on its way, a refused
write goes again whole, a file read ahead is taken by the checkout, and an
entry with nothing left to know is forgotten."""

from __future__ import annotations

import logging

import pytest

from semantic.runtime.memory.agent_cache import AgentCaches
from semantic.runtime.memory.block_pool import KVBudget
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import BlockUpdate
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.model.model_spec import ModelCacheSpec
from semantic.runtime.memory.turns import run_turn
from tests.tiny import tiny_model_with_tokenizer

ARCH = "llama"


class BehindDisk:
    """A ``CacheDisk`` like the GPU actor's: writes are numbered and land only
    when the test says (``land``); reads happen only ahead (``read`` finds none)."""

    def __init__(self, store: CacheStore):
        self.store, self.updates, self.reads = store, {}, 0

    def exists(self, agent_id, model_id):
        return self.store.exists(agent_id, model_id)

    def read(self, agent_id, model_id, spec_hash):
        self.reads += 1
        return None

    def write(self, update: BlockUpdate) -> int:
        self.updates[number := len(self.updates) + 1] = update
        return number

    def delete(self, agent_id, model_id):
        pass

    def land(self, number: int) -> None:
        self.store.write(self.updates[number])


@pytest.fixture
def setup(tmp_path):
    model, tok = tiny_model_with_tokenizer(ARCH)
    spec = ModelCacheSpec.from_model(model)
    disk = BehindDisk(CacheStore(tmp_path))
    caches = AgentCaches(disk, ARCH, spec, KVBudget(spec, 64 << 20, sliding_dtype_bytes=4))
    return Engine(model, tok), caches, disk


def turn(engine, caches, agent_id: str, text: str):
    return run_turn(engine, caches, agent_id, [{"role": "user", "content": text}], SamplingParams(max_tokens=4))


def test_a_cache_is_clean_only_when_its_own_write_lands(setup):
    engine, caches, disk = setup
    turn(engine, caches, "ann", "Name a river.")
    assert caches.entry("ann").dirty and caches.hand_over("ann")
    e = caches.entry("ann")
    assert e.pending == 1 and e.dirty and not caches.hand_over("ann")  # one write on its way at a time
    turn(engine, caches, "ann", "Name a river. And another.")  # a newer version before the first lands
    assert caches.hand_over("ann") and e.pending == 2
    disk.land(1)
    assert not caches.written("ann", 1, ok=True) and e.dirty  # superseded: says nothing of the newer one
    disk.land(2)
    assert caches.written("ann", 2, ok=True) and not e.dirty and e.pending is None


def test_a_dirty_cache_demoted_leaves_with_its_write_and_a_failed_one_is_told(setup, caplog):
    engine, caches, disk = setup
    turn(engine, caches, "bob", "Name a mountain.")
    caches.demote("bob")  # to make room: its write begins as it leaves
    e = caches.entry("bob")
    assert e is not None and e.memory is None and e.pending == 1 and caches.peek("bob") is None
    with caplog.at_level(logging.WARNING, "semantic.runtime"):
        assert not caches.written("bob", 1, ok=False)
    assert "could not be written and has left memory" in caplog.text
    assert caches.entry("bob") is None  # nothing left to know: forgotten
    turn(engine, caches, "cat", "Name a lake.")
    caches.demote("cat")
    disk.land(2)
    assert caches.written("cat", 2, ok=True) and caches.entry("cat") is None and caches.tier("cat") == "warm"


def test_a_refused_write_goes_again_whole(setup):
    engine, caches, disk = setup
    turn(engine, caches, "dan", "Tell me about lighthouses. " * 60)  # more than one block
    caches.hand_over("dan")
    disk.land(1)
    caches.written("dan", 1, ok=True)
    turn(engine, caches, "dan", "Tell me about lighthouses. " * 60 + "And boats?")
    caches.hand_over("dan")
    assert disk.updates[2].first >= 1  # only its new blocks ...
    assert not caches.written("dan", 2, ok=False, stale=True)  # ... refused: the earlier ones left the disk
    e = caches.entry("dan")
    assert e.pending == 3 and disk.updates[3].first == 0 and e.dirty  # handed over again, whole


def test_a_file_read_ahead_is_taken_by_the_checkout_and_unwanted_reads_are_forgotten(setup, tmp_path):
    engine, caches, disk = setup
    turn(engine, caches, "eve", "Name a forest.")
    caches.hand_over("eve")
    disk.land(1)
    caches.written("eve", 1, ok=True)
    caches.demote("eve")
    assert caches.entry("eve") is None and caches.want("eve") and not caches.want("eve")  # asked once
    assert caches.reading("eve")
    caches.arrived("eve", disk.store.read("eve", ARCH, caches.spec.hash))
    assert not caches.reading("eve") and not caches.want("eve")
    disk.reads = 0
    r = turn(engine, caches, "eve", "Name a forest. And a desert?")
    assert r.reused_tokens > 0 and disk.reads == 0  # from what was read ahead, not read now
    for i in range(50):  # asked for, then left: nothing stays behind
        assert caches.want(f"gone-{i}")
        caches.unwant(f"gone-{i}")
        caches.arrived(f"gone-{i}", None)  # its answer comes late: dropped
        assert caches.entry(f"gone-{i}") is None
    caches.delete("eve")
    assert caches.entry("eve") is None and not caches.written("eve", 1, ok=True)
