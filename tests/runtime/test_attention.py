"""The CPU attention (``runtime.model.attention``): its
attention against MLX's own SDPA within float tolerance, each sequence of a
decode step bitwise as alone, and the models' prefill and decode taking it."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import random

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_causal_mask

from semantic.runtime.model import attention
from semantic.runtime.model.attention import LONG, PackedPast, UnpackedPast, attend, attend_each
from semantic.runtime.engine.batch_cache import BatchQuantizedKVCache
from semantic.runtime.kv import make_sequence_cache, unpacked_rows
from semantic.runtime.engine.rowwise import rowwise
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model

SDPA_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def _qkv(heads: int, kv_heads: int, S: int, L: int, seed: int):
    q, k, v = (mx.random.normal(s, key=mx.random.key(seed + i)) for i, s in
               enumerate(((1, heads, S, 64), (1, kv_heads, L, 64), (1, kv_heads, L, 64))))
    return q * 2, k * 2, v


@pytest.mark.slow
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4), (2, 1)])
@pytest.mark.parametrize("S, L", [(1, 1), (1, 300), (17, 17), (40, 333), (128, 1100), (300, 300), (257, 700),
                                  (40, 9000)])  # (the last: blocks of 12 or 29 rows, a shorter one last)
@pytest.mark.parametrize("mask", ["none", "causal", "window", "additive"])
def test_attend_computes_what_mlx_sdpa_computes(heads, kv_heads, S, L, mask):
    q, k, v = _qkv(heads, kv_heads, S, L, seed=S + L)
    given = {"none": None, "causal": "causal" if S > 1 else None,
             "window": create_causal_mask(S, L - S, window_size=24),
             "additive": mx.random.uniform(-3, 0, (S, L), key=mx.random.key(1))}[mask]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask=given)
    got = attend(q, k, v, 0.125, given)
    assert got.shape == want.shape and mx.allclose(got, want, **SDPA_TOLERANCE).item()


def test_each_sequence_of_a_step_is_bitwise_as_alone():
    """attend_each shares one exp over the long sequences' scores: a
    sequence's output does not depend on who else is in the step, nor where
    it sits."""
    rng = random.Random(0)
    lengths = [1, 63, 300, LONG - 1, LONG, LONG + 1, 1500, 2100, 7]  # short ones take MLX's softmax
    fetched = [_qkv(9, 3, 1, n, seed=10 * i)[1:] for i, n in enumerate(lengths)]
    queries = mx.random.normal((len(lengths), 9, 1, 64), key=mx.random.key(99))
    alone = [attend_each(queries[i : i + 1], [fetched[i]], 0.125) for i in range(len(lengths))]
    for _ in range(6):
        members = rng.sample(range(len(lengths)), rng.randrange(2, len(lengths) + 1))
        together = attend_each(queries[mx.array(members)], [fetched[i] for i in members], 0.125)
        for at, i in enumerate(members):
            assert mx.array_equal(together[at : at + 1], alone[i]).item(), (members, i)
    for i, (k, v) in enumerate(fetched):
        want = mx.fast.scaled_dot_product_attention(queries[i : i + 1], k, v, scale=0.125)
        assert mx.allclose(alone[i], want, **SDPA_TOLERANCE).item()


@pytest.mark.slow
@pytest.mark.parametrize("arch", [a for a in TINY_CONFIGS if a in ("llama", "qwen2", "qwen3", "gemma3_text")])
def test_models_prefill_and_decode_through_it_on_the_cpu(arch, monkeypatch):
    """A standard-layout model made ``rowwise`` takes ``runtime.model.attention`` for a
    prefill chunk and for a decode step over its float working copies, and
    computes what mlx-lm's own attention computes, within float tolerance."""
    plain = tiny_model(arch)
    prompt = mx.array([[random.Random(1).randrange(1, VOCAB) for _ in range(40)]])
    view = make_sequence_cache(plain).view()
    want = plain(prompt, cache=view)  # mlx-lm's own attention: not rowwise yet
    want_next = plain(mx.array([[5]]), cache=view)

    calls = []
    for name in ("attend", "attend_each"):
        monkeypatch.setattr(f"semantic.runtime.engine.rowwise.{name}", (lambda f: lambda *a: calls.append(f.__name__) or f(*a))(
            getattr(attention, name)))
    model = rowwise(plain)
    view = make_sequence_cache(model).view()
    got = model(prompt, cache=view)
    got_next = model(mx.array([[5]]), cache=[BatchQuantizedKVCache([c]) for c in view])
    assert mx.allclose(got, want, atol=1e-4).item() and mx.allclose(got_next, want_next, atol=1e-4).item()
    layers = sum("self_attn" in layer for layer in model.layers)
    assert calls == ["attend"] * layers + ["attend_each"] * layers


