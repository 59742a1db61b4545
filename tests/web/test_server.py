"""The server end to end on a tiny random-weight model: the routes over a real
runtime, bad input answered with clear 4xx while others are served, the
agent API contract, SSE conformance, disconnects, auth, limits, operations."""

from __future__ import annotations

import copy
import json

import anyio
import pytest

from .live import CONTEXT, client, live_server, tiny_loaded
from .sse_util import parse_sse
from .test_anthropic import CLAUDE_CODE

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

ASK = {"model": "any", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}]}
CHAT = {"model": "any", "max_tokens": 8, "messages": [{"role": "user", "content": "Hello there"}]}
TOO_LONG = "word " * (CONTEXT + 100)


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()  # load once, outside any test's timing


async def test_bad_input_gets_clear_4xx_and_the_server_keeps_serving(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        await http.post("/v1/agents", json={"id": "known", "system": "Be brief."})

        async def expect(status, method, path, needle, **kw):
            r = await http.request(method, path, **kw)
            assert r.status_code == status, (path, kw, r.text)
            assert needle in r.text, (needle, r.text)
            return r.json()

        # malformed JSON, in each route's error shape
        body = await expect(400, "POST", "/v1/messages", "not valid JSON", content=b"{nope")
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        body = await expect(400, "POST", "/v1/chat/completions", "not valid JSON", content=b"{nope")
        assert body["error"]["type"] == "invalid_request_error" and "param" in body["error"]
        await expect(400, "POST", "/v1/agents/known/messages", "not valid JSON", content=b"[1,")
        # missing and mistyped fields
        await expect(400, "POST", "/v1/messages", "max_tokens: is required",
                     json={k: v for k, v in ASK.items() if k != "max_tokens"})
        await expect(400, "POST", "/v1/messages", "messages[0].content",
                     json={**ASK, "messages": [{"role": "user", "content": 5}]})
        await expect(400, "POST", "/v1/chat/completions", "messages: is required", json={"model": "x"})
        await expect(400, "POST", "/v1/chat/completions", "temperature: must be a number",
                     json={**CHAT, "temperature": "hot"})
        await expect(400, "POST", "/v1/agents/known/messages", "content: is required", json={"max_tokens": 4})
        await expect(400, "POST", "/v1/agents", "id: must be a string", json={"id": 7})
        # max_tokens <= 0 (above the cap it is clamped: test_max_tokens_above_the_cap_is_clamped)
        await expect(400, "POST", "/v1/messages", "must be at least 1, not 0", json={**ASK, "max_tokens": 0})
        await expect(400, "POST", "/v1/chat/completions", "at least 1", json={**CHAT, "max_tokens": -3})
        await expect(400, "POST", "/v1/agents/known/messages", "at least 1", json={"content": "hi", "max_tokens": 0})
        # a prompt over the context: a 400 with the numbers, streaming or not, on every route
        long_ask = {**ASK, "messages": [{"role": "user", "content": TOO_LONG}]}
        for stream in (False, True):
            body = await expect(400, "POST", "/v1/messages", f"model's {CONTEXT}-token context",
                                json={**long_ask, "stream": stream})
            assert "the prompt has" in body["error"]["message"]
            await expect(400, "POST", "/v1/chat/completions", f"{CONTEXT}-token context",
                         json={**CHAT, **long_ask, "stream": stream})
            await expect(400, "POST", "/v1/agents/known/messages", f"{CONTEXT}-token context",
                         json={"content": TOO_LONG, "max_tokens": 4, "stream": stream})
        # unknown agents on the agent API
        for method, path, kw in [("GET", "/v1/agents/ghost", {}), ("DELETE", "/v1/agents/ghost", {}),
                                 ("POST", "/v1/agents/ghost/messages", {"json": {"content": "hi", "max_tokens": 4}}),
                                 ("POST", "/v1/agents/ghost/fork", {"json": {"id": "ghost2"}})]:
            body = await expect(404, method, path, "no agent 'ghost'", **kw)
            assert body["error"]["type"] == "not_found_error"
        # agent ids with '/', '..', NUL, 10 KB: in the path, the header, the body
        for bad, why in [("a%2Fb", "'/'"), ("%2E%2E", "'..'"), ("a%00b", "NUL"), ("x" * 10240, "at most 128")]:
            await expect(400, "GET", f"/v1/agents/{bad}", why)
            await expect(400, "POST", f"/v1/agents/{bad}/messages", why, json={"content": "hi", "max_tokens": 4})
        for bad, why in [("a/b", "'/'"), ("..", "'..'"), ("a\x00b", "NUL"), ("x" * 10240, "at most 128")]:
            await expect(400, "POST", "/v1/agents", why, json={"id": bad})
            await expect(400, "POST", "/v1/chat/completions", why, json={**CHAT, "session_id": bad})
            if "\x00" not in bad:  # HTTP headers cannot carry NUL
                await expect(400, "POST", "/v1/messages", why, json=ASK, headers={"x-agent-id": bad})
        # it still serves
        r = await http.post("/v1/messages", json=ASK)
        assert r.status_code == 200 and r.json()["usage"]["output_tokens"] >= 1


@pytest.mark.slow
async def test_api_key_body_limit_and_body_timeout(tmp_path):
    async with live_server(tmp_path, api_key="sekret", max_body_bytes=4096, body_timeout_s=0.5) as url:
        async with client(url) as http:
            r = await http.post("/v1/messages", json=ASK)
            assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
            r = await http.post("/v1/chat/completions", json=CHAT, headers={"authorization": "Bearer nope"})
            assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
            assert (await http.get("/v1/agents", headers={"x-api-key": "wrong"})).status_code == 401
            assert (await http.get("/health")).status_code == 200  # open to probes
        async with client(url, **{"x-api-key": "sekret"}) as http:
            r = await http.post("/v1/messages", json={**ASK, "system": "x" * 5000})
            assert r.status_code == 413 and "limit of 4096 bytes" in r.json()["error"]["message"]

            async def trickle():  # a body without a length, sent in pieces: still capped
                for _ in range(5):
                    yield b"x" * 1000

            r = await http.post("/v1/chat/completions", content=trickle())
            assert r.status_code == 413 and r.json()["error"]["type"] == "invalid_request_error"

            # a client that stops sending its body half-way is answered, not waited for
            port = int(url.rsplit(":", 1)[1])
            async with await anyio.connect_tcp("127.0.0.1", port) as raw:
                await raw.send(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\nx-api-key: sekret\r\n"
                               b"content-length: 100\r\n\r\n{\"model\": ")
                answer = b""
                with anyio.fail_after(10):
                    while b"within" not in answer:
                        answer += await raw.receive()
            assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive within 0.5 s" in answer
            r = await http.post("/v1/messages", json=ASK, headers={"authorization": "Bearer sekret", "x-api-key": ""})
            assert r.status_code == 200
        async with anthropic.AsyncAnthropic(base_url=url, api_key="wrong", max_retries=0) as sdk:
            with pytest.raises(anthropic.AuthenticationError):
                await sdk.messages.create(**ASK)
        async with anthropic.AsyncAnthropic(base_url=url, api_key="sekret", max_retries=0) as sdk:
            assert (await sdk.messages.create(**ASK)).stop_reason in ("end_turn", "max_tokens")


async def test_the_agent_api_contract(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        r = await http.post("/v1/agents", json={"id": "ada", "system": "You are terse."})
        assert r.status_code == 201
        assert {"id": "ada", "model": "tiny", "system": "You are terse."}.items() <= r.json().items()
        assert (await http.post("/v1/agents", json={"id": "ada", "system": "You are terse."})).status_code == 200
        r = await http.post("/v1/agents", json={"id": "ada", "system": "You are verbose."})
        assert r.status_code == 409 and r.json()["error"]["type"] == "conflict_error"
        r = await http.post("/v1/agents", json={"id": "bob", "system": None, "model": "other-model"})
        assert r.status_code == 404 and r.json()["error"]["message"] == \
            "model 'other-model' is not served here; available: tiny"

        r = await http.post("/v1/agents/ada/messages", json={"content": "Hi!", "max_tokens": 5, "seed": 1})
        assert r.status_code == 200 and r.headers["x-agent-id"] == "ada"
        first = r.json()
        assert set(first) >= {"agent_id", "role", "content", "stop_reason", "usage", "timing"}
        assert (first["agent_id"], first["role"]) == ("ada", "assistant")
        assert first["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence")
        u = first["usage"]
        assert set(u) == {"prompt_tokens", "reused_tokens", "prefilled_tokens", "output_tokens", "drafted_tokens",
                          "accepted_tokens"}
        assert u["prompt_tokens"] == u["reused_tokens"] + u["prefilled_tokens"] and u["output_tokens"] >= 1
        assert 0 <= u["accepted_tokens"] <= u["drafted_tokens"]
        assert set(first["timing"]) == {"ttft_ms", "queued_ms", "prefill_ms", "decode_ms", "decode_tps"}
        assert first["timing"]["ttft_ms"] > 0

        r = await http.post("/v1/agents/ada/messages", json={"content": "More.", "max_tokens": 6, "stream": True})
        events = parse_sse(r.content)
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        assert {name for name, _ in events[:-1]} == {"delta"} and events[-1][0] == "done"
        done = events[-1][1]
        assert "".join(d["text"] for _, d in events[:-1]) == done["content"]
        # (the random model's reply may end mid-character, so its text need not re-render to the same tokens)
        assert done["usage"]["reused_tokens"] >= first["usage"]["prompt_tokens"]
        assert set(done) == set(first)

        r = await http.post("/v1/agents/ada/messages", json={"content": "x", "max_tokens": 3, "use_cache": False})
        assert r.json()["usage"]["reused_tokens"] == 0

        r = await http.post("/v1/agents/ada/fork", json={"id": "ada2"})
        assert r.status_code == 201 and r.json()["forked_from"] == "ada" and r.json()["id"] == "ada2"
        assert (await http.post("/v1/agents/ada/fork", json={"id": "ada2"})).status_code == 409

        listing = (await http.get("/v1/agents")).json()["agents"]
        assert [a["id"] for a in listing] == ["ada", "ada2"]
        assert all(a["tier"] == "hot" and a["tokens_cached"] > 0 and a["bytes"] > 0 for a in listing)
        one = (await http.get("/v1/agents/ada")).json()
        assert [m["role"] for m in one["history"]] == ["system"] + ["user", "assistant"] * 3
        assert one["history"][2]["content"] == first["content"]

        r = await http.delete("/v1/agents/ada")
        assert r.status_code == 200 and r.json() == {"id": "ada", "deleted": True}
        assert (await http.get("/v1/agents/ada")).status_code == 404
        assert (await http.get("/v1/agents/ada2")).status_code == 200


@pytest.mark.both_backends
async def test_a_client_that_disconnects_mid_stream_leaves_the_agent_consistent(tmp_path):
    # A ~320-token system prompt: the cancelled turn's cache is kept, and a follow-up reuses the shared
    # part if it is at least half of that cache (runtime.text.prefix) -- however many tokens the turn made
    # before the server noticed the hang-up (a loaded machine notices later), as the 512-token context
    # leaves room for fewer than the prompt.
    async with live_server(tmp_path) as url, client(url) as http:
        await http.post("/v1/agents", json={"id": "quitter", "system": "You talk a lot. " * 64})
        async with http.stream("POST", "/v1/agents/quitter/messages",
                               json={"content": "Tell me everything.", "max_tokens": 400, "stream": True}) as r:
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                seen += line.startswith("event: delta")
                if seen == 3:
                    break  # hang up
        with anyio.fail_after(10):  # the runtime cancels the turn within a step of noticing
            while (await http.get("/health")).json()["decoding"]:
                await anyio.sleep(0.05)
        history = (await http.get("/v1/agents/quitter")).json()["history"]
        assert [m["role"] for m in history] == ["system"]  # the cancelled turn left no trace
        r = await http.post("/v1/agents/quitter/messages", json={"content": "Short, please.", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["reused_tokens"] > 0  # the kept prefix is reused
        history = (await http.get("/v1/agents/quitter")).json()["history"]
        assert [m["content"] for m in history[1:]] == ["Short, please.", r.json()["content"]]


async def test_streamed_messages_follow_anthropics_sse_sequence_exactly(tmp_path):
    async with live_server(tmp_path, heartbeat_s=600) as url, client(url) as http:  # no keep-alive pings
        r = await http.post("/v1/messages", json={**ASK, "stream": True})
        assert r.status_code == 200 and r.headers["content-type"] == "text/event-stream; charset=utf-8"
        events = parse_sse(r.content)
    names = [name for name, _ in events]
    n = names.count("content_block_delta")
    assert n >= 1
    assert names == ["message_start", "ping", "content_block_start"] + ["content_block_delta"] * n + \
                    ["content_block_stop", "message_delta", "message_stop"]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert set(start) == {"id", "type", "role", "model", "content", "stop_reason", "stop_sequence", "usage"}
    assert (start["type"], start["role"], start["model"], start["content"], start["stop_reason"]) == \
           ("message", "assistant", "tiny", [], None)
    assert start["id"].startswith("msg_")
    assert events[2][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    for _, data in events[3:3 + n]:
        assert set(data) == {"type", "index", "delta"} and data["index"] == 0
        assert set(data["delta"]) == {"type", "text"} and data["delta"]["type"] == "text_delta"
    assert events[-3][1] == {"type": "content_block_stop", "index": 0}
    delta = events[-2][1]
    assert delta["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None} or \
           delta["delta"]["stop_reason"] == "end_turn"
    assert set(delta["usage"]) == {"input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens",
                                   "output_tokens", "drafted_tokens", "accepted_tokens"}
    assert delta["usage"]["input_tokens"] > 0 and 1 <= delta["usage"]["output_tokens"] <= 8
    assert events[-1][1] == {"type": "message_stop"}


async def test_the_sdk_stream_helper_assembles_the_non_streaming_text(tmp_path):
    async with live_server(tmp_path) as url:
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as sdk:
            plain = await sdk.messages.create(**{**ASK, "max_tokens": 12})
            async with sdk.messages.stream(**{**ASK, "max_tokens": 12}) as stream:
                text = "".join([t async for t in stream.text_stream])
                final = await stream.get_final_message()
    assert plain.content[0].text == text == final.content[0].text and text
    assert plain.stop_reason == final.stop_reason
    assert (plain.usage.input_tokens, plain.usage.output_tokens) == (final.usage.input_tokens, final.usage.output_tokens)


@pytest.mark.slow
async def test_a_claude_code_request_gets_a_valid_response(tmp_path):
    body = copy.deepcopy(CLAUDE_CODE)
    del body["stream"]
    body["max_tokens"] = 32000  # what Claude Code asks for: it stops at the end of the context instead
    extra = {"temperature": body.pop("temperature")}
    async with live_server(tmp_path, max_tokens_cap=64000) as url:
        async with anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0, timeout=120) as sdk:
            plain = await sdk.messages.create(**body, extra_body=extra)
            async with sdk.messages.stream(**{**body, "max_tokens": 16}, extra_body=extra) as stream:
                streamed = await stream.get_final_message()
    assert plain.stop_reason == "max_tokens" or plain.usage.output_tokens < 32000  # stopped at the context's end
    for message in (plain, streamed):
        assert message.content[0].type == "text"
        assert message.stop_reason in ("end_turn", "max_tokens")  # this template has no tools: text only
        assert message.usage.input_tokens + message.usage.cache_read_input_tokens > 50
        assert message.usage.output_tokens >= 1


async def test_stateless_turns_find_their_agent_by_content_and_reuse_its_cache(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        convo = [{"role": "system", "content": "You are a helper."}, {"role": "user", "content": "One."}]
        r1 = await http.post("/v1/chat/completions", json={**CHAT, "messages": convo})
        agent = r1.headers["x-agent-id"]
        reply = r1.json()["choices"][0]["message"]["content"]
        convo += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Two."}]
        r2 = await http.post("/v1/chat/completions", json={**CHAT, "messages": convo})
        assert r2.headers["x-agent-id"] == agent
        u1, u2 = r1.json()["usage"], r2.json()["usage"]
        assert u2["prompt_tokens_details"]["cached_tokens"] >= u1["prompt_tokens"]
        # another conversation gets another agent; a pinned one keeps its id
        r3 = await http.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": "Zzz"}]})
        assert r3.headers["x-agent-id"] != agent
        r4 = await http.post("/v1/messages", json=ASK, headers={"x-agent-id": "pinned"})
        assert r4.headers["x-agent-id"] == "pinned"
        assert (await http.get("/v1/agents/pinned")).json()["history"][0] == {"role": "user", "content": "Hello there"}


async def test_operations_routes(tmp_path):
    async with live_server(tmp_path, disk_budget=1 << 30) as url, client(url) as http:
        await http.post("/v1/messages", json=ASK)
        health = (await http.get("/health")).json()
        assert (health["status"], health["ready"], health["model"], health["context_length"]) == ("ok", True, "tiny", CONTEXT)
        memory = health["memory"]
        assert set(memory) == {"hot_bytes", "budget_bytes", "prefix_bytes", "mlx_active_bytes", "mlx_peak_bytes",
                               "demotions", "prefix_drops", "preemptions", "disk_bytes"} and health["queue_depth"] == 0
        assert 0 < memory["hot_bytes"] <= memory["budget_bytes"] and memory["prefix_bytes"] == 0  # no system prompt
        assert 0 < memory["mlx_active_bytes"] <= memory["mlx_peak_bytes"]
        assert (memory["demotions"], memory["prefix_drops"], memory["preemptions"]) == (0, 0, 0)
        disk = health["disk"]
        assert (disk["budget_bytes"], disk["pruned_files"], disk["failed_writes"]) == (1 << 30, 0, 0)
        assert disk["bytes"] == health["memory"]["disk_bytes"] > 0 and disk["free_bytes"] > 0
        rows = health["row_counts"]  # measured at load: one class of the counts 1..8, with a time for each
        assert tuple(rows["counts"]) in map(tuple, rows["classes"]) and len(rows["ms"]) == 8, rows
        assert all(p.keys() == {"shape", "way", "rows", "upto"} and p["upto"] == 8 for p in rows["plans"]), rows
        assert rows["prefill_from"] is None or rows["prefill_from"] > 8, rows  # decode-sized chunks never batch
        models = (await http.get("/v1/models")).json()
        assert [m["id"] for m in models["data"]] == ["tiny"]
        text = (await http.get("/metrics")).text
        for name in ("semantic_ttft_seconds_bucket", "semantic_decode_tokens_per_second_count",
                     'semantic_prompt_tokens_total{kind="prefilled"}', 'semantic_prompt_tokens_total{kind="reused"}',
                     'semantic_turns_total{cache="miss"} 1.0', "semantic_batch_size", "semantic_hot_cache_bytes",
                     "semantic_kv_budget_bytes 2.68435456e+08", "semantic_disk_cache_bytes",
                     "semantic_disk_budget_bytes 1.073741824e+09", "semantic_disk_free_bytes",
                     "semantic_disk_pruned_files_total 0.0", "semantic_disk_failed_writes_total 0.0",
                     "semantic_mlx_active_bytes", "semantic_mlx_peak_bytes", "semantic_demotions_total 0.0",
                     "semantic_prefix_drops_total 0.0", "semantic_preemptions_total 0.0"):
            assert name in text, name
    assert json.loads(json.dumps(health))


@pytest.mark.slow
async def test_old_anonymous_conversations_are_pruned_counted_and_forgotten(tmp_path):
    options = dict(conversation_ttl_s=1.0, runtime_options={"prune_interval_s": 0.1, "agent_idle_s": 0.2})
    async with live_server(tmp_path, **options) as url, client(url) as http:
        await http.post("/v1/agents", json={"id": "named", "system": "Be brief."})
        r = await http.post("/v1/messages", json=ASK)
        old, reply = r.headers["x-agent-id"], r.json()["content"][0]["text"]
        assert old.startswith("conv-") and (await http.get("/health")).json()["agents"] == 2
        with anyio.fail_after(10):  # unused for a second, and its actor retired
            while (health := (await http.get("/health")).json())["disk"]["pruned_files"] < 2:
                await anyio.sleep(0.05)
        assert health["disk"]["pruned_files"] == 2 and health["agents"] == 1  # its history and cache; named stays
        assert [a["id"] for a in (await http.get("/v1/agents")).json()["agents"]] == ["named"]
        assert "semantic_disk_pruned_files_total 2.0" in (await http.get("/metrics")).text
        follow_up = [ASK["messages"][0], {"role": "assistant", "content": reply}, {"role": "user", "content": "And?"}]
        r = await http.post("/v1/messages", json={**ASK, "messages": follow_up})
        assert r.status_code == 200 and r.headers["x-agent-id"] not in (old, "named")  # the index forgot it


async def test_tools_a_template_without_tools_is_told_are_left_out_under_auto_where_they_do_not_fit(tmp_path):
    small = {"type": "function", "function": {"name": "now", "description": "The time.", "parameters": {
        "type": "object", "properties": {}}}}
    large = copy.deepcopy(small)
    large["function"]["description"] = TOO_LONG  # more than the whole context
    ask = {**CHAT, "messages": [{"role": "user", "content": "Hi"}]}
    async with live_server(tmp_path) as url, client(url) as http:
        bare = (await http.post("/v1/chat/completions", json=ask)).json()["usage"]["prompt_tokens"]
        told = (await http.post("/v1/chat/completions", json={**ask, "tools": [small]})).json()
        left_out = await http.post("/v1/chat/completions", json={**ask, "tools": [large]})
        forced = await http.post("/v1/chat/completions", json={**ask, "tools": [large], "tool_choice": "required"})
    assert told["usage"]["prompt_tokens"] > bare + 30  # the tool, in the system prompt (SmolLM2's template)
    assert left_out.status_code == 200 and left_out.json()["usage"]["prompt_tokens"] == bare
    assert forced.status_code == 400 and f"{CONTEXT}-token context" in forced.text  # a call needs them told


async def test_a_turn_after_a_call_goes_on_from_its_agents_cache(tmp_path):
    """SmolLM2's template takes no tools: a forced call is written in the Hermes format it is
    told, and a client sends it back as a call (``tool_calls``, a ``tool_use`` block, a
    ``function_call`` item). The follow-up finds the call's agent and reuses every token it
    cached -- the prompt and the call as generated -- on each route."""
    weather = {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"]}}
    system, ask = "You are a helper.", "Weather in Oslo?"

    async def chat(http):
        body = {"model": "any", "max_tokens": 40, "tools": [{"type": "function", "function": weather}]}
        convo = [{"role": "system", "content": system}, {"role": "user", "content": ask}]
        r1 = await http.post("/v1/chat/completions", json={**body, "tool_choice": "required", "messages": convo})
        call = r1.json()["choices"][0]["message"]["tool_calls"][0]
        convo += [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": call["id"], "content": "Sunny, 20 C"}]
        r2 = await http.post("/v1/chat/completions", json={**body, "max_tokens": 4, "messages": convo})
        cached = r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        u1 = r1.json()["usage"]
        return r1, r2, u1["prompt_tokens"] + u1["completion_tokens"], cached

    async def anthropic_(http):
        body = {"model": "any", "max_tokens": 40, "system": system, "tools": [
            {"name": weather["name"], "input_schema": weather["parameters"]}]}
        convo = [{"role": "user", "content": ask}]
        r1 = await http.post("/v1/messages", json={**body, "tool_choice": {"type": "any"}, "messages": convo})
        use = next(b for b in r1.json()["content"] if b["type"] == "tool_use")
        convo += [{"role": "assistant", "content": [use]},
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                "content": "Sunny, 20 C"}]}]
        r2 = await http.post("/v1/messages", json={**body, "max_tokens": 4, "messages": convo})
        u1, u2 = r1.json()["usage"], r2.json()["usage"]
        return r1, r2, u1["input_tokens"] + u1["output_tokens"], u2["cache_read_input_tokens"]

    async def responses(http):
        body = {"model": "any", "max_output_tokens": 40, "instructions": system,
                "tools": [{"type": "function", **weather}]}
        r1 = await http.post("/v1/responses", json={**body, "tool_choice": "required", "input": ask})
        call = next(o for o in r1.json()["output"] if o["type"] == "function_call")
        items = [{"role": "user", "content": ask}, {k: call[k] for k in ("type", "call_id", "name", "arguments")},
                 {"type": "function_call_output", "call_id": call["call_id"], "output": "Sunny, 20 C"}]
        r2 = await http.post("/v1/responses", json={**body, "max_output_tokens": 4, "input": items})
        u1, u2 = r1.json()["usage"], r2.json()["usage"]
        return r1, r2, u1["input_tokens"] + u1["output_tokens"], u2["input_tokens_details"]["cached_tokens"]

    async with live_server(tmp_path) as url, client(url) as http:
        for route in (chat, anthropic_, responses):
            r1, r2, called, cached = await route(http)
            assert r1.status_code == r2.status_code == 200, (route.__name__, r1.text, r2.text)
            assert r2.headers["x-agent-id"] == r1.headers["x-agent-id"], route.__name__
            assert cached >= called - 1, (route.__name__, cached, called)  # (at most the end token is fed anew)
            stored = (await http.get(f"/v1/agents/{r1.headers['x-agent-id']}")).json()["history"]
            assert stored[2]["content"].startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city": ')
