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


# Cut by max_tokens: each reply's grammar closes within the limit (``runtime.text.grammar``).
CUT = 40


class Review(BaseModel):  # unbounded strings; lists the smallest document fills to 27 of the 40 tokens
    product: str
    pros: list[str] = Field(min_length=3)
    cons: list[str] = Field(min_length=3)
    score: int = Field(ge=1, le=10)


class Itinerary(BaseModel):  # the smallest document takes 33 of the 40 tokens
    title: str
    stops: list[Stop] = Field(min_length=2)
    tips: list[str]


CUT_ASKS = {Review: "Review the bicycle you rode today.", Itinerary: "Plan a short trip along the coast of Portugal."}


def parse_cut(url: str) -> dict:
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)

    def parse(model, seed):
        try:
            return gpt.chat.completions.parse(model="smollm2", response_format=model, temperature=1.0, seed=seed,
                                              max_tokens=CUT, messages=[{"role": "user", "content": CUT_ASKS[model]}])
        except openai.LengthFinishReasonError as e:  # (the SDK's parse refuses a reply cut by the limit)
            return e.completion

    with ThreadPoolExecutor(4) as pool:
        return {model: list(pool.map(lambda seed: parse(model, seed), range(RUNS))) for model in CUT_ASKS}


def smallest_call(smollm2) -> int:
    """Tokens in the smallest forced call of WEATHER on the embedded model (its markup is text there)."""
    from semantic.runtime.text.grammar import Grammars
    from semantic.web.tool_grammar import call_grammar

    tok = smollm2.tokenizer
    return len(Grammars(tok, tok.eos_token_ids).constraint(call_grammar("hermes", [WEATHER]), limit=10**6).closing)


def cut_calls(url: str, limits: list[int]) -> list:
    gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
    ask = [{"role": "user", "content": "What is the weather in Oslo?"}]
    tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
    out = []
    for limit in limits:
        out.append(("anthropic", limit, claude.messages.create(
            model="smollm2", max_tokens=limit, tools=[tool], tool_choice={"type": "tool", "name": "get_weather"},
            messages=ask)))
        with claude.messages.stream(model="smollm2", max_tokens=limit, tools=[tool], messages=ask,
                                    tool_choice={"type": "any"}) as stream:
            out.append(("anthropic", limit, stream.get_final_message()))
        out.append(("openai", limit, gpt.chat.completions.create(
            model="smollm2", tools=[WEATHER], tool_choice="required", messages=ask, max_tokens=limit)))
        out.append(("responses", limit, gpt.responses.create(
            model="smollm2", tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
            input=ask[0]["content"], max_output_tokens=limit)))
    return out


def call_of(route: str, reply) -> tuple[bool, str, dict]:
    """(whether the limit cut it, the text beside the call, the call's arguments) of a forced call's reply."""
    if route == "anthropic":
        uses = [b.input for b in reply.content if b.type == "tool_use"]
        text = "".join(b.text for b in reply.content if b.type == "text")
        return reply.stop_reason == "max_tokens", text, uses[0] if len(uses) == 1 else None
    if route == "openai":
        choice = reply.choices[0]
        calls = choice.message.tool_calls or []
        return (choice.finish_reason == "length", choice.message.content or "",
                json.loads(calls[0].function.arguments) if len(calls) == 1 else None)
    calls = [o for o in reply.output if o.type == "function_call"]
    text = "".join(p.text for o in reply.output if o.type == "message" for p in o.content)
    return reply.status == "incomplete", text, json.loads(calls[0].arguments) if len(calls) == 1 else None


@pytest.mark.slow
async def test_replies_cut_by_max_tokens_are_still_valid(smollm2, tmp_path):
    least = smallest_call(smollm2)
    limits = [least, least + 3]  # the smallest call exactly: cut whatever the model says; and with room for words
    async with live_server(tmp_path, model=smollm2, max_tokens_cap=1024) as url:
        with anyio.fail_after(1200):
            parsed = await anyio.to_thread.run_sync(parse_cut, url)
            calls = await anyio.to_thread.run_sync(cut_calls, url, limits)
    for model, completions in parsed.items():  # each reply the limit cut is JSON its model reads
        for completion in completions:
            choice = completion.choices[0]
            assert (choice.finish_reason, completion.usage.completion_tokens) == ("length", CUT), model
            model.model_validate_json(choice.message.content)
    schema = WEATHER["function"]["parameters"]
    for route, limit, reply in calls:  # a forced call cut by the limit is still a call, never markup in text
        cut, text, arguments = call_of(route, reply)
        assert arguments is not None and "<tool_call>" not in text, (route, limit, reply)
        jsonschema.validate(arguments, schema)
        assert cut or limit > least, (route, limit)  # at the smallest call's length every reply is cut


@pytest.mark.slow
async def test_under_auto_the_embedded_model_is_shown_the_tools_and_replies_with_text_or_a_valid_call(
        smollm2, tmp_path):
    asks = ["What is the weather in Oslo?", "Get me the forecast for Tokyo.", "Hi! How are you?"]

    def run(url):
        gpt = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
        claude = anthropic.Anthropic(base_url=url, api_key="x", max_retries=0, timeout=600)
        ask = [{"role": "user", "content": asks[0]}]
        tool = {"name": "get_weather", "input_schema": WEATHER["function"]["parameters"]}
        counts = [claude.messages.count_tokens(model="smollm2", messages=ask, **extra).input_tokens
                  for extra in ({}, {"tools": [tool]})]
        replies = [gpt.chat.completions.create(model="smollm2", tools=[WEATHER], max_tokens=60, temperature=1.0,
                                               seed=seed, messages=[{"role": "user", "content": text}])
                   for text in asks for seed in range(2)]
        return counts, replies

    async with live_server(tmp_path, model=smollm2, max_tokens_cap=1024) as url:
        with anyio.fail_after(1200):
            (bare, told), replies = await anyio.to_thread.run_sync(run, url)
    assert told > bare + 50  # the tool, in the system prompt (the template itself takes none)
    for reply in replies:  # text, or a call that parses and fits its schema: whichever the model chose
        choice = reply.choices[0]
        assert "<tool_call>" not in (choice.message.content or "")
        for call in choice.message.tool_calls or ():
            assert call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        assert choice.finish_reason in ("tool_calls", "length") if choice.message.tool_calls else \
            choice.finish_reason in ("stop", "length")
