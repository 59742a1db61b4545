"""Full attention layers: the cache of record (``SequenceQuantizedKVCache``),
blocks of 256 tokens quantized as each fills, and the float working copy a
sequence attends over while it runs (``DequantizingKVCache``).

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
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..cache_records import BLOCK_TOKENS, OPEN, PACKED, QUANTIZED, SINK, SINKS
from .quantize import Packed, check_format, close_block, grown, open_blocks

__all__ = ["DequantizingKVCache", "SequenceQuantizedKVCache"]


class SequenceQuantizedKVCache(_BaseCache):
    """One sequence's full-attention layer: ``closed`` tokens in quantized
    blocks (``packed``, rows as ``close_block`` lays them out), the rest in
    float (``open``), and the sinks' floats once block 0 is closed.

    It has no ``bits`` attribute (mlx-lm would take it for its own quantized
    cache): the width is ``kv_bits``."""

    KINDS = (QUANTIZED,)
    recurrent = False
    float_keys = attends_new = False
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
            capacity = (live + S + self.block - 1) // self.block * self.block
            old = self.open or (None, None)
            self.open = tuple(grown(o, live, capacity, x) for o, x in zip(old, (keys, values)))
        k, v = self.open
        k[..., live : live + S, :] = keys
        v[..., live : live + S, :] = values
        self.open = (k, v)
        self.offset += S

    def _close(self) -> None:
        k, v = (x[..., : self.block, :] for x in self.open)
        first = self.closed == 0
        if first:  # (copies: a view would keep the whole open buffer alive)
            self.sinks = (mx.contiguous(k[..., :SINKS, :]), mx.contiguous(v[..., :SINKS, :]))
        rows = close_block(k, v, self.group_size, self.kv_bits, first)
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

    def unpacked(self, start: int, stop: int, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        """Closed blocks' tokens [start, stop) (block bounds) in float, sinks in place."""
        dtype = dtype or self.sinks[0].dtype
        keys, values = open_blocks(tuple(t[..., start:stop, :] for t in self.packed), self.group_size, self.kv_bits,
                                   dtype, self.block)
        if start == 0:
            keys = mx.concatenate([self.sinks[0].astype(dtype), keys[..., SINKS:, :]], axis=2)
            values = mx.concatenate([self.sinks[1].astype(dtype), values[..., SINKS:, :]], axis=2)
        return keys, values

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

    def view(self, float_attention: bool) -> DequantizingKVCache:
        return DequantizingKVCache(self)

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


