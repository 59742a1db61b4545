"""Reasoning (``<think>...</think>``) split from the answer: the splitter on
every way a reply can arrive in pieces, and a live server whose template opens
the tag in its generation prompt (as DeepSeek-R1's does), on every route."""

from __future__ import annotations


import pytest

from runtime.models import LoadedModel
from web.reasoning import ReasoningSplitter, answer_text, split_reasoning

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
