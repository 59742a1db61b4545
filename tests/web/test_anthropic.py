"""/v1/messages: parsing and validation, the message JSON, the exact SSE sequence."""

from __future__ import annotations

import json
import logging

import pytest
from pydantic import TypeAdapter

from semantic.actors import Delta
from semantic.web import anthropic
from semantic.web.schema import ChatRequest, ChatResult, Heartbeat, ReasoningDelta, RequestError, ToolCall, Usage

from .sse_util import collect, parse_sse

sdk_types = pytest.importorskip("anthropic.types")

LIMIT = 4096
USER = [{"role": "user", "content": "hi"}]


def parse(body: dict | bytes, **headers) -> ChatRequest:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return anthropic.parse_request(raw, {k.replace("_", "-"): v for k, v in headers.items()}, max_tokens_cap=LIMIT)


def ok(**fields) -> dict:
    return {"model": "claude-x", "max_tokens": 100, "messages": USER, **fields}


# --- validation ---------------------------------------------------------------

BAD = [
    (b"{not json", "request body is not valid JSON"),
    (b"[1, 2]", "request body must be a JSON object"),
    (b"\xff\xfe\xfa", "request body is not"),
    (b"", "request body is not valid JSON"),
    ({"max_tokens": 10}, "messages: is required"),
    (ok(messages=[]), "messages: must not be empty"),
    (ok(messages="hi"), "messages: must be an array, not a string"),
    (ok(messages=["hi"]), "messages[0]: must be an object, not a string"),
    (ok(messages=[{"content": "hi"}]), "messages[0].role: is required"),
    (ok(messages=[{"role": "system", "content": "x"}]), "messages: must hold a user message, not only system"),
    (ok(messages=[{"role": "tool", "content": "x"}]),
     "messages[0].role: must be 'user', 'assistant' or 'system', not 'tool'"),
    (ok(messages=[*USER, {"role": "system", "content": 3}]),
     "messages[1].content: must be a string or an array of text blocks, not an integer"),
    (ok(messages=[{"role": 7, "content": "x"}]), "messages[0].role: must be a string, not an integer"),
    (ok(messages=[{"role": "user"}]), "messages[0].content: must be a string or an array of content blocks, not null"),
    (ok(messages=[{"role": "user", "content": 5}]), "messages[0].content: must be a string or an array"),
    (ok(messages=[{"role": "user", "content": ["hi"]}]),
     "messages[0].content[0]: must be a content block object, not a string"),
    (ok(messages=[{"role": "user", "content": [{"text": "hi"}]}]), "messages[0].content[0].type: is required"),
    (ok(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages[0].content[0].text: is required"),
    (ok(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]),
     "messages[0].content[0].type: 'image' blocks are not supported (this server reads text only)"),
    (ok(messages=[{"role": "user", "content": [{"type": "document", "source": {}}]}]),
     "'document' blocks are not supported (this server reads text only)"),
    (ok(messages=[{"role": "user", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": {}}]}]),
     "messages[0].content[0].type: 'tool_use' blocks are not supported here"),
    (ok(messages=[{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "a"}]}]),
     "'tool_result' blocks are not supported here"),
    (ok(messages=[{"role": "assistant", "content": [{"type": "tool_use", "name": "b", "input": {}}]}]),
     "messages[0].content[0].id: is required"),
    (ok(messages=[{"role": "assistant", "content": [{"type": "tool_use", "id": "a", "name": "b", "input": 3}]}]),
     "messages[0].content[0].input: must be an object, not an integer"),
    (ok(messages=[{"role": "user", "content": [{"type": "tool_result"}]}]),
     "messages[0].content[0].tool_use_id: is required"),
    (ok(messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": 3}]}]),
     "messages[0].content[0].content: must be a string or an array of blocks, not an integer"),
    (ok(max_tokens=None), "max_tokens: is required"),
    ({"messages": USER}, "max_tokens: is required"),
    (ok(max_tokens=0), "max_tokens: must be at least 1, not 0"),
    (ok(max_tokens=-5), "max_tokens: must be at least 1, not -5"),
    (ok(max_tokens="10"), "max_tokens: must be an integer, not a string"),
    (ok(max_tokens=1.5), "max_tokens: must be an integer, not a number"),
    (ok(max_tokens=True), "max_tokens: must be an integer, not a boolean"),
    (ok(temperature=1.5), "temperature: must be in [0, 1], not 1.5"),
    (ok(temperature="hot"), "temperature: must be a number, not a string"),
    (ok(top_p=0), "top_p: must be in (0, 1], not 0"),
    (ok(top_k=-1), "top_k: must be at least 0, not -1"),
    (ok(stop_sequences="END"), "stop_sequences: must be an array of strings, not a string"),
    (ok(stop_sequences=[""]), "stop_sequences[0]: must not be empty"),
    (ok(stop_sequences=[1]), "stop_sequences[0]: must be a string, not an integer"),
    (ok(stream="yes"), "stream: must be a boolean, not a string"),
    (ok(system=5), "system: must be a string or an array of text blocks, not an integer"),
    (ok(system=[{"type": "image"}]), "system[0].type: must be 'text', not 'image'"),
    (ok(metadata="x"), "metadata: must be an object, not a string"),
    (ok(model=5), "model: must be a string, not an integer"),
    (ok(tools="x"), "tools: must be an array, not a string"),
    (ok(tools=[{"name": "a"}]), "tools[0].input_schema: is required"),
    (ok(tools=[{"input_schema": {}}]), "tools[0].name: is required"),
    (ok(tools=[{"name": "a", "input_schema": {}}, {"name": "a", "input_schema": {}}]),
     "tools[1].name: tool names must be unique; 'a' appears twice"),
    (ok(tools=[{"type": "web_search_20250305", "name": "web_search"}]),
     "tools[0].type: server tool 'web_search_20250305' is not supported"),
    (ok(tools=[{"name": "a", "input_schema": {}}], tool_choice={"type": "tool", "name": "b"}),
     "tool_choice.name: names no tool in 'tools': 'b'"),
    (ok(tools=[{"name": "a", "input_schema": {}}], tool_choice={"type": "maybe"}),
     "tool_choice.type: must be 'auto', 'any', 'tool' or 'none', not 'maybe'"),
    (ok(output_config={"format": {"type": "json_object"}}),
     "output_config.format.type: must be 'json_schema', not 'json_object'"),
    (ok(output_config={"format": {"type": "json_schema", "schema": {"type": "object", "not": {}}}}),
     "output_config.format.schema: this server cannot enforce this JSON schema: Unimplemented keys"),
    (ok(output_format={"type": "json_schema"}), "output_format.schema: is required"),
    (ok(output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
        tools=[{"name": "a", "input_schema": {}}]),
     "output_config.format: structured output together with tools is not supported"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_bad_requests_are_400_with_a_clear_message(body, message):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.status == 400
    assert message in e.value.message
    err = anthropic.error_json(e.value)
    assert err == {"type": "error", "error": {"type": "invalid_request_error", "message": e.value.message}}
    sdk_types.ErrorResponse.model_validate(err)


@pytest.mark.parametrize("status, kind", [
    (400, "invalid_request_error"), (401, "authentication_error"), (403, "permission_error"),
    (404, "not_found_error"), (413, "request_too_large"), (429, "rate_limit_error"),
    (500, "api_error"), (503, "overloaded_error"), (422, "invalid_request_error"),
])
def test_error_types_follow_the_status(status, kind):
    assert anthropic.error_json(RequestError(status, "m"))["error"]["type"] == kind


# --- parsing ------------------------------------------------------------------


def test_a_minimal_request():
    req = parse(ok())
    assert req == ChatRequest(messages=({"role": "user", "content": "hi"},), max_tokens=100, model="claude-x")


def test_sampling_fields_and_stop_sequences():
    req = parse(ok(temperature=0, top_p=0.9, top_k=40, stop_sequences=["END", "\n\n"], stream=True,
                   metadata={"user_id": "u1"}), x_agent_id="agent-1")
    assert (req.temperature, req.top_p, req.top_k) == (0.0, 0.9, 40)
    assert req.stop == ("END", "\n\n")
    assert req.stream and req.agent_id == "agent-1" and req.metadata == {"user_id": "u1"}
    assert (req.seed, req.include_usage) == (None, False)


def test_null_fields_count_as_absent():
    req = parse(ok(temperature=None, system=None, stop_sequences=None, tools=None))
    assert (req.temperature, req.system, req.stop, req.tools) == (None, None, (), None)


def test_system_blocks_join_and_cache_control_is_ignored():
    system = [{"type": "text", "text": "You are terse.", "cache_control": {"type": "ephemeral"}},
              {"type": "text", "text": "Answer in French.", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = [{"role": "user", "content": [
        {"type": "text", "text": "Bonjour", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": ""},  # empty blocks drop out
        {"type": "text", "text": "ça va ?"}]}]
    req = parse(ok(system=system, messages=messages))
    assert req.system == "You are terse.\n\nAnswer in French."
    assert req.messages == ({"role": "user", "content": "Bonjour\n\nça va ?"},)
    assert req.conversation()[0] == {"role": "system", "content": req.system}


def test_unknown_fields_and_thinking_blocks_are_ignored():
    messages = [*USER, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "hmm", "signature": "x"},
        {"type": "redacted_thinking", "data": "y"},
        {"type": "text", "text": "hello"}]}, {"role": "user", "content": "again"}]
    req = parse(ok(messages=messages, thinking={"type": "enabled", "budget_tokens": 1024},
                   service_tier="auto", context_management={"edits": []}))
    assert req.messages[1] == {"role": "assistant", "content": "hello"}


# A request as Claude Code sends it: system blocks with cache_control, tools, and
# a tool_use / tool_result round trip (results first in the user turn, then text).
CLAUDE_CODE = {
    "model": "claude-sonnet-4-6",
    "max_tokens": 4000,
    "stream": True,
    "temperature": 1,
    "metadata": {"user_id": "user_abc_account__session_123"},
    "system": [
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude.",
         "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": "You are an interactive CLI tool that helps users with software engineering tasks.",
         "cache_control": {"type": "ephemeral"}},
    ],
    "tools": [
        {"name": "Bash", "description": "Executes a bash command",
         "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                          "required": ["command"], "additionalProperties": False,
                          "$schema": "http://json-schema.org/draft-07/schema#"}},
        {"name": "Read", "description": "Reads a file",
         "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}}},
         "cache_control": {"type": "ephemeral"}},
    ],
    "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "<system-reminder>Be careful.</system-reminder>"},
            {"type": "text", "text": "list the files", "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [
            {"type": "text", "text": "I'll list them."},
            {"type": "tool_use", "id": "toolu_01A", "name": "Bash", "input": {"command": "ls"}},
            {"type": "tool_use", "id": "toolu_01B", "name": "Read", "input": {"file_path": "a.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "a.py\nb.py"},
            {"type": "tool_result", "tool_use_id": "toolu_01B", "is_error": True,
             "content": [{"type": "text", "text": "no such file"}, {"type": "image", "source": {}}],
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "why did Read fail?"}]},
    ],
}


def test_a_claude_code_request_parses_into_a_template_ready_conversation():
    req = parse(CLAUDE_CODE)
    assert req.system == ("You are Claude Code, Anthropic's official CLI for Claude.\n\n"
                          "You are an interactive CLI tool that helps users with software engineering tasks.")
    assert req.messages == (
        {"role": "user", "content": "<system-reminder>Be careful.</system-reminder>\n\nlist the files"},
        {"role": "assistant", "content": "I'll list them.", "tool_calls": [
            {"id": "toolu_01A", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}},
            {"id": "toolu_01B", "type": "function", "function": {"name": "Read", "arguments": {"file_path": "a.py"}}},
        ]},
        {"role": "tool", "tool_call_id": "toolu_01A", "name": "Bash", "content": "a.py\nb.py"},
        {"role": "tool", "tool_call_id": "toolu_01B", "name": "Read",
         "content": "Error: no such file\n\n[image omitted: this server reads text only]"},
        {"role": "user", "content": "why did Read fail?"},
    )
    assert req.tools == (
        {"type": "function", "function": {"name": "Bash", "description": "Executes a bash command",
                                          "parameters": CLAUDE_CODE["tools"][0]["input_schema"]}},
        {"type": "function", "function": {"name": "Read", "description": "Reads a file",
                                          "parameters": CLAUDE_CODE["tools"][1]["input_schema"]}},
    )
    assert req.tool_names == {"Bash", "Read"} and req.tool_choice == "auto"
    assert (req.max_tokens, req.stream, req.temperature, req.model) == (4000, True, 1.0, "claude-sonnet-4-6")


BILLING = "x-anthropic-billing-header: cc_version=2.1.330.a1f; cc_entrypoint=sdk-cli; cch=93be1;"


def test_claude_codes_billing_header_is_never_part_of_the_prompt():
    blocks = [{"type": "text", "text": BILLING}, {"type": "text", "text": "You are Claude Code."}]
    assert parse(ok(system=blocks)).system == "You are Claude Code."
    assert parse(ok(system=[{"type": "text", "text": BILLING}])).system is None
    assert parse(ok(system=BILLING + "\nYou are Claude Code.")).system == "You are Claude Code."
    assert parse(ok(system="x-anthropic-billing-header is a term")).system == "x-anthropic-billing-header is a term"


def test_system_messages_inside_messages_stay_where_they_are():
    req = parse(ok(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
                             {"role": "system", "content": [{"type": "text", "text": "Now be brief."},
                                                            {"type": "text", "text": "Really."}]},
                             {"role": "user", "content": "go on"}]))
    assert [m["role"] for m in req.messages] == ["user", "assistant", "system", "user"]
    assert req.messages[2]["content"] == "Now be brief.\n\nReally."


@pytest.mark.parametrize("headers, metadata, hint", [
    ({"x_claude_code_session_id": "s-1"}, None, "s-1"),
    ({"x_claude_code_session_id": "s-1"}, {"user_id": '{"session_id": "s-2"}'}, "s-1"),
    ({}, {"user_id": '{"device_id": "d", "account_uuid": "", "session_id": "s-2"}'}, "s-2"),
    ({}, {"user_id": "user_ab12_account__session_0f3c2a1e-9b7d-4c61-a1f0-2f5e3c4b5a69"},
     "0f3c2a1e-9b7d-4c61-a1f0-2f5e3c4b5a69"),
    ({}, {"user_id": "someone"}, None),
    ({}, None, None),
])
def test_the_session_hint_comes_from_claude_codes_header_then_its_metadata(headers, metadata, hint):
    req = parse(ok(**({"metadata": metadata} if metadata else {})), **headers)
    assert req.hint == hint and req.agent_id is None


def test_max_tokens_above_the_cap_is_clamped_and_what_claude_code_adds_is_accepted():
    req = parse(ok(max_tokens=32000, thinking={"type": "adaptive"}, output_config={"effort": "high"},
                   context_management={"edits": [{"type": "clear_tool_uses_20250919"}]}))
    assert req.max_tokens == LIMIT
    assert parse(ok(max_tokens=LIMIT - 1)).max_tokens == LIMIT - 1


def test_count_tokens_needs_no_max_tokens():
    req = anthropic.parse_count_tokens(json.dumps({"model": "m", "messages": USER, "system": "Be brief."}).encode())
    assert req.system == "Be brief." and req.messages == ({"role": "user", "content": "hi"},)
    with pytest.raises(RequestError, match="messages: is required"):
        anthropic.parse_count_tokens(b'{"model": "m"}')


@pytest.mark.parametrize("choice, names, mode, callable_names", [
    ({"type": "auto"}, {"Bash", "Read"}, "auto", {"Bash", "Read"}),
    ({"type": "any"}, {"Bash", "Read"}, "required", {"Bash", "Read"}),
    ({"type": "tool", "name": "Read"}, {"Bash", "Read"}, "required", {"Read"}),
    ({"type": "none"}, set(), "auto", set()),
])
def test_tool_choice(choice, names, mode, callable_names):
    req = parse({**CLAUDE_CODE, "tool_choice": choice})
    assert (req.tool_names, req.tool_choice) == (names, mode)
    assert {t["function"]["name"] for t in req.callable_tools} == callable_names
    assert (req.tools is None) == (not names)


# --- responses ----------------------------------------------------------------

USAGE = Usage(input_tokens=7, cache_read_input_tokens=30, output_tokens=3)
CALL = ToolCall("call_1", "get_weather", {"city": "Paris"})


def test_message_json():
    body = anthropic.message_json(ChatResult("Hello!", "stop", USAGE), model="m", message_id="msg_1")
    assert body == {
        "id": "msg_1", "type": "message", "role": "assistant", "model": "m",
        "content": [{"type": "text", "text": "Hello!"}],
        "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 7, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 30,
                  "output_tokens": 3, "drafted_tokens": 0, "accepted_tokens": 0},
    }
    sdk_types.Message.model_validate(body)
    assert anthropic.message_json(ChatResult("x", "stop", USAGE), model="m")["id"].startswith("msg_")


