"""Block pool, per-group managers and KVBudget: exact block ids after each
step (as vLLM's tests/v1/core/test_prefix_caching.py asserts them), bytes per
block for published model shapes, the budget arithmetic."""

import doctest
import random

import pytest

from semantic.runtime.memory import block_pool
from semantic.runtime.memory.block_pool import GiB, BlockPool, BlockPoolError, KVBudget, default_budget, layer_groups
from semantic.runtime.errors import SemanticError
from semantic.runtime.model.model_spec import ModelCacheSpec, build_model
from tests.runtime.test_model_spec import GEMMA3_12B, GPT_OSS_20B, SMOLLM2_135M

SMOL = ModelCacheSpec.from_model(build_model(SMOLLM2_135M))  # 30 full, 3 KV heads, head dim 64
GEMMA = ModelCacheSpec.from_model(build_model(GEMMA3_12B))  # 8 full + 40 sliding(512), 4 x 256
GPT_OSS = ModelCacheSpec.from_model(build_model(GPT_OSS_20B))  # 12 full + 12 sliding(128), 8 x 64

Q4 = 0.5 + 4 / 64  # bytes per element: 4-bit values, fp16 scale and bias per 64
SMOL_BLOCK = int(256 * 30 * 2 * 3 * 64 * Q4)  # exact: 1_658_880
SMOL_OPEN = 256 * 30 * 2 * 3 * 64 * 2  # the open block: fp16, one an owner
GEMMA_FULL, GEMMA_SLIDING = int(256 * 8 * 2 * 4 * 256 * Q4), 256 * 40 * 2 * 4 * 256 * 2
GEMMA_OPEN = 256 * 8 * 2 * 4 * 256 * 2


def test_worked_example_in_docstring_holds():
    assert doctest.testmod(block_pool).failed == 0


# -- BlockPool


def test_pool_hands_out_lowest_free_ids_and_reuses_freed_ones():
    pool = BlockPool(8)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) == [3, 4]
    pool.free([1, 3])
    assert (pool.num_free, pool.num_used) == (5, 3)
    assert pool.allocate(3) == [1, 3, 5]  # lowest first, not the order freed
    pool.free([5, 0])
    assert pool.allocate(1) == [0]
    assert pool.allocate(0) == []
    assert pool.allocate(3) == [5, 6, 7]
    assert (pool.num_free, pool.allocate(1)) == (0, None)


def test_pool_is_all_or_nothing():
    pool = BlockPool(4)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(2) is None
    assert (pool.num_free, pool.num_used) == (1, 3)  # the refusal took nothing
    assert pool.allocate(1) == [3]
    assert pool.allocate(1) is None
    pool.free([2, 0])
    assert pool.allocate(2) == [0, 2]


def test_pool_misuse_raises_and_changes_nothing():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    with pytest.raises(BlockPoolError, match="block 4 is not in this pool"):
        pool.free([4])
    with pytest.raises(BlockPoolError, match="block -1 is not in this pool"):
        pool.free([-1])
    with pytest.raises(BlockPoolError, match=r"block 2 is already free \(double free\)"):
        pool.free([2])
    with pytest.raises(BlockPoolError, match=r"block 1 is already free \(double free\)"):
        pool.free([1, 1])
    with pytest.raises(BlockPoolError, match="block 9 is not in this pool"):
        pool.free([0, 9])  # a bad id anywhere frees nothing
    assert pool.num_used == 2
    pool.free([0])
    with pytest.raises(BlockPoolError, match="double free"):
        pool.free([0])
    with pytest.raises(BlockPoolError, match="negative"):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


# -- layer groups and bytes


def test_bytes_per_block_smollm2():
    full, open_block = layer_groups(SMOL)
    assert (full.name, full.n_layers, full.block_bytes) == ("full", 30, SMOL_BLOCK) == ("full", 30, 1_658_880)
    assert full.block_bytes == SMOL.bytes_per_token(4) * 256  # agrees with ModelCacheSpec
    assert (open_block.name, open_block.block_bytes) == ("open", SMOL_OPEN)
    assert layer_groups(SMOL, sliding_dtype_bytes=4)[1].block_bytes == 2 * SMOL_OPEN  # float32 on CPU
    (floats,) = layer_groups(SMOL, bits=16)  # nothing quantized: no open block apart
    assert (floats.name, floats.block_bytes) == ("full", SMOL_OPEN)


