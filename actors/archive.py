"""One agent's files as one archive, to move the agent to another server
(``semantic cache export`` / ``import``, ``POST /v1/agents/{id}/import``;
``docs/scaling.md``).

An archive is a tar of what the agent owns in a cache directory, at the paths
it has there, and an index last:

    histories/<agent>.json                           its history (required: it is the agent)
    <model key>/<agent>.kv/manifest.json             its cache for one model, and the files
    <model key>/<agent>.kv/<sha256>.block|ring|text  the manifest names (docs/cache-format.md)
    <model key>/<agent>.safetensors                  a version 1 cache
    semantic-archive.json                            {"format", "version", "agent_id", "caches",
                                                      "files": {path: {"bytes", "sha256"}}}

**Export** takes only the files manifests name (no temp files, nothing
quarantined), checks each against its name's sha256 as it copies it, and
leaves out a cache that fails (the agent is then cold on that model). It
writes the archive atomically (temp file, fsync, rename). A running server
may replace a cache meanwhile (a turn ended); a file gone under the export
makes it start over.

**Import** refuses a member that is not a regular file at a path of that
layout (absolute, ``..``, links, devices, another agent's files), unpacks into
a temp directory inside the cache directory, checks the index (every file
listed, of its size and sha256), the history, and every cache as a load
would, then renames the agent's files into place, the history last. Any
failure leaves the cache directory as it was; an import killed midway leaves
only its temp directory, which the next import removes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import tarfile
import tempfile
import time
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path

import anyio

from semantic.runtime.store import cache_file, cache_v1
from semantic.runtime.store.cache_file import model_key
from semantic.runtime.cache_records import AGENT_DIR_SUFFIX, MANIFEST, CacheFileError, InvalidAgentId, validate_agent_id
from semantic.runtime.store.disk import NoRoom, check_room, history_path, human_bytes
from semantic.runtime.errors import SemanticError
from semantic.runtime.files import fsync_dir, pid_alive, remove_tree
from semantic.runtime.text.json_reader import JSONError, read_json

from .errors import AgentExists
from .history import parse_history

__all__ = ["INDEX", "UPLOAD_PREFIX", "ArchiveError", "Summary", "agent_files", "export_agent", "import_agent",
           "receive_upload", "remove_abandoned"]

FORMAT = "semantic-agent-archive"
VERSION = 1
INDEX = "semantic-archive.json"
HISTORIES = "histories"
UPLOAD_PREFIX = ".tmp-import-"  # <cache dir>/.tmp-import-<pid>-<hex>: an import under way; <temp dir>/...tar: an upload
_ABANDONED_S = 3600.0  # an import's temp files older than this, or of a dead process, are removed
_CHUNK = 1 << 20
_ATTEMPTS = 5  # exports restarted because a running server replaced a cache meanwhile
_NOT_MODELS = (HISTORIES, cache_file.CacheStore.QUARANTINE)
_MODEL_KEY = r"(?!histories/|quarantine/)[A-Za-z0-9_-][A-Za-z0-9._-]*"
_NAME_MAX = 255  # bytes in one path component (Linux, macOS)
_LAYOUT = re.compile(  # every path an archive may hold; group "agent" is whose it is
    rf"{HISTORIES}/(?P<agent>[^/]+)\.json"
    rf"|(?P<cache>{_MODEL_KEY}/(?P<agent2>[^/]+)\{AGENT_DIR_SUFFIX})/(?:{MANIFEST}|[0-9a-f]{{64}}\.(?:block|ring|text))"
    rf"|(?P<v1>{_MODEL_KEY}/(?P<agent3>[^/]+)\{cache_v1.SUFFIX})"
)


class ArchiveError(SemanticError):
    """An archive that cannot be imported, or an agent that cannot be exported; nothing was changed."""


@dataclass(frozen=True)
class Summary:
    """What an archive holds: the agent, its history's length, its caches (model id, tokens)."""

    agent_id: str
    messages: int
    caches: tuple[tuple[str, int], ...]
    bytes: int

    def describe(self) -> str:
        caches = "; ".join(f"{model}: {tokens} tokens" for model, tokens in self.caches) or "none"
        return (f"history ({self.messages} messages) and {len(self.caches)} cache(s) ({caches}), "
                f"{human_bytes(self.bytes)}")


