"""An agent directory's manifest (``manifest.json``): what names the files
of one version of its cache. ``seal`` makes its bytes, checksum first;
``read_manifest`` reads them back and checks them against themselves:
the fields, that blocks, layers and token count agree, and each layer's
entry through the class of its kind (``kv.BY_KIND``). The files it names
are read by ``runtime.store.cache_file``; the layout is in
``docs/cache-format.md``."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import xxhash

from ..cache_records import BLOCK_TOKENS, DTYPES, FORMAT, FORMAT_VERSION, MANIFEST, CacheFileError, open_checked
from ..text.json_reader import JSONError, read_json
from ..kv import BY_KIND

__all__ = ["CONTENT_NAME", "content_check", "named_files", "read_manifest", "seal", "text_digest", "token_chains"]

_MAX_MANIFEST = 64 << 20
CONTENT_NAME = re.compile(r"[0-9a-f]{64}\.(block|ring|text)")  # a file named by the sha256 of its bytes
CHECK = re.compile(r"[0-9a-f]{32}")


def content_check(data: bytes | bytearray) -> str:
    """A content file's ``xxh3`` in its manifest entry: the 128-bit XXH3 of its
    bytes, what loading checks them against (a tenth of a sha256's time; its
    name, the sha256, is what a save finds it by)."""
    return xxhash.xxh3_128_hexdigest(data)


def token_chains(tokens: list[int]) -> list[str]:
    """Per block, a digest of every token id up to its end: two manifests' blocks
    hold the same tokens' K/V up to block b exactly when their chains agree at b."""
    h, out = hashlib.sha256(), []
    for lo in range(0, len(tokens), BLOCK_TOKENS):
        h.update(np.asarray(tokens[lo:lo + BLOCK_TOKENS], dtype="<u4").tobytes())
        out.append(h.hexdigest()[:32])
    return out


def text_digest(text: str) -> str:
    """The first 32 hex digits of the text's sha256: a manifest's ``text_digest``, a piece's ``upto``."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def seal(manifest: dict) -> bytes:
    """The manifest's bytes, its checksum (of everything else) first."""
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    digest = hashlib.sha256(json.dumps(body, separators=(",", ":")).encode()).hexdigest()
    return json.dumps({"checksum": "sha256:" + digest, **body}, separators=(",", ":")).encode()


def read_manifest(directory: os.PathLike | str) -> dict:
    """An agent directory's manifest, parsed and checked against itself (not its
    files). Raises ``CacheFileError``: ``missing`` when there is none."""
    path = Path(directory) / MANIFEST
    with open_checked(path) as f:
        raw = f.read(_MAX_MANIFEST + 1)
    if len(raw) > _MAX_MANIFEST:
        raise CacheFileError(path, "unparsable", "manifest too large")
    try:
        m = read_json(raw, "manifest")
    except JSONError as e:
        raise CacheFileError(path, "unparsable" if raw else "truncated", f"manifest is not JSON: {e}") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CacheFileError(path, "unparsable", "not a Semantic cache manifest")
    version = m.get("format_version")
    if type(version) is not int:
        raise CacheFileError(path, "unparsable", "no format version")
    if version != FORMAT_VERSION:
        which = "old format" if version < FORMAT_VERSION else "newer format"
        raise CacheFileError(path, which, f"format version {version}, this Semantic reads {FORMAT_VERSION}")
    if seal(m) != raw:
        raise CacheFileError(path, "bad checksum", "the manifest is not the one written")
    _check_manifest(path, m)
    return m


def _check_manifest(path: Path, m: dict) -> None:
    """Types, and that blocks, layers and token count agree; raises ``CacheFileError``."""

    def bad(reason, detail):
        return CacheFileError(path, reason, detail)

    try:
        n, blocks, layers = m["token_count"], m["blocks"], m["layers"]
        ok = (type(n) is int and n >= 0 and m["block_tokens"] == BLOCK_TOKENS
              and all(isinstance(m[k], str) for k in ("agent_id", "model_id", "spec_hash"))
              and all(type(m[k]) is float for k in ("created", "updated"))
              and isinstance(m["text_digest"], str)
              and isinstance(blocks, list) and isinstance(layers, list) and isinstance(m["text"], list)
              and all(isinstance(e, dict) and CONTENT_NAME.fullmatch(str(e.get("file")))
                      and ("xxh3" not in e or CHECK.fullmatch(str(e["xxh3"])))
                      for e in (*blocks, *m["text"], *([m["ring"]] if m["ring"] else [])))
              and all(type(e.get("tokens")) is int and isinstance(e.get("chain"), str) for e in blocks)
              and all(type(e.get(k)) is int for e in m["text"] for k in ("bytes", "chars"))
              and all(isinstance(e.get("upto"), str) for e in m["text"])
              and all(isinstance(e, dict) for e in layers))
    except (KeyError, TypeError):
        ok = False
    if not ok:
        raise bad("unparsable", "bad manifest fields")
    sizes = [e["tokens"] for e in blocks]
    if sum(sizes) != n or any(s != BLOCK_TOKENS for s in sizes[:-1]) or (sizes and not 0 < sizes[-1] <= BLOCK_TOKENS):
        raise bad("bad layout", f"blocks of {sizes[:3]}... tokens do not make {n}")
    for i, e in enumerate(layers):
        if e.get("offset") != n:
            raise bad("bad layout", f"layer {i} holds {e.get('offset')} tokens, the manifest lists {n}")
        _check_layer(path, i, e, n)


def _check_layer(path: Path, i: int, e: dict, n: int) -> None:
    def bad(detail):
        return CacheFileError(path, "bad layout", f"layer {i}: {detail}")

    tensors, kind = e.get("tensors"), _kind_of(e)
    dims = 3 if kind is not None and kind.blocked else None  # a blocked tensor's entry ends with its tokens: from 0
    if not isinstance(tensors, dict) or not all(
        isinstance(t, list) and t and t[0] in DTYPES and all(type(d) is int and d > 0 for d in t[1:dims])
        and all(type(d) is int and d >= 0 for d in t[dims:] if dims)
        for t in tensors.values()
    ):
        raise bad("bad tensor entries")
    if kind is None:
        raise bad(f"unknown kind {e.get('kind')!r}")
    try:
        kind.check_entry(e, n)
    except ValueError as err:
        raise bad(str(err)) from None


def _kind_of(e: dict):
    """The class that reads a layer entry's kind (``kv.BY_KIND``), or None."""
    kind = e.get("kind")
    return BY_KIND.get(kind) if isinstance(kind, str) else None

def named_files(manifest: dict) -> set[str]:
    """The names of every file the manifest names: its blocks, ring and text pieces."""
    ring = [manifest["ring"]] if manifest["ring"] else []
    return {e["file"] for e in (*manifest["blocks"], *manifest["text"], *ring)}
