"""Log-probabilities through the routes that have them, with the official
SDK where it reads them: one entry per output token, its bytes the reply's,
the likeliest alternatives sorted, the same streamed and not."""

from __future__ import annotations

import anyio
import pytest

from .live import client, live_server

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Tell me about the sea."}]


def check(entries: list[dict], text: str, top: int) -> None:
    assert b"".join(bytes(e["bytes"]) for e in entries).decode("utf-8", "replace") == text
    for e in entries:
        alternatives = e["top_logprobs"]
        assert len(alternatives) == top and e["logprob"] <= 0
        assert [a["logprob"] for a in alternatives] == sorted((a["logprob"] for a in alternatives), reverse=True)
        assert (alternatives[0]["bytes"], alternatives[0]["logprob"]) == (e["bytes"], e["logprob"])  # greedy


async def test_chat_completions_logprobs_streamed_and_not(tmp_path):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            whole = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, logprobs=True, top_logprobs=3)
            chunks = list(c.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, logprobs=True,
                                                    top_logprobs=3, stream=True))
            plain = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)
        return whole, chunks, plain

    async with live_server(tmp_path) as url:
        with anyio.fail_after(120):
            whole, chunks, plain = await anyio.to_thread.run_sync(ask, url)
    entries = [e.model_dump() for e in whole.choices[0].logprobs.content]
    check(entries, whole.choices[0].message.content, 3)
    assert len(entries) == whole.usage.completion_tokens
    streamed = [e.model_dump() for c in chunks if c.choices and c.choices[0].logprobs
                for e in c.choices[0].logprobs.content]
    assert streamed == entries
    assert plain.choices[0].logprobs is None


async def test_responses_and_agent_api_logprobs(tmp_path):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            def create(agent: str, **options):
                return c.responses.create(model="tiny", input="Tell me about the sea.", max_output_tokens=12,
                                          top_logprobs=2, include=["message.output_text.logprobs"],
                                          extra_headers={"X-Agent-Id": agent}, **options)

            return create("whole"), list(create("streamed", stream=True))

    async with live_server(tmp_path) as url, client(url) as http:
        with anyio.fail_after(120):
            response, events = await anyio.to_thread.run_sync(ask, url)
        await http.post("/v1/agents", json={"id": "sailor"})
        turn = (await http.post("/v1/agents/sailor/messages", json={
            "content": "Tell me about the sea.", "max_tokens": 12, "logprobs": 1})).json()
        bad = await http.post("/v1/agents/sailor/messages", json={"content": "x", "max_tokens": 1, "logprobs": 21})
    part = response.output[0].content[0]
    check([e.model_dump() for e in part.logprobs], part.text, 2)
    assert len(part.logprobs) == response.usage.output_tokens
    # Streamed, each text delta carries its own tokens' (no markup held back here): the same entries.
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == part.text and all(e.logprobs for e in deltas)
    assert [lp.model_dump() for e in deltas for lp in e.logprobs] == [e.model_dump() for e in part.logprobs]
    check(turn["logprobs"], turn["content"], 1)
    assert len(turn["logprobs"]) == turn["usage"]["output_tokens"]
    assert bad.status_code == 400 and "logprobs" in bad.json()["error"]["message"]