@pytest.mark.parametrize("result, reason, seq", [
    (ChatResult("a", "length", USAGE), "max_tokens", None),
    (ChatResult("a", "stop_sequence", USAGE, stop_sequence="END"), "stop_sequence", "END"),
    (ChatResult("", "tool_use", USAGE, tool_calls=(CALL,)), "tool_use", None),
])
def test_stop_reasons_map_to_anthropics(result, reason, seq):
    body = anthropic.message_json(result, model="m")
    assert (body["stop_reason"], body["stop_sequence"]) == (reason, seq)
    sdk_types.Message.model_validate(body)


def test_tool_calls_follow_the_text_block():
    body = anthropic.message_json(ChatResult("Checking.", "tool_use", USAGE, tool_calls=(CALL,)), model="m")
    assert body["content"] == [{"type": "text", "text": "Checking."},
                               {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {"city": "Paris"}}]


def test_a_cancelled_turn_has_no_message():
    with pytest.raises(RequestError) as e:
        anthropic.message_json(ChatResult("a", "cancelled", USAGE), model="m")
    assert e.value.status == 503
    assert anthropic.error_json(e.value)["error"]["type"] == "overloaded_error"


# --- the stream ---------------------------------------------------------------

_events = TypeAdapter(sdk_types.RawMessageStreamEvent)


