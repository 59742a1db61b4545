"""Cache files: an agent's KV cache for one model, kept on disk between turns.

One safetensors file per (agent, model). Quantized layers keep their Q4/Q8
triples exactly as the engine holds them (sliced to the live tokens, never
dequantized); sliding-window layers keep mlx-lm's full-precision ring. The
layout is documented in ``docs/cache-format.md``; in short, for a 2-layer
model whose layer 1 is sliding:

    [u64 header length][JSON header, space padded to 8 bytes][tensor bytes]
    header = {"__metadata__": {"checksum": "sha256:<64 hex>", "format": ...},
              "layer_0_k_weights": {...}, "layer_0_k_scales": {...}, ...,
              "layer_1_k": {...}, "layer_1_v": {...}}

The checksum covers the whole file with its own 64 hex digits read as zeros,
so a flipped byte in the header (a token id, the text) is caught as surely as
one in the tensors. The writer puts it first so it sits at a fixed offset.

We write and read the container ourselves rather than through
``safetensors.mlx``: that goes through numpy, which has no bfloat16, and
serializes the whole file in memory. Here tensors stream to disk one at a
time and are read back one at a time from a single open file, hashed as they
arrive, so nothing can change between verifying and loading. The result is
plain safetensors: any safetensors reader opens it.

``save``, ``encode`` and ``load`` touch MLX arrays: call them from the thread
that owns MLX. ``write_atomic`` (the bytes ``encode`` made), ``read_meta``,
``verify`` and the store's listings touch bytes only, on any thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import secrets
import struct
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache

from .batch_cache import DequantizingKVCache, SequenceQuantizedKVCache
from .errors import SemanticError

__all__ = [
    "FORMAT_VERSION",
    "CacheFileError",
    "CacheRecord",
    "CacheStore",
    "InvalidAgentId",
    "encode",
    "load",
    "model_key",
    "read_meta",
    "save",
    "validate_agent_id",
    "verify",
    "write_atomic",
]

log = logging.getLogger("semantic.cache")

FORMAT = "semantic-kv-cache"
FORMAT_VERSION = 1
SUFFIX = ".safetensors"
MAX_AGENT_ID = 128
_AGENT_CHARS = re.compile(r"[A-Za-z0-9._:@-]+")
_TMP = ".tmp-"  # temp files start with '.', which no agent id may: never taken for a cache
_STALE_TMP_S = 3600.0  # no save takes an hour: an older temp file is stale whatever its pid
_MAX_HEADER = 100 << 20  # safetensors' own limit
_CHUNK = 1 << 20
_PREFIX = b'{"__metadata__":{"checksum":"sha256:'
_SUM_AT = 8 + len(_PREFIX)  # file offset of the checksum's hex digits
_ZERO_SUM = "0" * 64

QUANTIZED, DEQUANTIZING, ROTATING = "quantized", "dequantizing", "rotating"
_PARTS = ("weights", "scales", "biases")

# safetensors dtype name -> (MLX dtype, numpy dtype of the raw bytes); bfloat16 travels as uint16.
_DTYPES = {
    "U32": (mx.uint32, np.dtype("<u4")),
    "F16": (mx.float16, np.dtype("<f2")),
    "BF16": (mx.bfloat16, np.dtype("<u2")),
    "F32": (mx.float32, np.dtype("<f4")),
}
_NAMES = {mx_dt: name for name, (mx_dt, _) in _DTYPES.items()}
_FLOATS = ("F16", "BF16", "F32")

assert sys.byteorder == "little", "safetensors is little-endian and tensors are written as they lie in memory"


class InvalidAgentId(SemanticError, ValueError):
    """An agent id that cannot name a cache file; the message names the broken rule."""


class CacheFileError(SemanticError):
    """A cache file that cannot be used. ``reason`` is one of: ``missing``,
    ``unreadable``, ``truncated``, ``unparsable``, ``old format``, ``newer format``,
    ``other model``, ``other spec``, ``other agent``, ``bad layout``, ``bad checksum``."""

    def __init__(self, path: os.PathLike | str, reason: str, detail: str):
        super().__init__(f"cache file {os.fspath(path)} is unusable ({reason}): {detail}")
        self.path = Path(path)
        self.reason = reason
        self.detail = detail


def validate_agent_id(agent_id: str) -> str:
    """Return ``agent_id`` if it may name a cache file, else raise ``InvalidAgentId``.

    Allowed: 1 to 128 ASCII characters from ``A-Z a-z 0-9 . _ : @ -``, not
    starting with '.' (so not '.' or '..', and never a hidden or temp file).
    Ids are case-sensitive; on a case-insensitive file system (macOS by
    default) two ids that differ only in case share one file: ``CacheStore.load``
    sees the other agent's id in it, quarantines it and starts cold, so neither
    ever gets the other's cache.
    """
    if not isinstance(agent_id, str):
        raise InvalidAgentId(f"agent id must be a string, not {type(agent_id).__name__}")
    if not agent_id:
        raise InvalidAgentId("agent id may not be empty")
    if len(agent_id) > MAX_AGENT_ID:
        raise InvalidAgentId(f"agent id may be at most {MAX_AGENT_ID} characters, not {len(agent_id)}")
    if "\x00" in agent_id:
        raise InvalidAgentId("agent id may not contain NUL")
    if any(ord(c) < 32 or ord(c) == 127 for c in agent_id):
        raise InvalidAgentId("agent id may not contain control characters")
    for sep in ("/", "\\"):
        if sep in agent_id:
            raise InvalidAgentId(f"agent id may not contain {sep!r}")
    if agent_id in (".", ".."):
        raise InvalidAgentId("agent id may not be '.' or '..'")
    if agent_id.startswith("."):
        raise InvalidAgentId("agent id may not start with '.'")
    if not _AGENT_CHARS.fullmatch(agent_id):
        bad = next(c for c in agent_id if not _AGENT_CHARS.fullmatch(c))
        raise InvalidAgentId(f"agent id may contain only A-Z a-z 0-9 . _ : @ -, not {bad!r}")
    return agent_id


@dataclass
class CacheRecord:
    """An agent's cache and what it covers: ``cache[L].offset == len(tokens)`` for every layer."""

    agent_id: str
    model_id: str
    spec_hash: str  # ModelCacheSpec.hash of the model the cache was computed with
    tokens: list[int]  # exactly the token ids whose K/V the cache holds
    text: str  # the prompt text those tokens came from
    created: float  # unix time
    updated: float  # unix time
    cache: list  # per layer: SequenceQuantizedKVCache, DequantizingKVCache or RotatingKVCache


