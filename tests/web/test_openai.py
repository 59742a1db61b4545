"""/v1/chat/completions: parsing and validation, the completion JSON, the chunk sequence."""

from __future__ import annotations

import json
import logging

import pytest

from semantic.actors import Delta
from semantic.web import openai
from semantic.web.schema import ChatRequest, ChatResult, RequestError, ToolCall, Usage

from .sse_util import collect, parse_sse

chat_types = pytest.importorskip("openai.types.chat")

LIMIT = 4096
USER = [{"role": "user", "content": "hi"}]


def parse(body: dict | bytes, **kw) -> ChatRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return openai.parse_request(raw, {"x-agent-id": kw["agent_id"]} if "agent_id" in kw else {}, max_tokens_cap=LIMIT)


def ok(**fields) -> dict:
    return {"model": "gpt-x", "messages": USER, **fields}


CALL_MSG = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

BAD = [
    (b"{not json", "request body is not valid JSON"),
    (b'"text"', "request body must be a JSON object"),
    ({"model": "m"}, "messages: is required"),
    (ok(messages=[]), "messages: must not be empty"),
    (ok(messages={"role": "user"}), "messages: must be an array, not an object"),
    (ok(messages=[{"role": "system", "content": "be brief"}]), "messages: must hold a user message"),
    (ok(messages=[{"role": "robot", "content": "x"}]),
     "messages[0].role: must be 'system', 'developer', 'user', 'assistant' or 'tool', not 'robot'"),
    (ok(messages=[{"role": "function", "name": "f", "content": "x"}]), "messages[0].role: must be"),
    (ok(messages=[{"content": "x"}]), "messages[0].role: is required"),
    (ok(messages=[{"role": "user"}]), "messages[0].content: is required"),
    (ok(messages=[{"role": "user", "content": 3}]),
     "messages[0].content: must be a string or an array of content parts, not an integer"),
    (ok(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
     "messages[0].content[0].type: 'image_url' parts are not supported (this server reads text only)"),
    (ok(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text: is required"),
    (ok(messages=[{"role": "user", "content": [{"type": "video"}]}]), "'video' parts are not supported"),
    (ok(messages=[*USER, {"role": "assistant"}]), "messages[1].content: is required"),
    (ok(messages=[*USER, {**CALL_MSG, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}]),
     "messages[1].tool_calls[0].function.arguments: is not valid JSON"),
    (ok(messages=[*USER, {**CALL_MSG, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]),
     "messages[1].tool_calls[0].function.arguments: must encode a JSON object, not an array"),
    (ok(messages=[*USER, {**CALL_MSG, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}]),
     "messages[1].tool_calls[0].id: is required"),
    (ok(messages=[*USER, CALL_MSG, {"role": "tool", "content": "18C"}]), "messages[2].tool_call_id: is required"),
    (ok(max_tokens=0), "max_tokens: must be at least 1, not 0"),
    (ok(max_completion_tokens=-1), "max_completion_tokens: must be at least 1, not -1"),
    (ok(max_tokens="many"), "max_tokens: must be an integer, not a string"),
    (ok(temperature=2.5), "temperature: must be in [0, 2], not 2.5"),
    (ok(top_p=1.5), "top_p: must be in (0, 1], not 1.5"),
    (ok(seed="s"), "seed: must be an integer, not a string"),
    (ok(stop=5), "stop: must be a string or an array of strings, not an integer"),
    (ok(stop=["a", ""]), "stop[1]: must not be empty"),
    (ok(stream=1), "stream: must be a boolean, not an integer"),
    (ok(stream=True, stream_options={"include_usage": "yes"}), "stream_options.include_usage: must be a boolean"),
    (ok(stream_options=[]), "stream_options: must be an object, not an array"),
    (ok(n=17), "n: must be at most 16, not 17"),
    (ok(n=0), "n: must be at least 1, not 0"),
    (ok(top_logprobs=3), "top_logprobs: needs logprobs: true"),
    (ok(logprobs=True, top_logprobs=21), "top_logprobs: must be at most 20, not 21"),
    (ok(response_format={"type": "xml"}), "response_format.type: must be 'text' or 'json_object' or 'json_schema'"),
    (ok(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
     "response_format.json_schema.schema: is required"),
    (ok(response_format={"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}}),
     "response_format.json_schema.schema: this server cannot enforce this JSON schema: Unimplemented keys: [\"not\"]"),
    (ok(response_format={"type": "json_object"}, tools=[TOOL]),
     "response_format: structured output together with tools is not supported"),
    (ok(session_id=7), "session_id: must be a string, not an integer"),
    (ok(session_id=""), "session_id: must not be empty"),
    (ok(tools=[{"type": "code_interpreter"}]), "tools[0].type: only 'function' tools are supported"),
    (ok(tools=[{"type": "function"}]), "tools[0].function: is required"),
    (ok(tools=[{"type": "function", "function": {}}]), "tools[0].function.name: is required"),
    (ok(tools=[TOOL, TOOL]), "tools[1].function.name: tool names must be unique"),
    (ok(tools=[TOOL], tool_choice="sometimes"), "tool_choice: must be 'none', 'auto', 'required' or"),
    (ok(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}),
     "tool_choice.function.name: names no tool in 'tools': 'nope'"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_bad_requests_are_400_with_a_clear_message(body, message):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.status == 400
    assert message in e.value.message
    param = None if e.value.message.startswith("request body") else e.value.message.split(":")[0]
    assert openai.error_json(e.value) == {"error": {"message": e.value.message, "type": "invalid_request_error",
                                                    "param": param, "code": None}}


@pytest.mark.parametrize("fields, hint", [({"prompt_cache_key": "k", "user": "u"}, "k"), ({"user": "u"}, "u"),
                                          ({}, None)])
def test_prompt_cache_key_then_user_is_the_session_hint(fields, hint):
    req = parse(ok(**fields))
    assert req.hint == hint and req.agent_id is None
    with pytest.raises(RequestError, match="prompt_cache_key: must not be empty"):
        parse(ok(prompt_cache_key=""))


def test_max_tokens_above_the_cap_is_clamped():
    assert parse(ok(max_tokens=LIMIT + 1)).max_tokens == LIMIT
    assert parse(ok(max_completion_tokens=10**6, max_tokens=5)).max_tokens == LIMIT
    assert parse(ok()).max_tokens == LIMIT


def test_the_header_and_session_id_must_agree():
    with pytest.raises(RequestError, match="names agent 'a' but the X-Agent-Id header names 'b'"):
        parse(ok(session_id="a"), agent_id="b")
    assert parse(ok(session_id="a"), agent_id="a").agent_id == "a"
    assert parse(ok(session_id="a")).agent_id == "a"
    assert parse(ok(), agent_id="b").agent_id == "b"


@pytest.mark.parametrize("status, kind", [(400, "invalid_request_error"), (401, "authentication_error"),
                                          (404, "not_found_error"), (413, "invalid_request_error"),
                                          (429, "rate_limit_error"), (500, "server_error"), (503, "server_error")])
def test_error_types_follow_the_status(status, kind):
    assert openai.error_json(RequestError(status, "m"))["error"]["type"] == kind


def test_a_minimal_request_gets_the_server_limit():
    assert parse(ok()) == ChatRequest(messages=({"role": "user", "content": "hi"},), max_tokens=LIMIT, model="gpt-x")


@pytest.mark.parametrize("fields, expected", [
    ({"max_tokens": 10}, 10),
    ({"max_completion_tokens": 20}, 20),
    ({"max_tokens": 10, "max_completion_tokens": 20}, 20),
])
def test_max_completion_tokens_wins(fields, expected):
    assert parse(ok(**fields)).max_tokens == expected


@pytest.mark.parametrize("stop, expected", [("END", ("END",)), (["a", "b"], ("a", "b")), (None, ())])
def test_stop_is_a_string_or_a_list(stop, expected):
    assert parse(ok(stop=stop)).stop == expected


def test_sampling_and_stream_options():
    req = parse(ok(temperature=1.2, top_p=0.5, seed=42, stream=True, stream_options={"include_usage": True},
                   presence_penalty=0, user="u", parallel_tool_calls=True))
    assert (req.temperature, req.top_p, req.seed, req.stream, req.include_usage) == (1.2, 0.5, 42, True, True)
    assert not parse(ok(stream_options={"include_usage": True})).include_usage  # only with stream


def test_system_and_developer_messages_lead_the_conversation():
    req = parse(ok(messages=[
        {"role": "system", "content": "Be brief."},
        {"role": "developer", "content": [{"type": "text", "text": "Use French."}]},
        {"role": "user", "content": [{"type": "text", "text": "Bonjour"}, {"type": "text", "text": "ça va ?"}]},
        {"role": "assistant", "content": "Oui."},
        {"role": "system", "content": "Now switch to English."},
        {"role": "user", "content": "ok"},
    ]))
    assert req.system == "Be brief.\n\nUse French."
    assert req.messages == (
        {"role": "user", "content": "Bonjour\n\nça va ?"},
        {"role": "assistant", "content": "Oui."},
        {"role": "system", "content": "Now switch to English."},
        {"role": "user", "content": "ok"},
    )


def test_tool_turns_become_template_messages():
    req = parse(ok(tools=[TOOL], messages=[*USER, CALL_MSG, {"role": "tool", "tool_call_id": "call_1",
                                                                "content": "18C"}]))
    assert req.messages[1:] == (
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C", "name": "get_weather"},
    )
    assert req.tools == (TOOL,) and req.tool_choice == "auto"


@pytest.mark.parametrize("choice, names, mode, callable_names", [
    ("auto", {"get_weather", "get_time"}, "auto", {"get_weather", "get_time"}),
    ("required", {"get_weather", "get_time"}, "required", {"get_weather", "get_time"}),
    ("none", set(), "auto", set()),
    ({"type": "function", "function": {"name": "get_time"}}, {"get_weather", "get_time"}, "required", {"get_time"}),
])
def test_tool_choice(choice, names, mode, callable_names):
    """A named tool is the one a call must be of; the model still sees every tool (the prompt stays the same)."""
    time_tool = {"type": "function", "function": {"name": "get_time"}}
    req = parse(ok(tools=[TOOL, time_tool], tool_choice=choice))
    assert (req.tool_names, req.tool_choice) == (names, mode)
    assert {t["function"]["name"] for t in req.callable_tools} == callable_names


# --- responses ----------------------------------------------------------------

USAGE = Usage(input_tokens=7, cache_read_input_tokens=30, output_tokens=3, drafted_tokens=5, accepted_tokens=2)
CALL = ToolCall("call_9", "get_weather", {"city": "Paris"})
USAGE_JSON = {"prompt_tokens": 37, "completion_tokens": 3, "total_tokens": 40,
              "prompt_tokens_details": {"cached_tokens": 30},
              "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 3}}


def test_completion_json():
    body = openai.completion_json(ChatResult("Hello!", "stop", USAGE), model="m", completion_id="chatcmpl-1",
                                  created=1700000000)
    assert body == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!", "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": USAGE_JSON, "system_fingerprint": None,
    }
    chat_types.ChatCompletion.model_validate(body)


@pytest.mark.parametrize("result, finish", [
    (ChatResult("a", "length", USAGE), "length"),
    (ChatResult("a", "stop_sequence", USAGE, stop_sequence="END"), "stop"),
    (ChatResult("", "tool_use", USAGE, tool_calls=(CALL,)), "tool_calls"),
])
def test_finish_reasons(result, finish):
    body = openai.completion_json(result, model="m")
    assert body["choices"][0]["finish_reason"] == finish
    chat_types.ChatCompletion.model_validate(body)


def test_tool_calls_in_the_message():
    message = openai.completion_json(ChatResult("", "tool_use", USAGE, tool_calls=(CALL,)), model="m")["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"] == [{"id": "call_9", "type": "function",
                                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]


def test_a_cancelled_turn_has_no_completion():
    with pytest.raises(RequestError) as e:
        openai.completion_json(ChatResult("a", "cancelled", USAGE), model="m")
    assert e.value.status == 503


async def items(*pieces, result=None, error=None):
    for piece in pieces:
        yield Delta(piece)
    if error is not None:
        raise error
    if result is not None:
        yield result


async def chunks(source, include_usage=False) -> list:
    raw = await collect(openai.completion_chunks(source, model="m", include_usage=include_usage,
                                                 completion_id="chatcmpl-1", created=1))
    events = parse_sse(raw)
    assert all(name is None for name, _ in events), "OpenAI streams have no event names"
    assert events[-1] == (None, "[DONE]")
    for _, data in events[:-1]:
        if "error" not in data:
            chat_types.ChatCompletionChunk.model_validate(data)
    return [data for _, data in events[:-1]]


def chunk(delta, finish=None, usage=False):
    body = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "system_fingerprint": None,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]}
    return body | {"usage": None} if usage else body


@pytest.mark.anyio
async def test_a_text_stream():
    got = await chunks(items("Hel", "", "lo", result=ChatResult("Hello!", "stop", USAGE)))
    assert got == [chunk({"role": "assistant", "content": ""}), chunk({"content": "Hel"}), chunk({"content": "lo"}),
                   chunk({"content": "!"}), chunk({}, "stop")]


@pytest.mark.anyio
async def test_include_usage_adds_a_usage_chunk_with_no_choices():
    got = await chunks(items("Hi", result=ChatResult("Hi", "length", USAGE)), include_usage=True)
    assert got == [chunk({"role": "assistant", "content": ""}, usage=True), chunk({"content": "Hi"}, usage=True),
                   chunk({}, "length", usage=True),
                   {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1, "model": "m",
                    "system_fingerprint": None, "choices": [], "usage": USAGE_JSON}]


@pytest.mark.anyio
async def test_tool_calls_stream_one_chunk_each():
    second = ToolCall("call_10", "get_time", {})
    got = await chunks(items(result=ChatResult("", "tool_use", USAGE, tool_calls=(CALL, second))))
    assert got == [
        chunk({"role": "assistant", "content": ""}),
        chunk({"tool_calls": [{"index": 0, "id": "call_9", "type": "function",
                               "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}),
        chunk({"tool_calls": [{"index": 1, "id": "call_10", "type": "function",
                               "function": {"name": "get_time", "arguments": "{}"}}]}),
        chunk({}, "tool_calls"),
    ]


@pytest.mark.anyio
async def test_an_error_mid_stream_is_an_error_chunk_then_done():
    got = await chunks(items("Hel", error=RequestError(400, "prompt too long")))
    assert got[-1] == {"error": {"message": "prompt too long", "type": "invalid_request_error",
                                 "param": None, "code": None}}


@pytest.mark.anyio
async def test_a_crash_mid_stream_is_a_server_error_chunk(caplog):
    with caplog.at_level(logging.ERROR, "semantic.web"):
        got = await chunks(items("Hel", error=KeyError("x")))
    assert got[-1]["error"]["type"] == "server_error" and "KeyError" in caplog.text


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_a_cancelled_turn_is_an_error_chunk():
    got = await chunks(items(result=ChatResult("", "cancelled", USAGE)))
    assert got[-1]["error"]["message"].startswith("the turn was cancelled")


@pytest.mark.anyio
async def test_the_item_stream_is_closed_once_the_result_is_in():
    closed = []

    async def source():
        try:
            yield ChatResult("Hi", "stop", USAGE)
            yield Delta("never read")
        finally:
            closed.append(True)

    got = await chunks(source())
    assert closed == [True] and got[-1]["choices"][0]["finish_reason"] == "stop"
