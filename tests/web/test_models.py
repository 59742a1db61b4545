"""Model choice over HTTP: a server started with two models runs each request on
the model it names, each agent keeps a cache per model, ``/v1/models`` lists
both, and a model it does not serve is a 404 in the route's own error shape."""

from __future__ import annotations

import pytest

from .live import client, live_server, tiny_loaded

pytestmark = pytest.mark.anyio

A, B = "tiny", "tiny-1"
QUESTIONS = ["Name a colour.", "Name a fruit.", "Name a river.", "Name a city.", "Name a tree."]


@pytest.fixture(scope="module", autouse=True)
def _models():
    tiny_loaded(), tiny_loaded(seed=1)  # load once, outside any test's timing


@pytest.mark.slow
async def test_requests_alternate_between_two_models_each_from_its_own_cache(tmp_path):
    async with live_server(tmp_path, models=(tiny_loaded(seed=1),)) as url, client(url) as http:
        listed = (await http.get("/v1/models")).json()["data"]
        assert [(m["id"], m["loaded"]) for m in listed] == [(A, True), (B, False)]

        # OpenAI chat completions, stateless: the client sends the whole conversation each time.
        messages, usage = [{"role": "system", "content": "You are terse."}], []
        for i, question in enumerate(QUESTIONS):
            model = [B, A][i % 2]
            messages.append({"role": "user", "content": question})
            r = await http.post("/v1/chat/completions", headers={"x-agent-id": "alice"},
                                json={"model": model, "max_tokens": 4, "messages": messages})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["model"] == model
            messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
            usage.append(body["usage"])
            listed = (await http.get("/v1/models")).json()["data"]
            assert [m["id"] for m in listed if m["loaded"]] == [model]
        cached = [u["prompt_tokens_details"]["cached_tokens"] for u in usage]
        assert cached[:2] == [0, 0]  # each model's first turn
        for earlier, later in [(0, 2), (1, 3), (2, 4)]:  # then each model's own cache of the last turn it ran
            assert cached[later] >= usage[earlier]["prompt_tokens"], (cached, usage)

        # The agent API and Anthropic's messages choose the same way.
        assert (await http.post("/v1/agents", json={"id": "bob", "model": B})).status_code == 201
        for model in (B, A, B):
            r = await http.post("/v1/agents/bob/messages", json={"content": "Hi!", "max_tokens": 3, "model": model})
            assert r.status_code == 200 and r.json()["model"] == model, r.text
        assert r.json()["usage"]["reused_tokens"] > 0  # B's cache of bob's first turn
        r = await http.post("/v1/messages", headers={"x-agent-id": "carol"},
                            json={"model": B, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == B


UNKNOWN = [
    ("/v1/messages", {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
     lambda j: (j["type"], j["error"]["type"], j["error"]["message"])),
    ("/v1/chat/completions", {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
     lambda j: ("error", j["error"]["type"], j["error"]["message"])),
    ("/v1/responses", {"max_output_tokens": 16, "input": "Hi"},
     lambda j: ("error", j["error"]["type"], j["error"]["message"])),
    ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "Hi"}]},
     lambda j: (j["type"], j["error"]["type"], j["error"]["message"])),
]


async def test_a_model_not_served_is_a_404_naming_the_ones_that_are(tmp_path):
    said = "model 'gpt-4o' is not served here; available: tiny, tiny-1"
    async with live_server(tmp_path, models=(tiny_loaded(seed=1),)) as url, client(url) as http:
        for path, body, shape in UNKNOWN:
            r = await http.post(path, json={**body, "model": "gpt-4o"})
            assert r.status_code == 404, (path, r.text)
            kind, error_type, message = shape(r.json())
            assert (kind, message) == ("error", said), path
            assert error_type in ("not_found_error", "invalid_request_error"), (path, error_type)
        await http.post("/v1/agents", json={"id": "dan"})
        r = await http.post("/v1/agents/dan/messages", json={"content": "Hi", "max_tokens": 3, "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["message"] == said
        r = await http.post("/v1/agents", json={"id": "eve", "model": "gpt-4o"})
        assert r.status_code == 404 and r.json()["error"]["message"] == said
        r = await http.post("/v1/chat/completions", json={"model": B, **UNKNOWN[1][1]})
        assert r.status_code == 200  # and the server serves on


async def test_one_model_answers_whatever_name_a_client_sends(tmp_path):
    """Claude Code and Codex send their own model names; a server of one model runs it."""
    async with live_server(tmp_path) as url, client(url) as http:
        r = await http.post("/v1/messages", json={"model": "claude-sonnet-4-5", "max_tokens": 3,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 200 and r.json()["model"] == A


async def test_a_model_that_cannot_load_is_a_503_and_the_server_goes_back(tmp_path):
    """A directory with a tokenizer but no weights: the swap fails on the GPU
    thread, the request that wanted it gets a 503, and the loaded model serves on."""
    import json
    import shutil

    from semantic.runtime.model.models import resolve

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve("smollm2", progress=False) / name, broken / name)
    (broken / "config.json").write_text(json.dumps({"model_type": "llama"}))
    async with live_server(tmp_path, models=(f"broken={broken}",)) as url, client(url) as http:
        ask = {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]}
        r = await http.post("/v1/chat/completions", json={"model": "broken", **ask})
        assert r.status_code == 503 and "could not be loaded" in r.json()["error"]["message"], r.text
        r = await http.post("/v1/chat/completions", json={"model": A, **ask})
        assert r.status_code == 200 and r.json()["model"] == A
        assert [m["id"] for m in (await http.get("/v1/models")).json()["data"] if m["loaded"]] == [A]