def test_bytes_per_block_gemma3_12b():
    full, open_block, sliding = layer_groups(GEMMA)
    assert (full.name, full.n_layers, full.block_bytes) == ("full", 8, GEMMA_FULL) == ("full", 8, 2_359_296)
    assert open_block.block_bytes == GEMMA_OPEN
    assert (sliding.name, sliding.window, sliding.n_layers) == ("sliding:512", 512, 40)
    assert sliding.block_bytes == GEMMA_SLIDING == 40 * 2**20  # fp16
    assert layer_groups(GEMMA, sliding_dtype_bytes=4)[2].block_bytes == 80 * 2**20  # float32 on CPU
    assert layer_groups(GEMMA, bits=8)[0].block_bytes == 256 * 8 * 2 * 4 * 256 * (1 + 4 / 64)


def test_bytes_per_block_gpt_oss_20b():
    full, open_block, sliding = layer_groups(GPT_OSS)
    assert (full.name, full.n_layers, full.block_bytes) == ("full", 12, 256 * 12 * 2 * 8 * 64 * Q4)
    assert (sliding.name, sliding.n_layers, sliding.block_bytes) == ("sliding:128", 12, 256 * 12 * 2 * 8 * 64 * 2)
    kv = KVBudget(GPT_OSS, GiB)
    assert kv.bytes_for(10_000) == \
        40 * full.block_bytes + open_block.block_bytes + 2 * sliding.block_bytes  # window 128 + 256 spare


def test_bad_cache_settings_are_refused_when_built():
    with pytest.raises(ValueError, match="bits must be 4, 8 or 16"):
        KVBudget(SMOL, GiB, bits=3)
    with pytest.raises(ValueError, match="divide head dim 64"):
        KVBudget(SMOL, GiB, group_size=128)
    with pytest.raises(ValueError, match="sliding_dtype_bytes"):
        KVBudget(GEMMA, GiB, sliding_dtype_bytes=1)
    with pytest.raises(ValueError, match="block_tokens must be positive"):
        KVBudget(SMOL, GiB, block_tokens=0)
    with pytest.raises(TypeError):
        KVBudget(SMOL, 1.5 * GiB)  # bytes are whole


# -- managers under KVBudget


def test_sliding_group_stops_at_the_window_and_its_spare():
    kv = KVBudget(GEMMA, GiB)
    assert kv.reserve("a", 1)
    assert kv.blocks_of("a") == {"full": [0], "open": [1], "sliding:512": [2]}
    assert kv.reserve("a", 300)
    assert kv.blocks_of("a") == {"full": [0, 3], "open": [1], "sliding:512": [2, 4]}
    assert kv.reserve("a", 600)
    assert kv.blocks_of("a") == {"full": [0, 3, 5], "open": [1], "sliding:512": [2, 4, 6]}
    assert kv.reserve("a", 5000)  # 20 blocks of context; the window and 256 spare tokens need 3
    assert kv.blocks_of("a") == {"full": [0, 3, 5, *range(7, 24)], "open": [1], "sliding:512": [2, 4, 6]}
    assert kv.bytes_of("a") == 20 * GEMMA_FULL + GEMMA_OPEN + 3 * GEMMA_SLIDING
    assert kv.bytes_for(10**5) - kv.bytes_for(10**4) == (391 - 40) * GEMMA_FULL  # only full layers grow


def test_reserve_grows_and_release_frees():
    one = SMOL_BLOCK + SMOL_OPEN  # an owner's first block, with its open block
    kv = KVBudget(SMOL, 3 * one + 4 * SMOL_BLOCK)
    assert kv.reserve("a", 256) and kv.blocks_of("a") == {"full": [0], "open": [1]}
    assert kv.reserve("b", 600) and kv.blocks_of("b") == {"full": [2, 3, 4], "open": [5]}
    assert kv.reserve("a", 257) and kv.blocks_of("a") == {"full": [0, 6], "open": [1]}
    assert kv.reserve("a", 100)  # reservations never shrink
    assert (kv.tokens_of("a"), kv.blocks_of("a")) == (257, {"full": [0, 6], "open": [1]})
    assert kv.used_bytes == 2 * one + 3 * SMOL_BLOCK and kv.free_bytes == one + SMOL_BLOCK
    kv.release("b")
    assert "b" not in kv and kv.owners() == ["a"]
    assert kv.reserve("c", 700) and kv.blocks_of("c") == {"full": [2, 3, 4], "open": [5]}
    assert kv.reserve("d", 0) and kv.blocks_of("d") == {"full": [], "open": []}  # registered, holds nothing
    assert kv.owners() == ["a", "c", "d"]
    assert [kv.bytes_of(o) for o in kv.owners()] == [one + SMOL_BLOCK, one + 2 * SMOL_BLOCK, 0]
    assert kv.used_bytes == 2 * one + 3 * SMOL_BLOCK
    for o in kv.owners():
        kv.release(o)
    assert (kv.used_bytes, kv.pool.num_used, kv.owners()) == (0, 0, [])