def agent_files(root: Path, agent_id: str) -> list[Path]:
    """What ``agent_id`` owns under the cache directory ``root``: its history,
    and its cache directory or version 1 file for each model."""
    root = Path(root)
    found = [p for p in [history_path(root / HISTORIES, agent_id)] if p.is_file()]
    for d in _model_dirs(root):
        found += [p for p in (d / f"{agent_id}{AGENT_DIR_SUFFIX}", d / f"{agent_id}{cache_v1.SUFFIX}") if p.exists()]
    return found


# -- export ------------------------------------------------------------------------


def export_agent(root: Path, agent_id: str, out: Path) -> tuple[Summary, list[str]]:
    """Write ``agent_id``'s files under ``root`` to the archive ``out`` (replaced
    atomically). Returns what it holds and, per cache left out, why. Raises
    ``InvalidAgentId``, ``ArchiveError`` (no such agent), ``OSError``."""
    root, out = Path(root), Path(out)
    validate_agent_id(agent_id)
    if not history_path(root / HISTORIES, agent_id).is_file():
        raise ArchiveError(f"no agent {agent_id!r} in {root} (it has no history there; "
                           f"'semantic cache ls' lists what is)")
    if not out.parent.is_dir():
        raise ArchiveError(f"no directory {out.parent} to write {out.name} in")
    left_out: dict[str, str] = {}
    attempts = 0
    while True:
        try:
            return _export(root, agent_id, out, left_out), [f"{key}: {why}" for key, why in left_out.items()]
        except _Damaged as e:
            left_out[e.key] = e.why  # then again without it
        except FileNotFoundError:  # a running server replaced a cache meanwhile: its new version is whole
            attempts += 1
            if attempts == _ATTEMPTS:
                raise ArchiveError(f"agent {agent_id!r} kept changing while it was exported; "
                                   f"try again once it is idle") from None


class _Damaged(Exception):
    def __init__(self, key: str, why: str):
        self.key, self.why = key, why


