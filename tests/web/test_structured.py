"""Structured output and forced tool calls through every route, driven by the
official SDKs against a real server: the reply is JSON the schema accepts, or
one call with valid arguments, however unlikely the random-weight model
finds it. The schemas allow finitely many replies, so each ends by
construction, never by the model's choice: their objects say nothing of
other keys, and are closed by default."""

from __future__ import annotations

import json
from typing import Literal

import anyio
import jsonschema
import pytest
from pydantic import BaseModel, Field

from .live import client, live_server, tiny_with_template
from .test_tools import DEEPSEEK_R1, DEEPSEEK_V31, HERMES, NOOP_FN, QWEN3_CODER, WEATHER_FN

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio


class Shirt(BaseModel):
    size: Literal["S", "M", "L"]
    cotton: bool
    colour: Literal["red", "green", "blue"]


class Label(BaseModel):  # a bounded string: OpenAI's strict schema keeps maxLength
    name: str = Field(max_length=8)
    shirts: list[Shirt] = Field(max_length=2)


ASK = [{"role": "user", "content": "Describe a shirt."}]
SHIRT = Shirt.model_json_schema()  # no "additionalProperties": closed all the same


async def in_thread(url: str, fn):
    with anyio.fail_after(120):
        return await anyio.to_thread.run_sync(fn, url)


async def test_openai_chat_parse_gives_the_pydantic_model(tmp_path):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            completion = c.chat.completions.parse(model="tiny", messages=ASK, response_format=Label, max_tokens=300)
            with c.chat.completions.stream(model="tiny", messages=ASK, response_format=Shirt,
                                           max_tokens=300) as stream:
                streamed = stream.get_final_completion()
            loose = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=300, response_format={
                "type": "json_schema", "json_schema": {"name": "shirt", "schema": SHIRT}})
        return completion, streamed, loose

    async with live_server(tmp_path) as url:
        completion, streamed, loose = await in_thread(url, ask)
    for c, model in ((completion, Label), (streamed, Shirt)):
        choice = c.choices[0]
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, model)
        assert choice.message.parsed == model.model_validate_json(choice.message.content)
    assert loose.choices[0].finish_reason == "stop"
    shirt = json.loads(loose.choices[0].message.content)
    jsonschema.validate(shirt, SHIRT)
    assert shirt.keys() == SHIRT["properties"].keys()  # no key the schema does not list


async def test_openai_json_object_is_an_object_or_cut_by_max_tokens(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        r = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "max_tokens": 40, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)


async def test_responses_parse_gives_the_pydantic_model(tmp_path):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            return c.responses.parse(model="tiny", input="Describe a shirt.", text_format=Shirt,
                                     max_output_tokens=300)

    async with live_server(tmp_path) as url:
        response = await in_thread(url, ask)
    assert response.status == "completed"
    assert isinstance(response.output_parsed, Shirt)
    assert response.text.format.type == "json_schema"  # echoed as asked


async def test_anthropic_parse_gives_the_pydantic_model(tmp_path):
    def ask(url):
        with anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as c:
            message = c.messages.parse(model="tiny", max_tokens=300, messages=ASK, output_format=Shirt)
            beta = c.messages.create(model="tiny", max_tokens=300, messages=ASK, extra_body={
                "output_format": {"type": "json_schema", "schema": SHIRT}})
        return message, beta

    async with live_server(tmp_path) as url:
        message, beta = await in_thread(url, ask)
    assert message.stop_reason == "end_turn"
    assert isinstance(message.parsed_output, Shirt)
    assert Shirt.model_validate_json(beta.content[0].text)


async def test_agent_api_format(tmp_path):
    schema = SHIRT
    async with live_server(tmp_path) as url, client(url) as http:
        assert (await http.post("/v1/agents", json={"id": "tailor"})).status_code == 201
        for _ in range(2):  # the second turn follows the first, both constrained
            r = await http.post("/v1/agents/tailor/messages", json={
                "content": "Another shirt.", "max_tokens": 300, "format": {"type": "json_schema", "schema": schema}})
            assert r.status_code == 200, r.text
            body = r.json()
            assert body["stop_reason"] == "end_turn"
            jsonschema.validate(json.loads(body["content"]), schema)
        bad = await http.post("/v1/agents/tailor/messages", json={
            "content": "x", "max_tokens": 5, "format": {"type": "json_schema", "schema": {"not": {}}}})
        assert bad.status_code == 400 and "format.schema" in bad.json()["error"]["message"]


WEATHER_SCHEMA = WEATHER_FN["function"]["parameters"]
OPENAI_TOOLS = [WEATHER_FN, NOOP_FN]
ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in OPENAI_TOOLS]


def valid_call(name: str, arguments: dict) -> None:
    assert name in ("get_weather", "noop")
    if name == "get_weather":
        jsonschema.validate(arguments, WEATHER_SCHEMA)
        assert arguments.keys() <= WEATHER_SCHEMA["properties"].keys()  # closed, though it does not say so
    else:
        assert arguments == {}