def test_a_running_owner_also_holds_its_float_working_copy():
    """A running sequence attends through a float32 copy of its full layers: 7.1x
    its Q4 blocks for SmolLM2, held while it runs, freed after."""
    working_block = 256 * 30 * 2 * 3 * 64 * 4  # float32 keys and values
    kv = KVBudget(SMOL, GiB, working_dtype_bytes=4)
    assert kv.bytes_for(300, running=True) == 2 * (SMOL_BLOCK + working_block) + SMOL_OPEN
    assert kv.reserve("a", 300, running=True)
    assert kv.used_bytes == kv.bytes_of("a") == 2 * (SMOL_BLOCK + working_block) + SMOL_OPEN
    assert set(kv.blocks_of("a")) == {"full", "open", "working"}
    kv.release("a")  # the turn ends: checked back in at its size, idle
    assert kv.reserve("a", 300) and kv.used_bytes == 2 * SMOL_BLOCK + SMOL_OPEN
    assert set(kv.blocks_of("a")) == {"full", "open"}
    tight = KVBudget(SMOL, SMOL_BLOCK + SMOL_OPEN + working_block, working_dtype_bytes=4)
    assert tight.fits(256, running=True) and not tight.fits(257, running=True) and tight.fits(256 * 8)


def test_a_running_owners_working_copy_stops_at_its_float_head():
    """Past the float head a running sequence reads its closed blocks packed:
    its working copy holds the head and two blocks (the open one, and a
    step's tokens past its end), however long the context."""
    working_block = 256 * 30 * 2 * 3 * 64 * 4
    kv = KVBudget(SMOL, 4 * GiB, working_dtype_bytes=4, working_head=4096)
    assert kv.bytes_for(1000, running=True) == 4 * (SMOL_BLOCK + working_block) + SMOL_OPEN
    for tokens in (32_768, 65_536):
        assert kv.bytes_for(tokens, running=True) == tokens // 256 * SMOL_BLOCK + SMOL_OPEN + 18 * working_block


def test_budget_for_exactly_three_owners_refuses_a_fourth():
    n = 1000  # 4 full + the open + 3 sliding blocks each
    kv = KVBudget(GEMMA, 3 * (4 * GEMMA_FULL + GEMMA_OPEN + 3 * GEMMA_SLIDING))
    assert kv.bytes_for(n) == 4 * GEMMA_FULL + GEMMA_OPEN + 3 * GEMMA_SLIDING
    assert all(kv.reserve(o, n) for o in "abc")
    assert kv.blocks_of("c") == {"full": [16, 17, 18, 19], "open": [20], "sliding:512": [21, 22, 23]}
    assert kv.free_bytes == 0
    assert not kv.reserve("d", n)
    assert kv.reserve("a", 1024)  # within its 4 blocks: no bytes needed
    assert not kv.reserve("a", 1025)  # a 5th block is refused the same way
    assert ("d" not in kv, kv.tokens_of("a"), kv.pool.num_used) == (True, 1024, 24)  # refusals took nothing
    kv.release("b")  # the caller demotes someone and retries
    assert kv.reserve("d", n)
    assert kv.blocks_of("d") == {"full": [8, 9, 10, 11], "open": [12], "sliding:512": [13, 14, 15]}
    assert kv.owners() == ["a", "c", "d"]


