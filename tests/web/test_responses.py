"""The Responses API (``/v1/responses``): parsing, response ids, the JSON and
the events (validated against the ``openai`` SDK's types), and a live server
on the tiny model driven by the ``openai`` SDK, the OpenAI Agents SDK and a
replay of what Codex sends."""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from pathlib import Path

import anyio
import pytest

from semantic.actors import Delta, Message
from semantic.web import responses
from semantic.web.chat import ChatTurn
from semantic.web.schema import ChatResult, Heartbeat, RequestError, ToolCall, Usage
from semantic.web.sse import KEEP_ALIVE

from .live import client, first_word_only, live_server, tiny_loaded, tiny_with_template
from .sse_util import collect, parse_sse
from .test_tools import HERMES

openai = pytest.importorskip("openai")
types = pytest.importorskip("openai.types.responses")
pydantic = pytest.importorskip("pydantic")

pytestmark = pytest.mark.anyio

LIMIT = 2048
CODEX = json.loads((Path(__file__).parent / "data" / "codex_requests.json").read_text())
EVENT = pydantic.TypeAdapter(types.ResponseStreamEvent)
USAGE = Usage(input_tokens=12, cache_read_input_tokens=30, output_tokens=5)
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}


def parse(body: dict, **headers) -> responses.ResponsesRequest:
    return responses.parse_request(json.dumps(body).encode(), headers, max_tokens_cap=LIMIT)


def bad(body: dict, status: int = 400, **headers) -> RequestError:
    with pytest.raises(RequestError) as e:
        parse(body, **headers)
    assert e.value.status == status
    return e.value


# --- parsing ------------------------------------------------------------------


def test_a_string_input_is_one_user_message_and_the_cap_is_the_default():
    req = parse({"model": "m", "input": "Hi"})
    assert req.messages == ({"role": "user", "content": "Hi"},)
    assert (req.system, req.max_tokens, req.max_output_tokens, req.store, req.stream) == \
           (None, LIMIT, None, True, False)
    assert parse({"input": "Hi", "max_output_tokens": LIMIT * 10}).max_tokens == LIMIT
    assert parse({"input": "Hi", "max_output_tokens": 16}).max_tokens == 16


def test_items_become_the_conversation():
    req = parse({"instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Weather?"},  # an easy input message: no type
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
         "content": [{"type": "output_text", "text": "Let me look.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "18C"},
        {"type": "message", "role": "system", "content": "Mid-conversation note."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "And"},
                                                         {"type": "input_text", "text": "tomorrow?"}]},
    ], "tools": [WEATHER]})
    assert req.system == "Be brief.\n\nRules."
    assert req.messages == (
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Let me look.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C", "name": "get_weather"},
        {"role": "system", "content": "Mid-conversation note."},
        {"role": "user", "content": "And\n\ntomorrow?"},
    )
    assert req.tools == ({"type": "function", "function": {k: WEATHER[k] for k in ("name", "description",
                                                                                     "parameters")}},)
    assert req.tool_names == {"get_weather"}


def test_codex_requests_parse_and_their_hosted_tools_are_ignored():
    for name, sequence in CODEX["sequences"].items():
        first, second = (responses.parse_request(json.dumps(r["body"]).encode(), r["headers"], max_tokens_cap=LIMIT)
                         for r in sequence)
        assert first.system.startswith(sequence[0]["body"]["input"][0]["content"][0]["text"][:50]), name
        assert [m["role"] for m in first.messages] == ["user"] * (len(first.messages))
        assert second.messages[:len(first.messages)] == first.messages
        assert [m["role"] for m in second.messages[len(first.messages):]] == ["assistant", "user"]
        assert first.hint == sequence[0]["body"]["prompt_cache_key"] and first.agent_id is None
        assert first.max_tokens == LIMIT and not first.store and first.stream
        kinds = {t["type"] for t in sequence[0]["body"]["tools"]}
        assert first.tool_names == {t["name"] for t in sequence[0]["body"]["tools"] if t["type"] == "function"}
        assert all(t["type"] == "function" for t in first.echo_tools) and kinds - {"function"} <= {"namespace",
                                                                                                 "web_search"}


