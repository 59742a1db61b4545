"""Batched quantized KV caches against the same sequences decoded alone, on tiny
random-weight models of every supported architecture."""

import runtime  # noqa: F401  (fast BLAS before mlx)

import random

import mlx.core as mx
import pytest
from mlx_lm.models.base import quantized_scaled_dot_product_attention
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from runtime.batch_cache import (
    BatchQuantizedKVCache,
    BatchSlidingKVCache,
    DequantizingBatchKVCache,
    DequantizingKVCache,
    SequenceQuantizedKVCache,
    _dequantize,
    _quantize,
    _quantize_unpack,
    _unpack,
    extend_caches,
    extract_cache,
    filter_caches,
    make_batch_cache,
    make_sequence_cache,
    merge_caches,
)
from tests.tiny import VOCAB, tiny_model

ARCHS = ["llama", "qwen2", "gemma3_text", "gpt_oss"]
STEPS = 12
CHUNK_STEP, EXTRA = 10, [7, 11]  # one step feeds 3 tokens a row, after the sliding rings have rotated


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def _last(logits: mx.array) -> tuple[mx.array, mx.array]:
    """Greedy tokens and the last-position logits they came from."""
    logits = logits[:, -1]
    return mx.argmax(logits, axis=-1), logits


def _prefill(model, prompt, chunk, bits=4):
    """Prompt alone into a fresh sequence cache, then a follow-up chunk; returns the
    cache and the first greedy token."""
    cache = make_sequence_cache(model, bits=bits)
    model(mx.array([prompt]), cache=cache)
    return cache, _last(model(mx.array([chunk]), cache=cache))[0]


def _inputs(step: int, token: mx.array) -> mx.array:
    """What each row feeds at a global step: its last token, plus two more at CHUNK_STEP."""
    if step != CHUNK_STEP:
        return token[:, None]
    return mx.concatenate([token[:, None], mx.broadcast_to(mx.array(EXTRA), (token.shape[0], 2))], axis=1)


def _decode_alone(model, cache, token, steps) -> tuple[list[int], list[mx.array]]:
    tokens, logits = [], []
    for step in steps:
        tokens.append(token.item())
        token, out = _last(model(_inputs(step, token), cache=cache))
        logits.append(out[0])
    return tokens, logits


