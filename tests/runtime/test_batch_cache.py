"""Batched quantized KV caches: per-sequence caches batched around attention, tested
bit for bit against the same sequences alone, on tiny random-weight models of
every supported architecture."""

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from semantic.runtime.engine.batch_cache import BatchQuantizedKVCache
from semantic.runtime.kv import DequantizingKVCache, SequenceQuantizedKVCache, WindowKVCache, make_sequence_cache
from semantic.runtime.kv.quantize import close_block, open_blocks, quantize, unpack
from semantic.runtime.engine.rowwise import _per_sequence, _rowwise_class, rowwise
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model

SLOTS = 8  # every forward below has this many token slots


def _dequantize(q, group_size: int, bits: int, dtype: mx.Dtype) -> mx.array:
    """The reference: ``mx.dequantize`` of a (weights, scales, biases) triple."""
    w, scales, biases = q
    return mx.dequantize(w, scales.astype(dtype), biases.astype(dtype), group_size=group_size, bits=bits)


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1, VOCAB) for _ in range(n)]


def _forward(model, tokens: list[int], views: list[list]) -> list[mx.array]:
    """One decode forward of SLOTS slots: sequence i feeds ``tokens[i]``; each one's logits."""
    tokens = tokens[:SLOTS]
    inputs = mx.array(tokens + [0] * (SLOTS - len(tokens)))[None]
    batch = [BatchQuantizedKVCache(layer) for layer in zip(*views)]
    logits = model(inputs, cache=batch)[0]
    return [logits[i] for i in range(len(tokens))]


def _prefilled(model, prompt: list[int], float_head: int | None = None, bits: int = 4) -> list:
    view = make_sequence_cache(model, bits=bits).view(float_head)
    model(mx.array([prompt]), cache=view)
    return view


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_each_sequence_in_a_forward_computes_as_alone(arch):
    """Sequences that join and leave (past the sliding windows, and one across a
    block's end) give the same logits, bit for bit, as each one alone in a
    forward of the same width -- wherever it sits among the slots."""
    model = rowwise(tiny_model(arch))
    rng = random.Random(0)
    prompts = [_tokens(rng, n) for n in (5, 250, 1, 40)]  # straddle the window of 16; the 250 crosses 256
    feeds = [_tokens(rng, 12) for _ in prompts]

    def run(members: dict[int, range]) -> dict[int, list[mx.array]]:
        views = {i: _prefilled(model, prompts[i]) for i in members}
        got = {i: [] for i in members}
        for step in range(12):
            live = [i for i in sorted(members, reverse=step % 2 == 1) if step in members[i]]  # order flips
            if live:
                for i, out in zip(live, _forward(model, [feeds[i][step] for i in live], [views[i] for i in live])):
                    got[i].append(out)
        return got

    schedule = {0: range(0, 12), 1: range(0, 8), 2: range(4, 12), 3: range(0, 12)}
    together = run(schedule)
    for i, steps in schedule.items():
        alone = run({i: steps})[i]
        assert len(alone) == len(together[i]) == len(steps)
        assert all(mx.array_equal(a, b).item() for a, b in zip(alone, together[i])), f"sequence {i}"


@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_standard_attention_path_computes_what_the_module_computes(arch):
    """The batched path for standard layouts against each mlx-lm module's own call
    on one sequence (same math, other op shapes: float tolerance), and against the
    module run per sequence on its slot."""
    model = tiny_model(arch)
    rng = random.Random(3)
    prompts = [_tokens(rng, n) for n in (30, 9, 17)]
    plain = [_prefilled(model, p) for p in prompts]
    own = [model(mx.array([[7]]), cache=v)[0, -1] for v in plain]  # mlx-lm's own attention, alone
    rowwise(model)
    attn = next(layer.self_attn for layer in model.layers if "self_attn" in layer)
    assert type(attn).__mro__[2].__module__.startswith("mlx_lm.models.")
    batched = _forward(model, [7, 7, 7], [_prefilled(model, p) for p in prompts])
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(own, batched))


