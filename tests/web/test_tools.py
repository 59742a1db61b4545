"""Tool calls: formats, their grammars (``web.tool_grammar``), parsing whole
and streamed text, models without tools."""

from __future__ import annotations

import json
import random

import pytest

from semantic.runtime.text.grammar import GrammarError
from semantic.web.schema import ChatResult, ToolCall, Usage
from semantic.web.tool_grammar import call_grammar
from semantic.web.tools import (LibraryFormat, ToolCallFilter, added_tokens, deepseek_tool_prompt, finish_result,
                       flatten_tool_messages, hermes_calls, library_format, parse_tool_calls, reply_format,
                       supports_tools, tool_format, tool_prompt)

# SmolLM2-Instruct's template (the embedded model): no tools.
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Written for these tests in the conventions of Hugging Face tool templates
# (Qwen 2.5 style): tools as {"type": "function", "function": ...}, calls under
# message.tool_calls[*].function with dict arguments, results as role "tool".
HERMES = """{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{%- for tool in tools %}
{{ tool | tojson }}
{%- endfor %}
</tools>
Return each call as <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
<tool_call>
{"name": "{{ tool_call.name }}", "arguments": {{ tool_call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

LLAMA_SNIPPET = """{%- if tools is not none %}Respond in the format {"name": function name, "parameters": dictionary
of argument name and its value}.{%- endif %}{{- "<|python_tag|>" + tool_call.name }}
{%- elif message.role == "tool" or message.role == "ipython" %}"""

MISTRAL_SNIPPET = "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{%- endif %}[TOOL_CALLS]"


@pytest.mark.parametrize("template, supported, fmt", [
    (SMOLLM2, False, None),
    (None, False, None),
    ("", False, None),
    (HERMES, True, "hermes"),
    (LLAMA_SNIPPET, True, "llama3"),
    (MISTRAL_SNIPPET, True, None),  # tools, but a format we cannot parse
    ("{{ toolset }} {{ my_tools }}", False, None),
])
def test_template_capabilities(template, supported, fmt):
    assert supports_tools(template) is supported
    assert tool_format(template) == fmt


def calls(text, fmt, names=None):
    rest, found = parse_tool_calls(text, fmt, names)
    for c in found:
        assert c.id.startswith("call_") and len(c.id) == 29
    return rest, [(c.name, c.arguments) for c in found]


@pytest.mark.parametrize("text, rest, found", [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "", [("get_weather", {"city": "Paris"})]),
    ('Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
     '<tool_call>\n{"name": "b", "arguments": {"x": [1, 2]}}\n</tool_call>',
     "Let me check.", [("a", {}), ("b", {"x": [1, 2]})]),
    ('<tool_call>{"name": "a", "arguments": "{\\"k\\": 1}"}</tool_call>', "", [("a", {"k": 1})]),
    ('<tool_call>{"name": "a", "parameters": {"k": 1}}</tool_call>', "", [("a", {"k": 1})]),
    ('<tool_call>{"name": "a"}</tool_call>', "", [("a", {})]),
    ('<tool_call>\n{"name": "a", "arguments": {"k": 1}}', "", [("a", {"k": 1})]),  # cut before the close tag
    ('<tool_call>{"name": "a", "arguments": {"k": </tool_call>', None, []),  # bad JSON stays text
    ('<tool_call>{"arguments": {}}</tool_call>', None, []),  # no name
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', None, []),
    ("Just text, no calls.", None, []),
    ('ok <tool_call>{bad}</tool_call> then <tool_call>{"name": "a", "arguments": {}}</tool_call>',
     "ok <tool_call>{bad}</tool_call> then", [("a", {})]),
])
def test_hermes_calls(text, rest, found):
    assert calls(text, "hermes") == (text if rest is None else rest, found)


@pytest.mark.parametrize("text, names, rest, found", [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, "", [("get_weather", {"city": "Paris"})]),
    ('  {"name": "a", "parameters": {}}; {"name": "b", "parameters": {"k": 2}}', None, "", [("a", {}), ("b", {"k": 2})]),
    ('{"name": "a", "arguments": {"k": 1}}', {"a"}, "", [("a", {"k": 1})]),
    ('<|python_tag|>{"name": "a", "parameters": {"k": 1}}<|eom_id|>', None, "", [("a", {"k": 1})]),
    ('Sure.<|python_tag|>{"name": "a", "parameters": {}}', {"b"}, "Sure.", [("a", {})]),  # tagged: any name
    ('<|python_tag|>brave_search.call(query="mlx kv cache")', None, "", [("brave_search", {"query": "mlx kv cache"})]),
    ('{"name": "Bob", "parameters": {"age": 3}}', {"get_weather"}, None, []),  # a JSON answer, not a call
    ('{"name": "a", "parameters": {}} and more words', None, None, []),
    ('{"title": "not a call"}', None, None, []),
    ("<|python_tag|>print('hi')", None, None, []),
    ("Paris is sunny.", None, None, []),
])
def test_llama3_calls(text, names, rest, found):
    assert calls(text, "llama3", names) == (text if rest is None else rest, found)


def test_no_format_finds_no_calls():
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call>'
    assert parse_tool_calls(text, None) == (text, [])


STREAMED = [
    ("hermes", 'Let me check the weather.  \n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("hermes", 'Two calls:\n<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": {}}</tool_call>\n'),
    ("hermes", "No calls, but a < sign and <tool and trailing space   "),
    ("hermes", "  Leading space, then <tool_call>{broken</tool_call> and after"),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Paris"}}'),
    ("llama3", 'Checking. <|python_tag|>{"name": "a", "parameters": {}}<|eom_id|>'),
    ("llama3", "Plain answer with <|python and a pipe | char."),
    ("llama3", '\n {"json": "answer"}'),
]


def _chunkings(text: str, rng: random.Random):
    yield list(text)  # one character at a time
    yield [text]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 8))))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


@pytest.mark.parametrize("fmt, text", STREAMED)
def test_streamed_text_is_always_a_prefix_of_the_final_text(fmt, text):
    final, found = parse_tool_calls(text, fmt)
    for pieces in _chunkings(text, random.Random(text)):
        hold = ToolCallFilter(fmt)
        released = "".join(hold.feed(p) for p in pieces)
        assert final.startswith(released), (pieces, released)
        assert "<tool_call>" not in released and "<|python_tag|>" not in released
        held = "<tool_call>" in text or "<|python_tag|>" in text or (fmt == "llama3" and text.lstrip()[:1] == "{")
        if not held:  # all but trailing whitespace is released at once
            assert released == text.rstrip()


def test_the_filter_releases_text_as_soon_as_it_is_safe():
    hold = ToolCallFilter("hermes")
    assert [hold.feed(p) for p in ["Hi", " there", " <", "b>", " <tool", "_call>", "{...", "</tool_call>"]] == \
           ["Hi", " there", "", " <b>", "", "", "", ""]


U = Usage(5, 0, 9)


@pytest.mark.parametrize("reason, fmt, held, expect_reason", [
    ("stop", "hermes", False, "tool_use"),
    ("length", "hermes", False, None),  # cut short: the calls stay text
    ("length", "hermes", True, "length"),  # a grammar closed the call within the limit: a call, cut
    ("stop_sequence", "hermes", True, None),
    ("stop", None, False, None),
])
def test_finish_result(reason, fmt, held, expect_reason):
    text = 'Checking.\n<tool_call>{"name": "a", "arguments": {"k": 1}}</tool_call>'
    result = ChatResult(text, reason, U, stop_sequence="END" if reason == "stop_sequence" else None)
    done = finish_result(result, fmt, {"a"}, held=held)
    if expect_reason:
        assert (done.text, done.stop_reason, [c.name for c in done.tool_calls]) == ("Checking.", expect_reason, ["a"])
    else:
        assert done == result


TOOL_TURNS = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": "Checking.", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "c2", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}]},
    {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": "18C"},
    {"role": "tool", "tool_call_id": "c2", "content": "25C"},
    {"role": "user", "content": "Which is warmer?"},
]


def test_flatten_tool_messages_for_templates_without_tools():
    assert flatten_tool_messages(TOOL_TURNS) == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"role": "assistant", "content": 'Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
                                         '"Paris"}}\n</tool_call>\n<tool_call>\n{"name": "get_weather", '
                                         '"arguments": {"city": "Rome"}}\n</tool_call>'},
        {"role": "user", "content": "[tool result from get_weather]\n18C\n\n[tool result]\n25C\n\nWhich is warmer?"},
    ]
    assert TOOL_TURNS[3]["role"] == "tool", "the input is left alone"
    # its replies' calls are read back in the format it is told
    call = flatten_tool_messages(TOOL_TURNS)[2]["content"].partition("\n")[2]
    tok = type("Tok", (), {"chat_template": SMOLLM2})()
    assert reply_format(tok) == "hermes"
    assert [(c.name, c.arguments) for c in parse_tool_calls(call, reply_format(tok))[1]] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]


def test_flattened_messages_render_with_a_template_without_tools():
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    text = render(conversations=[flatten_tool_messages(TOOL_TURNS)], chat_template=SMOLLM2,
                  add_generation_prompt=True)[0][0]
    assert "[tool result from get_weather]\n18C" in text and text.endswith("<|im_start|>assistant\n")


def test_normalised_tool_turns_render_through_a_hf_style_tool_template():
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    text = render(conversations=[TOOL_TURNS], tools=tools, chat_template=HERMES, add_generation_prompt=True)[0][0]
    assert '{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert "<tool_response>\n25C\n</tool_response>" in text
    # What the model then writes in this format parses back into the same call.
    _, found = parse_tool_calls('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>',
                                tool_format(HERMES))
    assert [(c.name, c.arguments) for c in found] == [("get_weather", {"city": "Rome"})]
    assert json.loads(json.dumps(found[0].arguments)) == {"city": "Rome"}


def test_tool_call_is_hashable_by_id_and_name():
    assert hash(ToolCall("c", "n", {"a": 1})) == hash(ToolCall("c", "n", {"b": 2}))


# Closed schemas: a forced call of these tools has finitely many forms.
# (their objects say nothing of other keys: closed by default, ``runtime.text.json_grammar``)
WEATHER_FN = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}}
NOOP_FN = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}


def takes(g: str, reply: str | list[int], tokenizer=None) -> bool:
    """Whether ``reply`` (text, as the tokenizer encodes it, or token ids) is a
    whole reply grammar ``g`` allows, for ``tokenizer`` (the embedded one)."""
    from semantic.runtime.text.grammar import Grammars
    from tests.tiny import embedded_tokenizer

    tok = tokenizer or embedded_tokenizer()
    size = len(getattr(tok, "_tokenizer", tok))
    constraint = Grammars(tok, tok.eos_token_ids).constraint(g)
    for t in tok.encode(reply, add_special_tokens=False) if isinstance(reply, str) else reply:
        if not constraint.allowed(size).tolist()[t]:
            return False
        constraint.advance(t)
    return constraint.allowed(size).tolist()[min(tok.eos_token_ids)]  # it may end here


@pytest.mark.slow
@pytest.mark.parametrize("fmt, reply", [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'),
    ("llama3", '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'),
])
def test_a_call_grammar_takes_exactly_what_the_parser_reads_as_a_call(fmt, reply):
    g = call_grammar(fmt, [WEATHER_FN, NOOP_FN])
    assert takes(g, reply)
    _, calls = parse_tool_calls(reply, fmt, {"get_weather", "noop"})
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo", "days": 3})]
    assert not takes(g, reply.replace("Oslo", "Rome"))  # not in the tool's schema
    assert not takes(g, reply.replace("get_weather", "get_wether"))  # no such tool
    assert not takes(g, reply.replace(', "days": 3', ""))  # a required argument left out
    assert not takes(g, "It is sunny.")  # forced: a call, never text
    with pytest.raises(GrammarError, match="not"):
        call_grammar(fmt, [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}])


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo", "days": 3}}'


@pytest.mark.slow
@pytest.mark.parametrize("fmt, reply, taken", [
    ("hermes", "It is sunny in Oslo.", True),
    ("hermes", HERMES_CALL, True),
    ("hermes", "Let me look.\n" + HERMES_CALL, True),  # text, then a call
    ("hermes", HERMES_CALL + "\n" + HERMES_CALL.replace("get_weather", "noop").replace(
        '{"city": "Oslo", "days": 3}', "{}"), True),  # two calls
    ("hermes", HERMES_CALL.replace("Oslo", "Rome"), False),  # a call, but not a valid one
    ("hermes", "Let me look. " + HERMES_CALL.replace("get_weather", "get_wether"), False),
    ("hermes", HERMES_CALL + " and some text after", False),
    ("llama3", "It is sunny in Oslo.", True),
    ("llama3", "Use {braces} as you like", True),
    ("llama3", LLAMA_CALL, True),
    ("llama3", LLAMA_CALL.replace("Oslo", "Rome"), False),
    ("llama3", '  {"name": "noop"', False),  # a reply that starts as JSON is a call
])
def test_under_auto_a_strict_grammar_takes_text_or_valid_calls(fmt, reply, taken):
    assert takes(call_grammar(fmt, [WEATHER_FN, NOOP_FN], forced=False), reply) is taken
    if taken:  # and the parser reads it as the grammar does: calls where it holds calls
        _, calls = parse_tool_calls(reply, fmt, {"get_weather", "noop"})
        assert bool(calls) == ("get_weather" in reply or "noop" in reply)


@pytest.mark.slow
def test_calls_a_template_without_tools_gets_back_are_as_its_grammar_has_them_written():
    calls = [{"function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}},
             {"function": {"name": "noop", "arguments": {}}}]
    assert hermes_calls(calls[:1]) == HERMES_CALL
    assert takes(call_grammar("hermes", [WEATHER_FN, NOOP_FN]), hermes_calls(calls[:1]))  # forced: one call
    assert takes(call_grammar("hermes", [WEATHER_FN, NOOP_FN], forced=False), "Let me look.\n" + hermes_calls(calls))


def test_auto_gets_a_grammar_only_when_a_tool_is_strict():
    from semantic.web.prepare import prepare
    from semantic.web.schema import ChatRequest

    ask = dict(messages=({"role": "user", "content": "Weather?"},), max_tokens=50)
    assert prepare(ChatRequest(**ask, tools=(WEATHER_FN,)), HERMES).grammar is None
    strict = prepare(ChatRequest(**ask, tools=(WEATHER_FN,), strict_tools=True), HERMES)
    assert strict.grammar == call_grammar("hermes", [WEATHER_FN], forced=False)
    told = prepare(ChatRequest(**ask, tools=(WEATHER_FN,), strict_tools=True), SMOLLM2)  # told, so held anyway
    assert told.grammar == call_grammar("hermes", [WEATHER_FN], forced=False)


def test_a_model_without_tools_is_told_of_them_and_held_to_text_or_a_call():
    from semantic.web.prepare import prepare
    from semantic.web.schema import ChatRequest

    ask = dict(messages=({"role": "user", "content": "Weather?"},), max_tokens=50, system="Be brief.")
    auto = prepare(ChatRequest(**ask, tools=(WEATHER_FN,)), SMOLLM2)
    assert auto.fmt == "hermes" and auto.grammar == call_grammar("hermes", [WEATHER_FN], forced=False)
    assert auto.messages[0].content == "Be brief.\n\n" + tool_prompt([WEATHER_FN]) and auto.holds_calls
    forced = prepare(ChatRequest(**ask, tools=(WEATHER_FN,), tool_choice="required"), SMOLLM2)
    assert forced.fmt == "hermes" and forced.grammar == call_grammar("hermes", [WEATHER_FN])
    assert forced.messages == auto.messages  # the same prompt whatever the choice: one cache serves both
    assert forced.tools is None and forced.tool_names == {"get_weather"}  # the template never sees them
    none = prepare(ChatRequest(**ask), SMOLLM2)  # (tool_choice "none" leaves the request no tools)
    assert (none.fmt, none.grammar, none.messages[0].content, none.holds_calls) == (None, None, "Be brief.", False)
    with_tools = prepare(ChatRequest(**ask, tools=(WEATHER_FN,), tool_choice="required"), HERMES)
    assert with_tools.tools == (WEATHER_FN,) and with_tools.messages[0].content == "Be brief."
    assert with_tools.grammar == call_grammar("hermes", [WEATHER_FN])
    assert prepare(ChatRequest(**ask, tools=(WEATHER_FN,)), HERMES).holds_calls is False  # auto, not strict
    odd = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}
    unheld = prepare(ChatRequest(**ask, tools=(odd,)), SMOLLM2)  # told, its calls parsed but not held
    assert (unheld.fmt, unheld.grammar, unheld.holds_calls) == ("hermes", None, False)
    assert unheld.messages[0].content == "Be brief.\n\n" + tool_prompt([odd])


# Qwen3-Coder's calls, in its template's own conventions (the real one renders them so).
QWEN3_CODER = """{%- for message in messages %}
{%- if message.role == "assistant" %}<|im_start|>assistant
{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set tool_call = tool_call.function if tool_call.function is defined else tool_call %}
{{- '\\n<tool_call>\\n<function=' + tool_call.name + '>\\n' }}
{%- for args_name, args_value in tool_call.arguments|items %}
{{- '<parameter=' + args_name + '>\\n' }}
{%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
{{- args_value }}
{{- '\\n</parameter>\\n' }}
{%- endfor %}
{{- '</function>\\n</tool_call>' }}
{%- endfor %}<|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}{# (the real one lists the tools in its system turn) #}{% if tools %}{% endif %}"""


def wrapper(parser: str | None):
    """The embedded tokenizer as mlx-lm wraps a model whose template names ``parser``."""
    import importlib

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from tests.tiny import embedded_tokenizer

    if parser is None:
        return TokenizerWrapper(embedded_tokenizer()._tokenizer)
    module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
    return TokenizerWrapper(embedded_tokenizer()._tokenizer, tool_parser=module.parse_tool_call,
                            tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end)


def test_mlx_lm_names_the_format_of_the_other_families():
    assert library_format(wrapper("qwen3_coder")) == LibraryFormat("qwen3_coder", "<tool_call>", "</tool_call>")
    assert library_format(wrapper("mistral")) == LibraryFormat("mistral", "[TOOL_CALLS]", "")
    assert library_format(wrapper("json_tools")) is None  # Hermes's JSON: read here
    assert library_format(wrapper(None)) is None
    assert tool_format(HERMES, library_format(wrapper("qwen3_coder"))).parser == "qwen3_coder"
    assert tool_format(SMOLLM2, library_format(wrapper("qwen3_coder"))) is None  # a template without tools


def test_qwen3_coder_calls_as_its_template_renders_them_parse_back_typed():
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    calls = [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}},
             {"type": "function", "function": {"name": "noop", "arguments": {}}}]
    text = render(conversations=[[{"role": "assistant", "content": "Let me check.", "tool_calls": calls}]],
                  tools=[WEATHER_FN, NOOP_FN], chat_template=QWEN3_CODER)[0][0]
    reply = text.removeprefix("<|im_start|>assistant\n").split("<|im_end|>")[0]
    fmt = library_format(wrapper("qwen3_coder"))
    rest, found = parse_tool_calls(reply, fmt, tools=[WEATHER_FN, NOOP_FN])
    assert rest == "Let me check."
    assert [(c.name, c.arguments) for c in found] == [("get_weather", {"city": "Oslo", "days": 3}), ("noop", {})]
    # A call cut short stays text; streamed, nothing from its marker on is shown.
    cut = reply[: reply.index("</parameter>")]
    assert parse_tool_calls(cut, fmt, tools=[WEATHER_FN]) == (cut, [])
    hold = ToolCallFilter(fmt)
    assert "".join(hold.feed(reply[i:i + 7]) for i in range(0, len(reply), 7)) == "Let me check."


