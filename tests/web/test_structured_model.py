"""Structured output and forced calls on the embedded model (SmolLM2, whose
template has no tools) over HTTP, with the official SDKs, as the README
shows them: every reply parses, every forced call validates. The schemas
bound every string and list, so max_tokens (the server's cap, 1024) holds
the longest document they allow (a character is at most 6 tokens, as a
``\\u00XX`` escape): each reply ends by construction, whatever the model would
write; temperature 1 with 6 seeds gives 6 different ones."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Annotated, Literal

import anyio
import jsonschema
import pytest
from pydantic import BaseModel, Field

from .live import live_server

anthropic = pytest.importorskip("anthropic")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.model, pytest.mark.anyio]

RUNS = 6


@pytest.fixture
def anyio_backend():
    return "asyncio"  # the server's event loop is not what this tests: one backend is enough


class City(BaseModel):  # the README's
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)
    coastal: bool
    size: Literal["village", "town", "city"]


class Stop(BaseModel):
    name: str = Field(max_length=20)
    coastal: bool


class Trip(BaseModel):  # nested, with a list
    title: str = Field(max_length=20)
    days: int = Field(ge=1, le=30)
    stops: list[Stop] = Field(max_length=3)


class Verdict(BaseModel):
    answer: Literal["yes", "no", "unsure"]
    confidence: int = Field(ge=0, le=100)  # (a float's digits would be unbounded)
    reasons: list[Annotated[str, Field(max_length=60)]] = Field(max_length=2)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}},
    "required": ["city"], "additionalProperties": False}}}
ASKS = {City: "Describe Lisbon.", Trip: "Plan a short trip along the coast of Portugal.",
        Verdict: "Is the sea salty? Answer with your reasons."}


def parse_all(url: str) -> dict:
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

    def parse(model, seed):
        return gpt.chat.completions.parse(model="smollm2", response_format=model, temperature=1.0, seed=seed,
                                          messages=[{"role": "user", "content": ASKS[model]}]).choices[0]

    with ThreadPoolExecutor(4) as pool:  # four at once: the server batches them
        return {model: list(pool.map(lambda seed: parse(model, seed), range(RUNS))) for model in ASKS}


def calls(url: str):
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    out = [gpt.chat.completions.create(model="smollm2", tools=[WEATHER], tool_choice="required", messages=ask)]
    chunks = gpt.chat.completions.create(model="smollm2", tools=[WEATHER], tool_choice="required", messages=ask,
                                         stream=True)
    out.append([c for c in chunks])
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    out.append(claude.messages.create(model="smollm2", max_tokens=1024, tools=[tool], tool_choice={"type": "any"},
                                      messages=ask))
    with claude.messages.stream(model="smollm2", max_tokens=1024, tools=[tool], messages=ask,
                                tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        out.append(stream.get_final_message())
    return out


@pytest.mark.slow
async def test_every_reply_parses_and_every_forced_call_validates(smollm2, tmp_path):
    async with live_server(tmp_path, model=smollm2, max_tokens_cap=1024) as url:
        with anyio.fail_after(1200):
            parsed = await anyio.to_thread.run_sync(parse_all, url)
            chat, chunks, message, streamed = await anyio.to_thread.run_sync(calls, url)
    for model, choices in parsed.items():
        assert [c.finish_reason for c in choices] == ["stop"] * RUNS, model
        assert all(isinstance(c.message.parsed, model) for c in choices), model
        assert len({c.message.content for c in choices}) > 1, model  # samples, not one reply RUNS times
    schema = WEATHER["function"]["parameters"]
    assert chat.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(chat.choices[0].message.tool_calls[0].function.arguments), schema)
    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or ()]
    assert chunks[-1].choices[0].finish_reason == "tool_calls" and deltas[0].function.name == "get_weather"
    jsonschema.validate(json.loads("".join(d.function.arguments or "" for d in deltas)), schema)
    for m in (message, streamed):
        uses = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and [u.name for u in uses] == ["get_weather"]
        jsonschema.validate(uses[0].input, schema)
