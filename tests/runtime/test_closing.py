"""Closing a grammar within the limit: a model-free walk finds the tokens
that complete what a reply has begun, and a reply under ``max_tokens`` keeps
within reach of its end, so one the limit cuts is still a document its
grammar accepts."""

from __future__ import annotations

import json

import jsonschema
import llguidance.hf
import pytest
from pydantic import BaseModel

from semantic.runtime.text.closing import Closer, grammar_literals
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.text.grammar import JSON_OBJECT, Grammars, json_schema, lark
from tests.runtime.test_engine import drain
from tests.tiny import embedded_tokenizer, tiny_model_with_tokenizer


class Item(BaseModel):
    name: str
    qty: int
    price: float


class Order(BaseModel):
    customer: str
    items: list[Item]
    note: str | None = None


ORDER = Order.model_json_schema()
ROWS = {"type": "array", "items": {"type": "object", "required": ["a", "b", "c"], "properties": {
    "a": {"type": "string"}, "b": {"type": "array", "items": {"type": "integer"}}, "c": {"type": "boolean"}}}}
OPTIONAL_FIRST = {"type": "object", "required": ["y"], "properties": {
    "x": {"type": "object", "required": ["p", "q"], "properties": {"p": {"type": "string"}, "q": {"type": "string"}}},
    "y": {"type": "integer", "minimum": 3}}}
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "required": ["city", "days"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 14}}}}}]


@pytest.fixture(scope="module")
def closer() -> Closer:
    tok = embedded_tokenizer()
    ends = sorted(tok.eos_token_ids)
    return Closer(llguidance.hf.from_tokenizer(tok._tokenizer, eos_token=ends), ends)


def closing_text(closer: Closer, grammar: str, begun: str) -> str | None:
    """What ``Closer.close`` adds to ``begun`` to complete ``grammar`` (checked to complete it)."""
    tok = embedded_tokenizer()
    matcher = llguidance.LLMatcher(closer._tokenizer, grammar, log_level=0)
    assert matcher.consume_tokens(tok.encode(begun, add_special_tokens=False)), "the test's text fits the grammar"
    tokens = closer.close(matcher, closer.literals(grammar))
    if tokens is None:
        return None
    assert matcher.consume_tokens(tokens) and matcher.is_accepting()
    return closer.text(tokens).decode()


def call_grammars():
    from semantic.web.reasoning import ThinkTags
    from semantic.web.tool_grammar import call_grammar
    from semantic.web.tools import LibraryFormat

    xml = LibraryFormat("qwen3_coder", "<tool_call>", "</tool_call>")
    notes = [{"type": "function", "function": {"name": "note", "parameters": {
        "type": "object", "required": ["text"], "properties": {"text": {"type": "string"}}}}}]
    return {"hermes": call_grammar("hermes", WEATHER), "auto": call_grammar("hermes", WEATHER, forced=False),
            "xml": call_grammar(xml, notes), "think": ThinkTags(False).constrain(json_schema(ORDER), {})}


@pytest.mark.parametrize("grammar, begun, closing", [
    ("order", "", '{"customer": "", "items": []}'),
    ("order", '{"customer": "Bob the', '", "items": []}'),
    ("order", '{"customer": "Bo", "items": [{"name": "x", "qty": 12', ', "price": 0}]}'),
    ("order", '{"customer": "Bo", "items": [{"name": "x", "qty": 1, "price": 2.5}, {"na',
     'me": "", "qty": 0, "price": 0}]}'),
    ("optional_first", "", '{"y": 3}'),  # the optional member left out, the bound kept
    ("object", '{"a": [1, {"b": "x', '"}]}'),
    ("hermes", "", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "", "days": 1}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', '", "days": 1}}\n</tool_call>'),
    ("auto", "It is sunny", ""),  # text is complete as it stands
    ("auto", 'Let me see. <tool_call>\n{"name": "get',
     '_weather", "arguments": {"city": "", "days": 1}}\n</tool_call>'),
    ("xml", "<tool_call>\n<function=note>\n<parameter=text>\nhello wor", "\n</parameter>\n</function>\n</tool_call>"),
    ("think", "<think>I should answer", '</think>{"customer": "", "items": []}'),  # a literal ends free text
])
def test_a_closing_completes_what_each_kind_of_grammar_began(closer, grammar, begun, closing):
    grammars = {"order": json_schema(ORDER), "optional_first": json_schema(OPTIONAL_FIRST), "object": JSON_OBJECT,
                **call_grammars()}
    assert closing_text(closer, grammars[grammar], begun) == closing


def test_a_string_that_must_be_longer_is_lengthened_then_closed(closer):
    grammar = json_schema({"type": "object", "required": ["s"],
                           "properties": {"s": {"type": "string", "minLength": 5}}})
    closing = closing_text(closer, grammar, '{"s": "ab')
    assert len(json.loads('{"s": "ab' + closing)["s"]) >= 5
    assert closing_text(closer, grammar, '{"s": "abcde') == '"}'


def test_a_grammar_with_no_end_has_no_closing(closer):
    # every document nests another: there is no smallest one
    assert closing_text(closer, lark('start: "(" start ")"'), "((") is None


def test_literals_are_read_from_the_grammar_text():
    literals = grammar_literals(call_grammars()["xml"])
    assert b"\n</parameter>\n" in literals and b"</function>" in literals
    assert b"</think>" in grammar_literals(call_grammars()["think"])