def test_eight_bit_sequences_batch_alike():
    model = rowwise(tiny_model("llama"))
    rng = random.Random(1)
    prompts = [_tokens(rng, n) for n in (7, 30)]
    views = [_prefilled(model, p, bits=8) for p in prompts]
    assert all(c.kv_bits == 8 for v in views for c in v)
    together = _forward(model, [3, 4], views)
    alone = [_forward(model, [t], [_prefilled(model, p, bits=8)])[0] for p, t in zip(prompts, (3, 4))]
    assert all(mx.array_equal(a, b).item() for a, b in zip(alone, together))


def test_rowwise_keeps_the_model_as_it_was():
    model = tiny_model("gpt_oss")
    names = [k for k, _ in tree_flatten(model.parameters())]
    cache = make_sequence_cache(model)
    before = model(mx.array([[1, 2, 3]]), cache=cache)
    rowwise(rowwise(model))
    attn = model.layers[0].self_attn
    assert [k for k, _ in tree_flatten(model.parameters())] == names
    assert type(attn).__name__ == "AttentionBlock" and "sinks" in attn
    after = model(mx.array([[1, 2, 3]]), cache=make_sequence_cache(model))  # other caches: as before
    assert mx.array_equal(before, after).item()


def test_other_attention_classes_run_per_sequence():
    """A class outside the standard list takes the module per sequence: the same
    logits as alone, and close to the standard path."""
    model = rowwise(tiny_model("llama"))
    views = [[_prefilled(model, p) for p in ([1, 2, 3], [4, 5])] for _ in range(3)]
    fast = _forward(model, [6, 7], views[0])
    for layer in model.layers:  # as if mlx-lm's class were unknown to the fast path
        layer.self_attn.__class__ = _rowwise_class(type("Custom", (type(layer.self_attn).__mro__[2],), {}))
    slow = _forward(model, [6, 7], views[1])
    alone = _forward(model, [7], views[2][1:])
    assert mx.array_equal(slow[1], alone[0]).item()
    assert all(mx.allclose(a, b, atol=1e-4).item() for a, b in zip(fast, slow))


def test_batch_arguments():
    with pytest.raises(ValueError, match="at least one sequence"):
        BatchQuantizedKVCache([])
    model = rowwise(tiny_model("llama"))
    with pytest.raises(ValueError, match="9 token slots used in a forward of 8"):
        _forward(model, [1] * 8, [_prefilled(model, [2, 3]) for _ in range(9)])
    batch = BatchQuantizedKVCache([SequenceQuantizedKVCache()] * 5)
    out = _per_sequence(lambda x, mask, cache: x + 1, mx.zeros((1, 8, 4)), batch)
    assert out.tolist()[0] == [[1.0] * 4] * 5 + [[0.0] * 4] * 3  # padding slots: zeros


def _kv(n: int, seed: int, H: int = 2, D: int = 64) -> tuple[mx.array, mx.array]:
    """Keys and values of ``n`` random float32 tokens, token 0 an outlier (an attention sink)."""
    k, v = mx.random.normal((2, 1, H, n, D), key=mx.random.key(seed))
    return k * mx.where(mx.arange(n)[:, None] == 0, 30.0, 1.0), v


def _filled(cache, n: int, seed: int, H: int = 2, D: int = 64):
    """``cache`` after ``n`` random float32 tokens."""
    if n:
        cache.update_and_fetch(*_kv(n, seed, H, D))
    return cache


