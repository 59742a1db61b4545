"""Files that a crash never leaves half written, and trees of files measured
and removed: what the cache store, the row counts, the persistence actor and
archives share. No MLX: any thread may call these."""

from __future__ import annotations

import os
import secrets
import shutil
import sys
from pathlib import Path

__all__ = ["TMP_PREFIX", "file_size", "fsync_dir", "pid_alive", "remove_tree", "tree_bytes", "write_atomic"]

TMP_PREFIX = ".tmp-"  # temp files start with '.', which no agent id may: never taken for a cache


def write_atomic(path: os.PathLike | str, data: bytes | bytearray | memoryview, sync_dir: bool = True) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename, fsync the
    directory): a reader sees the old file or the new one, never a part.  Touches
    no MLX array; safe on any thread.  Raises ``OSError``; the temp file never stays.
    ``sync_dir`` False leaves the directory's fsync to the caller (one for several files)."""
    path = Path(path)
    tmp = path.parent / f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.stem}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        with open(fd, "wb") as f:
            f.write(data)
            f.flush()
            _fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if sync_dir:
        fsync_dir(path.parent)  # makes the rename itself durable


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


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_size(path: Path) -> int:
    """Bytes of the file at ``path``; 0 when it cannot be read (gone meanwhile)."""
    try:
        return path.stat().st_size
    except OSError:
        return 0


def tree_bytes(top: Path) -> int:
    """Bytes of every file under ``top`` (or of ``top`` itself, a file)."""
    if not top.is_dir():
        return file_size(top)
    return sum(file_size(Path(parent) / name) for parent, _, names in os.walk(top) for name in names)


def remove_tree(path: Path) -> int:
    """Remove a file or a directory with everything in it; 1 if there was one."""
    try:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:
        return 0
    return 1


def pid_alive(pid: int) -> bool:
    """Whether a process ``pid`` runs (a writer that left temp files behind)."""
    if pid <= 0:  # 0 and -1 would signal whole groups: no writer has such a pid
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True
