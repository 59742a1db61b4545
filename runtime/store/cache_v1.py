"""Version 1 cache files: one safetensors file per (agent, model), listed,
verified and carried in archives, never loaded.

Caches are written in the block layout now (``runtime.store.cache_file``); a
version 1 file's Q4 rows are not what a token sees today, so the agent's
history is prefilled again and its next write replaces the file. The
layout is in ``docs/cache-format.md``; in short:

    [u64 header length][JSON header, space padded to 8 bytes][tensor bytes]
    header = {"__metadata__": {"checksum": "sha256:<64 hex>", "format": ...},
              "layer_0_k_weights": {...}, "layer_0_k_scales": {...}, ...}

The checksum covers the whole file with its own 64 hex digits read as zeros.
Tensors are read one at a time from one open file, hashed as they arrive.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import struct
from dataclasses import dataclass
from typing import BinaryIO

import numpy as np

from ..cache_records import DTYPES, FLOATS, FORMAT, CacheFileError, open_checked
from ..text.json_reader import JSONError, read_json

__all__ = ["SUFFIX", "VERSION", "read_meta", "verify"]

SUFFIX = ".safetensors"
VERSION = 1
_MAX_HEADER = 100 << 20  # safetensors' own limit
_CHUNK = 1 << 20
_PREFIX = b'{"__metadata__":{"checksum":"sha256:'
_SUM_AT = 8 + len(_PREFIX)  # file offset of the checksum's hex digits
_ZERO_SUM = "0" * 64
QUANTIZED, ROTATING, _DEQUANTIZING = "quantized", "rotating", "dequantizing"  # version 1's layer kinds and tensor parts
_PARTS = ("weights", "scales", "biases")


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: str  # safetensors name: U32, F16, BF16, F32
    shape: tuple[int, ...]
    start: int  # offsets in the data region
    end: int


@dataclass(frozen=True)
class _Header:
    raw: bytes  # length prefix + JSON, as on disk
    meta: dict[str, str]
    tensors: list[_Tensor]  # in file order
    size: int  # file size


def read_meta(path: os.PathLike | str) -> dict:
    """The header of a cache file, parsed, without reading or checking the tensors.

    Keys: format_version, agent_id, model_id, spec_hash, token_count, tokens,
    text, created, updated, bits, group_size (None if no quantized layer),
    layers (per-layer dicts), checksum, bytes (file size). Raises
    ``CacheFileError`` if the file is missing, unreadable, truncated, not a
    cache file or of another format version.
    """
    with open_checked(path) as f:
        return _parse(path, _read_header(path, f))


def verify(
    path: os.PathLike | str,
    *,
    model_id: str | None = None,
    spec_hash: str | None = None,
    agent_id: str | None = None,
) -> dict:
    """Check a whole cache file (header, layout and checksum, streamed in 1 MiB
    chunks) and, where given, that it is for this model, spec and agent.
    Returns ``read_meta``'s dict; raises ``CacheFileError``."""
    with open_checked(path) as f:
        header, info = _checked_header(path, f, model_id, spec_hash, agent_id)
        _read_tensors(path, f, header, info["checksum"], keep=False)
    return info


def _read_exact(path, f: BinaryIO, n: int, what: str) -> bytes:
    chunks, got = [], 0
    while got < n:
        b = f.read(n - got)
        if not b:
            raise CacheFileError(path, "truncated", f"file ends inside the {what}")
        chunks.append(b)
        got += len(b)
    return b"".join(chunks)