@pytest.mark.parametrize("reply", [
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Lima", "days": 2}',
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Lima", "days": 2}}]',
])
def test_mistral_calls_parse_in_both_of_its_forms(reply):
    rest, found = parse_tool_calls("Sure. " + reply, library_format(wrapper("mistral")))
    assert rest == "Sure."
    assert [(c.name, c.arguments) for c in found] == [("get_weather", {"city": "Lima", "days": 2})]


def test_a_library_format_turn_ends_in_tool_use():
    fmt = library_format(wrapper("qwen3_coder"))
    text = "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
    result = finish_result(ChatResult(text, "stop", Usage(1, 0, 1)), fmt, {"get_weather"}, [WEATHER_FN])
    assert result.stop_reason == "tool_use" and result.tool_calls[0].arguments == {"city": "Oslo"}


# The grammars of mlx-lm's formats: each takes the call its template renders
# (or its model writes), which the format's own parser reads back as a call
# whose arguments validate; and nothing that is not one.
DIARY_FN = {"type": "function", "function": {"name": "write", "parameters": {
    "type": "object", "required": ["text"], "properties": {
        "text": {"type": "string", "description": "what to write"}, "tags": {"type": "array", "items": {"type": "string"}},
        "pinned": {"type": "boolean"}}}}}


