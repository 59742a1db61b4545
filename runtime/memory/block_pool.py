"""Block pool: which owners' KV caches fit in memory at once, counted in blocks.

Three layers, as in vLLM v1 (``block_pool.py`` under
``single_type_kv_cache_manager.py`` under ``kv_cache_manager.py``):

* ``BlockPool``: block ids, free or used. Knows nothing of owners or bytes.
* ``FullAttentionManager`` / ``SlidingWindowManager``: one per layer group;
  maps owners to the ids they hold in that group.
* ``KVBudget``: one manager per layer group over one shared pool, and a
  budget in bytes. Callers see owners, token counts and bytes.

A *layer group* is every layer of one attention kind (and window): "full",
"sliding:512". A block is ``block_tokens`` tokens of one group, all its layers,
keys and values. Blocks of different groups differ in size (Q4 full layers
against full-precision sliding layers, and different layer counts), so the
byte budget, not the number of ids, is the binding limit: the pool holds as
many ids as the budget could fill with the smallest block, and ``KVBudget``
checks bytes before it takes ids.

Nothing here allocates tensor memory: the K/V arrays live in the caches of
``batch_cache.py``. A block id is a share of the budget with a stable name.
"""

from __future__ import annotations

import heapq
import operator
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from ..cache_records import BLOCK_TOKENS
from ..errors import SemanticError
from ..model.model_spec import (  # LayerKind: docstring example
    FULL, RECURRENT, SLIDING, STATE_CHECKPOINTS, WINDOW_SPARE, LayerKind, ModelCacheSpec, kv_bytes_per_token,
)

WORKING = "working"  # the layer group of running sequences' float working copies
OPEN = "open"  # the layer group of full layers' open blocks, in float (``kv.SequenceQuantizedKVCache``)

__all__ = [
    "BlockPool",
    "BlockPoolError",
    "FullAttentionManager",
    "KVBudget",
    "LayerGroup",
    "OpenBlockManager",
    "SlidingWindowManager",
    "StateManager",
    "default_budget",
    "layer_groups",
]

GiB = 1 << 30
Owner = Hashable  # an agent id, in practice


class BlockPoolError(Exception):
    """The pool or budget was misused (a bug in the caller): double free,
    unknown block id, unknown owner."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockPool:
    """Block ids ``0 .. num_blocks - 1``, each free or used.

    ``allocate`` hands out the lowest free ids (a heap), not vLLM's FIFO free
    queue: with no prefix caching there is nothing to gain from keeping freed
    blocks around longest, and lowest-first makes the ids a function of which
    blocks are free rather than of history, so tests can predict them.

    Not thread-safe: one owner (the ``KVBudget`` above it) calls it, and no
    method awaits, so no caller ever sees a half-done change.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a block pool needs at least one block, not {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks))  # a heap (a sorted list is one)
        self._is_free = bytearray(b"\x01") * num_blocks  # catches double frees in O(1)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """The ``n`` lowest free ids, ascending, or ``None`` (and nothing taken)
        when fewer than ``n`` are free. Raises ``BlockPoolError`` for ``n < 0``."""
        if n < 0:
            raise BlockPoolError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            return None
        ids = [heapq.heappop(self._free) for _ in range(n)]
        for b in ids:
            assert self._is_free[b], f"block {b} was in the free heap while used: free() let a double free through"
            self._is_free[b] = 0
        return ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Return used blocks to the pool. All or nothing: raises
        ``BlockPoolError`` (and frees none) if any id is unknown or already free."""
        ids = list(block_ids)
        seen = set()
        for b in ids:
            if not 0 <= b < self.num_blocks:
                raise BlockPoolError(f"block {b} is not in this pool (ids 0..{self.num_blocks - 1})")
            if self._is_free[b] or b in seen:
                raise BlockPoolError(f"block {b} is already free (double free)")
            seen.add(b)
        for b in ids:
            self._is_free[b] = 1
            heapq.heappush(self._free, b)


@dataclass(frozen=True)
class LayerGroup:
    name: str  # "full", "sliding:<window>" or "recurrent"
    kind: str  # FULL, SLIDING or RECURRENT
    window: int | None  # tokens a sliding layer keeps
    n_layers: int
    block_bytes: int  # one block: block_tokens tokens x n_layers layers, keys + values (recurrent: the whole state)