def test_growth_that_fits_one_group_but_not_the_other_takes_nothing():
    kv = KVBudget(GEMMA, 3 * GEMMA_FULL + GEMMA_OPEN + GEMMA_SLIDING)  # room for 3 full blocks, 1 sliding
    assert kv.reserve("a", 256) and kv.free_bytes == 2 * GEMMA_FULL
    assert not kv.reserve("a", 257)  # 1 full block would fit, its sliding block would not
    assert (kv.blocks_of("a"), kv.pool.num_used) == ({"full": [0], "open": [1], "sliding:512": [2]}, 3)


def test_fits_is_about_an_empty_budget():
    budget = 3 * (4 * GEMMA_FULL + GEMMA_OPEN + 3 * GEMMA_SLIDING)
    kv = KVBudget(GEMMA, budget)
    most = (budget - GEMMA_OPEN - 3 * GEMMA_SLIDING) // GEMMA_FULL  # beside the open block, a window and its spare
    assert kv.fits(most * 256) and not kv.fits(most * 256 + 1)
    assert all(kv.reserve(o, 1000) for o in "abc")
    assert kv.fits(1000) and not kv.reserve("d", 1000)  # fits after demotions, not now


def test_budget_below_one_block_per_group_is_refused_when_built():
    with pytest.raises(ValueError, match="cannot hold one block per layer group"):
        KVBudget(GEMMA, GEMMA_FULL + GEMMA_OPEN + GEMMA_SLIDING - 1)
    kv = KVBudget(GEMMA, GEMMA_FULL + GEMMA_OPEN + GEMMA_SLIDING)  # exactly one owner of one block
    assert kv.reserve("a", 256) and not kv.reserve("a", 257)


def test_owner_misuse_raises():
    kv = KVBudget(SMOL, GiB)
    with pytest.raises(BlockPoolError, match="owner 'x' holds no reservation"):
        kv.release("x")
    kv.reserve("a", 10)
    kv.release("a")
    with pytest.raises(BlockPoolError, match="owner 'a' holds no reservation"):
        kv.release("a")  # released twice
    for query in (kv.tokens_of, kv.blocks_of, kv.bytes_of):
        with pytest.raises(BlockPoolError, match="holds no reservation"):
            query("a")
    with pytest.raises(ValueError, match="non-negative"):
        kv.reserve("a", -1)


def test_random_reserves_and_releases_keep_the_books():
    rng = random.Random(0)
    kv = KVBudget(GPT_OSS, 64 * 2**20)
    for _ in range(2000):
        owner = rng.randrange(8)
        if owner in kv and rng.random() < 0.3:
            kv.release(owner)
        else:
            before = kv.bytes_of(owner) if owner in kv else 0
            ok = kv.reserve(owner, rng.randrange(4000))
            assert ok or (kv.bytes_of(owner) if owner in kv else 0) == before
        ids = [b for o in kv.owners() for g in kv.blocks_of(o).values() for b in g]
        assert len(ids) == len(set(ids)) == kv.pool.num_used
        assert kv.used_bytes == sum(kv.bytes_of(o) for o in kv.owners()) <= kv.budget_bytes


# -- default_budget


def test_default_budget_subtracts_weights_and_headroom():
    weights = 6 * GiB + GiB // 2
    assert default_budget(GEMMA, weights, 24 * GiB) == 24 * GiB - weights - 24 * GiB // 10  # 10% > 1 GiB
    assert default_budget(SMOL, 270 * 2**20, 8 * GiB) == 8 * GiB - 270 * 2**20 - GiB  # 1 GiB > 10%
    assert default_budget(SMOL, GiB, 4 * GiB, headroom=0) == 3 * GiB
    budget = default_budget(GEMMA, weights, 16 * GiB)
    assert KVBudget(GEMMA, budget).fits(1)  # the result is always a usable budget


def test_default_budget_with_nothing_left_says_so():
    with pytest.raises(SemanticError, match="no memory left for KV caches: 8.0 GiB of device memory less 7.5 GiB"):
        default_budget(GEMMA, 7 * GiB + GiB // 2, 8 * GiB)
    one_token = GEMMA_FULL + GEMMA_OPEN + GEMMA_SLIDING
    with pytest.raises(SemanticError, match="one block per layer group needs"):
        default_budget(GEMMA, 4 * GiB - one_token + 1, 5 * GiB)  # positive, below one block each
    assert default_budget(GEMMA, 4 * GiB - one_token, 5 * GiB) == one_token
    with pytest.raises(ValueError, match="non-negative"):
        default_budget(GEMMA, -1, 8 * GiB)
