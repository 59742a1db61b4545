"""A raw-text turn (``Agent.complete``): the prompt as it is, no template; its
tokens scored on request, from a cold prefill whatever the agent has cached,
on each choice's first delta and in the result; the agent keeps the prompt
and completion as its history, and its slot the turn's counts, not the
prompt's log-probabilities."""

from __future__ import annotations

import pytest

from semantic.actors import Message, Runtime
from tests.web.live import tiny_loaded

pytestmark = pytest.mark.anyio

PROMPT = "The lighthouse keeper counted"


async def test_a_scored_prompt_is_prefilled_whole_and_the_agent_keeps_the_text(tmp_path):
    tokens = tiny_loaded().tokenizer.encode(PROMPT)
    async with Runtime.open(tiny_loaded(), tmp_path / "cache", 256 << 20) as rt:
        agent = await rt.agent("reader")
        results = []
        for _ in range(2):  # the second time the agent has the prompt cached: it is prefilled again
            async with agent.complete(PROMPT, max_tokens=0, prompt_logprobs=2) as reply:
                assert [d async for d in reply] == []  # nothing generated: the result has them
            results.append(reply.result)
        async with agent.complete(PROMPT + " the ships", max_tokens=3) as reply:
            deltas = [d async for d in reply]
        more = reply.result
        async with agent.complete(PROMPT + " the ships", max_tokens=2, prompt_logprobs=0, choices=2) as reply:
            first = [d async for d in reply if d.prompt_logprobs]
        scored = reply.result
        with pytest.raises(ValueError, match="needs a prompt"):
            agent.complete("")
    for r in results:
        assert (r.reason, r.text, r.prefilled_tokens, r.reused_tokens) == ("length", "", len(tokens), 0)
        assert [e.token for e in r.prompt_logprobs] == tokens and r.prompt_logprobs[0].logprob is None
        assert all(len(e.top) == 2 for e in r.prompt_logprobs[1:])
    assert results[0].prompt_logprobs == results[1].prompt_logprobs
    assert sorted(d.choice for d in first) == [0, 1]  # each choice's first delta has them
    assert all(d.prompt_logprobs == scored.prompt_logprobs == scored.choices[0].prompt_logprobs for d in first)
    assert more.reused_tokens == len(tokens) and more.prompt_logprobs == () and deltas[0].prompt_logprobs == ()
    assert scored.reused_tokens == 0 and scored.prompt_tokens == more.prompt_tokens
    assert agent.history == (Message("user", PROMPT + " the ships"), Message("assistant", scored.text))
    kept = agent.last_result  # the slot keeps the counts, not the prompt's entries
    assert kept.output_tokens == scored.output_tokens and kept.prompt_logprobs == kept.choices[0].prompt_logprobs == ()