# -- writing ---------------------------------------------------------------


def save(path: os.PathLike | str, record: CacheRecord) -> None:
    """Write ``record`` to ``path`` atomically: a reader sees the old file or the new one.

    Raises ``InvalidAgentId`` for a bad agent id, ``ValueError`` for a cache that
    does not match its tokens or has unsupported layers (before touching the
    disk), ``OSError`` from the disk. On any exception, KeyboardInterrupt
    included, the temp file is removed and the previous file stays as it was.
    Evaluates the cache arrays; memory grows by at most one tensor.
    """
    path = Path(path)
    head, tensors = _prepare(record)

    # One pass: hash as we write, then patch the digest over the zeros (same length).
    digest = hashlib.sha256(head)

    def write(f: BinaryIO) -> None:
        f.write(head)
        for _, a in tensors:
            raw = _raw(a)  # one tensor materialised at a time
            f.write(raw)
            digest.update(raw)
            del raw
        f.seek(_SUM_AT)
        f.write(digest.hexdigest().encode())

    _write_atomic(path, write)


def encode(record: CacheRecord) -> bytearray:
    """The whole cache file for ``record``, checksum included, as bytes in memory.

    For writers that must not touch MLX: the owner of the MLX arrays encodes
    (this evaluates and copies them), another thread writes the bytes with
    ``write_atomic``.  ``save`` is the same file streamed to disk.  Raises what
    ``save`` raises before it touches the disk.
    """
    head, tensors = _prepare(record)
    data = bytearray(head)
    for _, a in tensors:
        data += _raw(a)
    data[_SUM_AT:_SUM_AT + 64] = hashlib.sha256(data).hexdigest().encode()
    return data


