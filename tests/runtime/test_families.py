"""Every family on its tiny random-weight model with the embedded model's
tokenizer: a multi-turn conversation prefills only each turn's new part, and a
cache saved here continues bit for bit in a fresh process."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from semantic.runtime.memory.agent_cache import AgentCaches
from semantic.runtime.memory.block_pool import KVBudget
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import CacheRecord
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.model.model_spec import ModelCacheSpec
from semantic.runtime.text.prefix import encode
from semantic.runtime.memory.turns import render, run_turn
from tests.runtime.test_engine import drain
from tests.tiny import TINY_CONFIGS, tiny_model_with_tokenizer

QUESTIONS = ["Name a river.", "Where does it start?", "Where does it end?", "How long is it?", "Name another."]


def _caches(arch: str, root) -> AgentCaches:
    model, _ = tiny_model_with_tokenizer(arch)
    spec = ModelCacheSpec.from_model(model)
    return AgentCaches(CacheStore(root), arch, spec, KVBudget(spec, 256 << 20, sliding_dtype_bytes=4))


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_each_turn_prefills_only_its_new_message_and_the_reply_before(arch, tmp_path):
    """Turns 2-5 prefill the new message and its template, and at most the 8
    tokens of the reply before it (a random model's reply need not re-render to
    its own tokens: the cache is cut back, or a recurrent state goes back to its
    checkpoint, to where the text diverged)."""
    model, tok = tiny_model_with_tokenizer(arch)
    engine, caches = Engine(model, tok), _caches(arch, tmp_path)
    messages = [{"role": "system", "content": "You are a patient tutor. " * 6}]
    report, previous = [], None
    for n, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        r = run_turn(engine, caches, "ann", messages, SamplingParams(max_tokens=8))
        if previous is not None:
            new_part = render(tok, messages)[len(previous):]
            assert r.prefilled_tokens <= len(encode(tok, new_part)) + 8, (n, r.prefilled_tokens, new_part)
            assert r.reused_tokens + r.prefilled_tokens == r.prompt_tokens
        report.append((r.prompt_tokens, r.reused_tokens, r.prefilled_tokens))
        previous = render(tok, messages)
        messages.append({"role": "assistant", "content": r.text})
    print(f"\n{arch}: (prompt, reused, prefilled) per turn: {report}")


FRESH = textwrap.dedent("""
    import semantic.runtime  # the fast BLAS before mlx, as every process of ours
    import sys, json
    import numpy as np
    import mlx.core as mx
    from semantic.runtime.store.cache_file import CacheStore
    from semantic.runtime.model.lean import lean
    from semantic.runtime.engine.rowwise import rowwise
    from tests.tiny import tiny_model_with_tokenizer
    root, cases = sys.argv[1], json.loads(sys.argv[2])
    for arch, extra in cases.items():
        model = lean(rowwise(tiny_model_with_tokenizer(arch)[0]))  # as an engine runs it
        cache = CacheStore(root).load("ann", arch, "spec").cache
        np.save(f"{root}/{arch}.npy", np.array(model(mx.array([extra]), cache=cache)[0, -1]))
""")


@pytest.mark.slow
def test_a_saved_cache_continues_bit_for_bit_in_a_fresh_process(tmp_path):
    """Save each family's cache after a prompt; a fresh process loads it and
    computes the next tokens' logits: bitwise those the saved cache gives here."""
    cases, want = {}, {}
    for arch in TINY_CONFIGS:
        model, tok = tiny_model_with_tokenizer(arch)
        tokens = encode(tok, render(tok, [{"role": "user", "content": "Tell me about rivers. " * 8}]))
        engine = Engine(model, tok)
        sid = engine.add(tokens, SamplingParams(max_tokens=3))
        finished = drain(engine)[sid]
        CacheStore(tmp_path).save(CacheRecord("ann", arch, "spec", list(finished.cache_tokens), "", 0.0, 0.0,
                                              finished.cache))
        cases[arch] = extra = encode(tok, " And lakes?")
        want[arch] = np.array(model(mx.array([extra]), cache=finished.cache.clone())[0, -1])
    out = subprocess.run([sys.executable, "-c", FRESH, str(tmp_path), json.dumps(cases)], capture_output=True,
                         text=True, timeout=600, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    for arch in TINY_CONFIGS:
        assert np.array_equal(np.load(tmp_path / f"{arch}.npy"), want[arch]), arch
