"""GPT-OSS's harmony replies (``web.harmony``): reasoning, text and calls read
apart, whole or streamed in any chunks, from what the model generates and
from what its real chat template renders; through the chat core, a reply's
channels become reasoning and text items and its calls the result's."""

from __future__ import annotations

import json

import jinja2
import pytest

from semantic.actors import Delta, Message
from semantic.runtime.outcome import TurnResult
from semantic.web.chat import _run_turn
from semantic.web.harmony import Harmony, HarmonySplitter, read_harmony, speaks_harmony
from semantic.web.identity import message_key
from semantic.web.prepare import Prepared
from semantic.web.schema import ChatResult, ReasoningDelta

CALL = '{"city": "Paris"}'
REPLIES = [  # (generated text, reasoning, text, calls)
    ("<|channel|>analysis<|message|>User wants weather.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
     "User wants weather.", "Sunny.", []),
    ("<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>" + CALL,
     "Need a tool.", "", [("get_weather", {"city": "Paris"})]),
    ("<|channel|>commentary<|message|>Let me look.<|end|><|start|>assistant to=functions.get_weather"
     "<|channel|>commentary json<|message|>" + CALL,
     None, "Let me look.", [("get_weather", {"city": "Paris"})]),  # a preamble is text
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>final<|message|>c", "a\n\nb", "c", []),
    (" to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>" + CALL,  # the recipient first
     None, "", [("get_weather", {"city": "Paris"})]),
    ("<|channel|>final<|message|>Only an answer.", None, "Only an answer.", []),
    ("A model that does not speak harmony.", None, "A model that does not speak harmony.", []),
    ("<|channel|>commentary to=functions.get_weather json<|message|>{not json", None, "{not json", []),
    ("<|channel|>analysis<|message|>cut short", "cut short", "", []),
]


@pytest.mark.parametrize("text, reasoning, answer, calls", REPLIES)
def test_a_reply_reads_as_reasoning_text_and_calls_whole_and_in_any_chunks(text, reasoning, answer, calls):
    thought, got, parsed = read_harmony(text)
    assert (thought, got, [(c.name, c.arguments) for c in parsed]) == (reasoning, answer, calls)
    for size in range(1, 12):
        splitter = HarmonySplitter()
        parts = [p for i in range(0, len(text), size) for p in splitter.feed(text[i:i + size])] + splitter.end()
        assert "".join(t for kind, t in parts if kind == "thinking") == (reasoning or "")
        assert answer.startswith("".join(t for kind, t in parts if kind == "text"))  # (bad arguments come last)
        assert all(t for _, t in parts) and not any("<|" in t for _, t in parts)  # no markup shown


# GPT-OSS's chat template (chat_template.jinja, as published with the model): how it renders
# an assistant's call and its answer, and its generation prompt -- the lines that do, verbatim.
GPT_OSS_ASSISTANT = """{%- for message in messages -%}
{%- if message.role == 'assistant' and "tool_calls" in message %}
    {%- set tool_call = message.tool_calls[0] %}
    {%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
    {{- "<|start|>assistant to=" }}
    {{- "functions." + tool_call.name + "<|channel|>commentary " }}
    {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
    {{- tool_call.arguments|tojson }}
    {{- "<|call|>" }}
{%- elif message.role == 'assistant' %}
    {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
{%- elif message.role == 'user' %}
    {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}"""


def render(messages: list[dict], generation: bool = False) -> str:
    env = jinja2.Environment()
    env.filters["tojson"] = json.dumps  # as transformers defines it
    return env.from_string(GPT_OSS_ASSISTANT).render(messages=messages, add_generation_prompt=generation)


def test_what_the_real_template_renders_reads_back():
    assert speaks_harmony(GPT_OSS_ASSISTANT) and not speaks_harmony("{{ messages }}")
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    prompt = render([{"role": "user", "content": "Weather?"}], generation=True)
    rendered = render([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [call]}])
    reply = rendered[len(prompt):]  # what the model said, as the template renders it back
    thought, text, calls = read_harmony(reply)
    assert (thought, text, [(c.name, c.arguments) for c in calls]) == (None, "", [("get_weather", {"city": "Paris"})])
    answered = render([{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "Sunny."}])
    assert read_harmony(answered[len(prompt):]) == (None, "Sunny.", [])


