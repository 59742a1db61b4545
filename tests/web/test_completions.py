"""/v1/completions: parsing, the ``logprobs`` object, and the route driven by
the official SDK over a real socket -- a prompt scored as evaluation harnesses
score one (``echo``, ``logprobs``, ``max_tokens: 0``), text completed, with
choices and stop strings, streamed and not."""

from __future__ import annotations

import json
import math
import re

import anyio
import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from semantic.actors import EngineOptions, TokenLogprob, TurnResult
from semantic.runtime.kv import make_sequence_cache
from semantic.web import completions
from semantic.web.chat import ChatTurn
from semantic.web.schema import ChatResult, CompletionRequest, RequestError, Usage

from .live import client, live_server, tiny_loaded

openai = pytest.importorskip("openai")

LIMIT = 4096
PROMPT = "The lighthouse keeper counted the ships that passed the rocks."


def parse(body: dict, headers: dict | None = None) -> CompletionRequest:
    return completions.parse_request(json.dumps(body).encode(), headers or {}, max_tokens_cap=LIMIT)


BAD = [
    ({}, "prompt: is required"),
    ({"prompt": ""}, "prompt: must not be empty"),
    ({"prompt": [""]}, "prompt[0]: must not be empty"),
    ({"prompt": ["one", "two"]}, "prompt: must be one prompt (a string, or an array of one string), not 2"),
    ({"prompt": []}, "prompt: must be one prompt"),
    ({"prompt": [1, 2, 3]}, "prompt: token ids are not supported; send the prompt as text"),
    ({"prompt": [[1, 2]]}, "prompt: token ids are not supported"),
    ({"prompt": {"text": "x"}}, "prompt: must be a string, not an object"),
    ({"prompt": "x", "logprobs": 6}, "logprobs: must be at most 5, not 6"),
    ({"prompt": "x", "logprobs": True}, "logprobs: must be an integer, not a boolean"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens: must be at least 0, not -1"),
    ({"prompt": "x", "n": 17}, "n: must be at most 16, not 17"),
    ({"prompt": "x", "best_of": 3}, "best_of: must equal n (1)"),
    ({"prompt": "x", "suffix": "y"}, "suffix: is not supported"),
    ({"prompt": "x", "temperature": 3}, "temperature: must be in [0, 2], not 3"),
    ({"prompt": "x", "stop": [""]}, "stop[0]: must not be empty"),
]


@pytest.mark.parametrize("body, message", BAD)
def test_bad_requests_are_400_naming_the_field(body, message):
    with pytest.raises(RequestError) as e:
        parse(body)
    assert e.value.status == 400 and e.value.message.startswith(message), e.value.message


def test_a_request_as_evaluation_harnesses_send_it():
    req = parse({"model": "m", "prompt": ["Paris is"], "echo": True, "logprobs": 1, "max_tokens": 0,
                 "temperature": 0, "seed": 1234, "user": "eval", "frequency_penalty": 0, "logit_bias": {},
                 "best_of": 1, "whatever": {"x": 1}})  # unknown and harmless fields: ignored, as on the chat route
    assert (req.prompt, req.echo, req.logprobs, req.prompt_logprobs, req.max_tokens) == ("Paris is", True, 1, 1, 0)
    assert (req.temperature, req.seed, req.hint, req.choices, req.stream) == (0.0, 1234, "eval", 1, False)
    plain = parse({"prompt": "x", "logprobs": 2, "stop": "\n", "n": 2, "best_of": 2})
    assert (plain.max_tokens, plain.prompt_logprobs, plain.stop, plain.choices) == (16, None, ("\n",), 2)
    assert parse({"prompt": "x", "max_tokens": 10**6}).max_tokens == LIMIT
    assert parse({"prompt": "x", "session_id": "a1"}, {"x-agent-id": "a1"}).agent_id == "a1"
    with pytest.raises(RequestError, match="session_id: names agent"):
        parse({"prompt": "x", "session_id": "a1"}, {"x-agent-id": "b2"})


def test_the_logprobs_object_and_its_text_offsets():
    """Offsets are characters of the choice's text: a BOS the prompt does not
    spell stands at 0 and is as wide as nothing, a character split between
    tokens counts at the token that begins it; each ``top_logprobs`` dict has
    the likeliest tokens and the token itself; -inf is written as -9999."""
    def lp(piece: bytes, logprob, *top) -> TokenLogprob:
        return TokenLogprob(1, piece, logprob, tuple(TokenLogprob(2, p, v) for p, v in top))

    prompt = [lp(b"<s>", None), lp(b"Caf", -2.0, (b"Coff", -0.1)), lp(b"\xc3", -0.2, (b"\xc3", -0.2)),
              lp(b"\xa9", -0.0, (b"\xa9", -0.0)), lp(b" au", -1.5, (b" au", -1.5))]
    output = [lp(b" lait", -0.5, (b" lait", -0.5)), lp(b"!", -math.inf, (b".", -0.01))]
    turn = TurnResult("length", " lait!", 5, 0, 5, 2, 0.0, 0.1, logprobs=tuple(output), prompt_logprobs=tuple(prompt))
    result = ChatResult(" lait!", "length", Usage(5, 0, 2), turn=turn)

    def choice(echo: bool) -> dict:
        req = CompletionRequest("Café au", 2, echo=echo, logprobs=1)
        return completions.response_json(ChatTurn("a", "m", req, (), None, 7), result)["choices"][0]

    echoed, plain = choice(True), choice(False)
    assert echoed["text"] == "Café au lait!" and plain["text"] == " lait!" and echoed["finish_reason"] == "length"
    assert echoed["logprobs"] == {
        "tokens": ["<s>", "Caf", "\ufffd", "\ufffd", " au", " lait", "!"],
        "token_logprobs": [None, -2.0, -0.2, -0.0, -1.5, -0.5, -9999.0],
        "top_logprobs": [None, {"Coff": -0.1, "Caf": -2.0}, {"\ufffd": -0.2}, {"\ufffd": -0.0}, {" au": -1.5},
                         {" lait": -0.5}, {".": -0.01, "!": -9999.0}],
        "text_offset": [0, 0, 3, 3, 4, 7, 12]}
    assert plain["logprobs"]["tokens"] == [" lait", "!"] and plain["logprobs"]["text_offset"] == [0, 5]


# The servers' KV cache settings the values are checked under: 4 bits against a direct forward over
# the same kind of cache; full precision (16) against the model over mlx-lm's own float cache.
KV_BITS = [4, 16]


def direct_logprobs(tokens: list[int], kv_bits: int) -> np.ndarray:
    """The float32 log-softmax of each row of a direct forward of the served
    model, all prompt tokens in one chunk as the engine prefills them, over
    the engine's own kind of cache at 4 bits, over mlx-lm's float ``KVCache``
    at 16: row ``i`` is prompt token ``i + 1``'s distribution."""
    model = tiny_loaded().model
    cache = make_prompt_cache(model) if kv_bits == 16 else make_sequence_cache(model, bits=kv_bits).view()
    rows = model(mx.array(tokens)[None], cache=cache)[0, :-1].astype(mx.float32)
    return np.array(rows - mx.logsumexp(rows, axis=-1, keepdims=True))


@pytest.mark.anyio
@pytest.mark.parametrize("kv_bits", KV_BITS)
async def test_the_sdk_scores_a_prompt_streamed_and_not(tmp_path, kv_bits):
    """``echo: true, logprobs: 1, max_tokens: 0``: the prompt's tokens, the first
    unscored, each other's logprob the log-softmax of the model's row before
    it (within 1e-4), offsets into the prompt; streamed, one chunk holds them.
    A scored prompt is prefilled whole, on an agent that has it cached too;
    a completion that goes on from it reuses the cache the scoring left."""
    score = dict(model="tiny", prompt=PROMPT, echo=True, logprobs=1, max_tokens=0,
                 extra_headers={"X-Agent-Id": "reader"})

    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            whole = c.completions.create(**score)
            chunks = list(c.completions.create(**score, stream=True, stream_options={"include_usage": True}))
            more = c.completions.create(**{**score, "prompt": PROMPT + " Then", "logprobs": None, "max_tokens": 1})
            return whole, chunks, more

    async with live_server(tmp_path, engine=EngineOptions(kv_bits=kv_bits)) as url, client(url) as http:
        with anyio.fail_after(120):
            whole, chunks, more = await anyio.to_thread.run_sync(ask, url)
            history = (await http.get("/v1/agents/reader")).json()["history"]
    tokens = tiny_loaded().tokenizer.encode(PROMPT)
    choice, lp = whole.choices[0], whole.choices[0].logprobs
    assert (whole.object, choice.text, choice.finish_reason) == ("text_completion", PROMPT, "length")
    assert len(lp.tokens) == len(tokens) and "".join(lp.tokens) == PROMPT
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(len(tokens))]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = direct_logprobs(tokens, kv_bits)
    got = np.array(lp.token_logprobs[1:])
    assert np.abs(got - want[np.arange(len(tokens) - 1), tokens[1:]]).max() < 1e-4
    for i, top in enumerate(lp.top_logprobs[1:]):
        assert lp.tokens[i + 1] in top and len(top) <= 2
        assert max(top.values()) == pytest.approx(want[i].max(), abs=1e-4)
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(tokens), 0)
    assert [(c.choices[0].text, c.choices[0].finish_reason) for c in chunks[:-1]] == [(PROMPT, None), ("", "length")]
    assert chunks[0].choices[0].logprobs == lp
    assert whole.usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens_details.cached_tokens == 0
    assert more.choices[0].text.startswith(PROMPT + " Then")
    assert more.usage.prompt_tokens_details.cached_tokens == len(tokens)  # the scoring's cache, extended
    assert history == [{"role": "user", "content": PROMPT + " Then"},
                       {"role": "assistant", "content": more.choices[0].text[len(PROMPT + " Then"):]}]