def _close(a: list[mx.array], b: list[mx.array]) -> bool:
    # Batched and single matmuls round differently (and Q4 can amplify that); a wrong
    # mask or a lost token moves logits by 0.05-7 on these models.
    return all(mx.abs(x - y).max().item() < 1e-2 for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_matches_alone(arch):
    model = tiny_model(arch)
    rng = random.Random(0)
    # Lengths straddle the sliding window (16); the row that joins is longer than the batch.
    prompts = [_tokens(rng, n) for n in (5, 23, 1, 40, 50)]
    chunks = [_tokens(rng, 3) for _ in prompts]
    # Rows 0-3 start at step 0, row 4 joins at step 6.
    expected = [_decode_alone(model, *_prefill(model, p, c), range(6 if i == 4 else 0, STEPS))
                for i, (p, c) in enumerate(zip(prompts, chunks))]

    # Rows 0-3 were prefilled alone; their follow-up chunks go in as one N=3 batch step.
    seqs = []
    for p in prompts[:4]:
        seqs.append(make_sequence_cache(model))
        model(mx.array([p]), cache=seqs[-1])
    batch = merge_caches(seqs)
    token = _last(model(mx.array(chunks[:4]), cache=batch))[0]
    rows = [0, 1, 2, 3]  # prompt index of each batch row
    got = {r: ([], []) for r in range(5)}  # tokens, logits
    for step in range(STEPS):
        if step == 4:  # the longest row finished early: the others' shared padding goes
            keep = [i for i, r in enumerate(rows) if r != 3]
            filter_caches(batch, keep)
            rows, token = [rows[i] for i in keep], token[mx.array(keep)]
        if step == 6:  # prompt 4 joins while the others decode
            cache, first = _prefill(model, prompts[4], chunks[4])
            extend_caches(batch, merge_caches([cache]))
            rows, token = rows + [4], mx.concatenate([token, first])
        if step == 8:  # row 1 leaves and carries on alone
            i = rows.index(1)
            extracted = _decode_alone(model, extract_cache(batch, i), token[i : i + 1], range(8, STEPS))
        if step == CHUNK_STEP:  # the sliding rings have wrapped; short rows still have padding
            assert all(c.rotated for c in batch if isinstance(c, BatchSlidingKVCache))
        t, logits = _last(model(_inputs(step, token), cache=batch))
        for i, r in enumerate(rows):
            got[r][0].append(token[i].item())
            got[r][1].append(logits[i])
        token = t

    for r in range(5):
        n = len(got[r][0])
        assert got[r][0] == expected[r][0][:n], f"row {r} tokens"
        assert _close(got[r][1], expected[r][1][:n]), f"row {r} logits"
    assert len(got[3][0]) == 4 and len(got[4][0]) == len(expected[4][0]) == STEPS - 6
    assert got[1][0][:8] + extracted[0] == expected[1][0]
    assert _close(got[1][1][:8] + extracted[1], expected[1][1])


def test_eight_bit_batch_matches_alone():
    model = tiny_model("llama")
    rng = random.Random(1)
    prompts, chunks = [_tokens(rng, n) for n in (7, 30)], [_tokens(rng, 2) for _ in range(2)]
    expected = [_decode_alone(model, *_prefill(model, p, c, bits=8), range(6))[0] for p, c in zip(prompts, chunks)]
    seqs = [_prefill(model, p, c, bits=8) for p, c in zip(prompts, chunks)]
    batch = merge_caches([c for c, _ in seqs])
    assert all(c.bits == 8 for c in batch)
    token, got = mx.concatenate([t for _, t in seqs]), [[], []]
    for _ in range(6):
        for g, t in zip(got, token.tolist()):
            g.append(t)
        token = _last(model(token[:, None], cache=batch))[0]
    assert got == expected


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_left_padded_batch_prefill(arch):
    # New prompts prefilled together in an empty left-padded batch, as the engine may do.
    model = tiny_model(arch)
    rng = random.Random(2)
    prompts = [_tokens(rng, n) for n in (9, 20, 4)]
    T = max(map(len, prompts))
    batch = make_batch_cache(model, left_padding=[T - len(p) for p in prompts])
    padded = mx.array([[0] * (T - len(p)) + p for p in prompts])
    token, logits = _last(model(padded, cache=batch))
    for i, p in enumerate(prompts):
        alone, alone_logits = _last(model(mx.array([p]), cache=make_sequence_cache(model)))
        assert alone.item() == token[i].item() and _close([alone_logits[0]], [logits[i]])
        assert extract_cache(batch, i)[-1].offset == len(p)


def _filled(cache, n: int, seed: int, B: int = 1, H: int = 2, D: int = 64):
    """``cache`` after ``n`` random float32 tokens."""
    if n:
        mx.random.seed(seed)
        k, v = mx.random.normal((2, B, H, n, D))
        cache.update_and_fetch(k, v)
    return cache


def _triples(cache: QuantizedKVCache):
    return [x[..., : cache.offset, :] for x in (*cache.keys, *cache.values)]


def test_merge_extract_round_trip_is_bit_exact_without_dequantizing(monkeypatch):
    singles = [_filled(SequenceQuantizedKVCache(), n, s) for s, n in enumerate((5, 300, 0, 1))]
    mx.eval([c.keys for c in singles if c.keys is not None])

    def forbidden(*args, **kwargs):
        raise AssertionError("merge/extract must not (de)quantize")

    monkeypatch.setattr(mx, "dequantize", forbidden)
    monkeypatch.setattr(mx, "quantize", forbidden)
    batch = BatchQuantizedKVCache.merge(singles + [None])
    assert batch.left_padding.tolist() == [295, 0, 300, 299, 300]
    assert batch.offset.tolist() == [5, 300, 0, 1, 0]
    for i, c in enumerate(singles):
        row = batch.extract(i)
        assert isinstance(row, QuantizedKVCache) and row.offset == c.offset
        if c.offset:
            assert all(mx.array_equal(a, b).item() for a, b in zip(_triples(row), _triples(c)))
            assert row.keys[0].shape[2] == c.offset  # exactly the row's tokens, no capacity
            assert row.keys[1].dtype == mx.float16
    assert batch.extract(4).offset == 0
    again = BatchQuantizedKVCache.from_state(batch.state)
    assert again.bits == 4 and mx.array_equal(again.extract(1).keys[0], singles[1].keys[0][..., :300, :]).item()

    wrapped = DequantizingBatchKVCache.merge([DequantizingKVCache(quantized=c) for c in singles])
    row = wrapped.extract(1)
    assert isinstance(row, DequantizingKVCache) and not hasattr(row, "bits")
    assert all(mx.array_equal(a, b).item() for a, b in zip(_triples(row.quantized), _triples(singles[1])))


def test_merge_takes_plain_mlx_lm_caches():
    # mlx-lm's own QuantizedKVCache keeps float32 scales for a float32 model; merging casts them.
    plain = _filled(QuantizedKVCache(group_size=64, bits=4), 7, 0)
    row = BatchQuantizedKVCache.merge([plain, None]).extract(0)
    assert mx.array_equal(row.keys[0], plain.keys[0][..., :7, :]).item()
    assert mx.array_equal(row.keys[1], plain.keys[1][..., :7, :].astype(mx.float16)).item()
    with pytest.raises(ValueError, match="bits"):
        BatchQuantizedKVCache.merge([plain, _filled(QuantizedKVCache(bits=8), 3, 1)])


def test_mask_padding_and_causal_chunk():
    batch = BatchQuantizedKVCache.merge([_filled(SequenceQuantizedKVCache(), n, n) for n in (3, 1, 4)])
    assert batch.left_padding.tolist() == [1, 3, 0] and batch.offset.tolist() == [3, 1, 4]
    one = batch.make_mask(1)
    assert one.shape == (3, 1, 1, 5)
    assert one[:, 0, 0].tolist() == [
        [False, True, True, True, True],
        [False, False, False, True, True],
        [True, True, True, True, True],
    ]
    chunk = batch.make_mask(2)  # two new tokens at positions 4 and 5
    assert chunk.shape == (3, 1, 2, 6)
    assert chunk[1, 0].tolist() == [
        [False, False, False, True, True, False],
        [False, False, False, True, True, True],
    ]
    assert chunk[2, 0].tolist() == [[True] * 5 + [False], [True] * 6]
    windowed = batch.make_mask(1, window_size=2)
    assert windowed[2, 0, 0].tolist() == [False, False, False, True, True]


def test_filter_drops_shared_padding_and_extend_right_aligns():
    batch = BatchQuantizedKVCache.merge([_filled(SequenceQuantizedKVCache(), n, n) for n in (3, 1, 4)])
    batch.filter([1, 0])
    assert batch.left_padding.tolist() == [2, 0] and batch.offset.tolist() == [1, 3] and batch.size() == 3
    other = BatchQuantizedKVCache.merge([_filled(SequenceQuantizedKVCache(), 6, 9)])
    batch.extend(other)
    assert batch.left_padding.tolist() == [5, 3, 0] and batch.offset.tolist() == [1, 3, 6] and batch.size() == 6
    assert batch.extract(2).offset == 6
    with pytest.raises(ValueError):
        batch.extend(BatchQuantizedKVCache([0], bits=8))
    empty = BatchQuantizedKVCache([0, 0])
    empty.extend(BatchQuantizedKVCache([0]))
    assert empty.empty() and empty.offset.tolist() == [0, 0, 0]


def test_growth_in_steps_and_trim():
    cache = BatchQuantizedKVCache([0, 2])
    _filled(cache, 3, 0, B=2)
    assert cache.keys[0].shape[2] == 256 and cache.size() == 3 and cache.offset.tolist() == [3, 1]
    _filled(cache, 253, 1, B=2)
    assert cache.keys[0].shape[2] == 256  # exactly full, no growth yet
    _filled(cache, 1, 2, B=2)
    assert cache.keys[0].shape[2] == 512 and cache.size() == 257
    assert cache.trim(7) == 7 and cache.size() == 250 and cache.offset.tolist() == [250, 248]
    k, _ = cache.update_and_fetch(*mx.random.normal((2, 2, 2, 1, 64)))
    assert k[0].shape[2] == 251 and cache.offset.tolist() == [251, 249]
    assert cache.is_trimmable() and cache.trim(1000) == 251 and cache.size() == 0


def test_scales_are_16_bit_and_attention_takes_them_as_they_are():
    # float32 model: float16 scales; the quantized SDPA mixes them with float32 queries.
    cache = _filled(BatchQuantizedKVCache([0, 0]), 49, 0, B=2)
    k, v = cache.update_and_fetch(*mx.random.normal((2, 2, 2, 1, 64)))
    assert k[1].dtype == v[2].dtype == mx.float16
    q = mx.random.normal((2, 4, 1, 64))
    out = quantized_scaled_dot_product_attention(mx.array(q), k, v, scale=0.125, mask=None, bits=4)
    dq = [mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=64, bits=4) for w, s, b in (k, v)]
    ref = mx.fast.scaled_dot_product_attention(q, *dq, scale=0.125)
    assert out.dtype == mx.float32 and mx.allclose(out, ref, atol=1e-5).item()

    # bfloat16 model: bfloat16 scales, so nothing promotes the model to float32.
    model = tiny_model("llama")
    model.set_dtype(mx.bfloat16)
    seqs = [make_sequence_cache(model) for _ in range(2)]
    for c, p in zip(seqs, ([1, 2, 3], [4, 5])):
        model(mx.array([p]), cache=c)
    batch = merge_caches(seqs)
    logits = model(mx.array([[6], [7]]), cache=batch)
    assert logits.dtype == mx.bfloat16 and batch[0].keys[1].dtype == mx.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_unpack_is_bit_exact_against_mx_dequantize(bits, group_size, dtype):
    x = (mx.random.normal((2, 3, 17, 128), key=mx.random.key(bits + group_size)) * 3).astype(dtype)
    q = _quantize(x, group_size, bits)
    assert mx.array_equal(_unpack(q, group_size, bits, dtype), _dequantize(q, group_size, bits, dtype)).item()
    *q2, unpacked = _quantize_unpack(x, group_size, bits)
    assert all(mx.array_equal(a, b).item() for a, b in zip(q, q2))
    assert mx.array_equal(unpacked, _dequantize(q, group_size, bits, dtype)).item()


