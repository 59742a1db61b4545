"""Batched quantized KV caches: many agents' Q4 caches in one forward pass, each
row computed exactly as it would be alone.

mlx-lm batches full-precision caches (``BatchKVCache``, left padded) and
quantizes single sequences (``QuantizedKVCache``), but does not batch quantized
caches. Here a batch never pads a cache: every agent keeps its own
per-sequence caches and they are batched *around* attention.

**Batch invariance by construction.** A row's numbers must not depend on its
neighbours, on any machine. Two things make them depend in a padded batch:

* attention over padded keys: where a row's keys sit in the padded tensor
  decides how softmax lanes and the BLAS k-loop group its sums (~1e-6 on the
  logits, enough to flip a 135M model's greedy token after Q4 rounding);
* a matmul's shape: BLAS picks its kernel by M (OpenBLAS: ``gemv`` at M = 1, a
  small-matrix kernel below M*N*K = 1e6 on SkylakeX, other blockings from
  M = 13 on Haswell and Zen), and each kernel sums in its own order.

So a forward is one row of token slots whose count is one of those measured
to give the same rows (``runtime.engine.row_counts``), and each layer gets a
``BatchQuantizedKVCache``: the caches of the sequences in the forward, one
slot each. ``runtime.engine.rowwise`` makes attention run per sequence over its own
cache, with the same shapes as when the sequence is alone; everything else
runs over all slots at once.

The per-sequence caches, a kind per layer, are ``runtime.kv``'s.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import mlx.core as mx


__all__ = ["BatchQuantizedKVCache", "ChunkMasks", "PrefillBatch"]


class BatchQuantizedKVCache:
    """One layer's caches of the sequences decoded together in a forward.

    The forward's input is one row of token slots (a measured count); a
    sequence takes ``widths[i]`` consecutive slots (one, or more when it
    verifies drafted tokens: ``runtime.engine.speculation``), each its next token
    after the one before, and slots after the last sequence are padding.
    Three agents in a forward of 6 slots, ``b`` verifying two drafts:

        slot      0  1  2  3  4  5
        cache     a  b  b  b  c  .      slot 5 is padding: computed, then ignored

    Attention modules made ``runtime.engine.rowwise.rowwise`` attend per slot when
    given this cache, over its sequence's cache up to and including that
    slot's token -- what a decode step of that token alone attends over. The
    model's own mask is not used (``make_mask`` gives None): each sequence's
    cache makes its own.
    """

    ROWS = 32  # decode steps whose new rows are held before they go to the records

    def __init__(self, caches: Sequence):
        if not caches:
            raise ValueError("a batch needs at least one sequence")
        self.caches = list(caches)
        self.widths = [1] * len(self.caches)  # this step's slots a sequence (``Decoder._launch`` sets them)
        # Every sequence attends over a float working copy: ``attend_new`` serves this layer.
        self.in_float = all(c.attends_new for c in self.caches)
        # Held steps: the keys and values of every slot (slots, H, 1, D), and the slots of each
        # sequence that go to its record (fewer than its width once drafts are cut).
        self._rows: list[tuple[tuple[mx.array, mx.array], list[int], list[int]]] = []

    def make_mask(self, *args, **kwargs):
        return None

    @property
    def slot_caches(self) -> list:
        """Each used slot's sequence cache, in slot order."""
        return [c for c, w in zip(self.caches, self.widths) for _ in range(w)]

    @property
    def positions(self) -> list[int]:
        """Each used slot's position in its sequence (before this step writes)."""
        return [c.offset + j for c, w in zip(self.caches, self.widths) for j in range(w)]

    def attend_new(self, keys: mx.array, values: mx.array) -> list[tuple[mx.array, mx.array]]:
        """Add every slot's new token (``keys``, ``values``: (slots, H, 1, D)) to
        its sequence's working copy in slot order and hold the rows for the
        records; return what each slot attends over.

        The records get up to ``ROWS`` steps at once (``flush``), where writing
        each record costs a few MLX ops a sequence and step; a new token is
        kept in float in its record's open block, so nothing is quantized here.
        """
        assert not self.full, "a full batch is flushed before its next step (Decoder._launch)"
        slots = keys.shape[0]
        self._rows.append(((keys, values), list(self.widths), list(self.widths)))
        if max(self.widths) == 1:  # a slot a sequence: one split
            new_k, new_v = mx.split(keys, slots), mx.split(values, slots)
            return [c.attend_new(k, v)[0] for c, k, v in zip(self.caches, new_k, new_v)]
        fetched, at = [], 0
        for c, w in zip(self.caches, self.widths):  # a sequence's slots are its tokens in order
            fetched += c.attend_new(keys[at : at + w].swapaxes(0, 2), values[at : at + w].swapaxes(0, 2))
            at += w
        return fetched

    @property
    def held(self) -> int:
        """Steps whose rows wait here for the records."""
        return len(self._rows)

    @property
    def full(self) -> bool:
        return self.held == self.ROWS

    def drop_last(self) -> None:
        """Forget the last step's rows: its sequences' working copies drop its tokens too
        (a decode step computed ahead and then dropped, ``runtime.engine.decode``)."""
        assert self._rows, "no step held to drop"
        _, _, kept = self._rows.pop()
        for c, n in zip(self.caches, kept):
            c.unwritten -= n

    def cut(self, i: int, n: int) -> None:
        """Drop the last ``n`` tokens sequence ``i`` wrote in the last step held
        (drafts it rejected): its working copy and its record never get them."""
        _, _, kept = self._rows[-1]
        assert 0 <= n <= kept[i], "only the last step's own tokens can be cut"
        kept[i] -= n
        self.caches[i].unwritten -= n

    def flush(self) -> None:
        """Write the held rows to each sequence's record (before anyone reads
        a record, and when ``ROWS`` steps are held)."""
        if not self._rows:
            return
        if all(max(widths) == 1 == min(kept) for _, widths, kept in self._rows):  # a slot a sequence: one gather
            steps = [mx.concatenate(parts, axis=2) for parts in zip(*(q for q, _, _ in self._rows))]
            rows = [tuple(t[i : i + 1] for t in steps) for i in range(len(self.caches))]
        else:
            rows = [[] for _ in self.caches]
            for q, widths, kept in self._rows:
                starts = itertools.accumulate([0, *widths[:-1]])
                for i, (at, n) in enumerate(zip(starts, kept)):
                    if n:  # a sequence's slots are its tokens in order: along the token axis
                        rows[i].append(tuple(t[at : at + n].swapaxes(0, 2) for t in q))
            rows = [tuple(mx.concatenate(parts, axis=2) for parts in zip(*r)) if r else None for r in rows]
        for c, r in zip(self.caches, rows):
            if r is not None:
                c.quantized.append(*r)
        for i, c in enumerate(self.caches):
            c.unwritten -= sum(kept[i] for _, _, kept in self._rows)
        self._rows = []

    @property
    def arrays(self) -> list:
        """What a step evaluates besides the sequences' caches, so graphs never grow."""
        return [t for q, _, _ in self._rows for t in q]