@pytest.mark.anyio
async def test_the_sdk_completes_text_with_choices_and_stop_strings(tmp_path):
    """Text continued as it is (its first space kept), each token's logprob
    and offset, streamed and not alike; two choices; a stop string ends the
    text before it; refusals come in the chat route's shape and words."""
    ask_for = dict(model="tiny", prompt="The sea is", max_tokens=6, logprobs=2)

    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            plain = c.completions.create(**ask_for)
            streamed = list(c.completions.create(**ask_for, stream=True, stream_options={"include_usage": True}))
            word = plain.choices[0].logprobs.tokens[2]
            cut = c.completions.create(model="tiny", prompt="The sea is", max_tokens=6, stop=[word, "never"])
            two = c.completions.create(model="tiny", prompt="The sea is", max_tokens=3, n=2, temperature=1.0, seed=3,
                                       echo=True)
            return plain, streamed, word, cut, two

    long = "lighthouse " * 600
    async with live_server(tmp_path) as url, client(url) as http:
        with anyio.fail_after(120):
            plain, streamed, word, cut, two = await anyio.to_thread.run_sync(ask, url)
            refusals = [await http.post("/v1/completions", json=body) for body in (
                {"prompt": "x", "logprobs": 6, "stream": True}, {"prompt": "x", "max_tokens": -1}, {"prompt": ""},
                {"prompt": long, "max_tokens": 1})]
            chat = await http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": long}]})
    choice, lp = plain.choices[0], plain.choices[0].logprobs
    assert choice.finish_reason == "length" and plain.usage.completion_tokens == 6 == len(lp.tokens)
    assert "".join(lp.tokens) == choice.text  # a reply that begins with a space keeps it: its tokens' text
    assert lp.text_offset == [len("".join(lp.tokens[:i])) for i in range(6)]
    assert all(t in top and 1 <= len(top) <= 3 for t, top in zip(lp.tokens, lp.top_logprobs))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    parts = [c.choices[0].logprobs for c in streamed if c.choices and c.choices[0].logprobs]
    assert [t for p in parts for t in p.tokens] == lp.tokens
    assert [o for p in parts for o in p.text_offset] == lp.text_offset
    assert streamed[-1].usage.completion_tokens == 6 and streamed[-2].choices[0].finish_reason == "length"
    assert cut.choices[0].text == choice.text[: choice.text.index(word)] and cut.choices[0].finish_reason == "stop"
    assert [c.index for c in two.choices] == [0, 1] and all(c.text.startswith("The sea is") for c in two.choices)
    assert two.usage.prompt_tokens == 3 and two.usage.completion_tokens <= 6
    errors = [r.json()["error"] for r in refusals]
    assert [r.status_code for r in refusals] == [400] * 4 and {e["type"] for e in errors} == {"invalid_request_error"}
    assert [e["message"] for e in errors[:3]] == ["logprobs: must be at most 5, not 6",
                                                  "max_tokens: must be at least 0, not -1", "prompt: must not be empty"]
    same = re.compile(r"the prompt has \d+ tokens, more than fit the model's 512-token context \(at most 511")
    assert chat.status_code == 400 and same.match(chat.json()["error"]["message"]) and same.match(errors[3]["message"])