def test_dequantizing_batch_working_copy_is_exactly_its_q4_rows():
    """Step by step, across growth, filter and extend, the float copy attention reads
    equals a fresh dequantization of the Q4 rows of record."""
    cache = _filled(DequantizingBatchKVCache([0, 5]), 250, 0, B=2)

    def check():
        fetched = cache.update_and_fetch(*mx.random.normal((2, cache.batch_size, 2, 1, 64)))
        for f, q in zip(fetched, (cache.keys, cache.values)):
            ref = _dequantize(tuple(x[..., : cache._idx, :] for x in q), 64, 4, mx.float32)
            assert f.shape[2] == cache._idx and mx.array_equal(f, ref).item()

    for _ in range(8):  # crosses the 256-position growth
        check()
    assert cache.keys[0].shape[2] == 512
    cache.filter([1])
    check()
    cache.extend(_filled(DequantizingBatchKVCache([0]), 30, 1))
    for _ in range(3):
        check()


def test_nbytes_against_fp16():
    B, H, T, D = 2, 2, 256, 64
    fp16 = 2 * B * H * T * D * 2
    for bits, ratio in ((4, (0.5 + 4 / 64) / 2), (8, (1 + 4 / 64) / 2)):
        cache = BatchQuantizedKVCache([0] * B, bits=bits)
        _filled(cache, T, 0, B=B)
        assert cache.keys[0].shape == (B, H, T, D * bits // 32)
        assert cache.nbytes / fp16 == pytest.approx(ratio)
    assert (0.5 + 4 / 64) / 2 <= 0.30
    for empty in (BatchQuantizedKVCache([0]), SequenceQuantizedKVCache(), DequantizingKVCache()):
        assert empty.nbytes == 0
    with pytest.raises(ValueError, match="bits"):
        BatchQuantizedKVCache([0], bits=3)
    with pytest.raises(ValueError, match="group size"):
        SequenceQuantizedKVCache(group_size=48)


def test_cache_kinds_per_architecture():
    llama, gemma, oss = (tiny_model(a) for a in ("llama", "gemma3_text", "gpt_oss"))
    assert all(type(c) is BatchQuantizedKVCache for c in make_batch_cache(llama, None))
    assert [type(c) for c in make_batch_cache(gemma, None)] == [BatchSlidingKVCache, BatchQuantizedKVCache] * 2
    assert [type(c) for c in make_batch_cache(oss, None)] == [BatchSlidingKVCache, DequantizingBatchKVCache]
    assert [type(c) for c in make_sequence_cache(oss)] == [RotatingKVCache, DequantizingKVCache]
    assert not hasattr(DequantizingBatchKVCache([0]), "bits") and BatchQuantizedKVCache([0]).bits == 4
    # Why the dequantizing kind exists: mlx-lm refuses sinks with a quantized cache.
    cache = [RotatingKVCache(16), QuantizedKVCache(bits=4)]
    with pytest.raises(ValueError, match="sinks"):
        oss(mx.array([[1, 2, 3]]), cache=cache)
    with pytest.raises(ValueError, match="merge"):
        merge_caches([make_sequence_cache(llama), make_sequence_cache(oss)[::-1]])


def test_sliding_chunk_after_rotation_sees_every_token():
    # mlx-lm's BatchRotatingKVCache.make_mask hides row 1's position 0 from this chunk.
    W = 16

    def positions(*rows):  # keys whose value is their token position
        return mx.array(rows, dtype=mx.float32)[:, None, :, None]

    singles = []
    for n in (16, 3):
        singles.append(RotatingKVCache(W))
        singles[-1].update_and_fetch(positions(list(range(n))), positions(list(range(n))))
    batch = merge_caches([[c] for c in singles])[0]
    batch.update_and_fetch(positions([16], [3]), positions([16], [3]))
    assert batch.rotated
    mask = batch.make_mask(2, window_size=W)
    keys, _ = batch.update_and_fetch(positions([17, 18], [4, 5]), positions([17, 18], [4, 5]))

    def seen(row, q):
        return sorted(int(k) for k, m in zip(keys[row, 0, :, 0].tolist(), mask[row, 0, q].tolist()) if m)

    assert seen(0, 0) == list(range(2, 18)) and seen(0, 1) == list(range(3, 19))
    assert seen(1, 0) == list(range(5)) and seen(1, 1) == list(range(6))
