"""Agents' KV caches on disk, kept between turns: one directory per (agent, model)
of immutable token blocks and a manifest that names them.

Quantized layers keep their Q4/Q8 triples exactly as the engine holds them
(never dequantized), cut into blocks of ``BLOCK_TOKENS`` tokens; sliding-window
layers keep their full-precision tokens (``WindowKVCache``: the window and a
few hundred more), in one small file written whole each save; an mlx-lm ring
written before that reads as one. The layout is documented in
``docs/cache-format.md``; in short:

    <root>/<model key>/<agent id>.kv/manifest.json    names everything below
    <root>/<model key>/<agent id>.kv/<sha256>.block   token ids + every layer's triples for 256 tokens
    <root>/<model key>/<agent id>.kv/<sha256>.ring    the sliding-window and recurrent layers, whole
    <root>/<model key>/<agent id>.kv/<sha256>.text    a piece of the prompt text

A file is named by the sha256 of its bytes, so it never changes once written:
the previous manifest stays valid until the new one replaces it (atomically),
and a save writes only what the previous manifest lacks -- the blocks a turn
added or changed, the ring, the new text, the manifest. Loading checks every
file against the check its manifest entry records (``content_check``; its
name, for an entry written before there were checks).

Writing is split across threads: ``snapshot`` (``runtime.store.cache_codec``, on
the thread that owns MLX) copies out the bytes of the blocks from a given one
on; ``CacheStore.write``
(any thread) hashes and writes them, taking the blocks before it from the
manifest on disk. Caches of an older format (version 1: one safetensors
file per agent, ``runtime.store.cache_v1``; version 2: blocks of per-token Q4
rows) are not loaded: the agent's history is prefilled again, and its next
write replaces them. What the files hold -- records, errors, the agent-id
rule -- is ``runtime.cache_records``; the manifest that names them,
``runtime.store.cache_manifest``; what a layer of each kind writes and how its
entry is checked, the kind's class in ``runtime.kv``; the MLX side of a
block, ``runtime.store.cache_codec``; writing a file atomically, ``runtime.files``.

(Long on purpose: the store is one class whose directory layout, quarantine
and crash rules hold together; split, each part would need the others'
private paths.)
"""

from __future__ import annotations

import hashlib
import logging
import math
import os
import re
import time
from pathlib import Path

import numpy as np

from . import cache_v1
from .cache_codec import HostCache, snapshot
from .cache_manifest import CONTENT_NAME, content_check, named_files, read_manifest, seal, text_digest, token_chains
from ..cache_records import (AGENT_DIR_SUFFIX, BLOCK_TOKENS, DTYPES, FORMAT, FORMAT_VERSION, MANIFEST, MAX_TEXT_PIECES,
                            BlockUpdate, CacheFileError, CacheRecord, InvalidAgentId, StaleBlocks, open_checked,
                            validate_agent_id)
from ..files import TMP_PREFIX, file_size, fsync_dir, pid_alive, remove_tree, tree_bytes, write_atomic
from ..kv import BY_KIND

__all__ = ["CacheStore", "load", "model_key", "read", "read_manifest"]

log = logging.getLogger("semantic.cache")
_OLDER = ", older: its history is prefilled again on its next turn"

_STALE_TMP_S = 3600.0  # no save takes an hour: an older temp file (or unnamed block) is stale


# -- reading -------------------------------------------------------------------


def _read_named(path: Path, size: int, check: str | None = None) -> bytes:
    """A content-named file's bytes, checked: ``size`` long, and the ``xxh3`` its
    manifest entry records (``content_check``), or where an entry has none
    (written before there were), the sha256 its name is."""
    with open_checked(path, missing="missing block") as f:
        have = os.fstat(f.fileno()).st_size
        if have != size:
            raise CacheFileError(path, "truncated" if have < size else "bad layout", f"{have} bytes, expected {size}")
        data = f.read(size + 1)
    if len(data) != size:
        raise CacheFileError(path, "truncated", f"read {len(data)} bytes, expected {size}")
    if check:
        same = content_check(data) == check
    else:  # an entry written before they had checks
        same = hashlib.sha256(data).hexdigest() == path.name.split(".", 1)[0]
    if not same:
        raise CacheFileError(path, "bad checksum", "the bytes are not the ones written")
    return data


def _block_layout(layers: list[dict]) -> list[tuple[int, str, str, tuple[int, int], tuple[int, int]]]:
    """(layer, tensor name, dtype, (heads, width), (first token, end)) of every blocked tensor, in block order."""
    return [(i, name, e["tensors"][name][0], tuple(e["tensors"][name][1:3]), tuple(e["tensors"][name][3:5]))
            for i, e in enumerate(layers)
            for name in BY_KIND[e["kind"]].blocked_names(e) if name in e["tensors"]]