@pytest.mark.anyio
async def test_a_texts_perplexity_over_http_is_bench_fidelitys(tmp_path):
    """Scored through ``/v1/completions`` (``echo``, ``logprobs``, ``max_tokens:
    0``) or by ``semantic bench fidelity``, a text of two blocks has the same
    perplexity at 4 bits: both go through the engine's cache path, cut alike."""
    from pathlib import Path

    from semantic.bench.fidelity import perplexity
    from semantic.runtime.engine.engine import Engine

    text = (Path(__file__).parents[2] / "bench" / "data" / "lighthouses.txt").read_text()[:2000]

    def ask(url):
        with openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as c:
            return c.completions.create(model="tiny", prompt=text, echo=True, logprobs=0, max_tokens=0)

    async with live_server(tmp_path) as url:
        with anyio.fail_after(120):
            scored = await anyio.to_thread.run_sync(ask, url)
    values = scored.choices[0].logprobs.token_logprobs[1:]
    loaded = tiny_loaded()
    tokens = loaded.tokenizer.encode(text)
    assert len(values) == len(tokens) - 1 > 256
    over_http = math.exp(-sum(values) / len(values))
    assert over_http == pytest.approx(perplexity(Engine(loaded.model, loaded.tokenizer), tokens), rel=1e-5)