async def items(*pieces, result: ChatResult | None = None, error: BaseException | None = None):
    for piece in pieces:
        yield Delta(piece) if isinstance(piece, str) else piece
    if error is not None:
        raise error
    if result is not None:
        yield result


async def stream(source) -> list[tuple[str, dict]]:
    raw = await collect(anthropic.message_events(source, model="m", message_id="msg_1"))
    events = parse_sse(raw)
    for name, data in events:
        assert name == data["type"], "the SSE event name repeats the data's type"
        if name not in ("ping", "error"):  # the SDK skips pings and raises errors
            _events.validate_python(data)
    return events


START = ("message_start", {"type": "message_start", "message": {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "m", "content": [],
    "stop_reason": None, "stop_sequence": None,
    "usage": {"input_tokens": 0, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0,
              "output_tokens": 0, "drafted_tokens": 0, "accepted_tokens": 0}}})  # the head goes out before the turn ends: its usage is in message_delta
TEXT_START = ("content_block_start", {"type": "content_block_start", "index": 0,
                                      "content_block": {"type": "text", "text": ""}})
PING = ("ping", {"type": "ping"})


def delta(text, index=0):
    return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                    "delta": {"type": "text_delta", "text": text}})


def stop(index):
    return ("content_block_stop", {"type": "content_block_stop", "index": index})


