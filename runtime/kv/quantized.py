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
from mlx_lm.models.cache import KVCache, _BaseCache, create_attention_mask

from ..attention import PackedPast
from ..cache_records import BLOCK_TOKENS, FLOATS, SINKS
from .kinds import register
from .quantize import Packed, check_format, close_block, grown, open_blocks

__all__ = ["CPU_FLOAT_HEAD", "DequantizingKVCache", "SequenceQuantizedKVCache", "device_float_head"]

OPEN_STEP = 64  # rows an open block's float buffer grows by (a divisor of BLOCK_TOKENS)
CPU_FLOAT_HEAD = 4096  # closed tokens a running sequence attends over in float on the CPU (docs/benchmarks.md)
QUANTIZED = "quantized"
# Its tensors: a closed block's rows, in file order; the open block's floats; the sinks'.
PACKED = ("k_weights", "k_scales", "k_biases", "v_weights", "v_scales", "v_biases")
OPEN = ("k", "v")
SINK = ("k_sinks", "v_sinks")


def device_float_head(model) -> Optional[int]:
    """The closed tokens a running sequence of ``model`` attends over unpacked
    in float (``DequantizingKVCache``), the rest packed: the first
    ``CPU_FLOAT_HEAD`` on the CPU, where MLX's quantized matmul reads keys at
    about half the speed of a float matmul; the first block (the sinks')
    elsewhere; all for attention with learned sinks, which
    ``runtime.attention`` does not take."""
    if any(isinstance(layer, dict) and "sinks" in layer.get("self_attn", {}) for layer in model.layers):
        return None
    return CPU_FLOAT_HEAD if mx.default_device() == mx.cpu else BLOCK_TOKENS


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

    def unpacked(self, start: int, stop: int, dtype: Optional[mx.Dtype] = None) -> tuple[mx.array, mx.array]:
        """Closed blocks' tokens [start, stop) (block bounds) in float, sinks in place."""
        dtype = dtype or self.sinks[0].dtype
        keys, values = open_blocks(tuple(t[..., start:stop, :] for t in self.packed), self.group_size, self.kv_bits,
                                   dtype, self.block)
        if start == 0:
            keys[..., :SINKS, :] = self.sinks[0].astype(dtype)
            values[..., :SINKS, :] = self.sinks[1].astype(dtype)
        return keys, values

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