@pytest.mark.parametrize("kernels", ["built", "none"])
@pytest.mark.parametrize("S", [1, 3, 4, 37, 128])
def test_attention_over_packed_blocks_matches_the_float_copy(S, kernels, monkeypatch):
    """Past the float head a sequence reads its closed blocks packed (the CPU
    kernels, or MLX's quantized matmul where they are not built: Metal's and
    CUDA's path too), or on the CPU, for a chunk of ``unpacked_rows()`` rows
    or more, unpacked for the chunk: what it attends over is the same keys
    and values as the float copy, in another order of sums. Each way, prefill
    (causal) and decode alike, is within 2e-5 of that attention computed
    in float64 (the float copy itself is ~1.2e-5 from it here)."""
    from semantic.runtime.kv import SequenceQuantizedKVCache

    if kernels == "none":
        monkeypatch.setattr(attention, "CPU_KERNELS", None)

    heads, kv_heads, n = 9, 3, max(1100, 1032 + S)  # the chunk within one block, after four closed ones
    q, k, v = _qkv(heads, kv_heads, S, n, seed=5)
    out = {}
    for head in (None, 256):  # every closed block unpacked in the copy; the first only (three past it)
        view = SequenceQuantizedKVCache().view(head)
        view.update_and_fetch(k[..., : n - S, :], v[..., : n - S, :])
        keys, values, past = view.update_and_fetch_past(k[..., n - S :, :], v[..., n - S :, :])
        assert (past is None) == (head is None)
        pasts = {"": None} if past is None else {"packed": view.quantized.packed_past(view.head, view.synced),
                                                  "chosen": past}
        for name, p in pasts.items():
            if S == 1:
                out[head, name] = attend_each(q, [(keys, values, p)], 0.125)
            else:
                out[head, name] = attend(q, keys, values, 0.125, "causal", p)
        if past is None:
            exact = _exact_causal(q, keys, values, 0.125)
        else:
            assert isinstance(past, UnpackedPast if S >= unpacked_rows() else PackedPast)
    for way, got in out.items():
        assert got.shape == exact.shape
        assert np.abs(np.array(got, np.float64) - exact).max() < 2e-5, way


def _exact_causal(q: mx.array, keys: mx.array, values: mx.array, scale: float) -> np.ndarray:
    """Causal attention of ``q`` (1, H, S, D), the last S of ``keys`` and
    ``values`` (1, KVH, L, D), in float64."""
    _, H, S, D = q.shape
    kv_heads, L = keys.shape[1], keys.shape[2]
    qq = np.array(q, np.float64).reshape(1, kv_heads, H // kv_heads, S, D) * scale
    scores = np.einsum("bhgsd,bhtd->bhgst", qq, np.array(keys, np.float64))
    seen = np.arange(L)[None, :] <= (L - S + np.arange(S))[:, None]
    scores = np.where(seen, scores, -np.inf)
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    return np.einsum("bhgst,bhtd->bhgsd", weights, np.array(values, np.float64)).reshape(1, H, S, D)