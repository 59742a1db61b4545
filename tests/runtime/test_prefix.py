"""Prefix plans with the real SmolLM2 tokenizer."""

import pytest

from semantic.runtime.text.prefix import COLD, DIVERGE, EXACT, EXTEND, encode, plan


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


pytestmark = pytest.mark.model


def test_cold_without_a_cache(tok):
    p = plan(tok, "hello there")
    assert (p.kind, p.keep, p.prompt) == (COLD, 0, encode(tok, "hello there"))


def test_exact(tok):
    ids = encode(tok, "same text")
    p = plan(tok, "same text", ids, "same text")
    assert (p.kind, p.keep, p.prompt) == (EXACT, len(ids), ids)
    assert plan(tok, "same text", ids, "same text", trimmable=0).kind == COLD


def test_extend_keeps_the_ids_the_model_generated(tok):
    # The model produced "Paris" as two pieces; re-encoding the text would merge them.
    generated = encode(tok, "The capital is Par") + encode(tok, "is")
    assert generated != encode(tok, "The capital is Paris")
    p = plan(tok, "The capital is Paris. And Spain?", generated, "The capital is Paris")
    assert p.kind == EXTEND and p.keep == len(generated)
    assert p.prompt == generated + encode(tok, ". And Spain?")
    assert p.suffix == encode(tok, ". And Spain?")


def test_diverge_trims_to_the_common_prefix(tok):
    old = "You are terse.\nUser: name three fruits\nAssistant: apple, pear, plum"
    new = "You are terse.\nUser: name three fruits\nAssistant: apple, fig"
    ids = encode(tok, old)
    p = plan(tok, new, ids, old)
    assert p.kind == DIVERGE and 0 < p.keep < len(ids)
    kept = tok.decode(ids[: p.keep])
    assert new.startswith(kept) and len(kept) >= len("You are terse.\nUser: name three fruits\nAssistant: apple,")
    assert tok.decode(p.prompt) == new


def test_diverge_below_the_share_goes_cold(tok):
    old = "A" * 10 + " completely different long history " * 20
    ids = encode(tok, old)
    p = plan(tok, "A" * 10 + " something else", ids, old, min_share=0.5)
    assert p.kind == COLD and p.keep == 0


def test_diverge_with_a_multibyte_boundary(tok):
    old = "café ☕ au lait"
    new = "café ☕ noir"
    ids = encode(tok, old)
    p = plan(tok, new, ids, old, min_share=0.1)
    assert tok.decode(p.prompt) == new
    assert "\ufffd" not in tok.decode(ids[: p.keep])