def render_call(template: str, calls: list[tuple[str, dict]]) -> str:
    """The assistant reply ``template`` renders for ``calls`` (nothing before them)."""
    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}
    text = render(conversations=[[message]], tools=[WEATHER_FN, NOOP_FN, DIARY_FN], chat_template=template)[0][0]
    return text.removeprefix("<|im_start|>assistant\n").split("<|im_end|>")[0].lstrip("\n")


def with_tokens(parser: str | None, *tokens: str, special: bool = True):
    """``wrapper(parser)`` over a copy of the embedded tokenizer that adds
    ``tokens`` to its vocabulary, as special tokens (or, not ``special``,
    as plain ones, like Qwen's ``<tool_call>``)."""
    import copy

    from mlx_lm.tokenizer_utils import TokenizerWrapper

    hf = copy.deepcopy(wrapper(None)._tokenizer)
    if special:
        hf.add_special_tokens({"additional_special_tokens": list(tokens)})
    else:
        hf.add_tokens(list(tokens))
    base = wrapper(parser)
    return TokenizerWrapper(hf, tool_parser=base.tool_parser, tool_call_start=base.tool_call_start,
                            tool_call_end=base.tool_call_end, eos_token_ids=base.eos_token_ids)


def read_back(text: str, fmt) -> list[tuple[str, dict]]:
    rest, calls = parse_tool_calls(text, fmt, {"get_weather", "noop", "write"}, [WEATHER_FN, NOOP_FN, DIARY_FN])
    assert rest == ""
    return [(c.name, c.arguments) for c in calls]