BAD = [
    ({}, "input: is required"),
    ({"input": []}, "input: must not be empty"),
    ({"input": 5}, "input: must be an array, not an integer"),
    ({"input": [{"type": "message", "role": "user", "content": "a"}, {"type": "message", "role": "user",
      "content": "b"}, {"type": "reasoning"}, {"type": "image_generation_call", "id": "ig_1"}]},
     "input[3].type: 'image_generation_call' items are not supported"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type: 'item_reference' items are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type: 'input_image' parts are not supported (this server reads text only)"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role: must be 'user', 'assistant', 'system' or"),
    ({"input": [{"role": "developer", "content": "x"}]}, "input: must hold a message or a function call output"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]},
     "input[0].arguments: is not valid JSON"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id: is required"),
    ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens: must be at least 1, not 0"),
    ({"input": "hi", "temperature": 3}, "temperature: must be in [0, 2], not 3"),
    ({"input": "hi", "text": {"format": {"type": "json_schema"}}}, "text.format.schema: is required"),
    ({"input": "hi", "text": {"format": {"type": "json_schema", "schema": {"type": "strin"}}}},
     "text.format.schema: this server cannot enforce this JSON schema: Invalid type: strin"),
    ({"input": "hi", "text": {"format": {"type": "json_object"}}, "tools": [WEATHER]},
     "text.format: structured output together with tools is not supported"),
    ({"input": "hi", "background": True}, "background: background responses are not supported"),
    ({"input": "hi", "tools": [WEATHER, WEATHER]}, "tools[1].name: tool names must be unique"),
    ({"input": "hi", "tools": [{"type": "function"}]}, "tools[0].name: is required"),
    ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}},
     "tool_choice.name: names no function tool in 'tools': 'nope'"),
]


@pytest.mark.parametrize("body, message", BAD, ids=[m[:50] for _, m in BAD])
def test_bad_requests_are_400_naming_the_field(body, message):
    err = bad(body)
    assert message in err.message
    assert responses.error_json(err) == {"error": {"message": err.message, "type": "invalid_request_error",
                                                   "param": err.message.split(":")[0], "code": None}}