def _export(root: Path, agent_id: str, out: Path, left_out: dict[str, str]) -> Summary:
    """One attempt: raises ``_Damaged`` for a cache that fails its checks, ``FileNotFoundError``
    for a file gone meanwhile."""
    history = history_path(root / HISTORIES, agent_id)
    try:
        messages = len(parse_history(history.read_bytes(), agent_id))
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ArchiveError(f"the history of agent {agent_id!r} in {root} is unreadable ({e!r})") from None
    files: dict[str, dict] = {}
    caches = []
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        with open(tmp, "xb") as f:
            with tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
                files[history.relative_to(root).as_posix()] = _add(tar, root, history)
                for d in _model_dirs(root):
                    if d.name in left_out:
                        continue
                    caches += _add_cache(tar, root, d, agent_id, files)
                index = {"format": FORMAT, "version": VERSION, "agent_id": agent_id, "exported": time.time(),
                         "caches": [{"model_id": m, "spec_hash": s, "tokens": t} for m, s, t in caches],
                         "files": files}
                _add_bytes(tar, INDEX, json.dumps(index, indent=1).encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(out.parent)
    return Summary(agent_id, messages, tuple((m, t) for m, _, t in caches), sum(e["bytes"] for e in files.values()))


def _add_cache(tar: tarfile.TarFile, root: Path, d: Path, agent_id: str, files: dict) -> list[tuple[str, str, int]]:
    """Add the agent's cache for the model of directory ``d``, if it has one:
    (model id, spec hash, tokens), or nothing."""
    kv, v1 = d / f"{agent_id}{AGENT_DIR_SUFFIX}", d / f"{agent_id}{cache_v1.SUFFIX}"
    try:
        if (kv / MANIFEST).is_file():
            raw = (kv / MANIFEST).read_bytes()  # the version we copy: the files it names never change
            m = cache_file.read_manifest(kv)
            if (kv / MANIFEST).read_bytes() != raw:
                raise FileNotFoundError(kv / MANIFEST)  # replaced meanwhile: start over
            _check_model(kv, m, d.name)
            name = (kv / MANIFEST).relative_to(root).as_posix()
            files[name] = _add_bytes(tar, name, raw)
            for name in _named(m):
                entry = _add(tar, root, kv / name)
                if entry["sha256"] != name.split(".", 1)[0]:
                    raise CacheFileError(kv / name, "bad checksum", "the bytes are not the ones written")
                files[(kv / name).relative_to(root).as_posix()] = entry
        elif v1.is_file():
            m = cache_v1.verify(v1, agent_id=agent_id)
            _check_model(v1, m, d.name)
            files[v1.relative_to(root).as_posix()] = _add(tar, root, v1)
        else:
            return []
    except CacheFileError as e:
        if e.reason == "missing":
            raise FileNotFoundError(e.path) from None  # removed meanwhile (pruned): start over
        raise _Damaged(d.name, f"cache left out, unusable ({e.reason}): {e.detail}") from None
    return [(m["model_id"], m["spec_hash"], m["token_count"])]


def _add(tar: tarfile.TarFile, root: Path, path: Path) -> dict:
    """Add the file ``path`` (at its path under ``root``); its size and sha256."""
    with open(path, "rb") as f:
        reader = _Hashing(f)
        info = _member(path.relative_to(root).as_posix(), os.fstat(f.fileno()).st_size)
        tar.addfile(info, reader)
    return {"bytes": info.size, "sha256": reader.sha256.hexdigest()}


def _add_bytes(tar: tarfile.TarFile, name: str, data: bytes) -> dict:
    tar.addfile(_member(name, len(data)), io.BytesIO(data))
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def _member(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = size, 0o644, int(time.time())
    return info


class _Hashing:
    """A reader that hashes what is read through it."""

    def __init__(self, f):
        self.f = f
        self.sha256 = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self.f.read(n)
        self.sha256.update(data)
        return data


# -- import ------------------------------------------------------------------------


def import_agent(root: Path, archive: Path, *, agent_id: str | None = None, replace: bool = False) -> Summary:
    """Put the agent in ``archive`` into the cache directory ``root``, checked
    first. ``agent_id``: the agent it must hold (None: any). ``replace``: an
    agent of that id in ``root`` is replaced (else ``AgentExists``). Raises
    ``ArchiveError``, ``AgentExists``, ``runtime.store.disk.NoRoom``, ``OSError``;
    on any of them ``root`` is as it was."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    remove_abandoned(root)
    staging = root / f"{UPLOAD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    staging.mkdir()
    try:
        found = _unpack(Path(archive), staging)
        index = _check_index(staging, found, agent_id)
        summary = _check_agent(staging, index["agent_id"])
        _move_in(root, staging, index["agent_id"], replace)
        return summary
    finally:
        remove_tree(staging)


def _unpack(archive: Path, staging: Path) -> dict[str, dict]:
    """Write every member into ``staging``; their sizes and sha256s by path."""
    found: dict[str, dict] = {}
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                name = _checked_name(member)
                if name is None:
                    continue
                if name in found:
                    raise ArchiveError(f"{name!r} is in the archive twice")
                check_room(staging, member.size)
                dest = staging / name
                dest.parent.mkdir(parents=True, exist_ok=True)
                found[name] = _write(dest, tar.extractfile(member), member.size)
    except (tarfile.TarError, EOFError) as e:
        raise ArchiveError(f"the archive is not a whole tar archive ({e})") from None
    except FileNotFoundError:
        raise ArchiveError("no such archive") from None
    except IsADirectoryError:
        raise ArchiveError("a directory, not an archive") from None
    return found


def _checked_name(member: tarfile.TarInfo) -> str | None:
    """The member's path if it may be unpacked (None: a directory entry, made as
    needed), else ``ArchiveError``: the path escapes, or names no file of an agent."""
    name = member.name
    parts = name.split("/")
    shown = repr(name[:100]) + ("..." if len(name) > 100 else "")
    try:
        too_long = any(len(part.encode()) > _NAME_MAX for part in parts)
    except UnicodeEncodeError:  # tarfile keeps bytes that are not UTF-8 as surrogates
        raise ArchiveError(f"archive member {shown} has a name that is not UTF-8: refused") from None
    if not name.isprintable():
        raise ArchiveError(f"archive member {shown} has a NUL or control character in its name: refused")
    if too_long:
        raise ArchiveError(f"archive member {shown} has a name longer than {_NAME_MAX} bytes: refused")
    if name.startswith("/"):
        raise ArchiveError(f"archive member {shown} has an absolute path: refused")
    if ".." in parts or "\\" in name:
        raise ArchiveError(f"archive member {shown} leads outside the cache directory: refused")
    if member.isdir():
        return None
    if not member.isreg() or member.issparse():
        raise ArchiveError(f"archive member {shown} is a link, a sparse or a special file: refused")
    if name != INDEX and not _LAYOUT.fullmatch(name):
        raise ArchiveError(f"archive member {shown} is not an agent's history or cache file: refused")
    return name


def _write(dest: Path, src, size: int) -> dict:
    sha, written = hashlib.sha256(), 0
    with open(dest, "xb") as f:
        while chunk := src.read(min(_CHUNK, size - written)):
            f.write(chunk)
            sha.update(chunk)
            written += len(chunk)
        f.flush()
        os.fsync(f.fileno())
    if written != size:
        raise ArchiveError(f"archive member {dest.name!r} is cut short ({written} of {size} bytes)")
    return {"bytes": size, "sha256": sha.hexdigest()}


def _check_index(staging: Path, found: dict[str, dict], agent_id: str | None) -> dict:
    """The index, checked: our format, a valid agent id (``agent_id`` if given),
    every other member listed with its size and sha256, and all of them that agent's."""
    if INDEX not in found:
        raise ArchiveError(f"no {INDEX} in it: not an agent archive of 'semantic cache export'")
    try:
        index = read_json((staging / INDEX).read_bytes(), INDEX)
    except JSONError as e:
        raise ArchiveError(f"{e}: not an agent archive of 'semantic cache export'") from None
    try:
        ok = index["format"] == FORMAT and isinstance(index["files"], dict) and isinstance(index["agent_id"], str)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ArchiveError(f"{INDEX} is damaged or not an agent archive's")
    if index.get("version") != VERSION:
        raise ArchiveError(f"archive version {index.get('version')!r}; this Semantic reads version {VERSION}")
    try:
        validate_agent_id(index["agent_id"])
    except InvalidAgentId as e:
        raise ArchiveError(f"the archive's agent id {index['agent_id'][:64]!r} is not valid: {e}") from None
    if agent_id is not None and index["agent_id"] != agent_id:
        raise ArchiveError(f"the archive holds agent {index['agent_id']!r}, not {agent_id!r}")
    members = {k: v for k, v in found.items() if k != INDEX}
    for name in sorted(members.keys() | index["files"].keys()):
        if name not in members:
            raise ArchiveError(f"{name!r} is listed in {INDEX} but missing: the archive is incomplete")
        if members[name] != index["files"].get(name):
            raise ArchiveError(f"{name!r} is damaged: its bytes are not the ones exported")
        m = _LAYOUT.fullmatch(name)
        if (m["agent"] or m["agent2"] or m["agent3"]) != index["agent_id"]:
            raise ArchiveError(f"{name!r} belongs to another agent than {index['agent_id']!r}")
    return index


def _check_agent(staging: Path, agent_id: str) -> Summary:
    """The history and every cache, checked as a load would check them."""
    history = history_path(staging / HISTORIES, agent_id)
    try:
        messages = len(parse_history(history.read_bytes(), agent_id))
    except FileNotFoundError:
        raise ArchiveError(f"the archive holds no history of agent {agent_id!r}") from None
    except (ValueError, KeyError, TypeError, AssertionError) as e:
        raise ArchiveError(f"the history of agent {agent_id!r} in the archive is unreadable ({e!r})") from None
    caches = []
    for d in _model_dirs(staging):
        kv, v1 = d / f"{agent_id}{AGENT_DIR_SUFFIX}", d / f"{agent_id}{cache_v1.SUFFIX}"
        try:
            if kv.is_dir():
                m = cache_file.read(kv, model_id=None, spec_hash=None, agent_id=agent_id, keep=False)
                _check_model(kv, m, d.name)
                caches.append((m["model_id"], m["token_count"]))
            if v1.is_file():
                m = cache_v1.verify(v1, agent_id=agent_id)
                _check_model(v1, m, d.name)
                caches.append((m["model_id"], m["token_count"]))
        except CacheFileError as e:
            raise ArchiveError(f"the archive's cache for {d.name} is unusable ({e.reason}): {e.detail}") from None
    size = sum(p.stat().st_size for p in staging.rglob("*") if p.is_file() and p.name != INDEX)
    return Summary(agent_id, messages, tuple(caches), size)


def _check_model(path: Path, m: dict, key: str) -> None:
    if model_key(m["model_id"]) != key:
        raise CacheFileError(path, "other model", f"cache is for {m['model_id']!r}, not in its model's directory")


def _move_in(root: Path, staging: Path, agent_id: str, replace: bool) -> None:
    """Rename the agent's files from ``staging`` into ``root``, caches first and the
    history last (it is what makes the agent exist); what ``root`` held of the
    agent goes aside first when ``replace``. On failure, everything goes back."""
    existing = agent_files(root, agent_id)
    if existing and not replace:
        raise AgentExists(f"agent {agent_id!r} exists in {root}; replace it with --replace")
    new = [p for d in _model_dirs(staging) for p in (d / f"{agent_id}{AGENT_DIR_SUFFIX}",
                                                      d / f"{agent_id}{cache_v1.SUFFIX}") if p.exists()]
    new.append(history_path(staging / HISTORIES, agent_id))
    aside = staging / ".replaced"
    done: list[tuple[Path, Path]] = []  # (from, to), to undo in reverse
    try:
        for p in existing:
            _rename(p, aside / p.relative_to(root), done)
        for p in new:
            _rename(p, root / p.relative_to(staging), done)
    except BaseException:
        for src, dst in reversed(done):
            os.replace(dst, src)
        raise
    for d in {root, root / HISTORIES, *(root / p.relative_to(staging).parent for p in new)}:
        fsync_dir(d)


def _rename(src: Path, dst: Path, done: list) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.replace(src, dst)
    done.append((src, dst))


def _named(manifest: dict) -> list[str]:
    """The content files a manifest names."""
    ring = [manifest["ring"]] if manifest["ring"] else []
    return sorted({e["file"] for e in (*manifest["blocks"], *manifest["text"], *ring)})


def _model_dirs(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(d for d in root.iterdir()
                  if d.is_dir() and not d.name.startswith(".") and d.name not in _NOT_MODELS)


def remove_abandoned(folder: Path) -> None:
    """Remove the temp files of imports and uploads that died (their process is
    gone, or they are old) from ``folder``: the cache directory, or where a
    server receives uploads."""
    now = time.time()
    for p in Path(folder).glob(f"{UPLOAD_PREFIX}*"):
        try:
            pid = int(p.name[len(UPLOAD_PREFIX):].split("-", 1)[0])
            if not pid_alive(pid) or now - p.stat().st_mtime > _ABANDONED_S:
                remove_tree(p)
        except (ValueError, OSError):
            continue


async def receive_upload(chunks: AsyncIterable[bytes], size: int | None, budget: int | None) -> Path:
    """``chunks`` written to a temp file as they arrive, outside the cache
    directory (which holds only what the persistence actor puts there), within
    ``budget`` bytes and the free space; removed if they do not all arrive."""
    folder = Path(tempfile.gettempdir())
    await anyio.to_thread.run_sync(remove_abandoned, folder)  # uploads of a server that died
    path = folder / f"{UPLOAD_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.tar"
    too_big = NoRoom(f"the archive is larger than this server's disk budget, {human_bytes(budget or 0)}")
    try:
        if size is not None:
            if budget is not None and size > budget:
                raise too_big
            check_room(folder, size)
        received = 0
        async with await anyio.open_file(path, "xb") as f:
            async for chunk in chunks:
                received += len(chunk)
                if budget is not None and received > budget:
                    raise too_big
                await f.write(chunk)
        return path
    except BaseException:
        path.unlink(missing_ok=True)
        raise