QWEN3_CODER_CALLS = [("get_weather", {"city": "Oslo", "days": 3}),
                     ("write", {"text": "Dear diary,\n<b>rain</b> & {wind}", "tags": ["a"], "pinned": True}),
                     ("write", {"text": ""}), ("noop", {})]


@pytest.mark.parametrize("call", QWEN3_CODER_CALLS, ids=lambda c: c[0])
def test_a_forced_qwen3_coder_call_is_one_its_parser_reads_back_valid(call):
    fmt = library_format(wrapper("qwen3_coder"))
    g = call_grammar(fmt, [WEATHER_FN, NOOP_FN, DIARY_FN])
    reply = render_call(QWEN3_CODER, [call])
    assert takes(g, reply) and read_back(reply, fmt) == [call]


@pytest.mark.slow
def test_a_qwen3_coder_grammar_takes_nothing_else():
    fmt = library_format(wrapper("qwen3_coder"))
    g = call_grammar(fmt, [WEATHER_FN, NOOP_FN, DIARY_FN])
    weather = render_call(QWEN3_CODER, [QWEN3_CODER_CALLS[0]])
    for bad in (weather.replace("Oslo", "Rome"),  # not in the schema
                weather.replace("3", "3.5"),  # an integer's
                weather.replace("<parameter=days>\n3\n</parameter>\n", ""),  # a required one left out
                render_call(QWEN3_CODER, [("write", {"text": "x</parameter>y"})]),  # the parser would cut it
                render_call(QWEN3_CODER, [("write", {"text": "null"})]),  # the parser reads None
                "It rains.", weather + "\nMore."):
        assert not takes(g, bad), bad
    assert not takes(g, render_call(QWEN3_CODER, QWEN3_CODER_CALLS[:2]))  # forced: one call
    auto = call_grammar(fmt, [WEATHER_FN, NOOP_FN, DIARY_FN], forced=False)
    for reply, calls in (("It rains.", []), (weather, QWEN3_CODER_CALLS[:1]),
                         (render_call(QWEN3_CODER, QWEN3_CODER_CALLS[:2]), QWEN3_CODER_CALLS[:2])):
        assert takes(auto, reply) and (read_back(reply, fmt) if calls else []) == calls
    assert takes(auto, "Let me look.\n" + weather)
    assert not takes(auto, "Let me look.\n" + weather.replace("Oslo", "Rome"))
    with pytest.raises(GrammarError, match="write.text"):
        call_grammar(fmt, [{"type": "function", "function": {"name": "write", "parameters": {
            "type": "object", "properties": {"text": {"type": "string", "pattern": "^a+$"}}}}}])