def write_atomic(path: os.PathLike | str, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync the
    directory): a reader sees the old file or the new one, never a part.  Touches
    no MLX array; safe on any thread.  Raises ``OSError``; the temp file never stays."""

    def write(f: BinaryIO) -> None:
        f.write(data)

    _write_atomic(Path(path), write)


def _write_atomic(path: Path, write) -> None:
    tmp = path.parent / f"{_TMP}{os.getpid()}-{secrets.token_hex(4)}-{path.stem}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with open(fd, "wb") as f:
            write(f)
            f.flush()
            _fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)  # makes the rename itself durable


def _prepare(record: CacheRecord) -> tuple[bytes, list[tuple[str, mx.array]]]:
    """(length prefix + header with a zero checksum, tensors in file order, still lazy)."""
    validate_agent_id(record.agent_id)
    tensors, layers, quant = _flatten(record)
    offsets, at = {}, 0
    for name, a in tensors:
        offsets[name] = {"dtype": _NAMES[a.dtype], "shape": list(a.shape), "data_offsets": [at, at + a.nbytes]}
        at += a.nbytes
    meta = {
        "checksum": "sha256:" + _ZERO_SUM,  # first, at _SUM_AT; patched once the bytes are hashed
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "agent_id": record.agent_id,
        "model_id": record.model_id,
        "spec_hash": record.spec_hash,
        "token_count": str(len(record.tokens)),
        "tokens": json.dumps([int(t) for t in record.tokens], separators=(",", ":")),
        "text": record.text,
        "created": repr(float(record.created)),
        "updated": repr(float(record.updated)),
        "bits": str(quant[0]) if quant else "",
        "group_size": str(quant[1]) if quant else "",
        "layers": json.dumps(layers, separators=(",", ":")),
    }
    body = json.dumps({"__metadata__": meta, **offsets}, separators=(",", ":")).encode()
    assert body.startswith(_PREFIX), "the checksum must lead the header"
    body += b" " * (-len(body) % 8)  # safetensors pads the header so tensor data is 8-byte aligned
    if len(body) > _MAX_HEADER:
        raise ValueError(f"header of {len(body)} bytes (token ids and text) exceeds safetensors' {_MAX_HEADER}")
    return struct.pack("<Q", len(body)) + body, tensors


def _flatten(record: CacheRecord) -> tuple[list[tuple[str, mx.array]], list[dict], tuple[int, int] | None]:
    """(tensors in file order, still lazy; per-layer metadata; (bits, group size) or None)."""
    n = len(record.tokens)
    tensors, layers, quant = [], [], set()
    for i, c in enumerate(record.cache):
        if isinstance(c, (DequantizingKVCache, QuantizedKVCache)):
            q = c.quantized if isinstance(c, DequantizingKVCache) else c
            kind = DEQUANTIZING if isinstance(c, DequantizingKVCache) else QUANTIZED
            _check_offset(i, q.offset, n)
            layers.append({"kind": kind, "offset": q.offset, "bits": q.bits, "group_size": q.group_size})
            quant.add((q.bits, q.group_size))
            if q.offset:
                for kv, triple in (("k", q.keys), ("v", q.values)):
                    for part, x in zip(_PARTS, triple):
                        tensors.append((f"layer_{i}_{kv}_{part}", x[..., : q.offset, :]))
        elif isinstance(c, RotatingKVCache):
            _check_offset(i, c.offset, n)
            # Past ``offset`` a ring buffer holds only never-written capacity.
            live = 0 if c.keys is None else min(c.offset, c.keys.shape[2])
            if not 0 <= c._idx <= live:
                raise ValueError(f"layer {i}: ring index {c._idx} outside its {live} live slots")
            layers.append({"kind": ROTATING, "offset": c.offset, "max_size": c.max_size, "keep": c.keep, "idx": c._idx})
            if live:
                tensors += [(f"layer_{i}_k", c.keys[..., :live, :]), (f"layer_{i}_v", c.values[..., :live, :])]
        else:
            raise ValueError(f"layer {i}: cannot save a {type(c).__name__}")
    if len(quant) > 1:
        raise ValueError(f"quantized layers disagree on (bits, group size): {sorted(quant)}")
    for name, a in tensors:
        if a.dtype not in _NAMES:
            raise ValueError(f"{name}: cannot save dtype {a.dtype}")
    return tensors, layers, next(iter(quant), None)


def _check_offset(layer: int, offset: int, n: int) -> None:
    if offset != n:
        raise ValueError(f"layer {layer} holds {offset} tokens but the record lists {n} token ids")


def _raw(a: mx.array) -> memoryview:
    """The array's bytes, row-major; bfloat16 reinterpreted as uint16 (numpy has no bfloat16)."""
    a = mx.contiguous(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a)
    mx.eval(a)
    return memoryview(a).cast("B")


