"""The MLX side of an agent's cache file: its layers' tensors copied out as
the bytes of blocks and a ring (``snapshot``, on the thread that owns MLX),
and the caches rebuilt from bytes read (``HostCache.build``), as the engine
would hold them after the same tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache_records import BLOCK_TOKENS, DTYPE_NAMES, BlockUpdate, CacheRecord, validate_agent_id
from ..kv import BY_KIND, SequenceCache

__all__ = ["HostCache", "snapshot"]


def snapshot(record: CacheRecord, first: int = 0) -> BlockUpdate:
    """The bytes of ``record``'s blocks from block ``first`` on, and of its rings
    (copies: the cache may change after this returns). Call on the thread that
    owns MLX; no hashing, no file I/O. Raises ``InvalidAgentId``, ``ValueError``
    (a cache that does not match its tokens, or unsupported layers)."""
    validate_agent_id(record.agent_id)
    n = len(record.tokens)
    layers, blocked, rings = _describe(record)
    if any(not 0 <= t < 2**32 for t in record.tokens):
        raise ValueError("token ids must fit in 32 bits")
    count = -(-n // BLOCK_TOKENS)
    first = max(0, min(first, count))
    start = first * BLOCK_TOKENS
    # One copy per tensor of what is new, then cut in blocks: tensor x holds tokens [at, at + rows).
    new = [(max(at, start), _host(x[..., max(0, start - at):, :])) for at, x in blocked]
    blocks = []
    for b in range(first, count):
        lo, hi = b * BLOCK_TOKENS, min(n, (b + 1) * BLOCK_TOKENS)
        data = bytearray(np.asarray(record.tokens[lo:hi], dtype="<u4").tobytes())
        for at, x in new:
            if at <= lo < at + x.shape[2]:
                data += x[..., lo - at : hi - at, :].tobytes()
        blocks.append(data)
    ring = bytearray()
    for x in rings:
        ring += _host(x).tobytes()
    return BlockUpdate(record.agent_id, record.model_id, record.spec_hash, list(record.tokens), record.text,
                       float(record.created), float(record.updated), layers, first, blocks, ring)


def _describe(record: CacheRecord) -> tuple[list[dict], list[tuple[int, mx.array]], list[mx.array]]:
    """(manifest layer entries; blocked tensors in block order, each with the first token it
    holds; ring tensors, live slots)."""
    n = len(record.tokens)
    layers, blocked, rings, quant = [], [], [], set()
    for i, c in enumerate(record.cache):
        if not hasattr(c, "describe"):
            raise ValueError(f"layer {i}: cannot save a {type(c).__name__}")
        entry, by_name, ring = c.describe()
        _check_offset(i, entry["offset"], n)
        entry["tensors"] = {}
        for name, (at, x) in by_name.items():
            entry["tensors"][name] = [_dtype_name(i, x), x.shape[1], x.shape[3], at, at + x.shape[2]]
            blocked.append((at, x))
        for name, x in ring.items():
            entry["tensors"][name] = [_dtype_name(i, x), *x.shape[1:]]
            rings.append(x)
        if "bits" in entry:
            quant.add((entry["bits"], entry["group_size"]))
        layers.append(entry)
    if len(quant) > 1:
        raise ValueError(f"quantized layers disagree on (bits, group size): {sorted(quant)}")
    return layers, blocked, rings


def _dtype_name(layer: int, x: mx.array) -> str:
    if x.dtype not in DTYPE_NAMES or x.shape[0] != 1:
        raise ValueError(f"layer {layer}: cannot save a {x.dtype} tensor of shape {x.shape}")
    return DTYPE_NAMES[x.dtype]


def _check_offset(layer: int, offset: int, n: int) -> None:
    if offset != n:
        raise ValueError(f"layer {layer} holds {offset} tokens but the record lists {n} token ids")


@dataclass(eq=False)
class HostCache:
    """A cache read from its files into host memory and checked, before any MLX
    array exists: what the reader (any thread) hands to the thread that owns
    MLX, which ``build``s the caches from it (a copy; no file I/O)."""

    record: CacheRecord  # everything but the cache (``cache`` is empty)
    layers: list[dict]  # the manifest's layer entries
    arrays: dict[str, np.ndarray]  # "layer_{i}_{name}" -> its data

    @property
    def tokens(self) -> list[int]:
        return self.record.tokens

    def build(self) -> CacheRecord:
        """The ``CacheRecord`` with its caches, as the engine would hold them after the same tokens."""
        arrays, cache = self.arrays, SequenceCache()
        for i, e in enumerate(self.layers):  # each layer's host buffers go as its arrays are made
            prefix = f"layer_{i}_"
            names = [k for k in arrays if k.startswith(prefix)]
            cache.append(BY_KIND[e["kind"]].rebuild(e, {k[len(prefix):]: _to_mx(arrays.pop(k)) for k in names}))
        return dataclasses.replace(self.record, cache=cache)


def _to_mx(x: np.ndarray) -> mx.array:
    a = mx.array(x)
    return a.view(mx.bfloat16) if x.dtype == np.dtype("<u2") else a


def _host(a: mx.array) -> np.ndarray:
    """The array in host memory (a view where MLX allows); bfloat16 as uint16."""
    a = mx.contiguous(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    mx.eval(a)
    return np.asarray(memoryview(a))