@dataclass(frozen=True)
class ChunkMasks:
    """What a model asked a ``PrefillBatch`` for (``make_mask``'s keyword
    arguments): each chunk's attention gets its own cache's mask, asked as the
    model asks when the chunk runs alone."""

    kwargs: dict

    def of(self, cache, rows: int):
        return cache.make_mask(rows, **self.kwargs)


class PrefillBatch:
    """One layer's caches of the sequences whose prompt chunks run together in a
    forward: the forward's token rows are sequence 0's chunk (``lengths[0]``
    rows), then sequence 1's, and so on. Attention modules made
    ``runtime.engine.rowwise.rowwise`` attend per chunk over its own cache, as when
    the chunk runs alone; everything else runs over all rows at once."""

    def __init__(self, caches: Sequence, lengths: Sequence[int]):
        if not caches or len(caches) != len(lengths) or min(lengths) < 1:
            raise ValueError("a prefill batch needs one chunk of at least one token per cache")
        self.caches, self.lengths = list(caches), list(lengths)

    def make_mask(self, N: int, **kwargs) -> "ChunkMasks":
        return ChunkMasks(kwargs)

    def chunks(self, x: mx.array, axis: int) -> list[mx.array]:
        """``x`` cut along ``axis`` (its token rows) into the chunks."""
        return mx.split(x, list(itertools.accumulate(self.lengths[:-1])), axis=axis) if len(self.lengths) > 1 else [x]