def layer_groups(
    spec: ModelCacheSpec,
    *,
    block_tokens: int = BLOCK_TOKENS,
    bits: int = 4,
    group_size: int = 64,
    sliding_dtype_bytes: int = 2,
) -> tuple[LayerGroup, ...]:
    """The layer groups of ``spec``: "full" first, then one sliding group per
    window, smallest window first, then "recurrent".

    Full layers store ``bits``-bit K/V with 16-bit scales and biases per
    ``group_size`` elements, and their open block (the newest tokens, up to a
    block) in float: the "open" group, one block an owner; at 16 bits they
    store floats only. Sliding layers store ``sliding_dtype_bytes`` per
    element (the model's float: 2 for fp16/bf16, 4 for float32), since their
    window already bounds them, and so do recurrent states and open blocks.
    Raises ``ValueError`` for settings the quantized cache cannot use.
    """
    if block_tokens < 1:
        raise ValueError(f"block_tokens must be positive, not {block_tokens}")
    if bits not in (4, 8, 16):
        raise ValueError(f"KV cache bits must be 4, 8 or 16, not {bits}")
    widths = {spec.head_dim, spec.v_head_dim or spec.head_dim}
    if group_size not in (32, 64, 128) or any(w % group_size for w in widths):
        raise ValueError(f"KV group size must be 32, 64 or 128 and divide head dim {spec.head_dim}"
                         f"{f' and value dim {spec.v_head_dim}' if spec.v_head_dim else ''}, not {group_size}")
    if sliding_dtype_bytes not in (2, 4):
        raise ValueError(f"sliding_dtype_bytes must be 2 (fp16/bf16) or 4 (float32), not {sliding_dtype_bytes}")
    groups = []
    per_token = spec.n_kv_heads * spec.kv_width * sliding_dtype_bytes  # keys + values, unquantized
    if spec.n_full and bits == 16:
        groups.append(LayerGroup(FULL, FULL, None, spec.n_full, per_token * block_tokens * spec.n_full))
    elif spec.n_full:
        quantized = kv_bytes_per_token(spec.n_kv_heads, spec.head_dim, bits, group_size, spec.v_head_dim)
        groups.append(LayerGroup(FULL, FULL, None, spec.n_full, round(quantized * block_tokens * spec.n_full)))
        groups.append(LayerGroup(OPEN, FULL, None, spec.n_full, per_token * block_tokens * spec.n_full))
    for w in sorted({k.window for k in spec.layers if k.kind == SLIDING}):
        n = sum(1 for k in spec.layers if k.kind == SLIDING and k.window == w)
        groups.append(LayerGroup(f"{SLIDING}:{w}", SLIDING, w, n, per_token * block_tokens * n))
    if spec.n_recurrent:  # one "block" is a sequence's whole state, whatever its length
        groups.append(LayerGroup(RECURRENT, RECURRENT, None, spec.n_recurrent, spec.state_bytes(sliding_dtype_bytes)))
    assert groups, "a ModelCacheSpec with no layers: from_model should have refused the model"
    return tuple(groups)


class FullAttentionManager:
    """Owner -> block ids of one layer group, taken from a shared pool.

    An owner of ``t`` tokens holds ``ceil(t / block_tokens)`` blocks. Sole
    writer of its table; ``KVBudget`` decides whether growth fits and only
    then calls ``grow``.
    """

    def __init__(self, group: LayerGroup, pool: BlockPool, block_tokens: int):
        self.group = group
        self.pool = pool
        self.block_tokens = block_tokens
        self._blocks: dict[Owner, list[int]] = {}
        self.num_blocks = 0  # held by all owners together

    def blocks_for(self, tokens: int) -> int:
        """Blocks an owner of ``tokens`` tokens holds in this group."""
        return _cdiv(tokens, self.block_tokens)

    def missing(self, owner: Owner, tokens: int) -> int:
        """Blocks ``owner`` lacks to cover ``tokens`` (never negative: no shrinking)."""
        return max(0, self.blocks_for(tokens) - len(self._blocks.get(owner, ())))

    def grow(self, owner: Owner, tokens: int) -> list[int] | None:
        """Take the blocks ``owner`` lacks; their ids, or ``None`` (owner
        unchanged) when the pool is short."""
        new = self.pool.allocate(self.missing(owner, tokens))
        if new is not None:
            self._blocks.setdefault(owner, []).extend(new)
            self.num_blocks += len(new)
        return new

    def free(self, owner: Owner) -> None:
        blocks = self._blocks.pop(owner, [])
        self.pool.free(blocks)
        self.num_blocks -= len(blocks)

    def blocks_of(self, owner: Owner) -> list[int]:
        return list(self._blocks.get(owner, ()))


