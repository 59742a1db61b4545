"""The MLX side of an agent's cache file: its layers' tensors copied out as
the bytes of blocks and a ring (``snapshot``, on the thread that owns MLX),
and the caches rebuilt from bytes read (``HostCache.build``), as the engine
would hold them after the same tokens."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache

from .batch_cache import DequantizingKVCache, SequenceQuantizedKVCache, StateCache, WindowKVCache
from .cache_records import (BLOCK_TOKENS, DEQUANTIZING, DTYPE_NAMES, PARTS, QNAMES, QUANTIZED, ROTATING, STATE,
                            WINDOW, BlockUpdate, CacheRecord, ring_names, validate_agent_id)

__all__ = ["HostCache", "snapshot"]


def snapshot(record: CacheRecord, first: int = 0) -> BlockUpdate:
    """The bytes of ``record``'s blocks from block ``first`` on, and of its rings
    (copies: the cache may change after this returns). Call on the thread that
    owns MLX; no hashing, no file I/O. Raises ``InvalidAgentId``, ``ValueError``
    (a cache that does not match its tokens, or unsupported layers)."""
    validate_agent_id(record.agent_id)
    n = len(record.tokens)
    layers, quantized, rings = _describe(record)
    if any(not 0 <= t < 2**32 for t in record.tokens):
        raise ValueError("token ids must fit in 32 bits")
    count = -(-n // BLOCK_TOKENS)
    first = max(0, min(first, count))
    start = first * BLOCK_TOKENS
    new = [_host(x[..., start:n, :]) for x in quantized]  # one copy per tensor of what is new, then cut in blocks
    blocks = []
    for b in range(first, count):
        lo, hi = b * BLOCK_TOKENS, min(n, (b + 1) * BLOCK_TOKENS)
        data = bytearray(np.asarray(record.tokens[lo:hi], dtype="<u4").tobytes())
        for x in new:
            data += x[..., lo - start:hi - start, :].tobytes()
        blocks.append(data)
    ring = bytearray()
    for x in rings:
        ring += _host(x).tobytes()
    return BlockUpdate(record.agent_id, record.model_id, record.spec_hash, list(record.tokens), record.text,
                       float(record.created), float(record.updated), layers, first, blocks, ring)


def _describe(record: CacheRecord) -> tuple[list[dict], list[mx.array], list[mx.array]]:
    """(manifest layer entries; quantized tensors in block order, full length; ring tensors, live slots)."""
    n = len(record.tokens)
    layers, quantized, rings, quant = [], [], [], set()
    for i, c in enumerate(record.cache):
        if isinstance(c, (DequantizingKVCache, QuantizedKVCache)):
            q = c.quantized if isinstance(c, DequantizingKVCache) else c
            _check_offset(i, q.offset, n)
            entry = {"kind": DEQUANTIZING if isinstance(c, DequantizingKVCache) else QUANTIZED,
                     "offset": q.offset, "bits": q.bits, "group_size": q.group_size, "tensors": {}}
            quant.add((q.bits, q.group_size))
            if q.offset:
                for name, x in zip(QNAMES, (*q.keys, *q.values)):
                    entry["tensors"][name] = [_dtype_name(i, x), x.shape[1], x.shape[3]]
                    quantized.append(x)
            layers.append(entry)
        elif isinstance(c, StateCache):
            _check_offset(i, c.offset, n)
            entry = {"kind": STATE, "offset": c.offset, "size": len(c.cache),
                     "checkpoints": [at for at, _ in c.checkpoints], "tensors": {}}
            held = [c.cache, *(state for _, state in c.checkpoints)]
            for name, x in zip(ring_names(entry), (x for state in held for x in state)):
                if x is not None:
                    entry["tensors"][name] = [_dtype_name(i, x), *x.shape[1:]]
                    rings.append(x)
            layers.append(entry)
        elif isinstance(c, WindowKVCache):
            _check_offset(i, c.offset, n)
            entry = {"kind": WINDOW, "offset": c.offset, "window": c.window, "tensors": {}}
            if c.held:
                for name, x in zip("kv", c.state):
                    entry["tensors"][name] = [_dtype_name(i, x), *x.shape[1:]]
                    rings.append(x)
            layers.append(entry)
        else:
            raise ValueError(f"layer {i}: cannot save a {type(c).__name__}")
    if len(quant) > 1:
        raise ValueError(f"quantized layers disagree on (bits, group size): {sorted(quant)}")
    return layers, quantized, rings


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
        arrays, cache = self.arrays, []
        for i, e in enumerate(self.layers):  # each layer's host buffers go as its arrays are made
            names = [k for k in arrays if k.startswith(f"layer_{i}_")]
            cache.append(_rebuild(i, e, {k: _to_mx(arrays.pop(k)) for k in names}))
        return dataclasses.replace(self.record, cache=cache)


def _to_mx(x: np.ndarray) -> mx.array:
    a = mx.array(x)
    return a.view(mx.bfloat16) if x.dtype == np.dtype("<u2") else a


def _rebuild(i: int, m: dict, arrays: dict[str, mx.array]):
    """One layer's cache object, as the engine would hold it after the same tokens."""
    if m["kind"] == STATE:
        c = StateCache(m["size"])
        get = lambda name: arrays.get(f"layer_{i}_{name}")  # noqa: E731
        c.cache = [get(str(j)) for j in range(m["size"])]
        c.offset = m["offset"]
        c.checkpoints = [(at, [get(f"c{k}.{j}") for j in range(m["size"])]) for k, at in enumerate(m["checkpoints"])]
        return c
    if m["kind"] in (WINDOW, ROTATING):
        c = WindowKVCache(m.get("window") or m["max_size"])
        if m["offset"]:
            k, v = arrays[f"layer_{i}_k"], arrays[f"layer_{i}_v"]
            if m["kind"] == ROTATING:  # unroll the ring: oldest first
                k, v = (_unrolled(x, m["idx"], m["offset"]) for x in (k, v))
            c.keys, c.values, c.live, c.offset = k, v, k.shape[2], m["offset"]
        return c
    q = SequenceQuantizedKVCache(m["group_size"], m["bits"])
    if m["offset"]:
        q.keys = tuple(arrays[f"layer_{i}_k_{p}"] for p in PARTS)
        q.values = tuple(arrays[f"layer_{i}_v_{p}"] for p in PARTS)
        q.offset = m["offset"]
    return DequantizingKVCache(quantized=q) if m["kind"] == DEQUANTIZING else q


def _unrolled(ring: mx.array, idx: int, offset: int) -> mx.array:
    """An mlx-lm ring's tokens in temporal order (its ``_temporal_order``, keep 0)."""
    if idx == ring.shape[2]:
        return ring
    if idx < offset:
        return mx.concatenate([ring[..., idx:, :], ring[..., :idx, :]], axis=2)
    return ring[..., :idx, :]


def _host(a: mx.array) -> np.ndarray:
    """The array in host memory (a view where MLX allows); bfloat16 as uint16."""
    a = mx.contiguous(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    mx.eval(a)
    return np.asarray(memoryview(a))