def _read_header(path, f: BinaryIO) -> _Header:
    size = os.fstat(f.fileno()).st_size
    if size < 8:
        raise CacheFileError(path, "truncated", f"{size} bytes, not even a header length")
    (n,) = struct.unpack("<Q", _read_exact(path, f, 8, "header length"))
    if n > _MAX_HEADER:
        raise CacheFileError(path, "unparsable", f"header length {n} is not plausible")
    if 8 + n > size:
        raise CacheFileError(path, "truncated", f"header of {n} bytes but the file has {size}")
    raw = _read_exact(path, f, n, "header")
    try:
        doc = read_json(raw, "header")
    except JSONError as e:  # bad UTF-8, bad JSON, absurd nesting
        raise CacheFileError(path, "unparsable", f"header is not JSON: {e}") from None
    meta = doc.get("__metadata__") if isinstance(doc, dict) else None
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise CacheFileError(path, "unparsable", "no text metadata in the header")
    if meta.get("format") != FORMAT:
        raise CacheFileError(path, "unparsable", "not a Semantic cache file")
    tensors = []
    for name, t in doc.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = t["dtype"], tuple(t["shape"]), t["data_offsets"]
            assert dtype in DTYPES and all(type(d) is int and d >= 0 for d in (*shape, start, end))
        except (AssertionError, KeyError, TypeError, ValueError):
            raise CacheFileError(path, "unparsable", f"bad entry for tensor {name!r}") from None
        tensors.append(_Tensor(name, dtype, shape, start, end))
    tensors.sort(key=lambda t: t.start)
    at = 0
    for t in tensors:  # contiguous, in order, each exactly as long as its shape says
        if t.start != at or t.end - t.start != math.prod(t.shape) * DTYPES[t.dtype][1].itemsize:
            raise CacheFileError(path, "bad layout", f"tensor {t.name!r} has the wrong byte range")
        at = t.end
    if size < 8 + n + at:
        raise CacheFileError(path, "truncated", f"{size} bytes, the header promises {8 + n + at}")
    if size > 8 + n + at:
        raise CacheFileError(path, "bad layout", f"{size - 8 - n - at} bytes after the last tensor")
    return _Header(struct.pack("<Q", n) + raw, meta, tensors, size)


def _parse(path, header: _Header) -> dict:
    """The metadata as typed values, checked for consistency with itself."""
    meta = header.meta
    try:
        version = int(meta["format_version"])
    except (KeyError, ValueError):
        raise CacheFileError(path, "unparsable", "no format version") from None
    if version != VERSION:
        which = "old format" if version < VERSION else "newer format"
        raise CacheFileError(path, which, f"format version {version}, this reader reads {VERSION}")
    if not header.raw[8:].startswith(_PREFIX):  # checked after the version: other versions may differ
        raise CacheFileError(path, "unparsable", "the checksum does not lead the header")
    try:
        info = {
            "format_version": version,
            "agent_id": meta["agent_id"],
            "model_id": meta["model_id"],
            "spec_hash": meta["spec_hash"],
            "token_count": int(meta["token_count"]),
            "tokens": read_json(meta["tokens"], "tokens"),
            "text": meta["text"],
            "created": float(meta["created"]),
            "updated": float(meta["updated"]),
            "bits": int(meta["bits"]) if meta["bits"] else None,
            "group_size": int(meta["group_size"]) if meta["group_size"] else None,
            "layers": read_json(meta["layers"], "layers"),
            "checksum": meta["checksum"],
            "bytes": header.size,
        }
    except (KeyError, ValueError, RecursionError) as e:
        raise CacheFileError(path, "unparsable", f"bad metadata: {e!r}") from None
    tokens, layers = info["tokens"], info["layers"]
    if not (isinstance(tokens, list) and all(type(t) is int for t in tokens) and len(tokens) == info["token_count"]):
        raise CacheFileError(path, "unparsable", "token ids do not match the token count")
    if not (isinstance(layers, list) and all(isinstance(m, dict) for m in layers)):
        raise CacheFileError(path, "unparsable", "bad layer metadata")
    if not re.fullmatch(r"sha256:[0-9a-f]{64}", info["checksum"]):
        raise CacheFileError(path, "unparsable", "bad checksum field")
    return info


def _checked_header(path, f, model_id, spec_hash, agent_id) -> tuple[_Header, dict]:
    """Header, typed metadata; the cheap checks, before any tensor byte is read."""
    header = _read_header(path, f)
    info = _parse(path, header)
    for reason, want, have in (
        ("other model", model_id, info["model_id"]),
        ("other spec", spec_hash, info["spec_hash"]),
        ("other agent", agent_id, info["agent_id"]),
    ):
        if want is not None and want != have:
            raise CacheFileError(path, reason, f"file is for {have!r}, wanted {want!r}")
    _check_layout(path, info, {t.name: t for t in header.tensors})
    return header, info