def _ring_layout(layers: list[dict]) -> list[tuple[int, str, str, tuple[int, ...]]]:
    return [(i, name, e["tensors"][name][0], tuple(e["tensors"][name][1:]))
            for i, e in enumerate(layers)
            for name in BY_KIND[e["kind"]].ring_names(e) if name in e["tensors"]]


def _in_block(layout, lo: int) -> list:
    """The entries of ``layout`` that hold the block starting at token ``lo``."""
    return [t for t in layout if t[4][0] <= lo < t[4][1]]


def _block_size(layout, lo: int, tokens: int) -> int:
    return 4 * tokens + sum(h * tokens * w * DTYPES[dt][1].itemsize for _, _, dt, (h, w), _ in _in_block(layout, lo))


def _ring_size(layers: list[dict]) -> int:
    return sum(math.prod(shape) * DTYPES[dt][1].itemsize for _, _, dt, shape in _ring_layout(layers))


def load(directory: os.PathLike | str, *, model_id: str, spec_hash: str, agent_id: str | None = None) -> CacheRecord:
    """Read an agent directory back as a ``CacheRecord`` whose caches continue
    exactly as the saved ones would (``read``, then ``HostCache.build``)."""
    return read(directory, model_id=model_id, spec_hash=spec_hash, agent_id=agent_id).build()


def read(directory: os.PathLike | str, *, model_id: str | None, spec_hash: str | None, agent_id: str | None = None,
         keep: bool = True) -> HostCache | dict:
    """Read an agent directory into host memory (with ``keep=False``: check every
    file, keep nothing, return the manifest). No MLX here: any thread may call it.
    Checks the manifest, that it is for this model, spec (and agent, if given),
    and every file it names: present, of the size the layers imply, its sha256
    equal to its name, its token ids those the manifest's chain says. Raises
    ``CacheFileError`` on any failure, never anything else."""
    directory = Path(directory)
    m = read_manifest(directory)
    for reason, want, have in (
        ("other model", model_id, m["model_id"]),
        ("other spec", spec_hash, m["spec_hash"]),
        ("other agent", agent_id, m["agent_id"]),
    ):
        if want is not None and want != have:
            raise CacheFileError(directory, reason, f"cache is for {have!r}, wanted {want!r}")
    layers = m["layers"]
    layout = _block_layout(layers)
    arrays = {f"layer_{i}_{name}": np.empty((1, h, stop - start, w), DTYPES[dt][1])
              for i, name, dt, (h, w), (start, stop) in layout} if keep else {}
    tokens, chains = [], []
    for b, e in enumerate(m["blocks"]):
        t = e["tokens"]
        at, lo = 4 * t, b * BLOCK_TOKENS
        data = _read_named(directory / e["file"], _block_size(layout, lo, t), e.get("xxh3"))
        tokens += np.frombuffer(data, "<u4", t).tolist()
        chains.append(e.get("chain"))
        for i, name, dt, (h, w), (start, _) in _in_block(layout, lo):
            size = h * t * w * DTYPES[dt][1].itemsize
            if keep:
                arrays[f"layer_{i}_{name}"][:, :, lo - start : lo - start + t, :] = \
                    np.frombuffer(data, DTYPES[dt][1], h * t * w, at).reshape(1, h, t, w)
            at += size
    if chains != token_chains(tokens):
        raise CacheFileError(directory, "bad layout", "the blocks do not hold the tokens the manifest lists")
    rings = _ring_layout(layers)
    if rings:
        if not m["ring"]:
            raise CacheFileError(directory, "bad layout", "no ring file")
        data, at = _read_named(directory / m["ring"]["file"], _ring_size(layers), m["ring"].get("xxh3")), 0
        for i, name, dt, shape in rings:
            count = math.prod(shape)
            if keep:
                arrays[f"layer_{i}_{name}"] = np.frombuffer(data, DTYPES[dt][1], count, at).reshape(1, *shape)
            at += count * DTYPES[dt][1].itemsize
    try:
        text = "".join(_read_named(directory / e["file"], e["bytes"], e.get("xxh3")).decode() for e in m["text"])
    except UnicodeDecodeError:  # a piece cut inside a character: not one we wrote
        raise CacheFileError(directory, "bad layout", "a text piece is not UTF-8") from None
    if text_digest(text) != m["text_digest"]:
        raise CacheFileError(directory, "bad layout", "the text pieces do not make the text")
    if not keep:
        return m
    record = CacheRecord(m["agent_id"], m["model_id"], m["spec_hash"], tokens, text, m["created"], m["updated"], [])
    return HostCache(record, layers, arrays)


