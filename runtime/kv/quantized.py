"""Full attention layers: the cache of record (``SequenceQuantizedKVCache``),
blocks of 256 tokens quantized as each fills (a running sequence attends
over it through ``kv.working_copy``).

**What a token sees.** A token attends over the blocks before its own
quantized (4 or 8 bits: keys per channel, values per token, 16-bit scales
and biases) and over its own block -- the open one, up to itself -- in the
floats the model computed; the first ``SINKS`` tokens stay in float too.
The newest tokens, which attention leans on most, are never rounded, and a
key channel's outliers stay in its own scale. Once a block is full it is
quantized and never changes; a sequence's cache depends on its own tokens
only (batch invariance), not on how they were cut into forwards: a chunk
that crosses a block's end attends a piece a block (``pieces``).

**Exact under rewinds.** What a token sees is a function of its position
alone, and so is what the cache holds after ``t`` tokens: the blocks before
the one token ``t`` falls in, closed (a full block is closed when the next
token comes), the rest in float. So it can go back within its open block
(trimming) or to any closed block's start (dropping the blocks after it); a
point inside a closed block is reached from that block's start by
prefilling the tokens again (``rewind_points``).

16 bits (``--kv-bits 16``) never closes a block: everything stays as the
model computed it, the full-precision reference.
"""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from ..model.attention import PackedPast
from ..cache_records import BLOCK_TOKENS, FLOATS, SINKS
from .kinds import register
from .quantize import Packed, check_format, close_block, grown, open_blocks
from .working_copy import DequantizingKVCache

__all__ = ["SequenceQuantizedKVCache"]

OPEN_STEP = 64  # rows an open block's float buffer grows by (a divisor of BLOCK_TOKENS)
QUANTIZED = "quantized"
# Its tensors: a closed block's rows, in file order; the open block's floats; the sinks'.
PACKED = ("k_weights", "k_scales", "k_biases", "v_weights", "v_scales", "v_biases")
OPEN = ("k", "v")
SINK = ("k_sinks", "v_sinks")


