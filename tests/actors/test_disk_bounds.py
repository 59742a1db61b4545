"""The runtime's disk bounds on a tiny model: a turn succeeds on a full disk
(the last good files stay, the cache is written once there is room), and old
conversations leave the runtime with their files while named and live agents
stay."""

from __future__ import annotations

import logging
import shutil
from collections import namedtuple

import anyio
import pytest

from semantic.actors import AgentGone, Runtime
from semantic.actors.persistence import history_path
from semantic.runtime.store.cache_file import CacheStore
from tests.web.live import tiny_loaded

pytestmark = pytest.mark.anyio

Usage = namedtuple("Usage", "total used free")


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()  # load once, outside any test's timing


def open_runtime(tmp_path, **options):
    return Runtime.open(tiny_loaded(), tmp_path / "cache", 64 << 20, **options)


async def test_a_turn_succeeds_on_a_full_disk_and_its_cache_is_written_once_there_is_room(
        tmp_path, monkeypatch, caplog):
    async with open_runtime(tmp_path) as rt:
        alice = await rt.agent("alice", system="Be brief.")
        await alice.reply("Hello", max_tokens=4)
        await rt.flush()
        store = CacheStore(rt.cache_dir)
        first = store.info("alice", "tiny")["tokens"]
        history = history_path(rt.cache_dir / "histories", "alice").read_bytes()

        monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(100 << 30, 100 << 30, 1 << 20))
        caplog.set_level(logging.WARNING, "semantic.actors")
        text = await alice.reply("Again", max_tokens=4)  # the turn itself succeeds
        await rt.flush()
        assert alice.last_result.reason in ("stop", "length") and alice.history[-1].content == text
        assert store.info("alice", "tiny")["tokens"] == first  # the last good file
        assert history_path(rt.cache_dir / "histories", "alice").read_bytes() == history
        assert any("'alice'" in r.getMessage() and "1.0 MiB free" in r.getMessage() for r in caplog.records)
        assert rt.disk()["failed_writes"] >= 2

        monkeypatch.undo()
        await rt.flush()  # the cache stayed dirty in memory: written now
        assert store.info("alice", "tiny")["tokens"] > first
        assert not list(rt.cache_dir.rglob(".tmp-*"))


@pytest.mark.slow
async def test_old_conversations_leave_the_runtime_and_named_and_live_agents_stay(tmp_path):
    options = dict(conversation_ttl_s=1.0, prune_interval_s=0.1, agent_idle_s=0.3)
    async with open_runtime(tmp_path, **options) as rt:
        told = []
        rt.on_pruned(told.extend)
        histories, store = rt.cache_dir / "histories", CacheStore(rt.cache_dir)
        old, named, live = [await rt.agent(i) for i in ("conv-old", "named", "conv-live")]
        for agent in (old, named, live):
            await agent.reply("Hi", max_tokens=2)
        await rt.flush()
        with anyio.fail_after(20):
            while not told:
                await rt.agent("conv-live")  # its actor keeps running: live, though unused
                await anyio.sleep(0.05)
        assert told == ["conv-old"] and not store.exists("conv-old", "tiny")
        assert not history_path(histories, "conv-old").exists()
        assert history_path(histories, "conv-live").exists() and store.exists("conv-live", "tiny")
        assert history_path(histories, "named").exists() and store.exists("named", "tiny")
        assert {a.id for a in await rt.agents()} == {"conv-live", "named"}
        with pytest.raises(AgentGone):
            await old.reply("Still there?", max_tokens=2)
        with anyio.fail_after(20):  # once its actor retires, conv-live goes too
            while len(told) < 2:
                await anyio.sleep(0.05)
        assert told == ["conv-old", "conv-live"] and not history_path(histories, "conv-live").exists()
        assert rt.disk()["pruned_files"] == 4
        assert history_path(histories, "named").exists()
        assert (await rt.agent("conv-old")).history == ()  # the id starts afresh