def test_hosted_tools_are_ignored_and_tool_choice_maps():
    hosted = [{"type": "web_search"}, {"type": "local_shell"}, {"type": "custom", "name": "apply_patch"}]
    req = parse({"input": "hi", "tools": [*hosted, WEATHER]})
    assert req.tool_names == {"get_weather"} and req.tool_choice == "auto"
    assert req.echo_tools == ({**WEATHER, "strict": False},)
    assert parse({"input": "hi", "tools": hosted}).tools is None
    assert parse({"input": "hi", "tools": [WEATHER], "tool_choice": "none"}).tools is None
    forced = parse({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert forced.tool_choice == "required" and forced.tool_name == "get_weather"
    assert forced.tool_names == {"get_weather"} and forced.callable_tools == forced.tools


def test_previous_response_ids_name_agent_states():
    prompt = (Message("system", "S"), Message("user", "hi"))
    for agent in ("conv-0123456789ab-01234567", "a_b__c", "x.y:z@w-1", "resp_1_2"):
        rid = responses.response_id(agent, prompt)
        state = responses.parse_response_id(rid)
        assert (state.agent_id, state.n, state.id) == (agent, 3, rid)
        assert state.matches((*prompt, Message("assistant", "yo")))
        assert state.matches((*prompt, Message("assistant", "yo"), Message("user", "more")))  # moved on
        assert not state.matches(prompt)  # no reply yet
        assert not state.matches((Message("system", "T"), Message("user", "hi"), Message("assistant", "yo")))
    assert parse({"input": "hi", "previous_response_id": rid}).previous_response_id == rid
    for nonsense in ("resp_abc", "resp_a_0_0123456789ab", "resp_a b_3_0123456789ab", "chatcmpl-1"):
        err = bad({"input": "hi", "previous_response_id": nonsense}, 404)
        assert responses.error_json(err) == {"error": {
            "message": f"Previous response with id {nonsense!r} not found.", "type": "invalid_request_error",
            "param": "previous_response_id", "code": "previous_response_not_found"}}
    err = bad({"input": "hi", "previous_response_id": rid}, 400, **{"x-agent-id": "other"})
    assert "X-Agent-Id header names 'other'" in err.message


def test_a_continued_request_is_the_history_then_the_input():
    history = (Message("system", "S"), Message("user", "hi"), Message("assistant", "yo"))
    req = parse({"input": [{"role": "developer", "content": "Note."}, {"role": "user", "content": "more"}],
                 "previous_response_id": responses.response_id("a", history[:2])})
    assert req.system is None  # a developer message after a previous response is no system prompt
    out = responses.continued(req, history)
    assert out.system == "S"
    assert out.messages == ({"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                            {"role": "system", "content": "Note."}, {"role": "user", "content": "more"})
    assert responses.continued(dataclasses.replace(req, system="New"), history).system == "New"


# --- the JSON and the events -----------------------------------------------------


def turn(items=(), request=None, agent="conv-x") -> ChatTurn:
    async def gen():
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item

    request = request or parse({"model": "m", "input": "hi", "metadata": {"k": "v"}, "temperature": 0.5})
    return ChatTurn(agent, "tiny", request, (Message("user", "hi"),), gen(), 1700000000)


CALL = ToolCall("call_1", "get_weather", {"city": "Paris"})


def test_the_response_json_is_an_sdk_response():
    t = turn()
    body = responses.response_json(t, ChatResult("Hello!", "stop", USAGE))
    r = types.Response.model_validate(body)
    assert r.output_text == "Hello!" and r.status == "completed" and r.incomplete_details is None
    assert r.id == responses.response_id("conv-x", t.messages) == "resp_conv-x_2_" + r.id[-12:]
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens,
            r.usage.total_tokens) == (42, 30, 5, 47)
    assert (r.metadata, r.temperature, r.store, r.model, r.created_at) == ({"k": "v"}, 0.5, True, "tiny", 1700000000)
    cut = types.Response.model_validate(responses.response_json(t, ChatResult("Hel", "length", USAGE)))
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    calls = types.Response.model_validate(responses.response_json(
        t, ChatResult("Let me check.", "tool_use", USAGE, tool_calls=(CALL,))))
    assert [o.type for o in calls.output] == ["message", "function_call"]
    fc = calls.output[1]
    assert (fc.call_id, fc.name, json.loads(fc.arguments), fc.status) == ("call_1", "get_weather",
                                                                          {"city": "Paris"}, "completed")
    only = responses.response_json(t, ChatResult("", "tool_use", USAGE, tool_calls=(CALL,)))
    assert [o["type"] for o in only["output"]] == ["function_call"]
    with pytest.raises(RequestError) as e:
        responses.response_json(t, ChatResult("", "cancelled", USAGE))
    assert e.value.status == 503


def test_a_stored_response_is_rebuilt_from_the_history():
    history = (Message("user", "hi"), Message("assistant", 'Sure.\n<tool_call>{"name": "f", "arguments": {}}'
                                                              '</tool_call>'))
    state = responses.parse_response_id(responses.response_id("a", history[:1]))
    r = types.Response.model_validate(responses.stored_json(state, history, model="tiny", created=5, fmt="hermes"))
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Sure."
    assert r.usage is None and r.id == state.id
    assert responses.deleted_json(r.id) == {"id": r.id, "object": "response.deleted", "deleted": True}


def sse(raw: bytes) -> list[tuple[str, dict]]:
    """The events of a stream, keep-alive comments (sent while a long prompt prefills) left out."""
    return parse_sse(raw.replace(KEEP_ALIVE, b""))


async def events_of(t: ChatTurn) -> list[tuple[str, dict]]:
    out = sse(await collect(responses.events(t, t.items)))
    for name, data in out:
        assert name == data["type"]
        EVENT.validate_python(data)
    assert [data["sequence_number"] for _, data in out] == list(range(len(out)))
    return out


async def test_a_streamed_response_follows_the_documented_sequence():
    out = await events_of(turn([Delta("Hel"), Heartbeat(), Delta("lo"), ChatResult("Hello!", "stop", USAGE)]))
    assert [n for n, _ in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.completed"]
    assert "".join(d["delta"] for n, d in out if n.endswith(".delta")) == "Hello!"
    final = types.Response.model_validate(out[-1][1]["response"])
    assert final.output_text == "Hello!" and final.usage.input_tokens_details.cached_tokens == 30
    assert out[0][1]["response"]["id"] == final.id and out[0][1]["response"]["status"] == "in_progress"
    raw = await collect(responses.events((t := turn([Heartbeat(), ChatResult("x", "stop", USAGE)])), t.items))
    assert b": keep-alive\n\n" in raw


async def test_streamed_tool_calls_and_a_cut_reply():
    out = await events_of(turn([ChatResult("", "tool_use", USAGE, tool_calls=(CALL,))]))
    assert [n for n, _ in out] == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done", "response.completed"]
    assert out[3][1]["delta"] == out[4][1]["arguments"] == '{"city": "Paris"}'
    out = await events_of(turn([Delta("Hel"), ChatResult("Hel", "length", USAGE)]))
    assert out[-1][0] == "response.incomplete"
    assert out[-1][1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    empty = await events_of(turn([ChatResult("", "stop", USAGE)]))  # still a message item, as Codex expects
    assert [n for n, _ in empty][2:6] == ["response.output_item.added", "response.content_part.added",
                                           "response.output_text.done", "response.content_part.done"]


async def test_a_failure_mid_stream_is_an_error_event_and_response_failed():
    out = await events_of(turn([Delta("Hel"), RequestError(503, "the server is shutting down; try again")]))
    assert [n for n, _ in out][-2:] == ["error", "response.failed"]
    assert out[-2][1]["message"] == "the server is shutting down; try again"
    assert out[-1][1]["response"]["error"] == {"code": "server_error",
                                                "message": "the server is shutting down; try again"}
    out = await events_of(turn([ChatResult("", "cancelled", USAGE)]))
    assert out[-1][0] == "response.failed"


# --- a live server ------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()  # load once, outside any test's timing


def tiny_with_tools():
    """The tiny model with a Hermes-style template that takes tools."""
    return tiny_with_template(HERMES)


def sdk(url: str):
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)


ASK = dict(model="tiny", max_output_tokens=8, instructions="You are a helper.")


async def test_turns_chained_by_previous_response_id_reuse_the_agent_and_its_cache(tmp_path):
    async with live_server(tmp_path) as url, sdk(url) as gpt, client(url) as http:
        first = await gpt.responses.create(**ASK, input="One.")
        assert first.id.startswith("resp_conv-") and first.status in ("completed", "incomplete")
        agent = responses.parse_response_id(first.id).agent_id
        second = await gpt.responses.create(**ASK, input="Two.", previous_response_id=first.id)
        assert responses.parse_response_id(second.id).agent_id == agent
        assert second.previous_response_id == first.id
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        assert second.usage.input_tokens > second.usage.input_tokens_details.cached_tokens
        # streaming, from the second
        # (the tiny model runs to max_output_tokens: "response.incomplete", which the SDK's
        # get_final_response() does not take, as with OpenAI's own API)
        async with gpt.responses.stream(**ASK, input="Three.", previous_response_id=second.id) as stream:
            seen = [e async for e in stream]
        text = "".join(e.delta for e in seen if e.type == "response.output_text.delta")
        assert seen[-1].type in ("response.completed", "response.incomplete")
        third = seen[-1].response
        assert third.output_text == text and responses.parse_response_id(third.id).agent_id == agent
        assert third.usage.input_tokens_details.cached_tokens >= second.usage.input_tokens
        history = (await http.get(f"/v1/agents/{agent}")).json()["history"]
        assert [m["content"] for m in history if m["role"] == "user"] == ["One.", "Two.", "Three."]
        # GET rebuilds each response from the history; DELETE deletes the agent
        got = await gpt.responses.retrieve(second.id)
        assert (got.id, got.output_text, got.usage) == (second.id, second.output_text, None)
        deleted = await http.delete(f"/v1/responses/{third.id}")
        assert deleted.json() == {"id": third.id, "object": "response.deleted", "deleted": True}
        assert (await http.get(f"/v1/agents/{agent}")).status_code == 404
        with pytest.raises(openai.NotFoundError):
            await gpt.responses.retrieve(first.id)


async def test_an_older_response_id_forks_and_leaves_the_original_as_it_was(tmp_path):
    async with live_server(tmp_path) as url, sdk(url) as gpt, client(url) as http:
        first = await gpt.responses.create(**ASK, input="Start.")
        agent = responses.parse_response_id(first.id).agent_id
        main = await gpt.responses.create(**ASK, input="Main branch.", previous_response_id=first.id)
        before = (await http.get(f"/v1/agents/{agent}")).json()["history"]
        branch = await gpt.responses.create(**ASK, input="Other branch.", previous_response_id=first.id)
        fork = responses.parse_response_id(branch.id).agent_id
        assert fork != agent and branch.output_text is not None
        assert branch.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens  # the fork's cache
        assert (await http.get(f"/v1/agents/{agent}")).json()["history"] == before
        forked = (await http.get(f"/v1/agents/{fork}")).json()["history"]
        assert forked[:3] == before[:3] and forked[3]["content"] == "Other branch."
        # both branches go on
        on_main = await gpt.responses.create(**ASK, input="More.", previous_response_id=main.id)
        on_branch = await gpt.responses.create(**ASK, input="More.", previous_response_id=branch.id)
        assert responses.parse_response_id(on_main.id).agent_id == agent
        assert responses.parse_response_id(on_branch.id).agent_id == fork
        assert (await gpt.responses.retrieve(main.id)).output_text == main.output_text


async def test_two_requests_continuing_one_response_at_once_both_keep_their_work(tmp_path):
    async with live_server(tmp_path) as url, sdk(url) as gpt:
        first = await gpt.responses.create(**ASK, input="Start.")
        replies = {}

        async def go(text):
            replies[text] = await gpt.responses.create(**ASK, input=text, previous_response_id=first.id)

        async with anyio.create_task_group() as tg:
            tg.start_soon(go, "Left.")
            tg.start_soon(go, "Right.")
        agents = {responses.parse_response_id(r.id).agent_id for r in replies.values()}
        assert len(agents) == 2  # one ran on the agent, the other on a fork: neither overwrote the other
        for reply in replies.values():
            assert (await gpt.responses.retrieve(reply.id)).output_text == reply.output_text


async def test_bad_requests_get_openai_errors_and_streams_refused_at_the_start_get_plain_http(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        missing = "resp_nobody_3_0123456789ab"
        for stream in (False, True):
            r = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": missing,
                                                       "stream": stream})
            assert r.status_code == 404 and r.headers["content-type"] == "application/json"
            assert r.json() == {"error": {"message": f"Previous response with id {missing!r} not found.",
                                          "type": "invalid_request_error", "param": "previous_response_id",
                                          "code": "previous_response_not_found"}}
        r = await http.post("/v1/responses", json={"input": [{"role": "user", "content": "a"},
                                                             {"type": "image_generation_call", "id": "x"}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "input[1].type"
        assert r.json()["error"]["message"] == "input[1].type: 'image_generation_call' items are not supported"
        r = await http.post("/v1/responses", json={"input": "word " * 600, "stream": True})  # over the context
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
        assert (await http.get(f"/v1/responses/{missing}")).status_code == 404
        assert (await http.get("/v1/responses/nonsense")).json()["error"]["message"] == \
               "Response with id 'nonsense' not found."
        assert (await http.delete(f"/v1/responses/{missing}")).status_code == 404
        # a stale id: its agent was rewritten by another conversation
        r = await http.post("/v1/responses", json={"input": "One.", "max_output_tokens": 4},
                            headers={"x-agent-id": "pinned"})
        stale = r.json()["id"]
        await http.post("/v1/responses", json={"input": "Else.", "max_output_tokens": 4},
                        headers={"x-agent-id": "pinned"})
        r = await http.post("/v1/responses", json={"input": "hi", "previous_response_id": stale})
        assert r.status_code == 404 and r.json()["error"]["code"] == "previous_response_not_found"


async def test_a_function_call_round_trip_on_a_template_with_tools(tmp_path):
    """The client sends back the call it got and its output; the model sees them through its template."""
    async with live_server(tmp_path, model=tiny_with_tools()) as url, sdk(url) as gpt, client(url) as http:
        first = await gpt.responses.create(**ASK, input="Weather in Paris?", tools=[WEATHER])
        agent = responses.parse_response_id(first.id).agent_id
        call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
        second = await gpt.responses.create(**ASK, tools=[WEATHER], previous_response_id=first.id, input=[
            call, {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}])
        assert responses.parse_response_id(second.id).agent_id == agent
        assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
        assert [t.name for t in second.tools] == ["get_weather"]
        history = (await http.get(f"/v1/agents/{agent}")).json()["history"]
        assert [m["role"] for m in history] == ["system", "user", "assistant", "assistant", "tool", "assistant"]
        assert history[3]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
        assert history[4] == {"role": "tool", "content": "18C and sunny", "tool_call_id": "call_1",
                              "name": "get_weather"}
        # stateless, the whole input every turn: the conversation finds its agent by content
        whole = [{"role": "user", "content": "Weather in Paris?"}, call,
                 {"type": "function_call_output", "call_id": "call_1", "output": "18C and sunny"}]
        r1 = await http.post("/v1/responses", json={**ASK, "tools": [WEATHER], "input": whole})
        assert r1.status_code == 200, r1.text
        whole += [*r1.json()["output"], {"role": "user", "content": "Thanks."}]
        r2 = await http.post("/v1/responses", json={**ASK, "tools": [WEATHER], "input": whole})
        assert r2.headers["x-agent-id"] == r1.headers["x-agent-id"] != agent
        assert r2.json()["usage"]["input_tokens_details"]["cached_tokens"] >= r1.json()["usage"]["input_tokens"]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the Agents SDK runs on asyncio only
async def test_the_openai_agents_sdk_runs_two_turns(smollm2, tmp_path):
    """On the embedded model, ending each reply at its first word (``first_word_only``): the SDK
    takes a reply cut at max_output_tokens ("response.incomplete") for an error, as it would from
    OpenAI, and what SmolLM2 says, and where it would stop, depends on the BLAS kernels."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    async with live_server(tmp_path, model=first_word_only(smollm2)) as url, sdk(url) as gpt:
        model = agents.OpenAIResponsesModel(model="smollm2", openai_client=gpt)
        bot = agents.Agent(name="helper", instructions="You name things. Answer with one word.", model=model,
                           model_settings=agents.ModelSettings(max_tokens=48))
        with anyio.fail_after(300):
            first = await agents.Runner.run(bot, "Name a fruit.")
            second = await agents.Runner.run(bot, "Name another fruit.", previous_response_id=first.last_response_id)
    assert isinstance(first.final_output, str) and isinstance(second.final_output, str)
    r1, r2 = first.raw_responses[-1], second.raw_responses[-1]
    u1, u2 = r1.usage, r2.usage
    assert u1.output_tokens < 48 and u2.output_tokens < 48, (u1, u2)  # ended by the model, not cut
    assert responses.parse_response_id(second.last_response_id).agent_id == \
           responses.parse_response_id(first.last_response_id).agent_id
    assert u2.input_tokens_details.cached_tokens >= u1.input_tokens + u1.output_tokens, (u1, u2)
    assert u2.input_tokens > u2.input_tokens_details.cached_tokens
    print(f"\nreplies {first.final_output!r}, {second.final_output!r}; turn 2 read "
          f"{u2.input_tokens_details.cached_tokens} of {u2.input_tokens} prompt tokens from the cache")


@pytest.mark.slow
@pytest.mark.model
async def test_a_replay_of_codex_is_served_from_one_agent(smollm2, tmp_path):
    """Codex's two requests (the short configuration), turn 2 with turn 1's reply as Codex echoes it."""
    first, second = (copy.deepcopy(r) for r in CODEX["sequences"]["short"])
    async with live_server(tmp_path, model=smollm2, max_tokens_cap=16) as url, client(url) as http:
        with anyio.fail_after(300):
            r1 = await http.post("/v1/responses", json=first["body"], headers=first["headers"])
            assert r1.status_code == 200, r1.text
            events1 = sse(r1.content)
            names = [n for n, _ in events1]
            assert names[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                                 "response.content_part.added"]
            # SmolLM2's reply ends or is cut at the cap (which, depends on the BLAS kernels): either
            # way the stream ends as documented, and says which
            assert names[-4:-1] == ["response.output_text.done", "response.content_part.done",
                                    "response.output_item.done"]
            done = events1[-1][1]["response"]
            cut = done["usage"]["output_tokens"] == 16
            assert (names[-1], done["status"], done["incomplete_details"]) == (
                ("response.incomplete", "incomplete", {"reason": "max_output_tokens"}) if cut
                else ("response.completed", "completed", None)), done
            assert done["usage"]["output_tokens"] <= 16
            item = done["output"][0]
            reply = {k: item[k] for k in ("type", "role", "content", "id", "status")}
            reply["content"] = [{"type": "output_text", "text": item["content"][0]["text"], "annotations": []}]
            body = second["body"]
            at = next(i for i, x in enumerate(body["input"]) if x.get("role") == "assistant")
            body["input"][at] = reply
            t0 = time.monotonic()
            r2 = await http.post("/v1/responses", json=body, headers=second["headers"])
            assert r2.status_code == 200, r2.text
        assert r2.headers["x-agent-id"] == r1.headers["x-agent-id"]
        u1, u2 = done["usage"], sse(r2.content)[-1][1]["response"]["usage"]
        assert u2["input_tokens_details"]["cached_tokens"] >= u1["input_tokens"] + u1["output_tokens"] - 2, \
            (u1, u2, time.monotonic() - t0)
        assert u2["input_tokens_details"]["cached_tokens"] >= 0.9 * u2["input_tokens"]
