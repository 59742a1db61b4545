"""A KV budget of a few agents' worth, over HTTP: many agents with system prompts
of their own, one request at a time, never fail while memory could be freed; a
request that truly cannot fit is a 503 that names what holds the memory."""

from __future__ import annotations

import httpx
import pytest

from .live import kv_bytes, live_server

pytestmark = [pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["trio"])]  # both: tests/actors


@pytest.mark.slow
async def test_sixty_turns_with_distinct_system_prompts_all_succeed(tmp_path):
    """24 agents with short system prompts of their own, then 6 with long ones,
    two rounds, one request at a time, in a budget of one running turn's block
    and 4 idle blocks (~1K tokens): every turn succeeds.  (Before: shared system prompts filled the budget and nothing
    could free them; each turn reserved its whole ``max_tokens`` up front.)"""
    short = [f"You are helper number {i}. Answer in one short sentence." for i in range(24)]
    long = [f"You are expert {i}. " + " ".join(f"Rule {k}: mind topic {i * 100 + k}." for k in range(12))
            for i in range(6)]  # ~150 tokens
    agents = [(f"short-{i}", s) for i, s in enumerate(short)] + [(f"long-{i}", s) for i, s in enumerate(long)]
    failures = []
    async with httpx.AsyncClient(timeout=120) as http:
        async with live_server(tmp_path / "cache", budget=kv_bytes(1) + kv_bytes(4, running=False)) as url:
            for who, system in agents:
                r = await http.post(f"{url}/v1/agents", json={"id": who, "system": system})
                assert r.status_code == 201, r.text
            for question in ("Name a fruit.", "Why that one?"):
                for who, _ in agents:
                    r = await http.post(f"{url}/v1/agents/{who}/messages",
                                        json={"content": question, "max_tokens": 64})
                    if r.status_code != 200:
                        failures.append((who, r.status_code, r.text))
            health = (await http.get(f"{url}/health")).json()
    assert not failures, f"{len(failures)} of 60 turns failed: {failures[:3]}"
    assert health["memory"]["hot_bytes"] <= health["memory"]["budget_bytes"]


async def test_a_turn_that_can_never_fit_is_a_503_naming_what_holds_the_memory(tmp_path):
    """A prompt larger than the whole budget is refused with 503 and a message
    that says what it needs and what the budget is."""
    async with httpx.AsyncClient(timeout=120) as http:
        async with live_server(tmp_path / "cache", budget=kv_bytes(1)) as url:
            r = await http.post(f"{url}/v1/agents", json={"id": "big", "system": "word " * 400})
            assert r.status_code == 201
            r = await http.post(f"{url}/v1/agents/big/messages", json={"content": "Hi.", "max_tokens": 4})
    assert r.status_code == 503, r.text
    message = r.json()["error"]["message"]
    assert "KV" in message and "budget" in message, message