def _check_layout(path, info: dict, tensors: dict[str, _Tensor]) -> None:
    """Every layer's tensors exist with the dtypes and shapes its metadata implies, and no others."""

    def bad(detail):
        return CacheFileError(path, "bad layout", detail)

    n, expected = info["token_count"], set()
    for i, m in enumerate(info["layers"]):
        kind, offset = m.get("kind"), m.get("offset")
        if offset != n:
            raise bad(f"layer {i} holds {offset} tokens, the file lists {n}")
        if kind in (QUANTIZED, _DEQUANTIZING):
            bits, group = m.get("bits"), m.get("group_size")
            if bits not in (4, 8) or group not in (32, 64, 128):
                raise bad(f"layer {i}: unsupported bits {bits!r} / group size {group!r}")
            heads = set()
            for kv in ("k", "v") if n else ():
                w, s, b = (tensors.get(f"layer_{i}_{kv}_{p}") for p in _PARTS)
                if not (w and s and b):
                    raise bad(f"layer {i}: missing {kv} triple")
                ok = (
                    w.dtype == "U32" and s.dtype in FLOATS and b.dtype == s.dtype
                    and len(w.shape) == 4 and w.shape[:3] == (1, w.shape[1], n) and s.shape == b.shape
                    and s.shape[:3] == w.shape[:3] and w.shape[3] * 32 // bits == s.shape[3] * group
                )
                if not ok:
                    raise bad(f"layer {i}: {kv} triple shapes {w.shape} {s.shape} {b.shape} do not fit")
                heads.add(w.shape[1])
                expected |= {w.name, s.name, b.name}
            if len(heads) > 1:
                raise bad(f"layer {i}: keys and values have different head counts")
        elif kind == ROTATING:
            size, keep, idx = m.get("max_size"), m.get("keep"), m.get("idx")
            if not (type(size) is int and size > 0 and type(keep) is int and 0 <= keep < size and type(idx) is int):
                raise bad(f"layer {i}: bad ring metadata")
            k, v = tensors.get(f"layer_{i}_k"), tensors.get(f"layer_{i}_v")
            if n:
                if not (k and v and k.dtype in FLOATS and v.dtype == k.dtype and len(k.shape) == len(v.shape) == 4):
                    raise bad(f"layer {i}: missing or bad ring tensors")
                live = k.shape[2]
                # A ring holds all n tokens, or is full (max_size, or more just after a multi-token chunk).
                if k.shape[:3] != v.shape[:3] or k.shape[0] != 1 or not (live == n or size <= live <= n):
                    raise bad(f"layer {i}: ring shapes {k.shape} {v.shape} do not fit {n} tokens")
                if not 0 <= idx <= live:
                    raise bad(f"layer {i}: ring index {idx} outside {live} slots")
                expected |= {k.name, v.name}
        else:
            raise bad(f"layer {i}: unknown kind {kind!r}")
    if extra := set(tensors) - expected:
        raise bad(f"unexpected tensors {sorted(extra)[:3]}")


def _read_tensors(path, f: BinaryIO, header: _Header, checksum: str, *, keep: bool) -> dict[str, np.ndarray]:
    """Stream the data region in file order, hashing as we go; with ``keep`` keep
    each tensor (bfloat16 as uint16). Raises ``CacheFileError`` (bad checksum, truncated)."""
    digest = hashlib.sha256(header.raw[:_SUM_AT] + _ZERO_SUM.encode() + header.raw[_SUM_AT + 64 :])
    scratch = None if keep else bytearray(_CHUNK)
    arrays = {}
    for t in header.tensors:
        n = t.end - t.start
        buf = np.empty(n, np.uint8) if keep else None
        got = 0
        while got < n:
            m = min(_CHUNK, n - got)
            view = memoryview(buf)[got : got + m] if keep else memoryview(scratch)[:m]
            k = f.readinto(view)
            if not k:
                raise CacheFileError(path, "truncated", f"file ends inside tensor {t.name!r}")
            digest.update(view[:k])
            got += k
        if keep:
            arrays[t.name] = buf.view(DTYPES[t.dtype][1]).reshape(t.shape)
    if "sha256:" + digest.hexdigest() != checksum:
        raise CacheFileError(path, "bad checksum", "the bytes are not the ones written")
    return arrays
