"""``n`` > 1 on the OpenAI chat route, with the official SDK: the choices are
one prompt prefilled once, each the reply a lone request with its seed
(``seed + index``) gets; ``usage`` counts the prompt once; streamed chunks
reassemble into the same choices; a forced call holds in every choice."""

from __future__ import annotations

import json

import anyio
import pytest

from .live import live_server
from .test_structured import OPENAI_TOOLS, valid_call

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.anyio

ASK = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.mark.slow
async def test_n_choices_each_the_reply_of_its_seed_streamed_and_not(tmp_path):
    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            def create(agent: str, **options):
                return c.chat.completions.create(model="tiny", messages=ASK, max_tokens=12, temperature=1.0,
                                                 extra_headers={"X-Agent-Id": agent}, **options)

            whole = create("whole", n=3, seed=5, logprobs=True)
            chunks = list(create("streamed", n=3, seed=5, stream=True, stream_options={"include_usage": True}))
            lone = [create(f"lone-{i}", seed=5 + i) for i in range(3)]
            calls = list(c.chat.completions.create(model="tiny", messages=ASK, max_tokens=200, n=2, stream=True,
                                                   tools=OPENAI_TOOLS, tool_choice="required"))
        return whole, chunks, lone, calls

    async with live_server(tmp_path) as url:
        with anyio.fail_after(180):
            whole, chunks, lone, calls = await anyio.to_thread.run_sync(ask, url)

    assert [c.index for c in whole.choices] == [0, 1, 2]
    texts = [c.message.content for c in whole.choices]
    assert texts == [one.choices[0].message.content for one in lone]
    assert whole.usage.prompt_tokens == lone[0].usage.prompt_tokens  # the prompt counted once
    assert whole.usage.completion_tokens == sum(len(c.logprobs.content) for c in whole.choices)
    assert whole.usage.completion_tokens == sum(one.usage.completion_tokens for one in lone)

    streamed, finish = ["", "", ""], {}
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] += c.delta.content or ""
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert streamed == texts
    assert finish == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens

    arguments: dict[int, dict[int, str]] = {0: {}, 1: {}}
    names, finish = {}, {}
    for chunk in calls:
        for c in chunk.choices:
            for tc in c.delta.tool_calls or ():
                names.setdefault(c.index, tc.function.name)
                arguments[c.index][tc.index] = arguments[c.index].get(tc.index, "") + (tc.function.arguments or "")
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert finish == {0: "tool_calls", 1: "tool_calls"}
    for index in (0, 1):
        valid_call(names[index], json.loads(arguments[index][0]))
