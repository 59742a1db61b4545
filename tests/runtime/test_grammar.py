"""Constrained decoding: a grammar masks one sequence's logits row, so the reply
follows it whatever the model prefers, and no neighbour's tokens change. A
schema's objects are closed unless it opens them, its numbers are those a
float64 holds, and otherwise it allows what llguidance's own grammar of it
does."""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import mlx.core as mx
import pytest

from llguidance import LLMatcher
from pydantic import BaseModel, Field

from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.text.grammar import JSON_OBJECT, GrammarError, Grammars, json_schema
from semantic.runtime.text.json_grammar import LAYOUT, json_lark, strict
from tests.runtime.test_engine import drain
from tests.tiny import embedded_tokenizer, tiny_model_with_tokenizer

# A finite language: every reply it allows ends within a bounded number of tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "ok": {"type": "boolean"},
        "size": {"enum": ["S", "M", "L"]},
        "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "size", "tags"],
    "additionalProperties": False,
}
COLOUR = {"enum": ["red", "green", "blue"]}


def test_a_schema_compiles_and_unsupported_keywords_are_named():
    assert json_lark(strict(SCHEMA)) and json_schema(SCHEMA).startswith("start: ")  # written as Lark
    with pytest.raises(GrammarError, match="not"):
        json_schema({"type": "object", "properties": {"a": {"not": {"type": "string"}}}})
    with pytest.raises(GrammarError, match="strin"):
        json_schema({"type": "strin"})
    with pytest.raises(GrammarError):
        json_schema(["not", "a", "schema"])
    with pytest.raises(ValueError):
        SamplingParams(grammar="%%% not a grammar")


def test_the_mask_allows_exactly_the_tokens_that_may_come_next():
    tok = embedded_tokenizer()
    constraint = Grammars(tok, tok.eos_token_ids).constraint(json_schema({"type": "boolean"}))
    allowed = constraint.allowed(len(tok.get_vocab())).tolist()
    texts = {i: tok.decode([i]) for i, ok in enumerate(allowed) if ok}
    assert texts and all(("true".startswith(t) or "false".startswith(t)) and t for t in texts.values())
    assert not any(allowed[i] for i in tok.eos_token_ids)  # nothing is complete yet
    for t in tok.encode("true", add_special_tokens=False):
        constraint.advance(t)
    allowed = constraint.allowed(len(tok.get_vocab()) + 7).tolist()  # rows padded past the vocabulary
    assert [i for i, ok in enumerate(allowed) if ok] == sorted(tok.eos_token_ids)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_random_model_writes_valid_json_and_stops(arch, temperature):
    model, tok = tiny_model_with_tokenizer(arch)
    engine = Engine(model, tok)
    prompt = tok.encode("Describe a shirt as JSON.")
    sid = engine.add(prompt, SamplingParams(max_tokens=256, temperature=temperature, seed=3,
                                            grammar=json_schema(SCHEMA)))
    done = drain(engine)[sid]
    assert done.reason == "stop"  # the grammar ended the reply: only the end of turn was allowed
    jsonschema.validate(json.loads(done.text), SCHEMA)


@pytest.mark.slow
def test_a_constrained_sequence_neither_changes_nor_is_changed_by_its_neighbours():
    model, tok = tiny_model_with_tokenizer("llama")
    prompts = [tok.encode(text) for text in ("A shirt:", "Once upon a time", "Colour?", "Hello there, friend")]
    samplings = [SamplingParams(max_tokens=40, grammar=json_schema(SCHEMA)),
                 SamplingParams(max_tokens=12),
                 SamplingParams(max_tokens=40, grammar=json_schema(COLOUR)),
                 SamplingParams(max_tokens=40, temperature=0.7, seed=5, grammar=JSON_OBJECT)]

    def run(pairs):
        engine = Engine(model, tok)
        ids = [engine.add(p, s) for p, s in pairs]
        done = drain(engine)
        return [done[i].output_tokens for i in ids]

    alone = [run([pair])[0] for pair in zip(prompts, samplings)]
    assert run(list(zip(prompts, samplings))) == alone
    assert tok.decode(list(alone[2])).strip('"') in COLOUR["enum"]


