"""What Claude Code sends, over a real server on a tiny model, through the
Anthropic SDK: mid-conversation system messages, a billing header that
changes every request, its session header shared by several conversations,
``max_tokens: 32000``, ``count_tokens``, and keep-alives while a prompt
prefills. (The real CLI runs in ``tests/clients``.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import anyio
import pytest

from .live import CONTEXT, client, live_server, tiny_loaded
from .sse_util import parse_sse

anthropic = pytest.importorskip("anthropic")

pytestmark = pytest.mark.anyio

SESSION = "0f3c2a1e-9b7d-4c61-a1f0-2f5e3c4b5a69"
EXTRA = {"thinking": {"type": "adaptive"}, "output_config": {"effort": "high"},
         "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}}


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()


def billing(suffix: str) -> dict:
    return {"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.330.{suffix}; cc_entrypoint=cli;"}


def system(suffix: str, prompt: str = "You are Claude Code, a coding agent. Answer briefly.") -> list[dict]:
    return [billing(suffix), {"type": "text", "text": prompt, "cache_control": {"type": "ephemeral"}}]


def sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="none", max_retries=0, timeout=120,
                                    default_headers={"X-Claude-Code-Session-Id": SESSION,
                                                     "anthropic-beta": "claude-code-20250219,"
                                                                       "mid-conversation-system-2026-04-07"})


async def ask(claude: anthropic.AsyncAnthropic, system_blocks, messages, max_tokens=12):
    raw = await claude.messages.with_raw_response.create(
        model="claude-sonnet-4-6", max_tokens=max_tokens, system=system_blocks, messages=messages,
        metadata={"user_id": '{"device_id": "d", "session_id": "%s"}' % SESSION}, extra_body=EXTRA)
    message = await raw.parse()
    return raw.headers["x-agent-id"], message


async def test_a_session_with_mid_conversation_system_messages_reuses_its_cache(tmp_path):
    notes = "The build failed on the parser module after the last merge. " * 4
    convo = [{"role": "user", "content": notes + "List the files here, then say which one is the largest."}]
    async with live_server(tmp_path) as url, sdk(url) as claude:
        main, first = await ask(claude, system("a1f"), convo)
        assert first.stop_reason in ("end_turn", "max_tokens")
        convo += [{"role": "assistant", "content": [{"type": "text", "text": first.content[0].text}]},
                  {"role": "system", "content": "Plan mode."},
                  {"role": "user", "content": "Plan?"}]
        # the title request and a sub-agent arrive with the same session but their own system prompts
        title, _ = await ask(claude, system("b07", "Write a 3-word title for this conversation."), convo[:1])
        sub, _ = await ask(claude, system("c33", "You are a sub-agent that searches files."),
                           [{"role": "user", "content": "Find main.py"}])
        again, second = await ask(claude, system("9e2"), convo)  # another billing suffix, as every request
        assert again == main and len({main, title, sub}) == 3
        u = first.usage
        assert second.usage.cache_read_input_tokens >= u.input_tokens + u.cache_read_input_tokens, second.usage
        # the main conversation edited (Claude Code clears old tool output): it keeps its agent and prefix
        convo[1]["content"][0]["text"] = "[cleared]"
        edited, third = await ask(claude, system("d41"), convo)
        assert edited == main and third.usage.cache_read_input_tokens > 0


async def test_max_tokens_is_clamped_to_the_servers_cap(tmp_path):
    async with live_server(tmp_path, max_tokens_cap=3) as url, sdk(url) as claude:
        _, message = await ask(claude, system("a"), [{"role": "user", "content": "Count to fifty."}], 32000)
    assert message.usage.output_tokens <= 3
    assert message.stop_reason == "max_tokens" or message.usage.output_tokens < 3


async def test_count_tokens_is_what_a_turn_over_the_same_prompt_prefills(tmp_path):
    messages = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"},
                {"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you?"}]
    async with live_server(tmp_path) as url, sdk(url) as claude:
        counted = await claude.messages.count_tokens(model="m", system=system("x"), messages=messages)
        _, message = await ask(claude, system("y"), messages, max_tokens=1)
        over = await claude.messages.count_tokens(model="m", messages=[{"role": "user", "content": "word " * CONTEXT}])
        async with client(url) as http:
            bad = await http.post("/v1/messages/count_tokens", json={"model": "m", "messages": []})
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    assert over.input_tokens > CONTEXT  # a number, not an error
    assert bad.status_code == 400 and "messages: must not be empty" in bad.json()["error"]["message"]


async def test_a_stream_starts_and_pings_before_the_first_token(tmp_path):
    """With a keep-alive interval far below the prefill time, the head and pings
    come before any text; the SDK skips the pings and still assembles the message."""
    long = "Summarise the following notes. " + "The lighthouse keeper logged the weather every hour. " * 30
    async with live_server(tmp_path, heartbeat_s=0.0005) as url, client(url) as http:
        async with http.stream("POST", "/v1/messages", json={
                "model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": long}]}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
        async with sdk(url) as sdk_client:
            async with sdk_client.messages.stream(model="m", max_tokens=4, messages=[
                    {"role": "user", "content": long + " Again."}]) as stream:
                final = await stream.get_final_message()
    names = [name for name, _ in parse_sse(raw)]
    first_text = names.index("content_block_start")
    assert names[:2] == ["message_start", "ping"]
    assert names[2:first_text].count("ping") >= 1, names  # pings while the prompt prefilled
    assert names[-1] == "message_stop" and final.stop_reason in ("end_turn", "max_tokens")


async def test_openai_streams_send_keep_alive_comments_the_sdk_skips(tmp_path):
    openai = pytest.importorskip("openai")
    long = "Summarise: " + "The lighthouse keeper logged the weather every hour. " * 30
    async with live_server(tmp_path, heartbeat_s=0.0005) as url, client(url) as http:
        async with http.stream("POST", "/v1/chat/completions", json={
                "model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": long}]}) as r:
            raw = b"".join([chunk async for chunk in r.aiter_bytes()])
        oa = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        chunks = [c async for c in await oa.chat.completions.create(
            model="m", max_tokens=4, stream=True, messages=[{"role": "user", "content": long + " Again."}])]
        await oa.close()
    assert raw.startswith(b": keep-alive\n\n") or b"\n\n: keep-alive\n\n" in raw
    assert raw.rstrip().endswith(b"data: [DONE]")
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


@pytest.mark.both_backends
async def test_a_client_gone_during_heartbeats_cancels_the_turn(tmp_path):
    async with live_server(tmp_path, heartbeat_s=0.0005) as url, client(url) as http:
        long = "word " * (CONTEXT - 20)
        async with http.stream("POST", "/v1/messages", json={
                "model": "m", "max_tokens": 400, "stream": True,
                "messages": [{"role": "user", "content": long}]}) as r:
            async for chunk in r.aiter_bytes():
                if b"ping" in chunk:
                    break  # leave mid-stream
        with anyio.fail_after(30):
            while (await http.get("/health")).json()["decoding"]:
                await anyio.sleep(0.05)


CAPTURED = json.loads((Path(__file__).parent / "data" / "claude_code_requests.json").read_text())


def replayed(request: dict, max_tokens: int = 24) -> tuple[dict, dict]:
    """A captured request as JSON body and headers (not streamed: the replies are compared)."""
    body = {**copy.deepcopy(request["body"]), "stream": False, "max_tokens": max_tokens}
    return body, {k: v for k, v in request["headers"].items() if k.lower() not in ("content-length", "host")}


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("variant", ["Bash", "Bash,Agent"])
async def test_a_replayed_session_with_its_title_and_sub_agent_requests_keeps_each_conversations_agent(
        smollm2, tmp_path, variant):
    """Claude Code 2.1.330's two requests (captured), with a title request and a
    sub-agent's turns (its own system prompt, the same session) in between:
    each conversation keeps its own agent, and the main turn 2 reads all of
    turn 1's prompt from the cache."""
    first, second = CAPTURED["sequences"][variant]
    body1, headers = replayed(first)
    title = {**body1, "system": [body1["system"][0], {"type": "text", "text": "Write a 3-word title."}],
             "messages": body1["messages"][:1], "tools": []}
    sub_agent = {**body1, "system": [body1["system"][0], {"type": "text", "text": "You are a file-search agent."}],
                 "messages": [{"role": "user", "content": "Find main.py"}]}
    async with live_server(tmp_path, model=smollm2) as url, client(url) as http:
        with anyio.fail_after(600):
            r1 = await http.post("/v1/messages?beta=true", json=body1, headers=headers)
            assert r1.status_code == 200, r1.text
            reply = r1.json()["content"][0]["text"]
            rt = await http.post("/v1/messages?beta=true", json=title, headers=headers)
            rs = await http.post("/v1/messages?beta=true", json=sub_agent, headers=headers)
            body2, _ = replayed(second)
            body2["messages"][len(body1["messages"])] = {"role": "assistant", "content": reply}  # as it got it
            r2 = await http.post("/v1/messages?beta=true", json=body2, headers=headers)
            assert r2.status_code == 200, r2.text
            rs2 = await http.post("/v1/messages?beta=true", json={**sub_agent, "messages": [
                *sub_agent["messages"], {"role": "assistant", "content": rs.json()["content"][0]["text"]},
                {"role": "user", "content": "And test_main.py?"}]}, headers=headers)
    agents = [r.headers["x-agent-id"] for r in (r1, rt, rs, r2, rs2)]
    assert agents[0] == agents[3] and agents[2] == agents[4] and len(set(agents)) == 3, agents
    u1, u2 = r1.json()["usage"], r2.json()["usage"]
    prompt1 = u1["input_tokens"] + u1["cache_read_input_tokens"]
    prompt2 = u2["input_tokens"] + u2["cache_read_input_tokens"]
    assert u2["cache_read_input_tokens"] >= prompt1 and u2["cache_read_input_tokens"] >= 0.9 * prompt2, (u1, u2)
    assert rs2.json()["usage"]["cache_read_input_tokens"] > 0


