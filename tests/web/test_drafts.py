"""Drafts verified while decoding (``runtime.engine.speculation``), as the routes
report them: the reply is the one without drafts, and usage, ``/metrics``,
the dashboard's turn record and ``/health`` say what was drafted and taken.

Which drafts a tiny random model takes is not known ahead, so the engine's
drafter is replaced by one that recalls the conversations it has seen: an
agent asked what an earlier one was asked gets the earlier reply as drafts,
every fourth token wrong (so some are cut)."""

from __future__ import annotations

import anyio
import pytest

from semantic.actors import EngineOptions
from semantic.runtime.engine import engine as engine_module
from semantic.runtime.engine.speculation import Drafter

from .live import client, live_server

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

ASK = "Tell me about the sea."


class Recalling(Drafter):
    seen: list[Drafter] = []
    rate = 0.99  # claimed, so that its drafts are verified (``choose_drafts``)

    def __init__(self, history, indents):
        super().__init__(history, indents)
        Recalling.seen.append(self)

    def offer(self, limit):
        mine = self.tokens
        for other in Recalling.seen:
            if other is not self and len(other.tokens) > len(mine) and other.tokens[: len(mine)] == mine:
                drafts = other.tokens[len(mine) : len(mine) + limit]
                return [t if (len(mine) + j) % 4 else t + 1 for j, t in enumerate(drafts)]
        return []


@pytest.fixture
def recalling(monkeypatch):
    Recalling.seen = []
    monkeypatch.setattr(engine_module, "Drafter", Recalling)


async def test_usage_reports_drafts_and_the_reply_is_unchanged(tmp_path, recalling):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            first = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}],
                                              max_tokens=40, extra_headers={"X-Agent-Id": "one"})
            again = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": ASK}],
                                              max_tokens=40, extra_headers={"X-Agent-Id": "two"})
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as c:
            message = c.messages.create(model="tiny", max_tokens=40, messages=[{"role": "user", "content": ASK}],
                                        extra_headers={"X-Agent-Id": "three"})
        return first, again, message

    async with live_server(tmp_path) as url, client(url) as http:
        with anyio.fail_after(120):
            first, again, message = await anyio.to_thread.run_sync(ask, url)
        await http.post("/v1/agents", json={"id": "four"})
        turn = (await http.post("/v1/agents/four/messages", json={"content": ASK, "max_tokens": 40})).json()
        metrics = (await http.get("/metrics")).text
        health = (await http.get("/health")).json()

    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.completion_tokens_details.accepted_prediction_tokens == 0  # nothing recalled yet
    details = again.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and details.rejected_prediction_tokens > 0
    usage = message.usage.model_dump()
    assert usage["drafted_tokens"] > usage["accepted_tokens"] > 0
    assert turn["usage"]["drafted_tokens"] > turn["usage"]["accepted_tokens"] > 0
    accepted = sum(n.accepted_prediction_tokens for n in (details,)) + usage["accepted_tokens"] + \
        turn["usage"]["accepted_tokens"]
    assert f'semantic_draft_tokens_total{{verdict="accepted"}} {float(accepted)}' in metrics
    assert health["speculation"] is True


async def test_speculation_off(tmp_path, recalling):
    async with live_server(tmp_path, engine=EngineOptions(speculation=False)) as url, client(url) as http:
        for agent in ("one", "two"):
            await http.post("/v1/agents", json={"id": agent})
            turn = (await http.post(f"/v1/agents/{agent}/messages", json={"content": ASK, "max_tokens": 20})).json()
            assert turn["usage"]["drafted_tokens"] == 0
        assert (await http.get("/health")).json()["speculation"] is False
    assert not Recalling.seen  # no drafter was made