def test_a_compiled_grammar_is_reused_and_each_sequence_matches_on_its_own():
    tok = embedded_tokenizer()
    grammars = Grammars(tok, tok.eos_token_ids)
    grammar = json_schema(COLOUR)
    first, second = grammars.constraint(grammar), grammars.constraint(grammar)
    start = first.allowed(len(tok.get_vocab()))
    for t in tok.encode('"red"', add_special_tokens=False):
        first.advance(t)
    assert first.allowed(len(tok.get_vocab())).sum().item() == len(tok.eos_token_ids)
    assert mx.array_equal(second.allowed(len(tok.get_vocab())), start).item()  # untouched by the first's tokens
    assert len(grammars._compiled) == 1
    with pytest.raises(GrammarError):
        grammars.constraint('{"grammars": [{"lark_grammar": "start: %%%"}]}')


def test_masked_logits_are_the_models_where_allowed():
    tok = embedded_tokenizer()
    from semantic.runtime.engine.sampling import Sampler

    constraint = Grammars(tok, tok.eos_token_ids).constraint(json_schema(COLOUR))
    logits = mx.random.normal((len(tok.get_vocab()),), key=mx.random.key(0))
    mask = constraint.allowed(logits.shape[0])
    token = Sampler(SamplingParams(), constraint)(logits).token.item()
    assert token == mx.argmax(mx.where(mask, logits, -mx.inf)).item() and mask[token].item()


def test_compiled_grammars_are_bounded():
    from semantic.runtime.text.grammar import CACHED

    tok = embedded_tokenizer()
    grammars = Grammars(tok, tok.eos_token_ids)
    for i in range(CACHED + 3):
        grammars.constraint(json_schema({"enum": [f"v{i}"]}))
    assert len(grammars._compiled) == CACHED
    assert json_schema({"enum": [f"v{CACHED + 2}"]}) in grammars._compiled  # the newest kept, the oldest gone
    assert json_schema({"enum": ["v0"]}) not in grammars._compiled


@pytest.fixture(scope="module")
def grammars() -> Grammars:
    tok = embedded_tokenizer()
    return Grammars(tok, tok.eos_token_ids)


def takes(grammars: Grammars, grammar: str, text: str) -> bool:
    """Whether ``text`` is a whole document ``grammar`` allows (its tokens as drafts are checked, then the end)."""
    tok = grammars._tokenizer
    constraint, ids = grammars.constraint(grammar), tok.encode(text, add_special_tokens=False)
    if constraint.allows(ids) < len(ids):
        return False
    for t in ids:
        constraint.advance(t)
    return constraint.allowed(len(tok.get_vocab()))[min(tok.eos_token_ids)].item()


# The schema LangChain's standard tests give ``magic_function``; a small model copies its keywords into the call.
MAGIC = {"type": "object", "properties": {"input": {"type": "integer", "exclusiveMinimum": -1000,
                                                    "exclusiveMaximum": 1000}}, "required": ["input"]}
NESTED = {"type": "object", "$defs": {"P": {"type": "object", "properties": {"x": {"type": "integer"}}}},
          "properties": {"list": {"type": "array", "items": {"$ref": "#/$defs/P"}},
                         "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}},
                                              {"type": "null"}]}}}
BUILT = {"$defs": NESTED["$defs"], "allOf": [{"$ref": "#/$defs/P"}, {"properties": {"b": {"type": "boolean"}}}]}