async def test_a_refused_or_abandoned_turn_leaves_its_conversation_free_for_the_next_request(tmp_path):
    """The agent a request continues is claimed from the moment it is chosen; a
    turn refused at the start, or a stream abandoned before its first byte,
    gives it back (else the conversation would lose its agent for good)."""
    convo = [{"role": "user", "content": "Name a colour."}]
    async with live_server(tmp_path) as url, client(url) as http:
        r1 = await http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "messages": convo})
        agent = r1.headers["x-agent-id"]
        convo.append({"role": "assistant", "content": r1.json()["content"][0]["text"]})
        for stream in (False, True):
            refused = await http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "stream": stream,
                                                            "messages": [*convo, {"role": "user",
                                                                                  "content": "word " * CONTEXT}]})
            assert refused.status_code == 400, refused.text
        with anyio.move_on_after(0.001):  # gone before the first byte
            await http.post("/v1/messages", json={"model": "m", "max_tokens": 4, "stream": True,
                                                  "messages": [*convo, {"role": "user", "content": "More?"}]})
        await anyio.sleep(0.5)
        r2 = await http.post("/v1/messages", json={"model": "m", "max_tokens": 4,
                                                   "messages": [*convo, {"role": "user", "content": "Another?"}]})
        assert r2.headers["x-agent-id"] == agent
