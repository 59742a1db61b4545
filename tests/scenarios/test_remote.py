"""Scenarios through a real ``semantic serve`` app over HTTP (the agent API):
the same greedy transcript and cache reuse as in process, and conversations
deleted on the server when they close."""

from __future__ import annotations

import httpx
import pytest

from semantic.actors import Runtime
from semantic.scenarios import runner
from semantic.scenarios.local import LocalBackend
from semantic.scenarios.remote import remote_backend
from tests.web.live import live_server

from .test_local import SCENARIO

pytestmark = [pytest.mark.model, pytest.mark.anyio]


@pytest.mark.slow
async def test_http_run_matches_the_in_process_run(smollm2, tmp_path):
    async with Runtime.open(smollm2, cache_dir=tmp_path / "local", budget=64 << 20) as rt:
        local = await runner.run(SCENARIO, LocalBackend(rt), run_id="l", seed=1)
    async with live_server(tmp_path / "served", model=smollm2) as url:
        async with remote_backend(url) as backend:
            remote = await runner.run(SCENARIO, backend, run_id="r", seed=1)
        async with httpx.AsyncClient(base_url=url) as client:
            listed = (await client.get("/v1/agents")).json()
    remote_results, local_results = [t.result for t in remote.turns], [t.result for t in local.turns]
    assert [r.text for r in remote_results] == [r.text for r in local_results]
    assert [(r.prompt_tokens, r.reused_tokens, r.output_tokens) for r in remote_results] == \
        [(r.prompt_tokens, r.reused_tokens, r.output_tokens) for r in local_results]
    assert all(r.ttft_s > 0 and r.decode_s is not None for r in remote_results)
    assert not any(a["id"].startswith("scn.") for a in listed["agents"]), "closed conversations are deleted"


async def test_a_failing_turn_is_a_clear_error(smollm2, tmp_path):
    from semantic.runtime.errors import SemanticError
    from semantic.scenarios.backend import Sampling

    async with live_server(tmp_path, model=smollm2) as url, remote_backend(url) as backend:
        agent = await backend.open_agent("ann", "You are Ann.", "scn.x.y.ann")
        with pytest.raises(SemanticError, match="400"):
            async for _ in agent.turn("word " * 10000, Sampling(max_tokens=4)):
                pass
        await agent.close()