class DequantizingKVCache(_BaseCache):
    """A cache of record (``quantized``) attended over through a float working
    copy: what a token sees (the module docstring), held so that a decode
    step writes one row, not the context.

    Rows [0, ``synced``) are closed blocks unpacked; the rest are the floats as
    written. A block closed by the record is unpacked here before the next
    write; a decode step whose first token starts a block closes the block
    before it here first (the record closes it when the batch's rows reach it,
    from the same floats, to the same bits). In a decode forward the copy runs
    ahead of the record by ``unwritten`` tokens, whose rows the forward's
    ``BatchQuantizedKVCache`` holds.
    """

    KINDS = ()  # never written: its record is
    recurrent = False
    float_keys = attends_new = True

    def __init__(self, quantized: SequenceQuantizedKVCache):
        self.quantized = quantized
        self._float: Optional[tuple[mx.array, mx.array]] = None  # same positions as the record
        self.synced = 0
        self.unwritten = 0  # decoded tokens after the record's, whose rows a ``BatchQuantizedKVCache`` holds

    @property
    def offset(self) -> int:
        return self.quantized.offset + self.unwritten

    @property
    def group_size(self) -> int:
        return self.quantized.group_size

    @property
    def kv_bits(self) -> int:
        return self.quantized.kv_bits

    def _sync(self, like: mx.array) -> None:
        """Make the copy hold what the record does (first use: all of it)."""
        q = self.quantized
        if self._float is None:
            if q.offset:
                self._float = q.floats(like.dtype)
            self.synced = q.closed
            return
        if q.offset < self.synced:  # the record went back (a copy closes ahead of it only at its end)
            self.synced = q.closed
        if q.closed > self.synced:
            self._put(self.synced, q.unpacked(self.synced, q.closed, like.dtype))
            self.synced = q.closed

    def _put(self, at: int, rows: tuple[mx.array, mx.array]) -> None:
        """Write rows (1, H, n, D) from position ``at``, growing the copy as needed."""
        n = rows[0].shape[2]
        fk, fv = self._float or (None, None)
        if fk is None or fk.shape[2] < at + n:
            step = self.quantized.block
            capacity = (at + n + step - 1) // step * step
            fk, fv = grown(fk, at, capacity, rows[0]), grown(fv, at, capacity, rows[1])
        fk[..., at : at + n, :] = rows[0]
        fv[..., at : at + n, :] = rows[1]
        self._float = (fk, fv)

    def update_and_fetch(self, keys, values):
        if self.unwritten:
            raise RuntimeError("a decoded token's rows are not in the record yet (BatchQuantizedKVCache.flush)")
        self._sync(keys)
        prev = self.offset
        self.quantized.append(keys, values)
        self._put(prev, (keys, values))
        self._sync(keys)  # the full block before, closed by this chunk's first token
        fk, fv = self._float
        return fk[..., : self.offset, :], fv[..., : self.offset, :]

    def attend_new(self, new_k: mx.array, new_v: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Add decoded tokens (1, H, n, D, all in one block) to the working copy
        only (their ``BatchQuantizedKVCache`` writes them to the record later);
        return what each attends over: the keys and values up to and including it."""
        self._sync(new_k)
        prev, n, q = self.offset, new_k.shape[2], self.quantized
        if q.kv_bits != 16 and prev % q.block == 0 and prev > self.synced:  # closes the block before: as the record will
            start = prev - q.block
            fk, fv = (x[..., start:prev, :] for x in self._float)
            packed = close_block(fk, fv, q.group_size, q.kv_bits, first=start == 0)
            keys, values = open_blocks(packed, q.group_size, q.kv_bits, new_k.dtype, q.block)
            if start == 0:
                keys = mx.concatenate([fk[..., :SINKS, :], keys[..., SINKS:, :]], axis=2)
                values = mx.concatenate([fv[..., :SINKS, :], values[..., SINKS:, :]], axis=2)
            self._put(start, (keys, values))
            self.synced = prev
        self._put(prev, (new_k, new_v))
        self.unwritten += n
        fk, fv = self._float
        return [(fk[..., : prev + j + 1, :], fv[..., : prev + j + 1, :]) for j in range(n)]

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def pieces(self, n: int) -> list[int]:
        return self.quantized.pieces(n)

    @property
    def state(self):
        return self.quantized.state

    def is_trimmable(self):
        return True

    def trim(self, n):  # the copy keeps its positions; live length follows the record
        return self.quantized.trim(n)

    def size(self):
        return self.offset

    def empty(self):
        return self.quantized.empty()

    @property
    def nbytes(self):
        return self.quantized.nbytes

    @property
    def trimmable_tokens(self) -> int:
        return self.quantized.trimmable_tokens

    def rewind_points(self) -> list[int]:
        return self.quantized.rewind_points()

    def can_rewind(self, tokens: int) -> bool:
        return self.quantized.can_rewind(tokens)

    def rewind(self, tokens: int) -> None:
        self.quantized.rewind(tokens)

    def mark(self) -> None:
        pass

    def view(self, float_attention: bool):
        return DequantizingKVCache(self.quantized)  # a fresh working copy

    @property
    def arrays(self):
        return self.quantized.arrays, self._float

    def describe(self):
        return self.quantized.describe()