def _fsync(fd: int) -> None:
    # macOS fsync stops at the drive's cache; F_FULLFSYNC reaches the platter.
    if sys.platform == "darwin":
        import fcntl

        try:
            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)
            return
        except OSError:
            pass
    os.fsync(fd)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# -- reading ---------------------------------------------------------------


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
    with _open(path) as f:
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
    with _open(path) as f:
        header, info = _checked_header(path, f, model_id, spec_hash, agent_id)
        _read_tensors(path, f, header, info["checksum"], keep=False)
    return info


def load(
    path: os.PathLike | str,
    *,
    model_id: str,
    spec_hash: str,
    agent_id: str | None = None,
) -> CacheRecord:
    """Read a cache file back as a ``CacheRecord`` whose caches continue exactly
    as the saved ones would.

    Checks the format version, model id, spec hash (and agent id if given),
    that every tensor's dtype and shape match the layer metadata, and the
    checksum. Tensors are read one at a time from one open file and hashed as
    they arrive, so memory peaks at the cache plus one tensor. Raises
    ``CacheFileError`` with a ``reason`` on any failure, never anything else.
    """
    with _open(path) as f:
        header, info = _checked_header(path, f, model_id, spec_hash, agent_id)
        arrays = _read_tensors(path, f, header, info["checksum"], keep=True)
    cache = [_rebuild(i, layer, arrays) for i, layer in enumerate(info["layers"])]
    return CacheRecord(
        agent_id=info["agent_id"],
        model_id=info["model_id"],
        spec_hash=info["spec_hash"],
        tokens=info["tokens"],
        text=info["text"],
        created=info["created"],
        updated=info["updated"],
        cache=cache,
    )


