"""The official SDKs accept what we send: a canned app built from the web
modules, served on a loopback port, driven by ``anthropic`` and ``openai``
streaming and not. Sync clients run in a worker thread while the server runs
in the test's event loop."""

from __future__ import annotations

import copy
import json

import anyio
import pytest

from semantic.web.schema import Usage

from .canned import MODEL, Canned, canned_app, serve
from .test_anthropic import CLAUDE_CODE

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")
pytest.importorskip("hypercorn")

pytestmark = pytest.mark.anyio

HELLO = ["Hel", "lo", ", wor", "ld!"]
WEATHER_TOOL = {"name": "get_weather", "description": "Weather in a city",
                "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
# A Hermes-format reply, cut so the markup straddles the deltas.
TOOL_REPLY = ["Let me check", ".\n<tool", '_call>\n{"name": "get_weather", ', '"arguments": {"city": "Paris"}}\n</tool_call>']


async def drive(canned: Canned, fn):
    """Run ``fn(base_url)`` in a thread against the canned app on a loopback server."""
    with anyio.fail_after(30):
        async with serve(canned_app(canned)) as url:
            return await anyio.to_thread.run_sync(fn, url)


def claude(url):
    return anthropic.Anthropic(base_url=url, api_key="test", max_retries=0, timeout=10)


def gpt(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="test", max_retries=0, timeout=10)


ASK = dict(model="claude-x", max_tokens=100, messages=[{"role": "user", "content": "hi"}])


def both_ways(url, **request):
    """The non-streaming message, the stream helper's text and final message."""
    with claude(url) as client:
        message = client.messages.create(**request)
        with client.messages.stream(**request) as stream:
            text = "".join(stream.text_stream)
            final = stream.get_final_message()
    return message, text, final


def same_message(a, b):
    da, db = a.model_dump(exclude={"id"}), b.model_dump(exclude={"id"})
    for d in (da, db):  # the stream helper's blocks carry one extra, unset field
        for block in d["content"]:
            block.pop("parsed_output", None)
    assert da == db


async def test_anthropic_stream_helper_assembles_the_non_streaming_message():
    canned = Canned(HELLO)
    message, text, final = await drive(canned, lambda url: both_ways(url, **ASK))
    assert message.content[0].text == text == final.content[0].text == "Hello, world!"
    assert (message.stop_reason, message.model, message.role) == ("end_turn", MODEL, "assistant")
    assert message.id.startswith("msg_")
    u = message.usage
    assert (u.input_tokens, u.cache_read_input_tokens, u.output_tokens) == (12, 30, 5)
    same_message(message, final)
    assert [r.stream for r in canned.seen] == [False, True]


async def test_anthropic_raw_events_come_in_the_documented_order():
    def run(url):
        with claude(url) as client:
            return [e.type for e in client.messages.create(**ASK, stream=True)]

    types = await drive(Canned(HELLO), run)
    assert types == ["message_start", "content_block_start"] + ["content_block_delta"] * 4 + \
                    ["content_block_stop", "message_delta", "message_stop"]  # the SDK drops pings


async def test_anthropic_tool_calls_come_back_as_tool_use_blocks_streaming_or_not():
    canned = Canned(TOOL_REPLY, tool_format="hermes")
    message, text, final = await drive(canned, lambda url: both_ways(url, **ASK, tools=[WEATHER_TOOL]))
    assert text == "Let me check."
    assert message.stop_reason == final.stop_reason == "tool_use"
    assert [b.type for b in message.content] == ["text", "tool_use"]
    call = message.content[1]
    assert (call.name, call.input) == ("get_weather", {"city": "Paris"}) and call.id.startswith("call_")
    assert (final.content[1].name, final.content[1].input) == ("get_weather", {"city": "Paris"})
    final.content[1].id = call.id  # ids are fresh per response
    same_message(message, final)


async def test_a_claude_code_request_gets_a_valid_response():
    body = copy.deepcopy(CLAUDE_CODE)
    del body["stream"]
    # This SDK no longer takes sampling arguments; older clients still send them.
    extra = {"temperature": body.pop("temperature"), "cache_control": {"type": "ephemeral"}}

    def run(url):
        with claude(url) as client:
            plain = client.messages.create(**body, extra_body=extra, extra_headers={"x-agent-id": "claude-code-1"})
            with client.messages.stream(**body, extra_body=extra) as stream:
                streamed = stream.get_final_message()
            return plain, streamed

    canned = Canned(["Read failed because ", "a.py does not exist."])
    plain, streamed = await drive(canned, run)
    assert plain.content[0].text == streamed.content[0].text == "Read failed because a.py does not exist."
    first = canned.seen[0]
    assert first.agent_id == "claude-code-1" and first.tool_names == {"Bash", "Read"}
    assert first.temperature == 1.0 and first.max_tokens == 4000
    assert [m["role"] for m in first.messages] == ["user", "assistant", "tool", "tool", "user"]


async def test_anthropic_sdk_raises_our_400_with_its_message():
    def run(url):
        with claude(url) as client, pytest.raises(anthropic.BadRequestError) as e:
            client.messages.create(**{**ASK, "max_tokens": 0})
        return e.value

    err = await drive(Canned(HELLO), run)
    assert err.status_code == 400
    assert err.body == {"type": "error", "error": {"type": "invalid_request_error", "message":
                        "max_tokens: must be at least 1, not 0"}}


async def test_anthropic_sdk_raises_an_error_event_mid_stream():
    def run(url):
        got = []
        with claude(url) as client, pytest.raises(anthropic.APIStatusError) as e:
            with client.messages.stream(**ASK) as stream:
                for text in stream.text_stream:
                    got.append(text)
        return got, e.value

    got, err = await drive(Canned(HELLO, fail_after=2), run)
    assert got == ["Hel", "lo"]
    assert err.body == {"type": "error", "error": {"type": "api_error", "message": "the engine failed mid-turn"}}


async def test_anthropic_async_client_streams_too():
    async def run(url):
        async with anthropic.AsyncAnthropic(base_url=url, api_key="test", max_retries=0, timeout=10) as client:
            async with client.messages.stream(**ASK) as stream:
                return "".join([t async for t in stream.text_stream])

    with anyio.fail_after(30):
        async with serve(canned_app(Canned(HELLO))) as url:
            assert await run(url) == "Hello, world!"


# --- openai -------------------------------------------------------------------

CHAT = dict(model="gpt-x", messages=[{"role": "user", "content": "hi"}])
WEATHER_FN = {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER_TOOL["input_schema"]}}