MISTRAL_V11 = ("{%- for m in messages %}{%- for c in m.tool_calls %}[TOOL_CALLS]{{ c.function.name }}[ARGS]"
               "{{ c.function.arguments | tojson }}{%- endfor %}{%- endfor %}{# tools #}")
MISTRAL_V3 = ("{%- for m in messages %}[TOOL_CALLS][{%- for c in m.tool_calls %}{{ {'name': c.function.name, "
              "'arguments': c.function.arguments} | tojson }}{{ ', ' if not loop.last }}{%- endfor %}]"
              "{%- endfor %}{# tools #}")


@pytest.mark.slow
@pytest.mark.parametrize("template, specials", [(MISTRAL_V11, ("[TOOL_CALLS]", "[ARGS]")),
                                               (MISTRAL_V3, ("[TOOL_CALLS]",))], ids=["name[ARGS]{...}", "[{...}]"])
def test_mistral_calls_in_the_form_its_tokenizer_has(template, specials):
    tok = with_tokens("mistral", *specials)
    fmt, tokens = library_format(tok), added_tokens(tok)
    g = call_grammar(fmt, [WEATHER_FN, NOOP_FN], tokens=tokens)
    one, two = QWEN3_CODER_CALLS[:1], [QWEN3_CODER_CALLS[0], ("noop", {})]
    reply = render_call(template, one)
    ids = tok.encode(reply, add_special_tokens=False)
    assert all(tokens[t] in ids for t in specials)  # as the model writes them: special tokens
    assert takes(g, ids, tok) and read_back(tok.decode(ids), fmt) == one
    assert not takes(g, render_call(template, [("get_weather", {"city": "Rome", "days": 3})]), tok)
    auto = call_grammar(fmt, [WEATHER_FN, NOOP_FN], forced=False, tokens=tokens)
    for text in ("It rains.", reply, render_call(template, two), "Sure. " + reply):
        assert takes(auto, text, tok), text
    assert read_back(render_call(template, two), fmt) == two
    assert not takes(auto, "Sure. " + render_call(template, [("get_weather", {"city": "Rome", "days": 3})]), tok)


