"""Sliding-window attention layers: ``WindowKVCache``, full precision,
bounded by its window and ``WINDOW_SPARE`` tokens more. Also reads the ring
of mlx-lm's ``RotatingKVCache`` that older cache files hold."""

from __future__ import annotations

from typing import Optional

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache, _BaseCache

from ..cache_records import FLOATS
from ..model.model_spec import WINDOW_SPARE
from .kinds import register
from .layer import Trimmed
from .quantize import grown

__all__ = ["WindowKVCache"]

WINDOW = "window"
ROTATING = "rotating"  # an mlx-lm ring, written before ``WindowKVCache``: read as one


@register
class WindowKVCache(Trimmed, _BaseCache):
    """A sliding-window layer's cache that a turn can cut back.

    Attention sees what mlx-lm's ``RotatingKVCache(window)`` gives it: a chunk
    of S new tokens attends over the ``window - 1`` tokens before it and
    itself (the model's window mask does the rest), one token over the last
    ``window``.  But a ring overwrites what leaves the window, so once it has
    wrapped nothing can be trimmed, and a turn whose text diverges from the
    cached one (a re-rendered reply, a stop string cut, an edited message)
    would start cold.  This one keeps the tokens in order and ``spare`` more
    than the window: up to ``spare`` tokens can always be trimmed.  Full
    precision, like mlx-lm's ring.
    """

    KINDS = (WINDOW, ROTATING)
    float_keys, attends_new, blocked = True, False, False
    step = 256

    def __init__(self, window: int, spare: int = WINDOW_SPARE):
        if window < 1 or spare < 0:
            raise ValueError(f"a window of {window} tokens and {spare} spare cannot hold a sliding layer")
        self.window, self.spare = window, spare
        self.keys: Optional[mx.array] = None  # buffer positions [start, live) hold the last tokens, oldest first
        self.values: Optional[mx.array] = None
        self.offset = 0  # tokens seen
        self.start = self.live = 0

    @property
    def held(self) -> int:
        return self.live - self.start

    def update_and_fetch(self, keys, values):
        S, context = keys.shape[2], min(self.held, self.window - 1)
        if self.keys is None or self.live + S > self.keys.shape[2]:  # a new buffer, without what was dropped
            held, capacity = self.held, (self.held + S + self.step - 1) // self.step * self.step
            old = (None, None) if self.keys is None else (self.keys[..., self.start :, :],
                                                           self.values[..., self.start :, :])
            self.keys, self.values = (grown(o, held, capacity, x) for o, x in zip(old, (keys, values)))
            self.start, self.live = 0, held
        self.keys[..., self.live : self.live + S, :] = keys
        self.values[..., self.live : self.live + S, :] = values
        self.live += S
        self.offset += S
        first = self.live - S - context
        fetched = self.keys[..., first : self.live, :], self.values[..., first : self.live, :]
        self.start = max(self.start, self.live - (self.window - 1 + self.spare))  # no trim reaches further back
        return fetched

    def make_mask(self, N: int, window_size: Optional[int] = None, return_array: bool = False):
        if N == 1:
            return None  # one token sees exactly the window it is given
        window_size = window_size or self.window
        offset = min(self.window - 1, self.offset)
        if offset + N > window_size or return_array:
            return create_causal_mask(N, offset, window_size=window_size)
        return "causal"

    @property
    def trimmable_tokens(self) -> int:
        """Tokens ``trim`` can drop: all while none was dropped, else those held beyond the window."""
        return self.offset if self.held == self.offset else max(0, self.held - (self.window - 1))

    def is_trimmable(self):
        return self.trimmable_tokens > 0

    def trim(self, n):
        n = min(n, self.trimmable_tokens)
        self.live -= n
        self.offset -= n
        return n

    def size(self):
        return min(self.offset, self.window)

    def empty(self):
        return self.keys is None

    @property
    def state(self):
        return self.keys[..., self.start : self.live, :], self.values[..., self.start : self.live, :]

    @property
    def nbytes(self):
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes

    def view(self, float_head=None):
        return self

    @property
    def arrays(self):
        return self.keys, self.values

    def describe(self):
        entry = {"kind": WINDOW, "offset": self.offset, "window": self.window}
        return entry, {}, dict(zip("kv", self.state)) if self.held else {}

    @classmethod
    def rebuild(cls, entry, arrays):
        c = cls(entry.get("window") or entry["max_size"])
        if entry["offset"]:
            k, v = arrays["k"], arrays["v"]
            if entry["kind"] == ROTATING:  # unroll the ring: oldest first
                k, v = (_unrolled(x, entry["idx"], entry["offset"]) for x in (k, v))
            c.keys, c.values, c.live, c.offset = k, v, k.shape[2], entry["offset"]
        return c

    @classmethod
    def check_entry(cls, entry, n):
        if entry["kind"] == ROTATING:
            _check_ring(entry, n)
            return
        tensors, window = entry["tensors"], entry.get("window")
        if not (type(window) is int and window > 0):
            raise ValueError("bad window")
        if n:
            k, v = tensors.get("k"), tensors.get("v")
            if set(tensors) != {"k", "v"} or len(k) != 4 or len(v) != 4 or k[0] not in FLOATS or v[0] != k[0]:
                raise ValueError("missing or bad window tensors")
            # It holds all n tokens, or at least the window's (window - 1 and the newest).
            if k[1:3] != v[1:3] or not (k[2] == n or window - 1 <= k[2] <= n):
                raise ValueError(f"window shapes {k} {v} do not fit {n} tokens")
        elif tensors:
            raise ValueError("an empty window with tensors")

    @classmethod
    def blocked_names(cls, entry):
        return []

    @classmethod
    def ring_names(cls, entry):
        return ["k", "v"]

    @classmethod
    def replacing(cls, cache, bits, group_size):
        if not isinstance(cache, RotatingKVCache):
            return None
        if cache.keep:
            raise ValueError("sliding layers that keep leading tokens cannot be batched")
        return cls(cache.max_size)


def _check_ring(entry, n: int) -> None:
    """An mlx-lm ring's entry (``ROTATING``)."""
    tensors, size, keep, idx = entry["tensors"], entry.get("max_size"), entry.get("keep"), entry.get("idx")
    if not (type(size) is int and size > 0 and type(keep) is int and 0 <= keep < size and type(idx) is int):
        raise ValueError("bad ring metadata")
    if n:
        k, v = tensors.get("k"), tensors.get("v")
        if set(tensors) != {"k", "v"} or len(k) != 4 or len(v) != 4 or k[0] not in FLOATS or v[0] != k[0]:
            raise ValueError("missing or bad ring tensors")
        live = k[2]
        # A ring holds all n tokens, or is full (max_size, or more just after a multi-token chunk).
        if k[1:3] != v[1:3] or not (live == n or size <= live <= n) or not 0 <= idx <= live:
            raise ValueError(f"ring shapes {k} {v} (index {idx}) do not fit {n} tokens")
    elif tensors:
        raise ValueError("an empty ring with tensors")


def _unrolled(ring: mx.array, idx: int, offset: int) -> mx.array:
    """An mlx-lm ring's tokens in temporal order (its ``_temporal_order``, keep 0)."""
    if idx == ring.shape[2]:
        return ring
    if idx < offset:
        return mx.concatenate([ring[..., idx:, :], ring[..., :idx, :]], axis=2)
    return ring[..., :idx, :]
