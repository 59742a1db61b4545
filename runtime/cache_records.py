"""What an agent's cache on disk is, to whoever reads or writes it: the
format's names and limits, its tensor types, the agent-id rule, the
records (a cache and what it covers; a version of it as bytes), the
errors, and the checked reader every file of it is opened with. The MLX
side is ``runtime.store.cache_codec``; the directory of files,
``runtime.store.cache_file``; version 1 files, ``runtime.store.cache_v1``; what each
layer kind writes and checks, its class in ``runtime.kv``."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import mlx.core as mx
import numpy as np

from .errors import SemanticError

__all__ = [
    "AGENT_CHARS",
    "AGENT_DIR_SUFFIX",
    "BLOCK_TOKENS",
    "DTYPES",
    "DTYPE_NAMES",
    "FLOATS",
    "FORMAT",
    "FORMAT_VERSION",
    "MANIFEST",
    "MAX_AGENT_ID",
    "MAX_TEXT_PIECES",
    "SINKS",
    "BlockUpdate",
    "CacheFileError",
    "CacheRecord",
    "InvalidAgentId",
    "StaleBlocks",
    "merged",
    "open_checked",
    "validate_agent_id",
]

FORMAT = "semantic-kv-cache"
FORMAT_VERSION = 3
BLOCK_TOKENS = 256  # the KV budget's block size, and a quantized layer's: blocks are quantized as they fill
SINKS = 4  # a quantized layer's first tokens, kept in float once their block is quantized
AGENT_DIR_SUFFIX = ".kv"  # never ".safetensors": an agent's directory and a version 1 file never share a name
MANIFEST = "manifest.json"
MAX_AGENT_ID = 128
AGENT_CHARS = re.compile(r"[A-Za-z0-9._:@-]+")
MAX_TEXT_PIECES = 32  # past this many, a save writes the text as one piece again
# safetensors dtype name -> (MLX dtype, numpy dtype of the raw bytes); bfloat16 travels as uint16.
DTYPES = {
    "U32": (mx.uint32, np.dtype("<u4")),
    "F16": (mx.float16, np.dtype("<f2")),
    "BF16": (mx.bfloat16, np.dtype("<u2")),
    "F32": (mx.float32, np.dtype("<f4")),
}
DTYPE_NAMES = {mx_dt: name for name, (mx_dt, _) in DTYPES.items()}
FLOATS = ("F16", "BF16", "F32")

assert sys.byteorder == "little", "tensors are written as they lie in memory, little-endian"


class InvalidAgentId(SemanticError, ValueError):
    """An agent id that cannot name a cache file; the message names the broken rule."""


class CacheFileError(SemanticError):
    """A cache that cannot be used. ``reason`` is one of: ``missing``, ``missing
    block``, ``unreadable``, ``truncated``, ``unparsable``, ``old format``, ``newer
    format``, ``other model``, ``other spec``, ``other agent``, ``bad layout``,
    ``bad checksum``."""

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
    if not AGENT_CHARS.fullmatch(agent_id):
        bad = next(c for c in agent_id if not AGENT_CHARS.fullmatch(c))
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
    cache: list  # per layer: SequenceQuantizedKVCache, WindowKVCache or StateCache
    format_version: int = FORMAT_VERSION  # of the files it was loaded from


class StaleBlocks(Exception):
    """An update leaves out blocks that the manifest on disk does not hold: the
    writer needs the whole cache (``snapshot(record)``)."""


@dataclass(eq=False)
class BlockUpdate:
    """A version of an agent's cache as bytes, from block ``first`` on: what the
    thread that owns MLX hands to the writer. Blocks before ``first`` are the
    ones the manifest on disk already holds for the same tokens."""

    agent_id: str
    model_id: str
    spec_hash: str
    tokens: list[int]
    text: str
    created: float
    updated: float
    layers: list[dict]  # the manifest's layer entries
    first: int  # index of blocks[0]
    blocks: list[bytearray]  # block files' bytes, blocks first, first + 1, ... up to the last
    ring: bytearray  # the sliding-window layers' file (empty: none)

    @functools.cached_property
    def nbytes(self) -> int:
        """Bytes the directory holds more while this is written, at most: its
        blocks, ring and text, and its manifest (the new one is written beside
        the old, then replaces it)."""
        files = sum(len(b) for b in self.blocks) + len(self.ring) + len(self.text.encode())
        blocks = -(-len(self.tokens) // BLOCK_TOKENS)
        manifest = len(json.dumps(self.layers, separators=(",", ":"))) + 200 * blocks + 100 * (MAX_TEXT_PIECES + 1)
        return files + manifest + 1024  # + the fields, checksum and digest


def merged(older: BlockUpdate, newer: BlockUpdate) -> BlockUpdate:
    """``newer``, also carrying the blocks before its ``first`` that only ``older``
    carried: both were pending, only the newer is written."""
    n = newer.first * BLOCK_TOKENS
    if newer.first <= older.first or older.first + len(older.blocks) < newer.first \
            or older.tokens[:n] != newer.tokens[:n]:
        return newer  # nothing to take over (or not the same tokens: the writer finds them stale)
    taken = older.blocks[: newer.first - older.first]
    return dataclasses.replace(newer, first=older.first, blocks=[*taken, *newer.blocks])


class open_checked:
    """``open(path, 'rb')`` unbuffered, with OS errors turned into ``CacheFileError``."""

    def __init__(self, path, missing: str = "missing"):
        self.path = path
        self.missing = missing

    def __enter__(self) -> BinaryIO:
        try:
            self.f = open(self.path, "rb", buffering=0)
        except FileNotFoundError:
            raise CacheFileError(self.path, self.missing, "no such file") from None
        except OSError as e:
            raise CacheFileError(self.path, "unreadable", e.strerror or str(e)) from None
        return self.f

    def __exit__(self, kind, e, tb):
        self.f.close()
        if isinstance(e, OSError):
            raise CacheFileError(self.path, "unreadable", e.strerror or str(e)) from e