@pytest.mark.parametrize("schema, taken, refused", [
    (MAGIC, ['{"input": 3}'], ['{"input": 3, "exclusiveMaximum": 1000}', '{"input": 1000}', '{"type": "integer"}']),
    ({**MAGIC, "additionalProperties": True}, ['{"input": 3, "exclusiveMaximum": 1000}'], ['{"input": 1000}']),
    ({**MAGIC, "additionalProperties": {"type": "string"}}, ['{"input": 3, "why": "so"}'],
     ['{"input": 3, "why": 1}', '{"input": 3, "input": 4}']),
    ({"properties": {"a": {"type": "integer"}, "no": False}, "additionalProperties": True}, ['{"b": 1}', "[]"],
     ['{"no": 1}']),
    (NESTED, ['{"list": [{"x": 1}, {}], "either": {"a": true}}', '{"either": null}'],
     ['{"list": [{"x": 1, "y": 2}]}', '{"either": {"a": true, "b": 1}}', '{"list": [], "more": 1}']),
    (BUILT, ['{"x": 1, "b": true}', "{}"], ['{"x": 1, "c": 2}']),  # the parts build one object, closed once
    ({"type": "object"}, ['{"any": [1, {"k": null}]}'], ["[]"]),  # no properties listed: any object
    ({"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}},  # llguidance's alone
     ['{"kids": [{"kids": []}, {}]}'], ['{"kids": [{"x": 1}]}']),
])
def test_objects_are_closed_unless_the_schema_opens_them(grammars, schema, taken, refused):
    g = json_schema(schema)
    assert [t for t in taken if not takes(grammars, g, t)] == []
    assert [t for t in refused if takes(grammars, g, t)] == []


NUMBER_DIGITS = (["12345678901234567", "-1.2345678901234567e308", "1.2345678901234567E-308", "0.00012345678901234567",
                  "0.5e+001"],
                 ["123456789012345678", "1.23456789012345678e308", "1.2345678901234567e3080", "0.12345678901234567891",
                  "0.0000000000000000001", "1111111111111111111111111111111111"])


@pytest.mark.parametrize("schema, taken, refused", [
    ({"type": "integer"}, ["1234567890123456789", "-1234567890123456789", "0"], ["12345678901234567890", "1e3"]),
    ({"type": "integer", "minimum": -5}, ["1234567890123456789", "-5"], ["12345678901234567890", "-6"]),
    ({"type": "integer", "exclusiveMinimum": 0, "maximum": 1e25}, ["1234567890123456789"],
     ["12345678901234567890", "0"]),
    ({"type": "number"}, *NUMBER_DIGITS),
    ({"type": "number", "minimum": 0}, [t.lstrip("-") for t in NUMBER_DIGITS[0]], ["-1", *NUMBER_DIGITS[1]]),
    ({"type": "number", "exclusiveMaximum": 0}, ["-1.2345678901234567e308", "-1e-5"], ["0", "0.0", "12", "-1e3080"]),
    # bounded away from 0: written out, as llguidance writes a bounded number; the digits are bounded all the same
    ({"type": "number", "minimum": -1e18, "maximum": 1e18}, ["12345678901234567", "-0.12345678901234567"],
     ["123456789012345678", "0.123456789012345678", "1e5"]),
    ({"type": "number", "minimum": 0.5, "exclusiveMaximum": 2}, ["0.5", "1.9999999999999999", "1"],
     ["0.49", "2", "1.99999999999999999"]),
    ({"type": "object", "additionalProperties": {"type": ["number", "null"]}}, ['{"a": 1.5, "b": null}'],
     ['{"a": 123456789012345678}']),
])
def test_numbers_are_those_a_float64_holds(grammars, schema, taken, refused):
    """17 significant digits (after at most 16 zeros leading a fraction) and a
    3-digit exponent, integers 19 digits, within the schema's own bounds: a
    model can no longer write digits that never end."""
    g = json_schema(schema)
    assert [t for t in taken if not takes(grammars, g, t)] == []
    assert [t for t in refused if takes(grammars, g, t)] == []
    free = ('{"n": 12345678901234567}', '{"n": [123456789012345678]}')  # json_object's numbers too
    assert [takes(grammars, JSON_OBJECT, t) for t in free] == [True, False]


class Addr(BaseModel):
    street: str = Field(max_length=12)
    zip: int | None = None


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=150)
    ratio: float = Field(gt=0, lt=1)
    tags: list[Literal["a", "b"]] = Field(max_length=2)
    home: Addr
    away: Addr | None = None
    scores: dict[str, float] = {}
    pair: tuple[int, bool]


PERSON_DOCS = [
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": [], "home": {"street": "Elm"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": ["a", "b"], "home": {"street": "Elm", "zip": -7},
     "away": None, "scores": {"x": -2.5, "y": 1e-5}, "pair": [0, False]},
    {"name": "Ann", "age": 151, "ratio": 0.5, "tags": [], "home": {"street": "Elm"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 1, "tags": [], "home": {"street": "Elm"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": ["c"], "home": {"street": "Elm"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": [], "home": {"street": "Elm Street 123"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": [], "home": {"street": "Elm", "town": "X"}, "pair": [1, True]},
    {"name": "Ann", "age": 3, "ratio": 0.5, "tags": [], "home": {"street": "Elm"}, "pair": [1, True, 2]},
    {"age": 3, "name": "Ann", "ratio": 0.5, "tags": [], "home": {"street": "Elm"}, "pair": [1, True]},  # order
]


def test_a_schema_allows_what_llguidance_allows_but_for_numbers(grammars):
    """Written as Lark, a schema allows the same documents as llguidance's own
    grammar of it (numbers within the bounds above)."""
    schema = strict(Person.model_json_schema())
    ours, theirs = json_schema(schema), LLMatcher.grammar_from_json_schema(json.dumps(schema), overrides=LAYOUT)
    docs = [json.dumps(d) for d in PERSON_DOCS]
    assert [takes(grammars, ours, d) for d in docs] == [takes(grammars, theirs, d) for d in docs]
    assert [takes(grammars, ours, d) for d in docs] == [True, True] + [False] * 7
