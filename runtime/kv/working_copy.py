"""The float working copy a running sequence attends over
(``DequantizingKVCache``): what ``kv.quantized``'s docstring says a token
sees, held so that a decode step writes one row, not the context; how
many closed tokens it keeps unpacked on each device (``device_float_head``);
and from how many query rows a prompt chunk reads the rest unpacked.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
from mlx_lm.models.cache import _BaseCache, create_attention_mask

from ..cache_records import BLOCK_TOKENS, SINKS
from ..model.attention import UnpackedPast, cpu_kernels
from .quantize import close_block, grown, open_blocks

if TYPE_CHECKING:
    from .quantized import SequenceQuantizedKVCache

__all__ = ["CPU_FLOAT_HEAD", "CPU_UNPACKED_ROWS", "DequantizingKVCache", "device_float_head", "float_head",
           "unpacked_rows"]

# The CPU's float head (closed tokens a running sequence attends over in float) and the chunk rows
# from which the blocks past it are read unpacked: with the attention kernels (runtime/model/kernels),
# which read a packed past faster than a float matmul reads its floats, and without them, where MLX's
# quantized matmul reads it at half that speed (docs/benchmarks.md).
KERNEL_FLOAT_HEAD, KERNEL_UNPACKED_ROWS = 1024, 64
CPU_FLOAT_HEAD, CPU_UNPACKED_ROWS = 4096, 4


def device_float_head(model) -> Optional[int]:
    """The closed tokens a running sequence of ``model`` attends over unpacked
    in float (``DequantizingKVCache``), the rest packed: the first block (the
    sinks') on Metal and CUDA, ``KERNEL_FLOAT_HEAD`` or ``CPU_FLOAT_HEAD`` on
    the CPU; all for attention with learned sinks, which
    ``runtime.model.attention`` does not take."""
    if any(isinstance(layer, dict) and "sinks" in layer.get("self_attn", {}) for layer in model.layers):
        return None
    return float_head()


def float_head() -> int:
    """``device_float_head`` for a model without learned sinks."""
    if mx.default_device() != mx.cpu:
        return BLOCK_TOKENS
    return CPU_FLOAT_HEAD if cpu_kernels() is None else KERNEL_FLOAT_HEAD


def unpacked_rows() -> Optional[int]:
    """A prompt chunk's rows from which it reads the blocks past the head
    unpacked for itself (float matmuls) rather than packed: on the CPU only."""
    if mx.default_device() != mx.cpu:
        return None
    return CPU_UNPACKED_ROWS if cpu_kernels() is None else KERNEL_UNPACKED_ROWS


class DequantizingKVCache(_BaseCache):
    """A cache of record (``quantized``) as a running sequence attends over it:
    what a token sees (``kv.quantized``'s docstring), held so that a decode step
    writes one row, not the context, and a long past costs its packed bytes.

    The first closed blocks, up to ``float_head`` tokens (None: all), are
    unpacked into a float working copy; the closed blocks after them are
    read packed from the record (``runtime.model.attention.PackedPast``); the
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
            n = q.offset - q.closed
            rows = self._capacity(self.head + n)  # room for the rest of the open block and the next
            if self.head:  # one buffer, written once
                tail = tuple(x[..., :n, :].astype(like.dtype) for x in q.open) if n else None
                self._float = q.unpacked(0, self.head, like.dtype, tail, rows)
            elif n:
                self._float = tuple(grown(x, n, rows, x) for x in q.open)
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

    def _fetched(self, rows: int = 1) -> tuple:
        """What ``rows`` new tokens attend over now: the copy's live rows, then
        the blocks past the head (None where there are none): packed, or on
        the CPU from ``unpacked_rows()`` rows unpacked for them alone. Which
        one depends on the rows and the device alone, never on another
        sequence."""
        past = None
        if self.synced > self.head:
            least = unpacked_rows()
            if least is not None and rows >= least:
                past = UnpackedPast(*self.quantized.unpacked(self.head, self.synced, mx.float32))
            else:
                past = self.quantized.packed_past(self.head, self.synced)
        return (*self._live(), past)

    def _live(self) -> tuple[mx.array, mx.array]:
        """The copy's rows in use."""
        live = self._row(self.offset)
        return tuple(x[..., :live, :] for x in self._float)

    def update_and_fetch_past(self, keys, values) -> tuple:
        """Add a prompt chunk's keys and values (1, H, S, D; within one block);
        return the float keys and values attended over (the chunk's at their
        end) and the blocks before them read packed or unpacked
        (``_fetched``; None when there are none)."""
        self._write(keys, values)
        return self._fetched(keys.shape[2])

    def _write(self, keys, values) -> None:
        if self.unwritten:
            raise RuntimeError("a decoded token's rows are not in the record yet (BatchQuantizedKVCache.flush)")
        self._sync(keys)
        prev = self.offset
        self.quantized.append(keys, values)
        self._put(self._row(prev), (keys, values))
        self._sync(keys)  # the full block before, closed by this chunk's first token

    def update_and_fetch(self, keys, values):
        """mlx-lm's protocol (attention modules that run their own call): the
        keys and values in float, packed blocks unpacked for the call."""
        self._write(keys, values)
        fk, fv = self._live()
        if self.synced == self.head:
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