def test_other_library_formats_get_their_markers_when_forced_and_nothing_under_auto():
    fmt = library_format(wrapper("minimax_m2"))
    g = call_grammar(fmt, [WEATHER_FN])
    assert takes(g, f'{fmt.start}<invoke name="get_weather">...</invoke>{fmt.end}')
    assert not takes(g, "It rains.") and not takes(g, f"{fmt.start}x{fmt.end} and more")
    assert call_grammar(fmt, [WEATHER_FN], forced=False) is None


def test_a_forced_call_gets_its_format_grammar():
    from semantic.web.harmony import call_grammar as harmony_grammar
    from semantic.web.prepare import prepare
    from semantic.web.schema import ChatRequest

    req = ChatRequest(messages=({"role": "user", "content": "Weather?"},), max_tokens=50, tools=(WEATHER_FN,),
                      tool_choice="required")
    fmt = library_format(wrapper("qwen3_coder"))
    prepared = prepare(req, QWEN3_CODER, fmt)
    assert (prepared.fmt, prepared.grammar, prepared.tools) == (fmt, call_grammar(fmt, [WEATHER_FN]), (WEATHER_FN,))
    harmony = prepare(req, "{# tools #}<|channel|>", None)
    assert harmony.grammar == harmony_grammar([WEATHER_FN]) and harmony.tools == (WEATHER_FN,)
    strict = ChatRequest(**{**req.__dict__, "tool_choice": "auto", "strict_tools": True})
    assert prepare(strict, QWEN3_CODER, fmt).grammar == call_grammar(fmt, [WEATHER_FN], forced=False)
    assert prepare(strict, "{# tools #}<|channel|>", None).grammar == harmony_grammar([WEATHER_FN], forced=False)


# DeepSeek's templates (V3.1; V3 and R1 fence the arguments) take no tools
# but write calls -- arguments concatenated as text -- and their results, in
# these conventions (written for these tests).
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_SEP, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
DEEPSEEK_V31 = ("{{ bos_token }}{%- for m in messages %}{%- if m.role == 'system' %}{{ m.content }}"
                "{%- elif m.role == 'user' %}<｜User｜>{{ m.content }}"
                "{%- elif m.role == 'assistant' %}<｜Assistant｜></think>{{ m.content }}{%- if m.tool_calls %}"
                "<｜tool▁calls▁begin｜>{%- for c in m.tool_calls %}{{ '<｜tool▁call▁begin｜>' + c.function.name + "
                "'<｜tool▁sep｜>' + c.function.arguments + '<｜tool▁call▁end｜>' }}{%- endfor %}<｜tool▁calls▁end｜>"
                "{%- endif %}<｜end▁of▁sentence｜>{%- elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}"
                "<｜tool▁output▁end｜>{%- endif %}{%- endfor %}{%- if add_generation_prompt %}<｜Assistant｜></think>"
                "{%- endif %}")
