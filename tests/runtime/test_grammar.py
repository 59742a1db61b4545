"""Constrained decoding: a grammar masks one sequence's logits row, so the reply
follows it whatever the model prefers, and no neighbour's tokens change."""

from __future__ import annotations

import json

import jsonschema
import mlx.core as mx
import pytest

from semantic.runtime.engine import Engine, SamplingParams
from semantic.runtime.grammar import JSON_OBJECT, GrammarError, Grammars, json_schema
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
    assert json.loads(json_schema(SCHEMA))  # llguidance's grammar text is JSON
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
    from semantic.runtime.sampling import Sampler

    constraint = Grammars(tok, tok.eos_token_ids).constraint(json_schema(COLOUR))
    logits = mx.random.normal((len(tok.get_vocab()),), key=mx.random.key(0))
    mask = constraint.allowed(logits.shape[0])
    token = Sampler(SamplingParams(), constraint)(logits).token.item()
    assert token == mx.argmax(mx.where(mask, logits, -mx.inf)).item() and mask[token].item()


def test_compiled_grammars_are_bounded():
    from semantic.runtime.grammar import CACHED

    tok = embedded_tokenizer()
    grammars = Grammars(tok, tok.eos_token_ids)
    for i in range(CACHED + 3):
        grammars.constraint(json_schema({"enum": [f"v{i}"]}))
    assert len(grammars._compiled) == CACHED
    assert json_schema({"enum": [f"v{CACHED + 2}"]}) in grammars._compiled  # the newest kept, the oldest gone
    assert json_schema({"enum": ["v0"]}) not in grammars._compiled
