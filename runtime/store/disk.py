"""The cache directory on disk: what it holds, how much it may hold, what to prune.

One implementation for the persistence actor (which prunes while it writes)
and for ``semantic cache prune`` and ``rm``: ``scan`` lists the files,
``plan`` decides what goes, ``apply`` removes it, ``remove_agent`` deletes
one agent's files.

The directory's total is every file under it: caches, histories,
quarantined files and temp files. An agent's cache for one model is one
unit: its directory (``<agent>.kv/``: the manifest, the files it names and
any temp file), or a version 1 file; its size is all of that, its last use
the manifest's mtime (every turn writes its agent's manifest anew). What
``plan`` removes, in this order:

* anonymous conversations (agent ids starting ``conv-``: the HTTP server
  makes them for clients that name no agent) unused for longer than
  ``conversation_ttl``: the history and every cache;
* with ``older_than``: the same for conversations unused for longer, and
  every cache and quarantined file not written for longer;
* while the total is over ``budget``: quarantined caches (``quarantine/``,
  and histories moved aside as unreadable), oldest first, then
  caches, least recently written first, until the total is at most
  ``target``.

Never removed: a named agent's history, a temp file (a write in progress),
any other file, every file of a ``protected`` agent (a write pending), a
``live`` agent's history (its actor runs), and, except by a conversation's TTL, the caches
of a ``hot`` agent (its cache is in memory, and a clean hot cache is not
written again when it leaves memory). A removed cache only means its agent
starts cold.
"""

from __future__ import annotations

import errno
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from .cache_file import CacheStore
from ..cache_records import AGENT_DIR_SUFFIX, MANIFEST, InvalidAgentId, validate_agent_id
from .cache_v1 import SUFFIX
from ..files import remove_tree, tree_bytes

__all__ = [
    "CACHE", "CONVERSATION_PREFIX", "FREE_MARGIN", "HISTORY", "OTHER", "QUARANTINE", "DiskFile", "NoRoom", "Plan",
    "apply", "check_room", "default_budget", "free_bytes", "history_path", "human_bytes", "human_duration",
    "is_conversation", "plan", "remove_agent", "scan",
]

CONVERSATION_PREFIX = "conv-"  # anonymous agents (web/identity.py names them conv-...)
FREE_MARGIN = 64 << 20  # free space a write must leave on the filesystem
HISTORY_SUFFIX = ".json"
BAD_HISTORY = ".json.bad-"  # unreadable histories moved aside (actors/agent.py)

CACHE, HISTORY, QUARANTINE, OTHER = "cache", "history", "quarantine", "other"


@dataclass(frozen=True)
class DiskFile:
    path: Path  # a file, or an agent's cache directory (removed whole)
    bytes: int
    mtime: float  # unix time it was last written (a cache directory: its manifest)
    kind: str  # cache, history, quarantine or other (never removed)
    agent: str | None = None  # cache and history files


@dataclass
class Plan:
    """What ``plan`` decided: files to remove (with why) and the totals before and after."""

    removals: list[tuple[DiskFile, str]] = field(default_factory=list)
    total: int = 0  # bytes under the directory now
    after: int = 0  # bytes once the removals are done
    agents_removed: list[str] = field(default_factory=list)  # conversations removed whole
    next_expiry: float | None = None  # unix time the first kept conversation passes (or passed) its TTL


class NoRoom(OSError):
    """Too little free space to write a file; nothing was written."""


def is_conversation(agent_id: str) -> bool:
    return agent_id.startswith(CONVERSATION_PREFIX)


def history_path(histories: Path, agent_id: str) -> Path:
    """Where an agent's history lives (``agent_id`` already validated)."""
    return Path(histories) / f"{agent_id}{HISTORY_SUFFIX}"


# -- space -------------------------------------------------------------------------


def free_bytes(directory: os.PathLike | str) -> int:
    """Free bytes on the filesystem that holds ``directory`` (or would: its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return shutil.disk_usage(path).free


def default_budget(root: os.PathLike | str) -> int:
    """The disk budget when none is given: half of what the directory could hold
    now, (its bytes + the free space of its filesystem) / 2.  Stable from one
    start to the next: as the directory grows, the free space shrinks as much."""
    return (scan(root, Path(root) / "histories")[1] + free_bytes(root)) // 2


def check_room(directory: os.PathLike | str, size: int, margin: int = FREE_MARGIN) -> None:
    """Raise ``NoRoom`` unless writing ``size`` bytes leaves ``margin`` free."""
    free = free_bytes(directory)
    if free < size + margin:
        raise NoRoom(errno.ENOSPC, f"{human_bytes(free)} free, the file needs {human_bytes(size)} "
                                   f"and {human_bytes(margin)} must stay free")


# -- what is there -------------------------------------------------------------------


def scan(root: os.PathLike | str, histories: os.PathLike | str) -> tuple[list[DiskFile], int]:
    """Everything under ``root`` (and ``histories``, if outside it), classified: files,
    and agents' cache directories and quarantined directories as units; and their total bytes."""
    root, histories = Path(root), Path(histories)
    files = [_classify(p, root, histories) for p in _walk(root, root)]
    if not histories.is_relative_to(root):
        files += [_classify(p, root, histories) for p in _walk(histories, root)]
    files = [f for f in files if f is not None]
    return files, sum(f.bytes for f in files)


def _walk(top: Path, root: Path):
    """Files under ``top``; an agent's cache directory or a quarantined directory as one path."""
    for parent, dirs, names in os.walk(top):
        parent = Path(parent)
        units = [d for d in dirs if _is_unit(parent / d, root)]
        dirs[:] = [d for d in dirs if d not in units]
        for name in (*names, *units):
            yield parent / name