def message_delta(reason, usage=USAGE, seq=None):
    return ("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                              "usage": {"input_tokens": usage.input_tokens, "cache_creation_input_tokens": 0,
                                        "cache_read_input_tokens": usage.cache_read_input_tokens,
                                        "output_tokens": usage.output_tokens,
                                        "drafted_tokens": usage.drafted_tokens,
                                        "accepted_tokens": usage.accepted_tokens}})


MESSAGE_STOP = ("message_stop", {"type": "message_stop"})


@pytest.mark.anyio
async def test_a_text_stream_is_exactly_the_documented_sequence():
    events = await stream(items("Hel", "", "lo!", result=ChatResult("Hello!", "stop", USAGE)))
    assert events == [START, PING, TEXT_START, delta("Hel"), delta("lo!"), stop(0),
                      message_delta("end_turn"), MESSAGE_STOP]


@pytest.mark.anyio
async def test_heartbeats_while_a_prompt_prefills_start_the_stream_and_ping():
    events = await stream(items(Heartbeat(), Heartbeat(), "Hi", result=ChatResult("Hi", "stop", USAGE)))
    assert events == [START, PING, PING, PING, TEXT_START, delta("Hi"), stop(0), message_delta("end_turn"),
                      MESSAGE_STOP]


@pytest.mark.anyio
async def test_reasoning_streams_as_a_thinking_block_before_the_text():
    result = ChatResult("Paris.", "stop", USAGE, reasoning="The capital... is Paris.")
    events = await stream(items(ReasoningDelta("The capital"), ReasoningDelta("... is Paris."), "Paris.",
                                result=result))
    thinking_start = ("content_block_start", {"type": "content_block_start", "index": 0, "content_block":
                                              {"type": "thinking", "thinking": "", "signature": ""}})
    assert events == [START, PING, thinking_start, thinking("The capital"), thinking("... is Paris."), stop(0),
                      ("content_block_start", {"type": "content_block_start", "index": 1,
                                               "content_block": {"type": "text", "text": ""}}),
                      delta("Paris.", 1), stop(1), message_delta("end_turn"), MESSAGE_STOP]
    body = anthropic.message_json(result, model="m")
    assert body["content"][:2] == [{"type": "thinking", "thinking": "The capital... is Paris.", "signature": ""},
                                   {"type": "text", "text": "Paris."}]
    sdk_types.Message.model_validate(body)