@register
class SequenceQuantizedKVCache(_BaseCache):
    """One sequence's full-attention layer: ``closed`` tokens in quantized
    blocks (``packed``, rows as ``close_block`` lays them out), the rest in
    float (``open``), and the sinks' floats once block 0 is closed.

    It has no ``bits`` attribute (mlx-lm would take it for its own quantized
    cache): the width is ``kv_bits``."""

    KINDS = (QUANTIZED,)
    recurrent = False
    float_keys = attends_new = False
    blocked = True
    block = BLOCK_TOKENS

    def __init__(self, group_size: int = 64, bits: int = 4):
        check_format(group_size, bits)
        self.group_size, self.kv_bits = group_size, bits
        self.offset = 0
        self.closed = 0  # tokens in closed blocks: a multiple of ``block`` (0 at 16 bits)
        self.packed: Optional[Packed] = None  # rows [0, closed) live
        self.open: Optional[tuple[mx.array, mx.array]] = None  # rows [0, offset - closed) live
        self.sinks: Optional[tuple[mx.array, mx.array]] = None  # (1, H, SINKS, D) while block 0 is closed

    # -- writing

    def append(self, keys: mx.array, values: mx.array) -> None:
        """Add the keys and values (1, H, S, D) of S tokens; quantize every full
        block a token comes after (a full block stays open until then, so the
        tokens of a step that filled it can still be cut)."""
        at, S = 0, keys.shape[2]
        while at < S:
            if self.kv_bits != 16 and self.offset - self.closed == self.block:
                self._close()
            n = S - at if self.kv_bits == 16 else min(S - at, self.block - (self.offset - self.closed))
            self._write_open(keys[..., at : at + n, :], values[..., at : at + n, :])
            at += n

    def _write_open(self, keys: mx.array, values: mx.array) -> None:
        live, S = self.offset - self.closed, keys.shape[2]
        if self.open is None or live + S > self.open[0].shape[2]:
            # within a block a quarter at a time: an idle agent holds about its open tokens, not a block
            step = OPEN_STEP if live + S <= self.block else self.block
            capacity = (live + S + step - 1) // step * step
            old = self.open or (None, None)
            self.open = tuple(grown(o, live, capacity, x) for o, x in zip(old, (keys, values)))
        k, v = self.open
        k[..., live : live + S, :] = keys
        v[..., live : live + S, :] = values
        self.open = (k, v)
        self.offset += S

    def close_full(self) -> None:
        """Quantize a full open block now rather than when the next token comes:
        the same bits (a decode step starting the next block reads it packed)."""
        if self.kv_bits != 16 and self.offset - self.closed == self.block:
            self._close()

    def _close(self) -> None:
        k, v = (x[..., : self.block, :] for x in self.open)
        first = self.closed == 0
        if first:  # (copies: a view would keep the whole open buffer alive)
            self.sinks = (mx.contiguous(k[..., :SINKS, :]), mx.contiguous(v[..., :SINKS, :]))
        rows = close_block(k, v, self.group_size, self.kv_bits, first)
        self.open = None  # the next block's buffer grows from nothing (``_write_open``)
        if self.packed is None or self.closed + self.block > self.packed[0].shape[2]:
            capacity = max(self.block, 2 * self.closed)  # doubling: a long prefill copies O(T), not O(T^2)
            old = self.packed or (None,) * len(rows)
            self.packed = tuple(grown(o, self.closed, capacity, r) for o, r in zip(old, rows))
        for dst, src in zip(self.packed, rows):
            dst[..., self.closed : self.closed + self.block, :] = src
        self.closed += self.block

    def update_and_fetch(self, keys, values):
        """mlx-lm's protocol, for a caller that attends over the record itself (the
        engine attends through ``view``, which keeps the floats): the chunk sees
        the blocks before its own unpacked, its own block in float."""
        self.append(keys, values)
        return self.floats(keys.dtype)

    # -- reading

    def floats(self, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        """Keys and values (1, H, offset, D) as attention sees them: closed blocks
        unpacked (sinks in float), the open block as written."""
        parts = [self.unpacked(0, self.closed, dtype)] if self.closed else []
        if self.offset > self.closed:
            parts.append(tuple(x[..., : self.offset - self.closed, :] for x in self.open))
        if not parts:
            raise ValueError("an empty cache has no keys")
        return tuple(mx.concatenate(p, axis=2) if len(p) > 1 else p[0] for p in zip(*parts))

    def unpacked(self, start: int, stop: int, dtype: Optional[mx.Dtype] = None,
                 tail: Optional[tuple[mx.array, mx.array]] = None, rows: Optional[int] = None
                 ) -> tuple[mx.array, mx.array]:
        """Closed blocks' tokens [start, stop) (block bounds) in float, sinks in
        place; then, if given, the ``tail`` rows, in ``rows`` rows in all
        (``quantize.open_blocks``)."""
        dtype = dtype or self.sinks[0].dtype
        sinks = tuple(x.astype(dtype) for x in self.sinks) if start == 0 else None
        return open_blocks(tuple(t[..., start:stop, :] for t in self.packed), self.group_size, self.kv_bits, dtype,
                           self.block, sinks, tail, rows)

    def packed_past(self, start: int, stop: int) -> PackedPast:
        """Closed blocks' tokens [start, stop) (block bounds, after block 0) as
        attention reads them packed, in place."""
        assert start >= self.block, "block 0 holds the sinks' floats: it is attended in float"
        kw, ks, kb, vw, vs, vb = (t[..., start:stop, :] for t in self.packed)
        _, H, T, _ = vw.shape
        D = vw.shape[-1] * 32 // self.kv_bits
        keys = tuple(t.reshape(1, H, T // self.block, D, -1) for t in (kw, ks, kb))
        return PackedPast(keys, (vw, vs, vb), self.group_size, self.kv_bits)

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def pieces(self, n: int) -> list[int]:
        """The lengths a chunk of ``n`` new tokens attends in, in order: one
        piece a block it falls in, as its tokens see different blocks closed."""
        if self.kv_bits == 16:
            return [n]
        out, at = [], self.offset
        while n:
            out.append(min(n, self.block - at % self.block))
            at, n = at + out[-1], n - out[-1]
        return out

    # -- going back

    @property
    def trimmable_tokens(self) -> int:
        return self.offset - self.closed

    def rewind_points(self) -> list[int]:
        return list(range(self.block, self.closed + 1, self.block))

    def can_rewind(self, tokens: int) -> bool:
        return self.closed <= tokens <= self.offset or (tokens % self.block == 0 and 0 <= tokens <= self.closed)

    def rewind(self, tokens: int) -> None:
        if not self.can_rewind(tokens):
            raise ValueError(f"a quantized cache of {self.offset} tokens ({self.closed} in closed blocks) cannot "
                             f"go back to {tokens}: only within its open block or to a block's start")
        if tokens < self.closed:
            self.closed = tokens
            self.sinks = self.sinks if tokens else None
        self.offset = tokens

    def mark(self) -> None:
        pass

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(n, self.trimmable_tokens)
        self.offset -= n
        return n

    def size(self):
        return self.offset

    def empty(self):
        return self.offset == 0

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.arrays)

    @property
    def state(self):
        """What it holds, up to what it covers: the blocks' rows and the sinks."""
        entry, blocked, sinks = self.describe()
        return [t for _, t in blocked.values()] + list(sinks.values())

    @property
    def arrays(self) -> list:
        return [*(self.packed or ()), *(self.open or ()), *(self.sinks or ())]

    def view(self, float_head: Optional[int] = None) -> DequantizingKVCache:
        return DequantizingKVCache(self, float_head)

    # -- files

    def describe(self):
        entry = {"kind": QUANTIZED, "offset": self.offset, "bits": self.kv_bits, "group_size": self.group_size,
                 "closed": self.closed}
        blocked = {}
        if self.closed:
            blocked.update((name, (0, t[..., : self.closed, :])) for name, t in zip(PACKED, self.packed))
        if self.offset > self.closed:
            blocked.update((name, (self.closed, t[..., : self.offset - self.closed, :]))
                           for name, t in zip(OPEN, self.open))
        return entry, blocked, dict(zip(SINK, self.sinks)) if self.closed else {}

    @classmethod
    def rebuild(cls, entry, arrays):
        c = cls(entry["group_size"], entry["bits"])
        c.offset, c.closed = entry["offset"], entry["closed"]
        if c.closed:
            c.packed = tuple(arrays[name] for name in PACKED)
            c.sinks = tuple(arrays[name] for name in SINK)
        if c.offset > c.closed:
            c.open = tuple(arrays[name] for name in OPEN)
        return c

    @classmethod
    def check_entry(cls, entry, n):
        tensors, bits, group, closed = entry["tensors"], entry.get("bits"), entry.get("group_size"), entry.get("closed")
        if bits not in (4, 8, 16) or group not in (32, 64, 128):
            raise ValueError(f"unsupported bits {bits!r} / group size {group!r}")
        if not (type(closed) is int and 0 <= closed <= n and closed % BLOCK_TOKENS == 0 and (bits < 16 or not closed)
                and n - closed <= (n if bits == 16 else BLOCK_TOKENS)):
            raise ValueError(f"{closed!r} tokens in closed blocks cannot go with {n} tokens at {bits} bits")
        names = (set(PACKED) | set(SINK) if closed else set()) | (set(OPEN) if n > closed else set())
        if set(tensors) != names:
            raise ValueError("missing or extra tensors")
        spans = {**dict.fromkeys(PACKED, [0, closed]), **dict.fromkeys(OPEN, [closed, n])}
        if any(len(tensors[name]) != 5 or tensors[name][3:] != span
               for name, span in spans.items() if name in tensors):
            raise ValueError("a tensor that does not cover its tokens")
        if n > closed:
            k, v = tensors["k"], tensors["v"]
            if k[0] not in FLOATS or v[0] != k[0] or v[1] != k[1]:
                raise ValueError(f"open block tensors {k} {v} do not fit")
        if closed:
            (kw, ks, kb, vw, vs, vb), sinks = (tensors[name] for name in PACKED), [tensors[name] for name in SINK]
            heads = kw[1]
            if not (kw[0] == vw[0] == "U32" and ks[0] in FLOATS and ks[:3] == kb[:3] and vs[:3] == vb[:3]
                    and vs[0] == ks[0] and {kw[1], ks[1], vw[1], vs[1]} == {heads}
                    and kw[2] * 32 // bits == ks[2] * group and vw[2] * 32 // bits == vs[2] * group
                    and all(len(t) == 4 and t[0] in FLOATS and t[1] == heads and t[2] == SINKS for t in sinks)
                    and sinks[0][3] == ks[2] * group and sinks[1][3] == vs[2] * group):
                raise ValueError(f"quantized tensors {kw} {ks} {kb} {vw} {vs} {vb} {sinks} do not fit")

    @classmethod
    def blocked_names(cls, entry):
        return [*PACKED, *OPEN]

    @classmethod
    def ring_names(cls, entry):
        return list(SINK)

    @classmethod
    def replacing(cls, cache, bits, group_size):
        return cls(group_size, bits) if isinstance(cache, KVCache) else None
