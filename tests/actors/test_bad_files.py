"""Bad cache files through the runtime: a block file that is corrupt or missing,
or a manifest that points past its blocks.  The persistence actor finds it
when it reads the cache for a turn; the agent starts cold with one warning
(the cache is quarantined), the turn succeeds, and the next turn is served
from the cache that turn wrote."""

from __future__ import annotations

import json
import logging

import pytest

from semantic.actors import Runtime
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import MANIFEST
from tests.web.live import tiny_loaded

pytestmark = pytest.mark.anyio


def corrupt(directory) -> None:
    block = directory / json.loads((directory / MANIFEST).read_text())["blocks"][0]["file"]
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))


def missing(directory) -> None:
    (directory / json.loads((directory / MANIFEST).read_text())["blocks"][0]["file"]).unlink()


def past_the_blocks(directory) -> None:
    manifest = json.loads((directory / MANIFEST).read_text())
    manifest["token_count"] += 300  # more tokens than its blocks hold
    (directory / MANIFEST).write_text(json.dumps(manifest))


@pytest.mark.slow
@pytest.mark.parametrize("damage", [corrupt, missing, past_the_blocks])
async def test_a_bad_cache_file_starts_the_agent_cold_once(tmp_path, caplog, damage):
    loaded = tiny_loaded()
    async with Runtime.open(loaded, tmp_path) as rt:
        agent = await rt.agent("a", system="You are terse.")
        await agent.reply("Hello there.", max_tokens=8)
    damage(CacheStore(tmp_path).agent_dir("a", loaded.name))
    caplog.clear()
    async with Runtime.open(loaded, tmp_path) as rt:
        agent = await rt.agent("a")
        async with agent.send("Go on.", max_tokens=8) as reply:
            assert await reply.text()
        assert reply.result.reused_tokens == 0  # cold: the file was not used
        async with agent.send("And then?", max_tokens=8) as reply:
            await reply.text()
        assert reply.result.reused_tokens > 0  # the cold turn's cache
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name == "semantic.cache"]
    assert len(warnings) == 1 and "starts cold" in warnings[0], warnings
    assert len(list((tmp_path / CacheStore.QUARANTINE).iterdir())) == 1