class SlidingWindowManager(FullAttentionManager):
    """A full-attention manager whose owners stop growing at the window.

    A sliding layer's cache (``kv.WindowKVCache``) keeps the last
    ``window + WINDOW_SPARE`` tokens at most, so they occupy that many tokens'
    blocks wherever the window starts (vLLM keeps one block more because its
    blocks are position-aligned). A prefill chunk briefly overfills it; that
    transient is activation headroom.
    """

    def blocks_for(self, tokens: int) -> int:
        return min(_cdiv(tokens, self.block_tokens), _cdiv(self.group.window + WINDOW_SPARE, self.block_tokens))


class OpenBlockManager(FullAttentionManager):
    """Full layers' open blocks: one float block an owner, from its first token on
    (its quantized share is in the "full" group: a block's worth is counted twice)."""

    def blocks_for(self, tokens: int) -> int:
        return min(tokens, 1)


class WorkingCopyManager(FullAttentionManager):
    """Running owners' float working copies of their full layers: every token up
    to the float head (``kv.DequantizingKVCache``; None: no head, all), and
    after it the open block (two blocks: it may run a step's tokens past its
    end before it closes); blocks past the head are read packed from the
    record, counted in the "full" group."""

    def __init__(self, group: LayerGroup, pool: BlockPool, block_tokens: int, head: int | None):
        super().__init__(group, pool, block_tokens)
        self.head = head

    def blocks_for(self, tokens: int) -> int:
        every = _cdiv(tokens, self.block_tokens)
        return every if self.head is None else min(every, _cdiv(self.head, self.block_tokens) + 2)


class StateManager(FullAttentionManager):
    """Recurrent layers: an owner's state is one block of fixed size, and each
    of its checkpoints another (``kv.StateCache``), held from its
    first token on, however long it grows."""

    def blocks_for(self, tokens: int) -> int:
        return (1 + STATE_CHECKPOINTS) * min(tokens, 1)