TEMPLATES = [(HERMES, None), (QWEN3_CODER, "qwen3_coder"), (DEEPSEEK_V31, None), (DEEPSEEK_R1, None)]
TEMPLATE_IDS = ["hermes", "qwen3-coder", "deepseek-v3.1", "deepseek-r1"]


@pytest.mark.slow
@pytest.mark.parametrize("template, parser", [(None, None), *TEMPLATES], ids=["no tools in the template", *TEMPLATE_IDS])
async def test_a_forced_call_is_one_valid_call_on_every_route(tmp_path, template, parser):
    model = tiny_with_template(template, parser) if template else None

    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as gpt, \
                anthropic.Anthropic(base_url=url, api_key="x", max_retries=0) as claude:
            chat = gpt.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, tools=OPENAI_TOOLS,
                                               tool_choice="required")
            named = gpt.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, tools=OPENAI_TOOLS,
                                                tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                                stream=True)
            deltas = [c.choices[0].delta for c in named if c.choices]
            response = gpt.responses.create(model="tiny", input="Weather?", max_output_tokens=200,
                                            tools=[{"type": "function", **t["function"]} for t in OPENAI_TOOLS],
                                            tool_choice="required")
            message = claude.messages.create(model="tiny", max_tokens=200, messages=ASK, tools=ANTHROPIC_TOOLS,
                                             tool_choice={"type": "any"})
        return chat, deltas, response, message

    async with live_server(tmp_path, model=model) as url:
        chat, deltas, response, message = await in_thread(url, ask)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0].function
    valid_call(call.name, json.loads(call.arguments))
    streamed = [tc for d in deltas for tc in d.tool_calls or ()]
    assert streamed[0].function.name == "get_weather"  # the one named
    jsonschema.validate(json.loads("".join(tc.function.arguments or "" for tc in streamed)), WEATHER_SCHEMA)
    calls = [item for item in response.output if item.type == "function_call"]
    assert response.status == "completed" and len(calls) == 1
    valid_call(calls[0].name, json.loads(calls[0].arguments))
    uses = [block for block in message.content if block.type == "tool_use"]
    assert message.stop_reason == "tool_use" and len(uses) == 1
    valid_call(uses[0].name, uses[0].input)


@pytest.mark.slow
@pytest.mark.parametrize("template, parser", TEMPLATES, ids=TEMPLATE_IDS)
async def test_a_conversation_with_a_call_continues_on_its_agent(tmp_path, template, parser):
    """The client sends the call back as ``tool_calls``, with its result: the
    server reads the stored reply's calls in the model's format, so the
    conversation is the same agent's, and only the result is new to it."""
    async with live_server(tmp_path, model=tiny_with_template(template, parser)) as url, client(url) as http:
        first = await http.post("/v1/chat/completions", json={  # a call with typed arguments: an integer
            "model": "tiny", "messages": ASK, "max_tokens": 200, "tools": [WEATHER_FN], "tool_choice": "required"})
        call = first.json()["choices"][0]["message"]["tool_calls"][0]
        history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "18C and sunny"}]
        second = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": history, "max_tokens": 3, "tools": [WEATHER_FN]})
    assert first.json()["choices"][0]["finish_reason"] == "tool_calls" and second.status_code == 200
    assert second.headers["x-agent-id"] == first.headers["x-agent-id"]


async def test_tools_whose_schema_cannot_be_enforced_are_a_400_when_a_call_is_forced(tmp_path):
    bad = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    async with live_server(tmp_path) as url, client(url) as http:
        forced = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "max_tokens": 5, "tools": [bad], "tool_choice": "required"})
        free = await http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": ASK, "max_tokens": 5, "tools": [bad]})
    assert forced.status_code == 400 and forced.json()["error"]["param"] == "tools"
    assert "cannot enforce a call" in forced.json()["error"]["message"]
    assert free.status_code == 200  # under auto the tools are told, their calls not held


@pytest.mark.slow
@pytest.mark.parametrize("template, parser", [(HERMES, None), (QWEN3_CODER, "qwen3_coder")], ids=["hermes", "qwen3-coder"])
async def test_auto_with_strict_tools_is_text_or_valid_calls(tmp_path, template, parser):
    """Under ``tool_choice: auto`` with ``strict`` tools, a tool-capable model
    may answer either way (``test_tools``: the grammar takes both); whichever
    it takes, a reply that ends is plain text or calls that validate."""
    strict = [{"type": "function", "function": {**t["function"], "strict": True}} for t in OPENAI_TOOLS]

    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as gpt:
            return [gpt.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, tools=strict,
                                                temperature=1.0, seed=seed) for seed in range(6)]

    async with live_server(tmp_path, model=tiny_with_template(template, parser)) as url:
        replies = await in_thread(url, ask)
    for reply in replies:
        choice = reply.choices[0]
        if choice.finish_reason == "tool_calls":
            for call in choice.message.tool_calls:
                valid_call(call.function.name, json.loads(call.function.arguments))
        elif choice.finish_reason == "stop":
            assert "<tool_call>" not in choice.message.content and not choice.message.tool_calls