def test_a_block_is_quantized_when_it_fills():
    """Keys per channel along the tokens, values per token, 16-bit scales; the
    open block and the sinks as written; 16 bits never closes a block."""
    k, v = _kv(600, 0)
    cache = SequenceQuantizedKVCache()
    cache.append(k[..., :255, :], v[..., :255, :])
    assert (cache.offset, cache.closed, cache.packed) == (255, 0, None)
    cache.append(k[..., 255:600, :], v[..., 255:600, :])
    assert (cache.offset, cache.closed, cache.trimmable_tokens) == (600, 512, 88)
    kw, ks, kb, vw, vs, vb = (t[..., :512, :] for t in cache.packed)
    assert kw.shape == vw.shape == (1, 2, 512, 64 * 4 // 32) and ks.shape == vs.shape == (1, 2, 512, 1)
    assert ks.dtype == vb.dtype == mx.float16  # a float32 model's scales and biases
    block = (kw[..., 256:512, :].reshape(1, 2, 64, 32), ks[..., 256:512, :].reshape(1, 2, 64, 4),
             kb[..., 256:512, :].reshape(1, 2, 64, 4))  # block 1's keys: (channels, tokens) groups of 64 tokens
    keys, values = cache.floats()
    assert mx.array_equal(keys[..., 256:512, :], _dequantize(block, 64, 4, mx.float32).swapaxes(-1, -2)).item()
    assert mx.array_equal(values[..., 4:512, :], _dequantize((vw, vs, vb), 64, 4, mx.float32)[..., 4:, :]).item()
    assert mx.array_equal(keys[..., :4, :], k[..., :4, :]).item()  # the sinks
    assert mx.array_equal(keys[..., 512:, :], k[..., 512:, :]).item()  # the open block
    assert 0 < mx.abs(keys[..., 4:512, :] - k[..., 4:512, :]).max().item() < 0.5  # the outlier token left out
    full = _filled(SequenceQuantizedKVCache(bits=16), 600, 0)
    assert full.closed == 0 and mx.array_equal(full.floats()[0], k).item()


def test_what_a_token_sees_depends_on_its_position_only():
    """Prefilled in chunks that end anywhere in a block, or decoded a token a step
    through a batch across a block's end: the same records and working copies, bit for bit."""
    k, v = _kv(700, 1)
    whole = SequenceQuantizedKVCache().view()
    for a, b in ((0, 256), (256, 512), (512, 700)):
        whole.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
    pieces = SequenceQuantizedKVCache().view()
    for a, b in ((0, 100), (100, 256), (256, 300), (300, 500)):
        pieces.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
    batch = BatchQuantizedKVCache([pieces])
    for t in range(500, 700):  # rows held and flushed in groups of ROWS: the block closes on either side
        if batch.full:
            batch.flush()
        batch.attend_new(k[..., t : t + 1, :], v[..., t : t + 1, :])
    batch.flush()
    assert (pieces.quantized.offset, pieces.quantized.closed, pieces.synced) == (700, 512, 512)
    for a, b in zip(whole.quantized.floats(), pieces.quantized.floats()):
        assert mx.array_equal(a, b).item()
    fetched = pieces.update_and_fetch(*(x[..., :1, :] for x in _kv(1, 2)))  # a chunk after the decode
    for a, b in zip(whole.quantized.floats(), fetched):
        assert mx.array_equal(a, b[..., :700, :]).item()


def test_rewinding_leaves_what_the_same_tokens_make():
    """Within the open block by trimming, to a block's start by dropping blocks;
    nowhere else (that is reached by prefilling from the block's start)."""
    k, v = _kv(700, 3)
    cache = SequenceQuantizedKVCache()
    cache.append(k, v)
    assert cache.rewind_points() == [256, 512] and cache.can_rewind(600) and not cache.can_rewind(511)
    with pytest.raises(ValueError, match="only within its open block or to a block's start"):
        cache.rewind(300)
    for back in (650, 512, 256, 0):
        cache.rewind(back)
        cache.append(k[..., back:700, :], v[..., back:700, :])
        fresh = SequenceQuantizedKVCache()
        fresh.append(k, v)
        assert all(mx.array_equal(a, b).item() for a, b in zip(cache.floats(), fresh.floats()))
    assert cache.trim(1000) == 188 and cache.offset == 512


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_unpack_is_bit_exact_against_mx_dequantize(bits, group_size, dtype):
    x = (mx.random.normal((2, 3, 17, 128), key=mx.random.key(bits + group_size)) * 3).astype(dtype)
    q = quantize(x, group_size, bits)
    assert mx.array_equal(unpack(q, group_size, bits, dtype), _dequantize(q, group_size, bits, dtype)).item()


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_open_blocks_is_bit_exact_against_mx_dequantize(bits, group_size, dtype):
    """Keys per channel come back in token order, each value what ``mx.dequantize``
    makes of its (channels, tokens) groups."""
    k, v = ((mx.random.normal((1, 3, 512, 128), key=mx.random.key(s)) * 3).astype(dtype) for s in (bits, group_size))
    packed = close_block(k[..., :256, :], v[..., :256, :], group_size, bits, first=False)
    packed = tuple(mx.concatenate([a, b], axis=2) for a, b in
                   zip(packed, close_block(k[..., 256:, :], v[..., 256:, :], group_size, bits, first=False)))
    keys, values = open_blocks(packed, group_size, bits, dtype, 256)
    for i in range(2):
        by_channel = quantize(k[..., 256 * i : 256 * (i + 1), :].swapaxes(-1, -2), group_size, bits)
        want = _dequantize(by_channel, group_size, bits, dtype).swapaxes(-1, -2)
        assert mx.array_equal(keys[..., 256 * i : 256 * (i + 1), :], want).item()
    assert mx.array_equal(values, _dequantize(quantize(v, group_size, bits), group_size, bits, dtype)).item()


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_working_copy_is_opened_in_one_buffer(dtype):
    """``open_blocks`` with sinks, a tail and room (the kernels for float32,
    MLX's ops otherwise): the blocks' floats with the sinks' first, then the
    tail, in ``rows`` rows."""
    k, v = ((mx.random.normal((1, 3, 600, 64), key=mx.random.key(s)) * 3).astype(dtype) for s in (5, 6))
    packed = tuple(mx.concatenate(p, axis=2) for p in zip(*(
        close_block(k[..., a : a + 256, :], v[..., a : a + 256, :], 64, 4, first=a == 0) for a in (0, 256))))
    plain = open_blocks(packed, 64, 4, dtype, 256)
    sinks, tail = (k[..., :4, :], v[..., :4, :]), (k[..., 512:600, :], v[..., 512:600, :])
    got = open_blocks(packed, 64, 4, dtype, 256, sinks, tail, 700)
    for g, p, first, after in zip(got, plain, sinks, tail):
        assert g.shape == (1, 3, 700, 64) and g.dtype == dtype
        assert mx.array_equal(g[..., :600, :], mx.concatenate([first, p[..., 4:, :], after], axis=2)).item()


def test_bfloat16_models_keep_bfloat16_scales():
    model = rowwise(tiny_model("llama"))
    model.set_dtype(mx.bfloat16)
    views = [_prefilled(model, p) for p in (list(range(1, 300)), [4, 5])]
    (logits, _) = _forward(model, [6, 7], views)
    assert logits.dtype == mx.bfloat16 and views[0][0].quantized.packed[1].dtype == mx.bfloat16


def test_nbytes_against_fp16():
    H, T, D = 2, 256, 64
    fp16 = 2 * H * T * D * 2
    for bits, ratio in ((4, (0.5 + 4 / 64) / 2), (8, (1 + 4 / 64) / 2)):
        cache = SequenceQuantizedKVCache(bits=bits)
        cache.append(*(x.astype(mx.float16) for x in _kv(T + 1, 0)))  # the next token closes the block
        closed = sum(t.nbytes for t in cache.packed)
        assert closed / fp16 == pytest.approx(ratio)
        assert cache.nbytes == closed + sum(x.nbytes for x in (*cache.open, *cache.sinks))
        assert DequantizingKVCache(cache).nbytes == cache.nbytes  # the copy is not the record
    assert (0.5 + 4 / 64) / 2 <= 0.30
    assert SequenceQuantizedKVCache().nbytes == 0
    with pytest.raises(ValueError, match="bits"):
        SequenceQuantizedKVCache(bits=3)
    with pytest.raises(ValueError, match="group size"):
        SequenceQuantizedKVCache(group_size=48)


def test_cache_kinds_per_architecture():
    llama, gemma, oss = (tiny_model(a) for a in ("llama", "gemma3_text", "gpt_oss"))
    assert all(type(c) is SequenceQuantizedKVCache for c in make_sequence_cache(llama))
    assert [type(c) for c in make_sequence_cache(gemma)] == [WindowKVCache, SequenceQuantizedKVCache] * 2
    assert [type(c) for c in make_sequence_cache(oss)] == [WindowKVCache, SequenceQuantizedKVCache]
    # Attention reads float working copies of full layers; sliding layers as they are.
    assert [type(c) for c in make_sequence_cache(gemma).view()] == [WindowKVCache, DequantizingKVCache] * 2
    # Neither has ``bits``: mlx-lm would take it for its own quantized cache, which refuses sinks.
    assert not hasattr(DequantizingKVCache(SequenceQuantizedKVCache()), "bits")
    assert not hasattr(SequenceQuantizedKVCache(), "bits") and SequenceQuantizedKVCache().kv_bits == 4
    with pytest.raises(ValueError, match="sinks"):
        oss(mx.array([[1, 2, 3]]), cache=[RotatingKVCache(16), QuantizedKVCache(bits=4)])


def test_fixed_shape_matmul_rows_do_not_depend_on_their_neighbours(smollm2):
    """The one property of the BLAS that batch invariance assumes, checked for every
    weight shape of the embedded model on this machine: in a matmul of fixed shape
    (a decode forward's slots x a weight), a row comes out the same wherever it sits
    and whatever the other rows hold. (Shapes are what BLAS picks kernels by: other
    slot counts, M = 1 among them, give other bits.)"""
    weights = {p.shape: p for _, p in tree_flatten(smollm2.model.parameters()) if p.ndim == 2}
    failures = []
    for shape, w in weights.items():
        x = mx.random.normal((SLOTS, shape[-1]), key=mx.random.key(shape[0]))
        together = x @ w.T
        for row in range(SLOTS):
            alone = mx.zeros_like(x)
            alone[0] = x[row]
            if not mx.array_equal((alone @ w.T)[0], together[row]).item():
                failures.append(f"{shape} row {row}")
    assert not failures, "this BLAS computes a row by its position or neighbours: " + ", ".join(failures)


def test_past_the_float_head_blocks_are_read_packed_from_the_record():
    """A view with a float head of one block holds that block and the open one
    in float, whatever the context; the model's own call (mlx-lm's protocol)
    still gets every key and value as a view with no head gives them, bit for
    bit -- after a rewind to a block's start too. A decode step that starts
    a block past the head needs the rows in the record first."""
    k, v = _kv(1300, 4)
    full, headed = SequenceQuantizedKVCache().view(), SequenceQuantizedKVCache().view(256)
    for a, b in ((0, 100), (100, 256), (256, 512), (512, 700), (700, 768), (768, 1000)):  # a chunk a block
        want = full.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
        got = headed.update_and_fetch(k[..., a:b, :], v[..., a:b, :])
        assert all(mx.array_equal(x, y).item() for x, y in zip(want, got))
    assert (headed.head, headed.synced) == (256, 768) and headed._float[0].shape[2] <= 3 * 256
    for cache in (full, headed):
        cache.rewind(512)
    want = full.update_and_fetch(k[..., 512:600, :], v[..., 512:600, :])
    got = headed.update_and_fetch(k[..., 512:600, :], v[..., 512:600, :])
    assert all(mx.array_equal(x, y).item() for x, y in zip(want, got))
    headed.update_and_fetch(k[..., 600:768, :], v[..., 600:768, :])
    batch = BatchQuantizedKVCache([headed])
    batch.attend_new(k[..., 768:769, :], v[..., 768:769, :])  # the record holds block 2: it closes it
    batch.flush()
    assert headed.quantized.closed == 768
    for t in range(769, 1024):  # 255 steps: 31 of them held at the end
        if batch.full:
            batch.flush()
        batch.attend_new(k[..., t : t + 1, :], v[..., t : t + 1, :])
    with pytest.raises(RuntimeError, match="in the record first"):
        batch.attend_new(k[..., 1024:1025, :], v[..., 1024:1025, :])