class DequantizingKVCache(_BaseCache):
    """A cache of record (``quantized``) as a running sequence attends over it:
    what a token sees (the module docstring), held so that a decode step
    writes one row, not the context, and a long past costs its packed bytes.

    The first closed blocks, up to ``float_head`` tokens (None: all), are
    unpacked into a float working copy; the closed blocks after them are
    read packed from the record (``runtime.attention.PackedPast``); the
    tokens after the closed blocks are floats as written. So the copy holds
    rows [0, ``head``) unpacked, then the tokens from ``synced`` (the closed
    tokens it has taken in) on. A block closed by the record is taken in
    before the next write. A decode step whose first token starts a block
    closes the block before it: in the record where the record holds it
    (the engine writes a batch's held rows to the records before such a
    step), else in the copy from the same floats, to the same bits. In a
    decode forward the copy runs ahead of the record by ``unwritten``
    tokens, whose rows the forward's ``BatchQuantizedKVCache`` holds.
    """

    KINDS = ()  # never written: its record is
    recurrent = False
    float_keys = attends_new = True

    def __init__(self, quantized: SequenceQuantizedKVCache, float_head: Optional[int] = None):
        self.quantized = quantized
        block = quantized.block  # at least the first block: the sinks' floats stay in the copy
        self.float_head = None if float_head is None else max(block, float_head // block * block)
        self._float: Optional[tuple[mx.array, mx.array]] = None
        self.head = 0  # closed tokens unpacked in the copy: rows [0, head)
        self.synced = 0  # closed tokens taken in: [head, synced) are read packed
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

    def _row(self, position: int) -> int:
        """The copy's row of a token at or after ``synced``."""
        return position - self.synced + self.head

    def _sync(self, like: mx.array) -> None:
        """Make the copy hold what the record does (first use: all of it)."""
        q = self.quantized
        if self._float is None:
            self.head, self.synced = self._head_of(q.closed), q.closed
            parts = [q.unpacked(0, self.head, like.dtype)] if self.head else []
            if q.offset > q.closed:
                parts.append(tuple(x[..., : q.offset - q.closed, :] for x in q.open))
            if parts:  # one copy, with room for the rest of the open block and the next
                live = self.head + q.offset - q.closed
                room = self._capacity(live) - live
                parts.append(tuple(mx.zeros((*x.shape[:2], room, x.shape[3]), x.dtype) for x in parts[0]))
                self._float = tuple(mx.concatenate(p, axis=2) for p in zip(*parts))
            return
        if q.closed < self.synced:  # the record went back to a block's start (nothing after it)
            self.head, self.synced = min(self.head, q.closed), q.closed
        if q.closed > self.synced:
            self._take_in(q.closed, like)

    def _head_of(self, closed: int) -> int:
        """Closed tokens unpacked in the copy when ``closed`` are: up to the float head."""
        return closed if self.float_head is None else min(closed, self.float_head)

    def _take_in(self, closed: int, like: mx.array) -> None:
        """Take in the record's blocks from ``synced`` to ``closed``: unpacked in
        place while the head has room, else read packed from now on (their
        float rows leave the copy: the rows after them move up)."""
        head = self._head_of(closed)
        if head > self.head:  # (the head is full before any block is read packed: head == synced)
            self._put(self.head, self.quantized.unpacked(self.head, head, like.dtype))
            self.head = self.synced = head
        if closed > self.synced:
            after, at = self.offset - closed, self._row(closed)
            if after > 0:
                self._put(self.head, tuple(x[..., at : at + after, :] for x in self._float))
            self.synced = closed

    def _put(self, at: int, rows: tuple[mx.array, mx.array]) -> None:
        """Write rows (1, H, n, D) from row ``at``, growing the copy as needed."""
        n = rows[0].shape[2]
        fk, fv = self._float or (None, None)
        if fk is None or fk.shape[2] < at + n:
            capacity = self._capacity(at + n)
            fk, fv = grown(fk, at, capacity, rows[0]), grown(fv, at, capacity, rows[1])
        fk[..., at : at + n, :] = rows[0]
        fv[..., at : at + n, :] = rows[1]
        self._float = (fk, fv)

    def _capacity(self, rows: int) -> int:
        """Rows a copy holding ``rows`` is given: to its block's end and one block
        more, so a chunk or step that crosses into the next block does not copy
        it again; never more than the float head and two blocks (the budget's
        ``WorkingCopyManager``) for rows that fit them."""
        step = self.quantized.block
        need = (rows + step - 1) // step * step
        if self.float_head is None:
            return need + step
        return max(need, min(need + step, self.float_head + 2 * step))

    def _fetched(self) -> tuple:
        """What a token attends over now: the copy's live rows, then the packed blocks (or None)."""
        fk, fv = self._float
        live = self._row(self.offset)
        packed = self.quantized.packed_past(self.head, self.synced) if self.synced > self.head else None
        return fk[..., :live, :], fv[..., :live, :], packed

    def update_and_fetch_past(self, keys, values) -> tuple:
        """Add a prompt chunk's keys and values (1, H, S, D; within one block);
        return the float keys and values attended over (the chunk's at their
        end) and the ``PackedPast`` before them (None when there is none)."""
        if self.unwritten:
            raise RuntimeError("a decoded token's rows are not in the record yet (BatchQuantizedKVCache.flush)")
        self._sync(keys)
        prev = self.offset
        self.quantized.append(keys, values)
        self._put(self._row(prev), (keys, values))
        self._sync(keys)  # the full block before, closed by this chunk's first token
        return self._fetched()

    def update_and_fetch(self, keys, values):
        """mlx-lm's protocol (attention modules that run their own call): the
        keys and values in float, packed blocks unpacked for the call."""
        fk, fv, packed = self.update_and_fetch_past(keys, values)
        if packed is None:
            return fk, fv
        middle = self.quantized.unpacked(self.head, self.synced, keys.dtype)
        return tuple(mx.concatenate([f[..., : self.head, :], m, f[..., self.head :, :]], axis=2)
                     for f, m in zip((fk, fv), middle))

    def attend_new(self, new_k: mx.array, new_v: mx.array) -> list[tuple]:
        """Add decoded tokens (1, H, n, D, all in one block) to the working copy
        only (their ``BatchQuantizedKVCache`` writes them to the record later);
        return what each attends over (``update_and_fetch_past``'s triple), up
        to and including it."""
        self._sync(new_k)
        prev, n, q = self.offset, new_k.shape[2], self.quantized
        if q.kv_bits != 16 and prev % q.block == 0 and prev > self.synced:  # the block before closes first
            if q.offset == prev:  # the record holds it: closed now, as at its next token
                q.close_full()
                self._sync(new_k)
            elif self.float_head is not None and self.head + q.block > self.float_head:
                raise RuntimeError("a step that starts a block past the float head needs its sequence's rows in "
                                   "the record first (BatchQuantizedKVCache.flush)")
            else:  # closed here, from the floats the record will close it from
                start = prev - q.block
                fk, fv = (x[..., self._row(start) : self._row(prev), :] for x in self._float)
                packed = close_block(fk, fv, q.group_size, q.kv_bits, first=start == 0)
                keys, values = open_blocks(packed, q.group_size, q.kv_bits, new_k.dtype, q.block)
                if start == 0:
                    keys = mx.concatenate([fk[..., :SINKS, :], keys[..., SINKS:, :]], axis=2)
                    values = mx.concatenate([fv[..., :SINKS, :], values[..., SINKS:, :]], axis=2)
                self._put(self.head, (keys, values))
                self.head += q.block
                self.synced = prev
        self._put(self._row(prev), (new_k, new_v))
        self.unwritten += n
        fk, fv, packed = self._fetched()
        end = fk.shape[2]
        return [(fk[..., : end - n + j + 1, :], fv[..., : end - n + j + 1, :], packed) for j in range(n)]

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

    def view(self, float_head: Optional[int] = None):
        return DequantizingKVCache(self.quantized, float_head)  # a fresh working copy

    @property
    def arrays(self):
        return self.quantized.arrays, self._float

    def describe(self):
        return self.quantized.describe()