DEEPSEEK_R1 = DEEPSEEK_V31.replace(
    "c.function.name + '<｜tool▁sep｜>' + c.function.arguments",
    "c.type + '<｜tool▁sep｜>' + c.function.name + '\\n```json\\n' + c.function.arguments + '\\n```'")


DS_MARKERS = (DS_BEGIN, DS_END, DS_CALL, DS_SEP, DS_CALL_END)


def deepseek(template: str, special: bool = False):
    """The embedded tokenizer with a DeepSeek template, whose markers are tokens (special ones, or not)."""
    tok = with_tokens(None, *DS_MARKERS, special=special)
    tok._tokenizer.chat_template = template
    return tok


def render_deepseek(template: str, calls: list[tuple[str, dict]], text: str = "") -> str:
    """The reply a DeepSeek template renders for ``calls`` after ``text``."""
    from semantic.runtime.memory.turns import arguments_as_json

    render = pytest.importorskip("transformers.utils.chat_template_utils").render_jinja_template
    message = {"role": "assistant", "content": text, "tool_calls": [
        {"type": "function", "function": {"name": name, "arguments": args}} for name, args in calls]}
    rendered = render(conversations=[arguments_as_json([message])], chat_template=template, bos_token="")[0][0]
    return rendered.removeprefix("<｜Assistant｜></think>").removesuffix("<｜end▁of▁sentence｜>")


@pytest.mark.slow
@pytest.mark.parametrize("template, parser", [(DEEPSEEK_V31, "deepseek_v3_1"), (DEEPSEEK_R1, "deepseek_r1")])
@pytest.mark.parametrize("special", [False, True], ids=["plain marker tokens", "special marker tokens"])
def test_deepseek_calls_read_back_and_a_grammar_holds_them(template, parser, special):
    tok = deepseek(template, special)
    fmt = library_format(tok)
    tokens = added_tokens(tok)
    assert (fmt.parser, fmt.start, fmt.end) == (parser, DS_BEGIN, DS_END) and set(DS_MARKERS) <= set(tokens)
    assert reply_format(tok) == fmt and tool_format(template, fmt) is None  # its template takes no tools
    one, two = [("get_weather", {"city": "Oslo", "days": 3})], [("get_weather", {"city": "Oslo", "days": 3}),
                                                                 ("noop", {})]
    reply = render_deepseek(template, one)
    rest, found = parse_tool_calls("Let me look." + render_deepseek(template, two), fmt)
    assert rest == "Let me look." and [(c.name, c.arguments) for c in found] == two
    forced = call_grammar(fmt, [WEATHER_FN, NOOP_FN], tokens=tokens)
    ids = tok.encode(reply, add_special_tokens=False)
    assert takes(forced, ids, tok) and read_back(tok.decode(ids), fmt) == one
    for bad in (render_deepseek(template, [("get_weather", {"city": "Rome", "days": 3})]),
                render_deepseek(template, two), "It rains."):
        assert not takes(forced, bad, tok), bad
    auto = call_grammar(fmt, [WEATHER_FN, NOOP_FN], forced=False, tokens=tokens)
    for text in ("It rains.", reply, render_deepseek(template, two), render_deepseek(template, one, "Let me look.")):
        assert takes(auto, text, tok), text
    assert not takes(auto, render_deepseek(template, [("get_wether", {})], "Let me look."), tok)


def test_a_deepseek_model_is_told_of_the_tools_and_keeps_its_tool_turns():
    from semantic.runtime.memory.turns import render
    from semantic.web.prepare import prepare
    from semantic.web.schema import ChatRequest

    tok = deepseek(DEEPSEEK_V31)
    fmt, tokens = library_format(tok), added_tokens(tok)
    req = ChatRequest(messages=tuple(TOOL_TURNS), max_tokens=50, tools=(WEATHER_FN,), tool_choice="required")
    prepared = prepare(req, DEEPSEEK_V31, fmt, tokens)
    assert (prepared.tools, prepared.fmt, prepared.grammar) == (None, fmt, call_grammar(fmt, [WEATHER_FN], tokens=tokens))
    assert prepared.messages[0].content == "Be brief.\n\n" + deepseek_tool_prompt([WEATHER_FN], fmt)
    assert [m.role for m in prepared.messages] == [m["role"] for m in TOOL_TURNS]  # not flattened
    prompt = render(tok, [m.as_dict() for m in prepared.messages])
    assert DS_CALL + 'get_weather' + DS_SEP + '{"city": "Paris"}' + DS_CALL_END in prompt
    assert "<｜tool▁output▁begin｜>18C<｜tool▁output▁end｜>" in prompt
    free = prepare(ChatRequest(messages=tuple(TOOL_TURNS), max_tokens=50), DEEPSEEK_V31, fmt)
    assert (free.fmt, free.grammar, free.messages[0].content) == (None, None, "Be brief.")


