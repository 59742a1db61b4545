"""Reasoning (``<think>...</think>``) split from the answer: the splitter on
every way a reply can arrive in pieces, and a live server whose template opens
the tag in its generation prompt (as DeepSeek-R1's does), on every route."""

from __future__ import annotations

import json

import pytest

from semantic.runtime.model.models import LoadedModel
from semantic.web.reasoning import ReasoningSplitter, answer_text, split_reasoning

from .live import client, live_server, tiny_loaded, tiny_with_template

REPLIES = [
    ("<think>\nThe user greets me.\n</think>\n\nHello!", False, "\nThe user greets me.\n", "Hello!"),
    ("  <think>a</think>b", False, "a", "b"),
    ("Hello <think>not reasoning</think>", False, None, "Hello <think>not reasoning</think>"),
    ("<thi", False, None, "<thi"),
    ("<think>unfinished", False, "unfinished", ""),
    ("weighing it up</think>\n\nYes.", True, "weighing it up", "Yes."),
    ("no close tag: all of it is reasoning", True, "no close tag: all of it is reasoning", ""),
    ("plain answer", False, None, "plain answer"),
    ("<think></think>Direct.", False, "", "Direct."),
]


@pytest.mark.parametrize("text, opened, reasoning, answer", REPLIES)
def test_a_whole_reply_splits_into_reasoning_and_answer(text, opened, reasoning, answer):
    assert split_reasoning(text, opened) == (reasoning, answer)


@pytest.mark.parametrize("text, opened, reasoning, answer", REPLIES)
def test_any_chunking_streams_the_same_parts(text, opened, reasoning, answer):
    for size in range(1, len(text) + 1):
        splitter = ReasoningSplitter(opened)
        parts = [p for i in range(0, len(text), size) for p in splitter.feed(text[i:i + size])] + splitter.end()
        thinking = "".join(t for kind, t in parts if kind == "thinking")
        assert (thinking if splitter.reasoned else None, "".join(t for kind, t in parts if kind == "text")) == (
            reasoning, answer), size
        assert all(t for _, t in parts)


def test_a_stored_reply_is_matched_by_its_answer():
    assert answer_text("<think>hmm</think>\n\nHi") == "Hi"
    assert answer_text("just text") == "just text"


def thinking_model() -> LoadedModel:
    """The tiny model with a template whose generation prompt opens ``<think>``:
    its random-weight replies never close the tag, so all of a reply is reasoning."""
    template = tiny_loaded().tokenizer.chat_template
    return tiny_with_template(template.replace("'<|im_start|>assistant\n'", "'<|im_start|>assistant\n<think>\n'"))


@pytest.mark.anyio
async def test_reasoning_comes_back_apart_from_the_answer_on_every_route(tmp_path):
    ask = {"model": "m", "max_tokens": 6, "messages": [{"role": "user", "content": "Is it raining?"}]}
    async with live_server(tmp_path, thinking_model()) as url, client(url) as http:
        message = (await http.post("/v1/messages", json=ask)).json()
        completion = (await http.post("/v1/chat/completions", json=ask)).json()["choices"][0]["message"]
        await http.post("/v1/agents", json={"id": "thinker"})
        turn = (await http.post("/v1/agents/thinker/messages", json={"content": "Is it raining?",
                                                                     "max_tokens": 6})).json()
        async with http.stream("POST", "/v1/messages", json={**ask, "stream": True}) as r:
            streamed = (await r.aread()).decode()
    thinking, text = message["content"][0], message["content"][1]
    assert thinking["type"] == "thinking" and thinking["thinking"] and thinking["signature"] == ""
    assert text == {"type": "text", "text": ""}
    assert completion["reasoning_content"] and completion["content"] == ""
    assert turn["reasoning"] and turn["content"] == ""
    assert '"thinking_delta"' in streamed and streamed.index('"thinking"') < streamed.index('"type":"text"')


@pytest.mark.anyio
async def test_reasoning_is_a_reasoning_item_in_responses(tmp_path):
    openai = pytest.importorskip("openai")
    async with live_server(tmp_path, thinking_model()) as url:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        plain = await client.responses.create(model="m", input="Is it raining?", max_output_tokens=6)
        events = []
        async with client.responses.stream(model="m", input="Is it snowing?", max_output_tokens=6) as stream:
            async for event in stream:
                events.append(event.type)
        await client.close()
    kinds = [item.type for item in plain.output]
    assert kinds == ["reasoning", "message"] and plain.output[0].content[0].text
    assert events.index("response.reasoning_text.delta") < events.index("response.reasoning_text.done")
    assert events.index("response.reasoning_text.done") < events.index("response.content_part.added")


SHIRT = {"type": "object", "properties": {"size": {"enum": ["S", "M"]}}, "required": ["size"],
         "additionalProperties": False}