def _is_unit(path: Path, root: Path) -> bool:
    if path.parent == root / CacheStore.QUARANTINE:
        return True
    return path.parent.parent == root and path.name.endswith(AGENT_DIR_SUFFIX) and path.parent.name != "histories"


def _stat(path: Path) -> tuple[int, float]:
    """(bytes, last written) of a file or a unit directory (whose last write is its manifest's)."""
    if not path.is_dir():
        st = path.stat()
        return st.st_size, st.st_mtime
    try:
        mtime = (path / MANIFEST).stat().st_mtime
    except FileNotFoundError:  # a first write that never finished
        mtime = path.stat().st_mtime
    return tree_bytes(path), mtime


def _classify(path: Path, root: Path, histories: Path) -> DiskFile | None:
    try:
        size, mtime = _stat(path)
    except OSError:  # removed while we walk
        return None
    name, parent = path.name, path.parent
    kind, agent = OTHER, None
    if parent == root / CacheStore.QUARANTINE or (parent == histories and BAD_HISTORY in name):
        kind = QUARANTINE
    elif parent == histories and name.endswith(HISTORY_SUFFIX):
        agent, kind = _agent(name[: -len(HISTORY_SUFFIX)]), HISTORY
    elif parent.parent == root and parent != histories:
        for suffix in (SUFFIX, AGENT_DIR_SUFFIX):
            if name.endswith(suffix) and path.is_dir() == (suffix == AGENT_DIR_SUFFIX):
                agent, kind = _agent(name[: -len(suffix)]), CACHE
    if kind != QUARANTINE and agent is None:
        kind = OTHER
    return DiskFile(path, size, mtime, kind, agent)


def _agent(stem: str) -> str | None:
    try:
        return validate_agent_id(stem)
    except InvalidAgentId:
        return None


# -- what goes -----------------------------------------------------------------------


def plan(
    files: list[DiskFile],
    *,
    budget: int | None = None,
    target: int | None = None,
    older_than: float | None = None,
    conversation_ttl: float | None = None,
    protected: frozenset[str] | set[str] = frozenset(),
    live: frozenset[str] | set[str] = frozenset(),
    hot: frozenset[str] | set[str] = frozenset(),
    now: float | None = None,
) -> Plan:
    """Decide what to remove from ``files`` (``scan``'s list); see the module docstring.
    ``budget`` and ``target`` are bytes (``target`` defaults to ``budget``); ages are seconds."""
    now = time.time() if now is None else now
    out = Plan(total=sum(f.bytes for f in files))
    gone: set[Path] = set()

    def remove(f: DiskFile, why: str) -> None:
        if f.path not in gone:
            gone.add(f.path)
            out.removals.append((f, why))

    by_agent: dict[str, list[DiskFile]] = {}
    for f in files:
        if f.agent is not None:
            by_agent.setdefault(f.agent, []).append(f)
    ttls = [t for t in (conversation_ttl, older_than) if t is not None]
    for agent, own in sorted(by_agent.items()):
        if not is_conversation(agent) or not ttls:
            continue
        last_use = max(f.mtime for f in own)
        if now - last_use > min(ttls) and agent not in protected and agent not in live:
            for f in own:
                remove(f, f"conversation unused for {human_duration(now - last_use)}")
            out.agents_removed.append(agent)
        else:  # a protected one may be past it already: it goes once it is no longer protected
            expiry = last_use + min(ttls)
            out.next_expiry = expiry if out.next_expiry is None else min(out.next_expiry, expiry)

    kept = {*protected, *hot}
    if older_than is not None:
        for f in files:
            stale = now - f.mtime > older_than
            if stale and (f.kind == QUARANTINE or (f.kind == CACHE and f.agent not in kept)):
                remove(f, f"not used for {human_duration(now - f.mtime)}")

    left = out.total - sum(f.bytes for f, _ in out.removals)
    if budget is not None and left > budget:
        target = budget if target is None else min(target, budget)
        quarantined = sorted((f for f in files if f.kind == QUARANTINE), key=lambda f: f.mtime)
        caches = sorted((f for f in files if f.kind == CACHE and f.agent not in kept), key=lambda f: f.mtime)
        for f in (*quarantined, *caches):
            if left <= target:
                break
            if f.path not in gone:
                remove(f, "over the disk budget" if f.kind == CACHE else "quarantined, over the disk budget")
                left -= f.bytes
    out.after = left
    return out


def apply(p: Plan) -> list[DiskFile]:
    """Remove the plan's files (and cache directories); return those removed.  One
    written again since it was scanned (another size or mtime: a writer replaced
    it) is left alone."""
    removed = []
    for f, _ in p.removals:
        try:
            if _stat(f.path) != (f.bytes, f.mtime):
                continue
        except FileNotFoundError:
            continue
        if remove_tree(f.path):
            removed.append(f)
    return removed


def remove_agent(store: CacheStore, histories: Path, agent_id: str, model_id: str | None = None) -> tuple[int, bool]:
    """Delete an agent's cache files (only ``model_id``'s if given) and, when no
    model is given, its history.  Returns (cache files removed, history removed).
    Raises ``InvalidAgentId``, ``OSError``."""
    caches = store.delete(agent_id, model_id)
    if model_id is not None:
        return caches, False
    try:
        history_path(histories, agent_id).unlink()
    except FileNotFoundError:
        return caches, False
    return caches, True


def human_duration(seconds: float) -> str:
    for unit, n in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= n:
            return f"{seconds / n:.1f} {unit}"
    return f"{seconds:.0f} s"


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError
