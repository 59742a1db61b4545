"""Sliding-window layers (``WindowKVCache``): attention sees what mlx-lm's ring
gives it, and a cache can be cut back after its window wrapped, so a turn that
diverges from the cached text (an edited message, a re-rendered reply)
prefills only from where it diverges instead of starting cold; a hybrid's
recurrent states (``StateCache``) go back to a checkpoint instead."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache, make_prompt_cache

from semantic.runtime.memory.agent_cache import AgentCaches
from semantic.runtime.kv import SequenceCache, WindowKVCache
from semantic.runtime.memory.block_pool import KVBudget
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.model.model_spec import WINDOW_SPARE, ModelCacheSpec
from semantic.runtime.text.prefix import encode
from semantic.runtime.memory.turns import render, run_turn
from tests.tiny import tiny_model, tiny_model_with_tokenizer

SLIDING = ["gemma3_text", "gemma3", "gpt_oss"]  # windows of 16 tokens


def _feed(model, caches, pieces) -> list[mx.array]:
    """Logits of the last position after each piece of token ids."""
    out = []
    for piece in pieces:
        logits = model(mx.array(piece)[None], cache=caches)
        mx.eval(logits)
        out.append(logits[0, -1])
    return out


@pytest.mark.parametrize("arch", SLIDING)
def test_attention_sees_what_mlx_lms_ring_gives_it(arch):
    """Chunks and single tokens, far past the window: the same logits (to float
    rounding: the ring hands attention its keys in another order) and the same
    greedy tokens as mlx-lm's own caches."""
    model = tiny_model(arch)
    ring = make_prompt_cache(model)
    assert any(isinstance(c, RotatingKVCache) for c in ring)
    ours = [WindowKVCache(c.max_size) if isinstance(c, RotatingKVCache) else KVCache() for c in ring]
    ids = mx.random.randint(1, 500, (120,), key=mx.random.key(3)).tolist()
    pieces = [ids[:40], *([t] for t in ids[40:70]), ids[70:90], *([t] for t in ids[90:])]
    want, got = _feed(model, ring, pieces), _feed(model, ours, pieces)
    for i, (a, b) in enumerate(zip(want, got)):
        assert mx.allclose(a, b, atol=1e-4, rtol=1e-4).item(), i
        assert mx.argmax(a).item() == mx.argmax(b).item(), i


def test_a_window_holds_its_spare_and_cuts_back_exactly():
    """Fed past its window and spare, it holds window - 1 + spare tokens (in a
    buffer a growth step larger at most); cut back by what it can, it continues
    bit for bit as a cache that was only ever fed the shorter sequence."""
    window, spare = 16, 40
    k = mx.random.normal((1, 2, 300, 64), key=mx.random.key(1))
    v = mx.random.normal((1, 2, 300, 64), key=mx.random.key(2))

    def fed(n: int) -> WindowKVCache:
        c = WindowKVCache(window, spare)
        c.step = 32
        for lo in range(0, n, 7):  # chunks of 7, so a grow drops some and keeps others
            c.update_and_fetch(k[..., lo:min(n, lo + 7), :], v[..., lo:min(n, lo + 7), :])
        return c

    c = fed(250)
    assert c.held == window - 1 + spare and c.offset == 250 and c.keys.shape[2] <= c.held + 7 + c.step
    assert SequenceCache([c]).trimmable_tokens == spare
    cut = c.trimmable_tokens
    assert c.trim(cut + 5) == cut and c.offset == 250 - cut and not c.is_trimmable()
    fresh = fed(250 - cut)
    for lo in range(250 - cut, 300, 10):  # both go on with the same tokens
        a = c.update_and_fetch(k[..., lo:lo + 10, :], v[..., lo:lo + 10, :])
        b = fresh.update_and_fetch(k[..., lo:lo + 10, :], v[..., lo:lo + 10, :])
        assert all(mx.array_equal(x, y).item() for x, y in zip(a, b))
        assert a[0].shape[2] == min(window - 1, lo) + min(10, 300 - lo)  # the window before the chunk, and it
    young = fed(30)
    assert young.trimmable_tokens == 30 and young.trim(30) == 30 and young.offset == young.held == 0


@pytest.mark.parametrize("arch", ["gemma3", "gpt_oss", "qwen3_next"])
def test_a_turn_that_diverges_past_the_window_prefills_only_from_where_it_diverges(arch, tmp_path):
    """Sliding windows are cut back to the divergence; a hybrid's recurrent
    states (which cannot be cut back) go back to their latest checkpoint before
    it: where the diverging turn's predecessor started."""
    model, tok = tiny_model_with_tokenizer(arch)
    spec = ModelCacheSpec.from_model(model)
    engine = Engine(model, tok)
    caches = AgentCaches(CacheStore(tmp_path), arch, spec, KVBudget(spec, 256 << 20, sliding_dtype_bytes=4))
    greedy = SamplingParams(max_tokens=8)
    system = {"role": "system", "content": "You are a careful assistant. " * 8}  # far past the 16-token window
    asked = [system, {"role": "user", "content": "Name three rivers in Europe and one in Africa."}]
    first = run_turn(engine, caches, "alice", asked, greedy)
    asked += [{"role": "assistant", "content": first.text},
              {"role": "user", "content": "Now name three mountains in Asia, please."}]
    second = run_turn(engine, caches, "alice", asked, greedy)
    cached = caches.peek("alice")
    assert cached.tokens and all(c.offset > c.window for c in cached.cache if isinstance(c, WindowKVCache))
    marks = cached.cache.checkpoints()
    # The client edits its last message: the new prompt leaves the cached text inside that message.
    edited = asked[:-1] + [{"role": "user", "content": "Now name three lakes in Asia, please."}]
    text = render(tok, edited)
    shared = next(i for i, (a, b) in enumerate(zip(text, cached.text)) if a != b)
    third = run_turn(engine, caches, "alice", edited, greedy)
    cold = len(encode(tok, text))
    print(f"\n{arch}: turn 2 reused {second.reused_tokens} of {second.prompt_tokens}; the edited turn prefilled "
          f"{third.prefilled_tokens} of {third.prompt_tokens} (a cold start would prefill {cold}: what a wrapped "
          f"ring or a state without checkpoints did); checkpoints at {marks}")
    assert second.reused_tokens > 0.5 * second.prompt_tokens
    if arch == "qwen3_next":  # back to where turn 2 started (its checkpoints: there, and its prompt's end)
        assert marks[0] == second.reused_tokens and third.reused_tokens == second.reused_tokens
        assert len(encode(tok, text[shared:])) < third.prefilled_tokens < cold / 2
    else:
        assert third.prefilled_tokens <= len(encode(tok, text[shared:])) + 2  # from the divergence on
        assert third.reused_tokens >= len(encode(tok, text[:shared])) - 2
    # A fresh agent prefills all of it: the figure printed as cold.
    fresh = AgentCaches(CacheStore(tmp_path / "cold"), arch, spec, KVBudget(spec, 256 << 20, sliding_dtype_bytes=4))
    assert run_turn(engine, fresh, "bob", edited, greedy).prefilled_tokens == cold


def test_the_spare_is_counted_in_the_budget():
    spec = ModelCacheSpec.from_model(tiny_model("gemma3_text"))
    kv = KVBudget(spec, 1 << 30, block_tokens=16, sliding_dtype_bytes=4)
    full, open_block, sliding = kv.groups
    assert (full.name, open_block.name, sliding.name) == ("full", "open", f"sliding:{sliding.window}")
    held = -(-(sliding.window + WINDOW_SPARE) // 16)  # blocks of the window and the spare, however long
    assert kv.bytes_for(10_000, running=False) == \
        625 * full.block_bytes + open_block.block_bytes + held * sliding.block_bytes


def test_a_ring_from_an_older_file_loads_as_a_window_in_time_order():
    """Cache files written before ``WindowKVCache`` hold mlx-lm's ring (kind
    "rotating"): it loads as a window layer, unrolled, and attention then gets
    the same keys as the ring would give it."""
    import numpy as np

    from semantic.runtime.store.cache_codec import HostCache
    from semantic.runtime.cache_records import CacheRecord

    ring = RotatingKVCache(16)
    position = mx.arange(60, dtype=mx.float32).reshape(1, 1, 60, 1) * mx.ones((1, 1, 1, 64))
    for lo, hi in [(0, 30), *((t, t + 1) for t in range(30, 37))]:  # a chunk, then single tokens mid-ring
        ring.update_and_fetch(position[..., lo:hi, :], position[..., lo:hi, :])
    live = min(ring.offset, ring.keys.shape[2])
    assert ring.offset == 37 and 0 < ring._idx < live
    entry = {"kind": "rotating", "offset": 37, "max_size": 16, "keep": 0, "idx": ring._idx, "tensors": {}}
    arrays = {f"layer_0_{n}": np.array(x[..., :live, :]) for n, x in (("k", ring.keys), ("v", ring.values))}
    record = CacheRecord("a", "m", "s", list(range(37)), "", 0.0, 0.0, [])
    [window] = HostCache(record, [entry], arrays).build().cache
    assert isinstance(window, WindowKVCache) and window.offset == 37
    assert window.state[0][0, 0, :, 0].tolist() == list(range(37 - live, 37))  # oldest first
    k_ring, _ = ring.update_and_fetch(position[..., 37:38, :], position[..., 37:38, :])
    k_ours, _ = window.update_and_fetch(position[..., 37:38, :], position[..., 37:38, :])
    assert sorted(k_ring[0, 0, :, 0].tolist()) == k_ours[0, 0, :, 0].tolist() == list(range(22, 38))