@pytest.mark.slow
def test_a_marker_the_tokenizer_adds_is_written_as_its_token():
    """Qwen's ``<tool_call>`` is a token of its own (not a special one), which
    llguidance reads as special: the grammar names it by id, or the model
    could only spell the marker out, which it never learned to."""
    tok = with_tokens(None, "<tool_call>", "</tool_call>", special=False)
    reply = "Let me look.\n" + HERMES_CALL
    ids = tok.encode(reply, add_special_tokens=False)
    assert added_tokens(tok)["<tool_call>"] in ids
    for forced, text in ((True, HERMES_CALL), (False, reply), (False, "It rains.")):
        assert takes(call_grammar("hermes", [WEATHER_FN, NOOP_FN], forced, added_tokens(tok)), text, tok)
    assert not takes(call_grammar("hermes", [WEATHER_FN, NOOP_FN], False), ids, tok)  # by its text: refused


def test_a_named_tool_is_the_one_called_and_every_tool_is_still_shown():
    """The prompt does not change with ``tool_choice`` (so neither does the
    cache, nor the conversation a told-tools system prompt belongs to)."""
    from semantic.web.prepare import prepare
    from semantic.web.schema import ChatRequest

    ask = dict(messages=({"role": "user", "content": "Weather?"},), max_tokens=50, tools=(WEATHER_FN, NOOP_FN))
    named = ChatRequest(**ask, tool_choice="required", tool_name="noop")
    hermes = prepare(named, HERMES)
    assert hermes.tools == (WEATHER_FN, NOOP_FN) and hermes.grammar == call_grammar("hermes", [NOOP_FN])
    fmt = library_format(deepseek(DEEPSEEK_V31))
    told = prepare(named, DEEPSEEK_V31, fmt)
    assert told.messages[0].content == deepseek_tool_prompt([WEATHER_FN, NOOP_FN], fmt)
    assert told.messages[0] == prepare(ChatRequest(**ask), DEEPSEEK_V31, fmt).messages[0]
    assert told.grammar == call_grammar(fmt, [NOOP_FN])


# LangChain's standard tests call it with 3; a small model shown its schema copies the keywords into the call.
MAGIC_FN = {"type": "function", "function": {"name": "magic_function", "description": "Applies a magic function.",
                                              "parameters": {"type": "object", "properties": {"input": {
                                                  "type": "integer", "exclusiveMinimum": -1000,
                                                  "exclusiveMaximum": 1000}}, "required": ["input"]}}}


def magic_calls(fmt: str, *arguments: dict):
    """The tokenizer of ``fmt``'s model, the grammars of a forced and of a
    strict ``auto`` call of MAGIC_FN in ``fmt``, and its replies calling it with
    each of ``arguments``."""
    from semantic.web.harmony import call_grammar as harmony_grammar

    from .test_harmony import HARMONY_TOKENS

    if fmt == "gpt-oss":
        tok = with_tokens(None, *HARMONY_TOKENS)
        grammars = harmony_grammar([MAGIC_FN]), harmony_grammar([MAGIC_FN], forced=False)
        return tok, grammars, [f"<|channel|>commentary to=functions.magic_function <|constrain|>json<|message|>"
                               f"{json.dumps(a)}" for a in arguments]
    tok = {"mistral": lambda: with_tokens("mistral", "[TOOL_CALLS]"), "qwen3-coder": lambda: wrapper("qwen3_coder"),
           "deepseek-v3.1": lambda: deepseek(DEEPSEEK_V31)}.get(fmt, lambda: wrapper(None))()
    form = fmt if fmt in ("hermes", "llama3") else library_format(tok)
    render = {
        "hermes": lambda a: f'<tool_call>\n{{"name": "magic_function", "arguments": {json.dumps(a)}}}\n</tool_call>',
        "llama3": lambda a: json.dumps({"name": "magic_function", "parameters": a}),
        "mistral": lambda a: "[TOOL_CALLS]" + json.dumps([{"name": "magic_function", "arguments": a}]),
        "qwen3-coder": lambda a: render_call(QWEN3_CODER, [("magic_function", a)]),
        "deepseek-v3.1": lambda a: render_deepseek(DEEPSEEK_V31, [("magic_function", a)])}[fmt]
    grammars = [call_grammar(form, [MAGIC_FN], forced, added_tokens(tok)) for forced in (True, False)]
    return tok, grammars, [render(a) for a in arguments]


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["hermes", "llama3", "mistral", "qwen3-coder", "deepseek-v3.1", "gpt-oss"])
def test_a_call_carries_no_argument_its_schema_does_not_list(fmt):
    """``magic_function(3)``: the schema says nothing of other keys, so a call
    that copies its keywords into the arguments is refused, forced or strict."""
    from semantic.runtime.text.grammar import Grammars

    tok, grammars, (call, copied) = magic_calls(fmt, {"input": 3}, {"input": 3, "exclusiveMaximum": 1000})
    matchers, size = Grammars(tok, tok.eos_token_ids), len(tok._tokenizer)

    def takes(g: str, reply: str) -> bool:  # (``takes`` above, on one tokenizer's matchers)
        constraint = matchers.constraint(g)
        for t in tok.encode(reply, add_special_tokens=False):
            if not constraint.allowed(size).tolist()[t]:
                return False
            constraint.advance(t)
        return constraint.allowed(size).tolist()[min(tok.eos_token_ids)]

    assert [takes(g, call) for g in grammars] == [True, True]
    assert [takes(g, copied) for g in grammars] == [False, False]