class KVBudget:
    """Owners' hot KV caches, counted in blocks, within ``budget_bytes``.

    ``reserve(owner, tokens)`` grows an owner to cover ``tokens`` in every layer
    group, all or nothing; ``False`` means it does not fit now: the caller
    demotes another owner (``release``) and retries. ``fits(tokens)`` says
    whether retrying can ever succeed. Raises ``ValueError`` when the budget
    cannot hold one block per layer group, or for unusable cache settings.

    Worked example, a Gemma 3 12B-like model (8 full + 40 sliding layers with a
    512-token window, 4 KV heads, head dim 256) and a 1 GiB budget::

        full block    = 256 tokens x 8 layers  x 2 x 4 x 256 x 0.5625 B (Q4) = 2.25 MiB
        open block    = 256 tokens x 8 layers  x 2 x 4 x 256 x 2 B (fp16)   = 8 MiB, one an owner
        sliding block = 256 tokens x 40 layers x 2 x 4 x 256 x 2 B (fp16)   = 40 MiB

        >>> layers = tuple(LayerKind(FULL) if i % 6 == 5 else LayerKind(SLIDING, 512) for i in range(48))
        >>> kv = KVBudget(ModelCacheSpec("gemma3_text", 48, 4, 256, layers, False), budget_bytes=GiB)
        >>> [(g.name, g.n_layers, g.block_bytes / 2**20) for g in kv.groups]
        [('full', 8, 2.25), ('open', 8, 8.0), ('sliding:512', 40, 40.0)]
        >>> kv.bytes_for(1000) / 2**20  # 4 full blocks + the open one + 3 sliding blocks
        137.0
        >>> kv.bytes_for(10_000) / 2**20  # 40 full blocks; window + spare (768) cap the sliding ones at 3
        218.0
        >>> kv.reserve("a", 1000), kv.blocks_of("a")
        (True, {'full': [0, 1, 2, 3], 'open': [4], 'sliding:512': [5, 6, 7]})
        >>> kv.reserve("a", 1200), kv.blocks_of("a")  # one more full block, no more sliding
        (True, {'full': [0, 1, 2, 3, 8], 'open': [4], 'sliding:512': [5, 6, 7]})
        >>> sum(kv.reserve(f"b{i}", 1000) for i in range(20))  # 6 more fit: 7 owners in 1 GiB
        6
        >>> kv.fits(100_000), kv.fits(200_000)  # 200k tokens need 782 full blocks: never fits
        (True, False)

    Sliding layers dominate short contexts; only full layers grow with context.
    Not thread-safe: one actor owns it (no method awaits, so none is seen half-done).
    """

    def __init__(
        self,
        spec: ModelCacheSpec,
        budget_bytes: int,
        *,
        block_tokens: int = BLOCK_TOKENS,
        bits: int = 4,
        group_size: int = 64,
        sliding_dtype_bytes: int = 2,
        working_dtype_bytes: int = 0,
        working_head: int | None = None,
    ):
        self.spec = spec
        self.block_tokens = block_tokens
        self.budget_bytes = budget_bytes = operator.index(budget_bytes)  # TypeError for a float
        self.groups = layer_groups(
            spec, block_tokens=block_tokens, bits=bits, group_size=group_size, sliding_dtype_bytes=sliding_dtype_bytes
        )
        one_token = sum(g.block_bytes for g in self.groups)  # one block in every group
        if budget_bytes < one_token:
            raise ValueError(
                f"a KV budget of {budget_bytes} B cannot hold one block per layer group "
                f"({one_token} B for {spec.model_type}); raise the budget"
            )
        # Enough ids for the budget filled with the smallest block; bytes bind first.
        self.pool = BlockPool(budget_bytes // min(g.block_bytes for g in self.groups))
        managers = {SLIDING: SlidingWindowManager, RECURRENT: StateManager}
        self._managers = [(OpenBlockManager if g.name == OPEN else managers.get(g.kind, FullAttentionManager))(
            g, self.pool, block_tokens) for g in self.groups]
        # A running sequence holds a float working copy of its full layers' first
        # ``working_head`` tokens (None: all) and its open block, while it runs.
        self._working = None
        if working_dtype_bytes and spec.n_full:
            per_token = spec.n_kv_heads * spec.kv_width * working_dtype_bytes * spec.n_full
            group = LayerGroup(WORKING, FULL, None, spec.n_full, per_token * block_tokens)
            self._working = WorkingCopyManager(group, self.pool, block_tokens, working_head)
        self._tokens: dict[Owner, int] = {}  # reservation order = owners() order

    # -- owners

    def reserve(self, owner: Owner, tokens: int, running: bool = False) -> bool:
        """Grow ``owner`` (registering it if new) to cover ``tokens`` tokens --
        and, when ``running``, its float working copy of them.

        ``True`` when it now does (a smaller ``tokens`` than held is a no-op:
        reservations never shrink; ``release`` does). ``False``, with nothing
        changed, when the growth does not fit in the free bytes.
        Raises ``ValueError`` for negative ``tokens``.
        """
        if tokens < 0:
            raise ValueError(f"tokens must be non-negative, not {tokens}")
        managers = self._managers_for(running)
        need = sum(m.missing(owner, tokens) * m.group.block_bytes for m in managers)
        if need > self.free_bytes:
            return False
        for m in managers:
            got = m.grow(owner, tokens)
            assert got is not None, "bytes fit but ids ran out: the pool is smaller than budget // smallest block"
        self._tokens[owner] = max(tokens, self._tokens.get(owner, 0))
        return True

    def _managers_for(self, running: bool) -> list[FullAttentionManager]:
        return self._managers + [self._working] if running and self._working else self._managers

    def release(self, owner: Owner) -> None:
        """Free all of ``owner``'s blocks. Raises ``BlockPoolError`` if it holds
        no reservation (released twice, or never reserved)."""
        self._check(owner)
        for m in self._managers_for(running=True):
            m.free(owner)
        del self._tokens[owner]

    def owners(self) -> list[Owner]:
        """Owners holding a reservation, in the order they first reserved."""
        return list(self._tokens)

    def __contains__(self, owner: Owner) -> bool:
        return owner in self._tokens

    def tokens_of(self, owner: Owner) -> int:
        self._check(owner)
        return self._tokens[owner]

    def blocks_of(self, owner: Owner) -> dict[str, list[int]]:
        """Block ids per layer group name (copies); "working" while it runs with a working copy."""
        self._check(owner)
        blocks = {m.group.name: m.blocks_of(owner) for m in self._managers}
        if self._working and (working := self._working.blocks_of(owner)):
            blocks[WORKING] = working
        return blocks

    def bytes_of(self, owner: Owner) -> int:
        self._check(owner)
        return sum(len(m.blocks_of(owner)) * m.group.block_bytes for m in self._managers_for(True))

    def _check(self, owner: Owner) -> None:
        if owner not in self._tokens:
            raise BlockPoolError(f"owner {owner!r} holds no reservation")

    # -- totals

    @property
    def used_bytes(self) -> int:
        managers = self._managers_for(True)
        assert self.pool.num_used == sum(m.num_blocks for m in managers), (
            "pool and managers disagree on used blocks: a manager leaked or double-counted blocks"
        )
        return sum(m.num_blocks * m.group.block_bytes for m in managers)

    @property
    def free_bytes(self) -> int:
        return self.budget_bytes - self.used_bytes

    def bytes_for(self, tokens: int, running: bool = False) -> int:
        """What an owner of ``tokens`` tokens costs (``running``: with its working copy)."""
        return sum(m.blocks_for(tokens) * m.group.block_bytes for m in self._managers_for(running))

    def fits(self, tokens: int, running: bool = False) -> bool:
        """Could a new owner of ``tokens`` tokens fit with every other owner released?"""
        return self.bytes_for(tokens, running) <= self.budget_bytes


def default_budget(
    spec: ModelCacheSpec,
    weights_bytes: int,
    device_memory_bytes: int,
    headroom: int | None = None,
    *,
    block_tokens: int = BLOCK_TOKENS,
    bits: int = 4,
    group_size: int = 64,
    sliding_dtype_bytes: int = 2,
) -> int:
    """Bytes left for hot KV caches: device memory - model weights - headroom.

    ``headroom`` defaults to ``max(1 GiB, device memory // 10)``: prefill
    activations, the transient dequantized K/V of a batch, a prefill chunk
    overfilling a sliding window, and whatever else the process holds.
    ``device_memory_bytes`` is what the accelerator may use (on Metal, the
    recommended working set rather than all of RAM).

    Raises ``SemanticError`` when what is left cannot hold even one block per
    layer group (so the result is never negative and always a valid
    ``KVBudget``), ``ValueError`` for negative inputs.
    """
    if min(weights_bytes, device_memory_bytes) < 0 or (headroom is not None and headroom < 0):
        raise ValueError("memory sizes must be non-negative")
    if headroom is None:
        headroom = max(GiB, device_memory_bytes // 10)
    left = device_memory_bytes - weights_bytes - headroom
    groups = layer_groups(
        spec, block_tokens=block_tokens, bits=bits, group_size=group_size, sliding_dtype_bytes=sliding_dtype_bytes
    )
    need = sum(g.block_bytes for g in groups)
    if left < need:
        raise SemanticError(
            f"no memory left for KV caches: {_size(device_memory_bytes)} of device memory less "
            f"{_size(weights_bytes)} of {spec.model_type} weights and {_size(headroom)} of headroom "
            f"leaves {_size(max(left, 0))}, and one block per layer group needs {_size(need)}; "
            f"use a smaller model or a machine with more memory"
        )
    return left


def _size(n: int) -> str:
    return f"{n / GiB:.1f} GiB" if n >= GiB else f"{n / 2**20:.1f} MiB"