def test_under_a_limit_only_the_closing_is_allowed_once_the_tokens_left_are_no_more():
    tok = embedded_tokenizer()
    grammar = json_schema(ORDER)
    begun = tok.encode('{"customer": "Bob', add_special_tokens=False)
    free = Grammars(tok, tok.eos_token_ids).constraint(grammar, limit=100)
    for t in begun:
        free.advance(free.fit(t))
    closing = free.closing
    assert tok.decode(list(closing)) == '", "items": []}'
    vocab = len(tok.get_vocab())
    assert sum(free.allowed(vocab).tolist()) > 1000  # a string's content: the model writes on
    tight = Grammars(tok, tok.eos_token_ids).constraint(grammar, limit=len(begun) + len(closing))
    for t in begun:
        tight.advance(tight.fit(t))
    allowed = tight.allowed(vocab).tolist()
    assert [i for i, ok in enumerate(allowed) if ok] == [closing[0]]
    assert tight.allows(list(closing)) == 0  # no drafts where nothing is left to choose


def test_a_token_that_opens_what_cannot_close_in_time_is_taken_for_the_closing():
    tok = embedded_tokenizer()
    begun = tok.encode('[{"a": "x", "b": [], "c": true}', add_special_tokens=False)
    another = tok.encode(', {"', add_special_tokens=False)  # a second row needs ~12 tokens more
    constraint = Grammars(tok, tok.eos_token_ids).constraint(json_schema(ROWS), limit=len(begun) + 4)
    for t in begun:
        constraint.advance(constraint.fit(t))
    assert tok.decode(list(constraint.closing)) == "]"
    assert constraint.fit(another[0]) == constraint.closing[0]  # refused for the closing's "]"
    assert constraint.fit(tok.encode("]", add_special_tokens=False)[0]) is not None


def test_complete_text_that_would_open_a_call_past_the_limit_ends_the_reply():
    tok = embedded_tokenizer()
    constraint = Grammars(tok, tok.eos_token_ids).constraint(call_grammars()["auto"], limit=8)
    for t in tok.encode("Sure.", add_special_tokens=False):
        constraint.advance(constraint.fit(t))
    opening = tok.encode(" <tool_call>", add_special_tokens=False)
    taken = []
    for t in opening:
        if (fitted := constraint.fit(t)) != t:
            break
        constraint.advance(t)
        taken.append(t)
    assert fitted is None  # the call cannot close in time: the reply ends, with its text
    assert "<tool_call>" in tok.decode(taken + [t]) and "<tool_call>" not in tok.decode(taken)


def test_drafts_under_a_stop_lexeme_leave_the_matcher_sound():
    tok = embedded_tokenizer()
    constraint = Grammars(tok, tok.eos_token_ids).constraint(call_grammars()["think"])
    for t in tok.encode("<think>I am", add_special_tokens=False):
        constraint.advance(t)
    drafts = tok.encode(" thinking about", add_special_tokens=False)
    assert constraint.allows(drafts) == len(drafts)
    assert len(constraint.masks(drafts, len(tok.get_vocab()))) == len(drafts) + 1
    assert not constraint._matcher.is_error()  # (llguidance cannot roll back past a stop= lexeme)


def smallest(grammar: str) -> int:
    """Tokens in the grammar's smallest document (its closing from the start)."""
    tok = embedded_tokenizer()
    return len(Grammars(tok, tok.eos_token_ids).constraint(grammar, limit=10**6).closing)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("schema", [ORDER, ROWS, OPTIONAL_FIRST], ids=["order", "rows", "optional_first"])
def test_a_random_model_cut_by_its_limit_still_writes_valid_json(arch, schema):
    model, tok = tiny_model_with_tokenizer(arch)
    grammar = json_schema(schema)
    least = smallest(grammar)
    engine = Engine(model, tok)  # drafts on: a history that repeats offers them
    runs = [(limit, temperature) for limit in (least, least + 1, least + 7, least + 30) for temperature in (0.0, 1.2)]
    ids = {engine.add(tok.encode(f"Write JSON, take {i}. " * 3), SamplingParams(
        max_tokens=limit, temperature=temperature, seed=i, grammar=grammar)): limit for i, (limit, temperature)
        in enumerate(runs)}
    done = drain(engine)
    for sid, limit in ids.items():
        reply = done[sid]
        jsonschema.validate(json.loads(reply.text), schema)
        assert reply.reason == "length" and len(reply.output_tokens) == limit or reply.reason == "stop"


@pytest.mark.slow
def test_a_forced_call_cut_by_its_limit_is_a_whole_call_and_its_closing_is_certain():
    from semantic.web.tools import parse_tool_calls

    model, tok = tiny_model_with_tokenizer("llama")
    grammar = call_grammars()["hermes"]
    limit = smallest(grammar) + 12
    engine = Engine(model, tok)
    sid = engine.add(tok.encode("Call it."), SamplingParams(max_tokens=limit, temperature=1.0, seed=4,
                                                           grammar=grammar, logprobs=2))
    reply = drain(engine)[sid]
    assert reply.reason == "length" and len(reply.output_tokens) == limit
    _, calls = parse_tool_calls(reply.text, "hermes")
    assert calls[0].name == "get_weather" and 1 <= calls[0].arguments["days"] <= 14
    assert reply.logprobs[-1].logprob == 0.0  # "</tool_call>"'s last token: the only one allowed
    assert [t.token for t in reply.logprobs[-1].top] == [reply.output_tokens[-1]]