def openai_three_ways(url, **request):
    """The non-streaming completion, the text of the raw chunks (and the usage
    chunk), and the stream helper's final completion."""
    with gpt(url) as client:
        completion = client.chat.completions.create(**request)
        chunks = list(client.chat.completions.create(**request, stream=True,
                                                     stream_options={"include_usage": True}))
        with client.chat.completions.stream(**request) as stream:
            final = stream.get_final_completion()
    return completion, chunks, final


async def test_openai_streaming_and_not_agree():
    canned = Canned(HELLO, usage=Usage(12, 30, 5))
    completion, chunks, final = await drive(canned, lambda url: openai_three_ways(url, **CHAT))
    choice = completion.choices[0]
    assert (choice.message.content, choice.finish_reason, completion.object) == ("Hello, world!", "stop", "chat.completion")
    assert completion.id.startswith("chatcmpl-") and completion.model == MODEL
    u = completion.usage
    assert (u.prompt_tokens, u.completion_tokens, u.total_tokens, u.prompt_tokens_details.cached_tokens) == (42, 5, 47, 30)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "Hello, world!"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage == completion.usage
    assert final.choices[0].message.content == "Hello, world!" and final.choices[0].finish_reason == "stop"
    assert canned.seen[1].include_usage and not canned.seen[2].include_usage


async def test_openai_tool_calls_streaming_and_not():
    canned = Canned(TOOL_REPLY, tool_format="hermes")
    completion, chunks, final = await drive(canned, lambda url: openai_three_ways(url, **CHAT, tools=[WEATHER_FN]))
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "tool_calls"
    assert message.content == "Let me check."
    [call] = message.tool_calls
    assert (call.type, call.function.name, call.function.arguments) == ("function", "get_weather", '{"city": "Paris"}')
    streamed = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in streamed) == "Let me check."
    assert [tc.function.name for d in streamed for tc in d.tool_calls or ()] == ["get_weather"]
    [final_call] = final.choices[0].message.tool_calls
    assert (final_call.function.name, json.loads(final_call.function.arguments)) == ("get_weather", {"city": "Paris"})
    assert final.choices[0].finish_reason == "tool_calls"


async def test_openai_session_id_names_the_agent():
    canned = Canned(HELLO)

    def run(url):
        with gpt(url) as client:
            client.chat.completions.create(**CHAT, extra_body={"session_id": "agent-7"})

    await drive(canned, run)
    assert canned.seen[0].agent_id == "agent-7"


async def test_openai_sdk_raises_our_400():
    def run(url):
        with gpt(url) as client, pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**CHAT, max_tokens=0)
        return e.value

    err = await drive(Canned(HELLO), run)
    assert err.status_code == 400
    assert err.body == {"message": "max_tokens: must be at least 1, not 0", "type": "invalid_request_error",
                        "param": "max_tokens", "code": None}


async def test_openai_sdk_raises_an_error_chunk_mid_stream():
    def run(url):
        got = []
        with gpt(url) as client, pytest.raises(openai.APIError) as e:
            for chunk in client.chat.completions.create(**CHAT, stream=True):
                got.append(chunk.choices[0].delta.content)
        return got, e.value

    got, err = await drive(Canned(HELLO, fail_after=2), run)
    assert got == ["", "Hel", "lo"]
    assert err.message == "the engine failed mid-turn"