def thinking(text, index=0):
    return ("content_block_delta", {"type": "content_block_delta", "index": index,
                                    "delta": {"type": "thinking_delta", "thinking": text}})


@pytest.mark.anyio
async def test_text_held_back_arrives_before_the_block_stops():
    result = ChatResult("Hello!", "stop_sequence", USAGE, stop_sequence="END")
    events = await stream(items("Hel", result=result))
    assert events == [START, PING, TEXT_START, delta("Hel"), delta("lo!"), stop(0),
                      message_delta("stop_sequence", seq="END"), MESSAGE_STOP]


@pytest.mark.anyio
async def test_tool_calls_stream_as_tool_use_blocks_after_the_text():
    second = ToolCall("call_2", "get_time", {})
    result = ChatResult("Checking.", "tool_use", USAGE, tool_calls=(CALL, second))
    events = await stream(items("Checking.", result=result))
    assert events == [
        START, PING, TEXT_START, delta("Checking."), stop(0),
        ("content_block_start", {"type": "content_block_start", "index": 1, "content_block":
                                 {"type": "tool_use", "id": "call_1", "name": "get_weather", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 1, "delta":
                                 {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}}),
        stop(1),
        ("content_block_start", {"type": "content_block_start", "index": 2, "content_block":
                                 {"type": "tool_use", "id": "call_2", "name": "get_time", "input": {}}}),
        ("content_block_delta", {"type": "content_block_delta", "index": 2, "delta":
                                 {"type": "input_json_delta", "partial_json": "{}"}}),
        stop(2),
        message_delta("tool_use"), MESSAGE_STOP,
    ]


@pytest.mark.anyio
async def test_an_error_mid_stream_is_one_error_event_and_the_end():
    events = await stream(items("Hel", error=RequestError(400, "prompt is 9000 tokens; the context holds 8192")))
    assert events == [START, PING, TEXT_START, delta("Hel"),
                      ("error", {"type": "error", "error": {"type": "invalid_request_error",
                                                            "message": "prompt is 9000 tokens; the context holds 8192"}})]


@pytest.mark.anyio
async def test_a_crash_mid_stream_is_an_api_error_event_and_a_log_record(caplog):
    with caplog.at_level(logging.ERROR, "semantic.web"):
        events = await stream(items("Hel", error=ZeroDivisionError("boom")))
    assert events[-1] == ("error", {"type": "error", "error": {
        "type": "api_error", "message": "the server failed while generating; see its log"}})
    assert "ZeroDivisionError" in caplog.text


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_a_cancelled_turn_ends_the_stream_with_an_overloaded_error():
    events = await stream(items("Hel", result=ChatResult("Hel", "cancelled", USAGE)))
    assert events[-1][1]["error"]["type"] == "overloaded_error"
    assert [name for name, _ in events].count("message_stop") == 0


@pytest.mark.anyio
async def test_a_stream_without_a_result_is_a_bug_reported_as_an_error_event(caplog):
    with caplog.at_level(logging.ERROR, "semantic.web"):
        events = await stream(items("Hel"))
    assert events[-1][0] == "error" and "without a ChatResult" in caplog.text


@pytest.mark.both_backends
@pytest.mark.anyio
async def test_cancellation_is_not_turned_into_an_error_event():
    import anyio

    async def stuck():
        yield Delta("a")
        await anyio.sleep_forever()

    seen = []
    with anyio.CancelScope() as scope:
        async for chunk in anthropic.message_events(stuck(), model="m"):
            seen.append(chunk)
            if b"text_delta" in chunk:
                scope.cancel()
    assert scope.cancelled_caught and b"error" not in b"".join(seen)


@pytest.mark.anyio
async def test_the_item_stream_is_closed_once_the_result_is_in():
    closed = []

    async def source():
        try:
            yield Delta("Hi")
            yield ChatResult("Hi", "stop", USAGE)
            yield Delta("never read")
        finally:
            closed.append(True)

    events = await stream(source())
    assert closed == [True] and events[-1] == MESSAGE_STOP