# -- the store -------------------------------------------------------------


def model_key(model_id: str) -> str:
    """A directory name for ``model_id``: a readable slug plus 8 hex digits of its sha256
    (slugs collide, 'a/b' and 'a-b'; the hash tells them apart)."""
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", model_id).strip(".-")[:48] or "model"
    return f"{slug}-{hashlib.sha256(model_id.encode()).hexdigest()[:8]}"


class CacheStore:
    """Agents' caches under ``root``: ``root/<model_key(model_id)>/<agent_id>.kv/``
    (``<agent_id>.safetensors`` for a version 1 file), unusable ones moved to
    ``root/quarantine/``.

    One writer (the persistence actor, or the owner of an ``AgentCaches``);
    several processes may share a root, as every file is renamed into place.
    Creating a store removes temp files left by writers that died (their pid is
    gone, or they are over an hour old) and, from agents' directories, files no
    manifest names that are over an hour old.
    """

    QUARANTINE = "quarantine"

    def __init__(self, root: os.PathLike | str):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_written = 0  # by write(), every file included (for benchmarks and tests)
        self._clean()

    def agent_dir(self, agent_id: str, model_id: str) -> Path:
        """Where the cache of ``agent_id`` for ``model_id`` lives. Raises ``InvalidAgentId``."""
        return self.root / model_key(model_id) / f"{validate_agent_id(agent_id)}{AGENT_DIR_SUFFIX}"

    def legacy_path(self, agent_id: str, model_id: str) -> Path:
        """Where a version 1 file of ``agent_id`` for ``model_id`` would be."""
        return self.root / model_key(model_id) / f"{validate_agent_id(agent_id)}{cache_v1.SUFFIX}"

    def exists(self, agent_id: str, model_id: str) -> bool:
        return (self.agent_dir(agent_id, model_id) / MANIFEST).is_file() or \
            self.legacy_path(agent_id, model_id).is_file()

    def save(self, record: CacheRecord) -> Path:
        """Write ``record`` (on the thread that owns MLX) and return its directory.
        Files the manifest on disk already names are not written again.
        Raises ``InvalidAgentId``, ``ValueError`` (cache and tokens disagree) or ``OSError``."""
        self.write(snapshot(record))
        return self.agent_dir(record.agent_id, record.model_id)

    def write(self, update: BlockUpdate) -> int:
        """Write an update (any thread: bytes only): its blocks not on disk yet, its
        ring and new text, then the manifest (atomic); then remove the files no
        longer named, and a version 1 file. Returns the bytes written. Raises
        ``StaleBlocks`` (the manifest on disk lacks blocks before ``update.first``),
        ``InvalidAgentId``, ``OSError``."""
        d = self.agent_dir(update.agent_id, update.model_id)
        if not d.is_dir():
            d.mkdir(parents=True, exist_ok=True)
            fsync_dir(d.parent)
            fsync_dir(self.root)
        old = self._previous(d, update)
        written = 0

        def put(data: bytes | bytearray, kind: str) -> dict:
            nonlocal written
            name = f"{hashlib.sha256(data).hexdigest()}.{kind}"
            if not (d / name).is_file():  # named by content: one that is there holds these bytes
                write_atomic(d / name, data, sync_dir=False)
                written += len(data)
            return {"file": name, "xxh3": content_check(data)}

        blocks = []
        for b, chain in enumerate(token_chains(update.tokens)):
            if b < update.first:
                e = old["blocks"][b] if old and b < len(old["blocks"]) else None
                if e is None or e.get("chain") != chain or not (d / e["file"]).is_file():
                    raise StaleBlocks(f"block {b} of agent {update.agent_id!r} is not on disk")
            else:
                e = put(update.blocks[b - update.first], "block")
                e.update(tokens=min(BLOCK_TOKENS, len(update.tokens) - b * BLOCK_TOKENS), chain=chain)
            blocks.append(e)
        manifest = {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "agent_id": update.agent_id,
            "model_id": update.model_id,
            "spec_hash": update.spec_hash,
            "token_count": len(update.tokens),
            "block_tokens": BLOCK_TOKENS,
            "created": update.created,
            "updated": update.updated,
            "layers": update.layers,
            "blocks": blocks,
            "ring": put(update.ring, "ring") if update.ring else None,
            "text": self._text_pieces(old, update.text, put),
            "text_digest": text_digest(update.text),
        }
        fsync_dir(d)  # the files are in place before the manifest that names them
        data = seal(manifest)
        write_atomic(d / MANIFEST, data)
        written += len(data)
        self.bytes_written += written
        self._remove_unnamed(d, manifest)
        legacy = self.legacy_path(update.agent_id, update.model_id)
        if legacy.exists():
            legacy.unlink()
            log.info("cache of agent %r for %s moved from a version 1 file to blocks", update.agent_id,
                     update.model_id)
        return written

    def load(self, agent_id: str, model_id: str, spec_hash: str) -> CacheRecord | None:
        """``read``, built into MLX caches (on the thread that owns MLX)."""
        host = self.read(agent_id, model_id, spec_hash)
        return None if host is None else host.build()

    def read(self, agent_id: str, model_id: str, spec_hash: str) -> HostCache | None:
        """The agent's cache for this model in host memory, or None: absent, of an
        older format (one line on ``semantic.cache``; the agent's history is
        prefilled again), or unusable (moved to quarantine with one warning;
        the agent starts cold). No MLX: any thread may call it.
        Raises only ``InvalidAgentId``."""
        d = self.agent_dir(agent_id, model_id)
        legacy = self.legacy_path(agent_id, model_id)
        try:
            if (d / MANIFEST).exists() or not legacy.exists():
                return read(d, model_id=model_id, spec_hash=spec_hash, agent_id=agent_id)
            raise CacheFileError(legacy, "old format", f"format version {cache_v1.VERSION}")
        except CacheFileError as e:
            if e.reason == "old format":  # not what a token sees today: its next write replaces it
                log.info("the cache of %s is in an older format (%s); its history is prefilled again",
                         agent_id, e.detail)
            elif e.reason != "missing":
                self._quarantine(d if (d / MANIFEST).exists() else legacy, agent_id, e)
            return None

    def info(self, agent_id: str, model_id: str) -> dict | None:
        """``entries()``'s dict for one agent, or None (no cache, or its manifest is unusable)."""
        d = self.agent_dir(agent_id, model_id)
        legacy = self.legacy_path(agent_id, model_id)
        return self._entry(d) if (d / MANIFEST).exists() or not legacy.exists() else self._legacy_entry(legacy)

    def delete(self, agent_id: str, model_id: str | None = None) -> int:
        """Remove the agent's cache for ``model_id`` (every model if None); return how
        many caches went. Quarantined files stay. Raises ``InvalidAgentId``."""
        validate_agent_id(agent_id)
        dirs = [self.root / model_key(model_id)] if model_id is not None else self._model_dirs()
        removed = 0
        for d in dirs:
            removed += remove_tree(d / f"{agent_id}{AGENT_DIR_SUFFIX}")
            removed += remove_tree(d / f"{agent_id}{cache_v1.SUFFIX}")
        return removed

    def entries(self) -> list[dict]:
        """One dict per cache (agent, model, tokens, bytes, updated, path), from
        manifests and version 1 headers alone; unusable ones are left out (see ``verify``)."""
        out = []
        for path in self._caches():
            e = self._entry(path) if path.is_dir() else self._legacy_entry(path)
            if e is not None:
                out.append(e)
        return out

    def verify(self) -> list[tuple[Path, bool, str]]:
        """Check every cache in full: (path, ok, what): its format when ok (an older
        one: its agent's history is prefilled again on its next turn), else the
        reason. A cache must also sit where its own manifest says it belongs.
        Moves nothing."""
        out = []
        for path in self._caches():
            agent = path.name.rsplit(".", 1)[0]
            try:
                if path.is_dir():
                    m, version = read(path, model_id=None, spec_hash=None, agent_id=agent, keep=False), FORMAT_VERSION
                else:
                    m, version = cache_v1.verify(path, agent_id=agent), cache_v1.VERSION
                if model_key(m["model_id"]) != path.parent.name:
                    raise CacheFileError(path, "other model", f"cache is for {m['model_id']!r}")
                out.append((path, True, f"format {version}" + ("" if version == FORMAT_VERSION else _OLDER)))
            except CacheFileError as e:
                if e.reason == "old format":  # (a version 2 manifest: its blocks are not read)
                    out.append((path, True, e.detail.split(",")[0].replace("format version", "format") + _OLDER))
                else:
                    out.append((path, False, e.reason))
        return out

    def disk_bytes(self) -> int:
        """Bytes of every file under the root, quarantine and temp files included."""
        return tree_bytes(self.root)

    # -- internals --

    def _previous(self, d: Path, update: BlockUpdate) -> dict | None:
        """The manifest on disk if it is this agent's for this model and spec, else None."""
        try:
            m = read_manifest(d)
        except CacheFileError:
            return None
        same = (m["agent_id"], m["model_id"], m["spec_hash"]) == (update.agent_id, update.model_id, update.spec_hash)
        return m if same else None

    @staticmethod
    def _text_pieces(old: dict | None, text: str, put) -> list[dict]:
        """The previous manifest's text pieces that still begin ``text``, then one piece with the rest."""
        pieces, at = [], 0
        if old:
            for e in old["text"]:
                end = at + e["chars"]
                if e["upto"] != text_digest(text[:end]):
                    break
                pieces.append(e)
                at = end
        if len(pieces) >= MAX_TEXT_PIECES:
            pieces, at = [], 0
        if at < len(text):
            data = text[at:].encode()
            e = put(data, "text")
            e.update(bytes=len(data), chars=len(text) - at, upto=text_digest(text))
            pieces.append(e)
        return pieces

    def _remove_unnamed(self, d: Path, manifest: dict) -> None:
        """Remove the content files the manifest no longer names (an older version's)."""
        named = named_files(manifest)
        for p in d.iterdir():
            if CONTENT_NAME.fullmatch(p.name) and p.name not in named:
                p.unlink(missing_ok=True)

    def _entry(self, d: Path) -> dict | None:
        try:
            m = read_manifest(d)
        except CacheFileError:
            return None
        size = (d / MANIFEST).stat().st_size + sum(file_size(d / f) for f in named_files(m))
        return dict(agent=m["agent_id"], model=m["model_id"], tokens=m["token_count"], bytes=size,
                    updated=m["updated"], path=d)

    @staticmethod
    def _legacy_entry(path: Path) -> dict | None:
        try:
            m = cache_v1.read_meta(path)
        except CacheFileError:
            return None
        return dict(agent=m["agent_id"], model=m["model_id"], tokens=m["token_count"], bytes=m["bytes"],
                    updated=m["updated"], path=path)

    def _model_dirs(self) -> list[Path]:
        return sorted(
            d for d in self.root.iterdir() if d.is_dir() and d.name != self.QUARANTINE and not d.name.startswith(".")
        )

    def _caches(self) -> list[Path]:
        """Agents' directories with a manifest, and version 1 files of agents that have none."""
        out = []
        for d in self._model_dirs():
            for p in sorted(d.iterdir()):
                stem, dot, suffix = p.name.rpartition(".")
                try:
                    validate_agent_id(stem)
                except InvalidAgentId:
                    continue
                if f".{suffix}" == AGENT_DIR_SUFFIX and (p / MANIFEST).is_file():
                    out.append(p)
                elif f".{suffix}" == cache_v1.SUFFIX and p.is_file() and \
                        not (d / f"{stem}{AGENT_DIR_SUFFIX}" / MANIFEST).is_file():
                    out.append(p)
        return out

    def _quarantine(self, path: Path, agent_id: str, error: CacheFileError) -> None:
        ns = time.time_ns()
        stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(ns // 10**9)) + f".{ns // 1000 % 10**6:06d}Z"
        name = f"{path.parent.name}--{agent_id}--{stamp}--{error.reason.replace(' ', '-')}"
        dest = self.root / self.QUARANTINE / name
        try:
            dest.parent.mkdir(exist_ok=True)
            os.replace(path, dest)
            where = f"moved to {dest}"
        except OSError as e:
            where = f"could not be moved aside ({e.strerror or e})"
        log.warning("cache of agent %r is unusable (%s: %s), %s; the agent starts cold",
                    agent_id, error.reason, error.detail, where)

    def _clean(self) -> None:
        """Remove dead writers' temp files, and stale files no manifest names."""
        now = time.time()
        for d in self._model_dirs():
            agents = [p for p in d.iterdir() if p.name.endswith(AGENT_DIR_SUFFIX) and p.is_dir()]
            for p in [*d.glob(f"{TMP_PREFIX}*"), *(t for a in agents for t in a.glob(f"{TMP_PREFIX}*"))]:
                try:
                    pid = int(p.name[len(TMP_PREFIX) :].split("-", 1)[0])
                except ValueError:
                    pid = None
                try:
                    if pid is None or not pid_alive(pid) or now - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()
                except FileNotFoundError:  # its writer renamed it meanwhile
                    pass
            for a in agents:
                try:
                    named = named_files(read_manifest(a))
                except CacheFileError:
                    continue  # loading it says why (and quarantines it)
                for p in a.iterdir():
                    try:  # a young one may be a live writer's, its manifest still to come
                        if CONTENT_NAME.fullmatch(p.name) and p.name not in named and now - p.stat().st_mtime > _STALE_TMP_S:
                            p.unlink()
                    except FileNotFoundError:
                        pass