class _open:
    """``open(path, 'rb')`` unbuffered, with OS errors turned into ``CacheFileError``."""

    def __init__(self, path):
        self.path = path

    def __enter__(self) -> BinaryIO:
        try:
            self.f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CacheFileError(self.path, "missing", "no such file") from None
        except OSError as e:
            raise CacheFileError(self.path, "unreadable", e.strerror or str(e)) from None
        return self.f

    def __exit__(self, kind, e, tb):
        self.f.close()
        if isinstance(e, OSError):
            raise CacheFileError(self.path, "unreadable", e.strerror or str(e)) from e


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
        doc = json.loads(raw)
    except (ValueError, RecursionError) as e:  # bad UTF-8, bad JSON, absurd nesting
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
            assert dtype in _DTYPES and all(type(d) is int and d >= 0 for d in (*shape, start, end))
        except (AssertionError, KeyError, TypeError, ValueError):
            raise CacheFileError(path, "unparsable", f"bad entry for tensor {name!r}") from None
        tensors.append(_Tensor(name, dtype, shape, start, end))
    tensors.sort(key=lambda t: t.start)
    at = 0
    for t in tensors:  # contiguous, in order, each exactly as long as its shape says
        if t.start != at or t.end - t.start != math.prod(t.shape) * _DTYPES[t.dtype][1].itemsize:
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
    if version != FORMAT_VERSION:
        which = "old format" if version < FORMAT_VERSION else "newer format"
        raise CacheFileError(path, which, f"format version {version}, this Semantic reads {FORMAT_VERSION}")
    if not header.raw[8:].startswith(_PREFIX):  # checked after the version: other versions may differ
        raise CacheFileError(path, "unparsable", "the checksum does not lead the header")
    try:
        info = {
            "format_version": version,
            "agent_id": meta["agent_id"],
            "model_id": meta["model_id"],
            "spec_hash": meta["spec_hash"],
            "token_count": int(meta["token_count"]),
            "tokens": json.loads(meta["tokens"]),
            "text": meta["text"],
            "created": float(meta["created"]),
            "updated": float(meta["updated"]),
            "bits": int(meta["bits"]) if meta["bits"] else None,
            "group_size": int(meta["group_size"]) if meta["group_size"] else None,
            "layers": json.loads(meta["layers"]),
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
        if kind in (QUANTIZED, DEQUANTIZING):
            bits, group = m.get("bits"), m.get("group_size")
            if bits not in (4, 8) or group not in (32, 64, 128):
                raise bad(f"layer {i}: unsupported bits {bits!r} / group size {group!r}")
            heads = set()
            for kv in ("k", "v") if n else ():
                w, s, b = (tensors.get(f"layer_{i}_{kv}_{p}") for p in _PARTS)
                if not (w and s and b):
                    raise bad(f"layer {i}: missing {kv} triple")
                ok = (
                    w.dtype == "U32" and s.dtype in _FLOATS and b.dtype == s.dtype
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
                if not (k and v and k.dtype in _FLOATS and v.dtype == k.dtype and len(k.shape) == len(v.shape) == 4):
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


def _read_tensors(path, f: BinaryIO, header: _Header, checksum: str, *, keep: bool) -> dict[str, mx.array]:
    """Stream the data region in file order, hashing as we go; with ``keep`` build
    each tensor as an MLX array. Raises ``CacheFileError`` (bad checksum, truncated)."""
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
            mx_dtype, np_dtype = _DTYPES[t.dtype]
            a = mx.array(buf.view(np_dtype).reshape(t.shape))
            arrays[t.name] = a.view(mx.bfloat16) if mx_dtype == mx.bfloat16 else a
    if "sha256:" + digest.hexdigest() != checksum:
        raise CacheFileError(path, "bad checksum", "the bytes are not the ones written")
    return arrays


def _rebuild(i: int, m: dict, arrays: dict[str, mx.array]):
    """One layer's cache object, as the engine would hold it after the same tokens."""
    if m["kind"] == ROTATING:
        c = RotatingKVCache(m["max_size"], m["keep"])
        if m["offset"]:
            c.state = (arrays[f"layer_{i}_k"], arrays[f"layer_{i}_v"], m["offset"], m["keep"], m["max_size"], m["idx"])
        return c
    q = SequenceQuantizedKVCache(m["group_size"], m["bits"])
    if m["offset"]:
        q.keys = tuple(arrays[f"layer_{i}_k_{p}"] for p in _PARTS)
        q.values = tuple(arrays[f"layer_{i}_v_{p}"] for p in _PARTS)
        q.offset = m["offset"]
    return DequantizingKVCache(quantized=q) if m["kind"] == DEQUANTIZING else q


# -- the store -------------------------------------------------------------


def model_key(model_id: str) -> str:
    """A directory name for ``model_id``: a readable slug plus 8 hex digits of its sha256
    (slugs collide, 'a/b' and 'a-b'; the hash tells them apart)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_id).strip(".-")[:48] or "model"
    return f"{slug}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


class CacheStore:
    """Cache files under ``root``: ``root/<model_key(model_id)>/<agent_id>.safetensors``,
    bad files moved to ``root/quarantine/``.

    One owner (the persistence side of the GPU actor); several processes may
    share a root, as every write is an atomic rename. Creating a store removes
    temp files left by writers that died (their pid is gone, or they are over an
    hour old).
    """

    QUARANTINE = "quarantine"

    def __init__(self, root: os.PathLike | str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._clean_temp()

    def path(self, agent_id: str, model_id: str) -> Path:
        """Where the cache of ``agent_id`` for ``model_id`` lives. Raises ``InvalidAgentId``."""
        return self.root / model_key(model_id) / f"{validate_agent_id(agent_id)}{SUFFIX}"

    def save(self, record: CacheRecord) -> Path:
        """Write ``record`` (replacing the agent's file for that model) and return its path.
        Raises ``InvalidAgentId``, ``ValueError`` (cache and tokens disagree) or ``OSError``."""
        path = self.path(record.agent_id, record.model_id)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root)
        save(path, record)
        return path

    def write_encoded(self, agent_id: str, model_id: str, data: bytes | bytearray) -> Path:
        """Write a file made by ``encode`` as the agent's cache for ``model_id`` (atomic;
        touches no MLX array, so any thread may call it).  Raises ``InvalidAgentId``, ``OSError``."""
        path = self.path(agent_id, model_id)
        if not path.parent.is_dir():
            path.parent.mkdir(parents=True, exist_ok=True)
            _fsync_dir(self.root)
        write_atomic(path, data)
        return path

    def load(self, agent_id: str, model_id: str, spec_hash: str) -> CacheRecord | None:
        """The agent's cache for this model, or None: absent, or unusable. An unusable
        file is moved to quarantine with one warning on ``semantic.cache``; the agent
        starts cold. Raises only ``InvalidAgentId``."""
        path = self.path(agent_id, model_id)
        try:
            return load(path, model_id=model_id, spec_hash=spec_hash, agent_id=agent_id)
        except CacheFileError as e:
            if e.reason == "missing":
                return None
            self._quarantine(path, e)
            return None

    def delete(self, agent_id: str, model_id: str | None = None) -> int:
        """Remove the agent's cache for ``model_id`` (every model if None); return how
        many files went. Quarantined files stay. Raises ``InvalidAgentId``."""
        validate_agent_id(agent_id)
        dirs = [self.root / model_key(model_id)] if model_id is not None else self._model_dirs()
        removed = 0
        for d in dirs:
            try:
                (d / f"{agent_id}{SUFFIX}").unlink()
                removed += 1
            except FileNotFoundError:
                pass
        return removed

    def entries(self) -> list[dict]:
        """One dict per readable cache file (agent, model, tokens, bytes, updated, path),
        from headers alone; files whose header is unusable are left out (see ``verify``)."""
        out = []
        for path in self._files():
            try:
                m = read_meta(path)
            except CacheFileError:
                continue
            out.append(
                dict(agent=m["agent_id"], model=m["model_id"], tokens=m["token_count"],
                     bytes=m["bytes"], updated=m["updated"], path=path)
            )
        return out

    def verify(self) -> list[tuple[Path, bool, str]]:
        """Check every cache file in full: (path, ok, reason), reason 'ok' when it is.
        A file must also sit where its own header says it belongs. Moves nothing."""
        out = []
        for path in self._files():
            try:
                m = verify(path, agent_id=path.name[: -len(SUFFIX)])
                if model_key(m["model_id"]) != path.parent.name:
                    raise CacheFileError(path, "other model", f"file is for {m['model_id']!r}")
                out.append((path, True, "ok"))
            except CacheFileError as e:
                out.append((path, False, e.reason))
        return out

    def disk_bytes(self) -> int:
        """Bytes of every file under the root, quarantine and temp files included."""
        total = 0
        for p in self.root.rglob("*"):
            try:
                if p.is_file():
                    total += p.stat().st_size
            except OSError:  # removed while we walk
                pass
        return total

    # -- internals --

    def _model_dirs(self) -> list[Path]:
        return sorted(
            d for d in self.root.iterdir() if d.is_dir() and d.name != self.QUARANTINE and not d.name.startswith(".")
        )

    def _files(self) -> list[Path]:
        """Cache files: ``<valid agent id>.safetensors`` in a model directory (never temp files)."""
        out = []
        for d in self._model_dirs():
            for p in sorted(d.glob(f"*{SUFFIX}")):
                try:
                    validate_agent_id(p.name[: -len(SUFFIX)])
                except InvalidAgentId:
                    continue
                out.append(p)
        return out

    def _quarantine(self, path: Path, error: CacheFileError) -> None:
        ns = time.time_ns()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
        name = f"{path.parent.name}--{path.stem}--{stamp}--{error.reason.replace(' ', '-')}"
        dest = self.root / self.QUARANTINE / name
        try:
            dest.parent.mkdir(exist_ok=True)
            os.replace(path, dest)
            where = f"moved to {dest}"
        except OSError as e:
            where = f"could not be moved aside ({e.strerror or e})"
        log.warning("cache of agent %r is unusable (%s: %s), %s; the agent starts cold",
                    path.stem, error.reason, error.detail, where)

    def _clean_temp(self) -> None:
        now = time.time()
        for d in self._model_dirs():
            for p in d.glob(f"{_TMP}*"):
                try:
                    pid = int(p.name[len(_TMP) :].split("-", 1)[0])
                except ValueError:
                    pid = None
                try:
                    if pid is None or not _alive(pid) or now - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()
                except FileNotFoundError:  # its writer renamed it meanwhile
                    pass


def _alive(pid: int) -> bool:
    if pid <= 0:  # 0 and -1 would signal whole groups: no writer has such a pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