@pytest.mark.slow
@pytest.mark.parametrize("tags_are_tokens", [False, True], ids=["tags as text", "tags as tokens (Qwen3)"])
def test_a_reasoning_model_thinks_then_answers_as_the_grammar_says(tags_are_tokens):
    """Under a grammar (structured output, a forced call) a model that reasons
    still thinks first: its answer -- what a client parses -- is what the
    grammar holds, never its thoughts. A prompt that opened the tag holds the
    reply to closing it."""
    from semantic.runtime.text.grammar import json_schema
    from semantic.web.reasoning import ThinkTags
    from semantic.web.tools import added_tokens

    from .test_tools import takes, with_tokens

    tok = with_tokens(None, "<think>", "</think>", special=False) if tags_are_tokens else with_tokens(None)
    answer = '{"size": "M"}'
    for opened, reply, taken in ((False, answer, True), (False, "<think>\nSmall or medium?\n</think>\n\n" + answer, True),
                                 (True, "Small or medium?\n</think>\n\n" + answer, True), (True, answer, False),
                                 (False, "Well, " + answer, False), (True, "Hm.</think>" + answer + " ok", False)):
        g = ThinkTags(opened).constrain(json_schema(SHIRT), added_tokens(tok))
        assert takes(g, reply, tok) is taken, (opened, reply)
        if taken:
            assert split_reasoning(reply, opened)[1] == answer


@pytest.mark.slow
def test_a_gpt_oss_reply_thinks_then_answers_on_the_final_channel():
    from semantic.runtime.text.grammar import json_schema
    from semantic.web.harmony import Harmony, read_harmony

    from .test_harmony import HARMONY_TOKENS
    from .test_tools import takes, with_tokens

    tok = with_tokens(None, *HARMONY_TOKENS)
    g = Harmony().constrain(json_schema(SHIRT), {})
    for reply, taken in (('<|channel|>final<|message|>{"size": "S"}', True),
                         ('<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>'
                          '{"size": "S"}', True), ('{"size": "S"}', False), ('<|channel|>final<|message|>S', False)):
        assert takes(g, tok.encode(reply, add_special_tokens=False), tok) is taken, reply
        if taken:
            assert read_harmony(reply)[1] == '{"size": "S"}'


def test_prepare_lets_a_reasoning_model_think_before_its_constrained_reply():
    from semantic.runtime.text.grammar import json_schema
    from semantic.web.harmony import Harmony
    from semantic.web.harmony import call_grammar as harmony_grammar
    from semantic.web.prepare import prepare
    from semantic.web.reasoning import ThinkTags
    from semantic.web.schema import ChatRequest

    from .test_tools import HERMES, WEATHER_FN, call_grammar

    ask = dict(messages=({"role": "user", "content": "Shirt?"},), max_tokens=50)
    structured = ChatRequest(**ask, grammar=json_schema(SHIRT))
    assert prepare(structured, HERMES).grammar == json_schema(SHIRT)  # a model that does not reason
    assert prepare(structured, HERMES, reasoning=ThinkTags(True)).grammar == \
        ThinkTags(True).constrain(json_schema(SHIRT), {})
    forced = ChatRequest(**ask, tools=(WEATHER_FN,), tool_choice="required")
    assert prepare(forced, HERMES, reasoning=ThinkTags(False)).grammar == \
        ThinkTags(False).constrain(call_grammar("hermes", [WEATHER_FN]), {})
    gpt_oss = "{# tools #}<|channel|>"
    assert prepare(forced, gpt_oss, reasoning=Harmony()).grammar == harmony_grammar([WEATHER_FN])  # its own thoughts
    assert prepare(structured, gpt_oss, reasoning=Harmony()).grammar == Harmony().constrain(json_schema(SHIRT), {})


@pytest.mark.anyio
async def test_a_prompt_that_closes_the_tag_gets_no_reasoning_and_its_answer_held(tmp_path):
    """DeepSeek-V3.1 out of thinking mode (Qwen3 with thinking off alike) closes the tag in its
    generation prompt: the reply is all answer, and a grammar holds it from its first token."""
    template = tiny_loaded().tokenizer.chat_template
    closed = tiny_with_template(template.replace("'<|im_start|>assistant\n'",
                                                 "'<|im_start|>assistant\n<think>\n\n</think>\n\n'"))
    ask = {"model": "m", "max_tokens": 50, "messages": [{"role": "user", "content": "Shirt size?"}],
           "response_format": {"type": "json_schema", "json_schema": {"name": "shirt", "schema": SHIRT}}}
    async with live_server(tmp_path, closed) as url, client(url) as http:
        reply = (await http.post("/v1/chat/completions", json=ask)).json()["choices"][0]
    assert reply["finish_reason"] == "stop" and not reply["message"].get("reasoning_content")
    assert json.loads(reply["message"]["content"])["size"] in ("S", "M")


@pytest.mark.anyio
@pytest.mark.parametrize("prompt_ends, reads", [("<|im_start|>assistant\n", "may think"),
                                                ("<|im_start|>assistant\n<think>\n", "opened"),
                                                ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "no reasoning")])
async def test_how_a_reply_reasons_follows_what_the_generation_prompt_did_with_the_tag(prompt_ends, reads):
    from types import SimpleNamespace

    from semantic.web.chat import ChatCore
    from semantic.web.metrics import Metrics
    from semantic.web.reasoning import ThinkTags

    class Runtime:  # what ChatCore asks of the runtime here: the tokenizer, a rendered prompt
        async def tokenizer(self, model=None):
            return SimpleNamespace(chat_template="{% if thinking %}<think></think>{% endif %}")

        async def prompt(self, messages, tools=None, model=None):
            return "<|im_start|>user\nhi<|im_end|>\n" + prompt_ends, 9

    reasoning = await ChatCore(Runtime(), Metrics())._reasoning("m")
    assert {"may think": isinstance(reasoning, ThinkTags) and not reasoning.opened,
            "opened": isinstance(reasoning, ThinkTags) and reasoning.opened,
            "no reasoning": reasoning is None}[reads]