def test_a_stored_reply_is_the_conversation_a_client_sends_back():
    """The index finds an agent by what its client sends back: the answer and
    calls, without the channels the model wrote."""
    stored = Message("assistant", REPLIES[1][0])
    sent = Message("assistant", "", ({"id": "call_x", "type": "function",
                                     "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},))
    assert message_key(stored, None) == message_key(sent, None)
    assert message_key(Message("assistant", REPLIES[0][0]), None) == message_key(Message("assistant", "Sunny."), None)


class Replaying:
    """A turn's reply stream that replays ``pieces`` (a ``Reply`` as the chat core reads it)."""

    def __init__(self, pieces: list[str]):
        self.pieces = list(pieces)
        text = "".join(pieces)
        self.result = TurnResult("stop", text, 10, 0, 10, len(pieces), 0.0, 0.1)

    async def poll(self, timeout: float):
        if not self.pieces:
            raise StopAsyncIteration
        return Delta(self.pieces.pop(0))

    def close(self) -> None:
        pass


@pytest.mark.anyio
@pytest.mark.parametrize("text, reasoning, answer, calls", REPLIES[:3])
async def test_the_chat_core_streams_channels_apart_and_ends_with_the_calls(text, reasoning, answer, calls):
    pieces = [text[i:i + 5] for i in range(0, len(text), 5)]
    prepared = Prepared((), None, None, frozenset())
    items = [item async for item in _run_turn(Replaying(pieces), prepared, Harmony(), 1, 1.0)]
    result = items[-1]
    assert isinstance(result, ChatResult)
    assert "".join(i.text for i in items if isinstance(i, ReasoningDelta)) == (reasoning or "")
    assert "".join(i.text for i in items if isinstance(i, Delta)) == answer
    assert (result.reasoning, result.text) == (reasoning, answer)
    assert [(c.name, c.arguments) for c in result.tool_calls] == calls
    assert result.stop_reason == ("tool_use" if calls else "stop")


def test_the_detokenizer_gives_special_tokens_as_text():
    """What the reader relies on: mlx-lm's streaming detokenizer writes a
    special token's text (the embedded tokenizer's, as GPT-OSS's markers are)."""
    from tests.tiny import embedded_tokenizer

    tok = embedded_tokenizer()
    detokenizer = tok.detokenizer
    for token in tok.encode("<|im_start|>assistant hi<|im_end|>", add_special_tokens=False):
        detokenizer.add_token(token)
    detokenizer.finalize()
    assert detokenizer.text == "<|im_start|>assistant hi<|im_end|>"


HARMONY_TOKENS = ("<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>", "<|call|>", "<|return|>")


@pytest.mark.slow
def test_a_forced_call_is_one_gpt_oss_writes_with_its_special_tokens_and_reads_back_valid():
    from semantic.web.harmony import call_grammar

    from .test_tools import NOOP_FN, WEATHER_FN, takes, with_tokens

    tok = with_tokens(None, *HARMONY_TOKENS)
    thought = "<|channel|>analysis<|message|>Need a tool.<|end|><|start|>assistant"
    call = '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo", "days": 3}'
    answer = "<|channel|>final<|message|>Sunny."
    forced, auto = call_grammar([WEATHER_FN, NOOP_FN]), call_grammar([WEATHER_FN, NOOP_FN], forced=False)
    for text in (call, thought + call):
        ids = tok.encode(text, add_special_tokens=False)
        assert {tok.convert_tokens_to_ids(t) for t in HARMONY_TOKENS[:5]} & set(ids)  # written as special tokens
        assert takes(forced, ids, tok) and takes(auto, ids, tok)
        assert [(c.name, c.arguments) for c in read_harmony(tok.decode(ids))[2]] == [
            ("get_weather", {"city": "Oslo", "days": 3})]
    for bad in (answer, thought + answer, call.replace("Oslo", "Rome"), call.replace("get_weather", "get_wether")):
        assert not takes(forced, tok.encode(bad, add_special_tokens=False), tok), bad
    assert takes(auto, tok.encode(thought + answer, add_special_tokens=False), tok)
    assert not takes(forced, tok.encode("Sunny.", add_special_tokens=False), tok)  # text is no harmony reply
