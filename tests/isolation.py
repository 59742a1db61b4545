"""The test run kept out of the user's files.

``enter()`` (called by ``tests/conftest.py`` before anything reads a path)
points ``SEMANTIC_HOME`` and ``HOME`` at one temporary folder for the whole
run, so servers, CLIs and child processes keep their files there. Two folders
of the user's cache home are linked in, to be read only: the prepared
embedded model (``models/``, prepared by ``make test`` before the run) and
the pinned client CLIs (``clients/``). Nothing else of it is seen:
row counts, agents' caches and settings start empty, as on a fresh machine.

An audit hook refuses, in the test processes, a write outside the temporary
folders, the repository and the virtual environment, any write to the
user's cache home, ``~/.codex`` and ``~/.claude``, and any read of them but
of the two linked folders. ``snapshot()`` of the user's
cache home before and after the run tells whether anything changed it
(``pytest_sessionfinish`` in ``tests/conftest.py``).
"""

from __future__ import annotations

import hashlib
import os
import sys
import tempfile
from pathlib import Path

__all__ = ["Isolation", "enter", "snapshot"]

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("models", "clients")
_RUN = "SEMANTIC_TESTS_RUN"  # the user's home, their cache home and the run's home, for xdist's workers
# events that change a path: which of their arguments are read (r) and written (w)
_WRITES = {"os.rename": "ww", "shutil.move": "ww", "os.link": "rw", "os.symlink": "rw", "shutil.copyfile": "rw",
           **dict.fromkeys(("os.mkdir", "os.remove", "os.rmdir", "os.truncate", "os.chmod", "os.utime",
                            "shutil.rmtree"), "w")}


class Isolation:
    def __init__(self, user_home: Path, user_cache: Path, run_home: Path):
        self.user_home = user_home
        self.user_cache = user_cache
        self.run_home = run_home  # HOME and SEMANTIC_HOME of the run
        self.private = (user_cache, user_home / ".codex", user_home / ".claude", user_home / ".claude.json")
        self.readable = tuple(user_cache / name for name in LINKED)
        self.writable = tuple({Path(tempfile.gettempdir()).resolve(), run_home, ROOT, Path(sys.prefix).resolve(),
                               Path("/dev")})
        self.refused: list[str] = []  # what the hook refused (a test that caused one fails)
        self.watching = True

    def snapshot(self) -> dict[str, str]:
        """``snapshot`` of the user's cache home (the hook looks away while it reads)."""
        self.watching = False
        try:
            return snapshot(self.user_cache)
        finally:
            self.watching = True

    def check(self, event: str, args: tuple) -> None:
        if not self.watching:
            return
        if event == "open":
            mode = args[1]
            writes = mode is None and len(args) > 2 and args[2] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT) \
                or isinstance(mode, str) and any(c in mode for c in "wax+")
            uses = [(args[0], bool(writes))]
        elif event in _WRITES:
            if event == "os.mkdir" and _is_dir(args[0]):
                return
            uses = [(path, how == "w") for path, how in zip(args, _WRITES[event])]
        else:
            return
        for path, writes in uses:
            if not isinstance(path, (str, bytes, os.PathLike)):
                continue  # a file descriptor, a mode
            where = Path(os.path.abspath(os.fsdecode(path)))
            if _under(where, self.private) and not (not writes and _under(where, self.readable)):
                self._refuse(f"{event} {where}: the user's own files")
            if writes and not _under(where, self.writable):
                self._refuse(f"{event} {where}: outside the run's temporary folders")

    def _refuse(self, what: str) -> None:
        self.refused.append(what)
        raise PermissionError(f"a test touched {what} (tests/isolation.py)")


def enter() -> Isolation:
    """Give the run its own home (see the module's docstring) and install the hook.
    pytest-xdist's workers inherit the home their controller made (``_RUN``)."""
    if _RUN in os.environ:
        user_home, user_cache, run_home = (Path(p) for p in os.environ[_RUN].split(os.pathsep))
    else:
        user_home = Path(os.environ.get("HOME") or Path.home()).resolve()
        from semantic.runtime.paths import cache_home

        user_cache = cache_home().resolve()
        run_home = Path(tempfile.mkdtemp(prefix="semantic-tests-")).resolve()
        for name in LINKED:
            if (user_cache / name).is_dir():
                (run_home / name).symlink_to(user_cache / name, target_is_directory=True)
        os.environ[_RUN] = os.pathsep.join(map(str, (user_home, user_cache, run_home)))
    os.environ.pop("XDG_CACHE_HOME", None)
    os.environ["SEMANTIC_HOME"] = str(run_home)
    os.environ["HOME"] = str(run_home)
    isolation = Isolation(user_home, user_cache, run_home)
    sys.addaudithook(isolation.check)
    return isolation


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under ``folder`` (links not followed) by its path: its size and
    modification time, and its SHA-256 below 16 MB. Empty when there is none."""
    out = {}
    if not folder.is_dir():
        return out
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            digest = ""
            if os.path.isfile(path) and not os.path.islink(path) and st.st_size < 16 << 20:
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, folder)] = f"{st.st_size} {st.st_mtime_ns} {digest}"
    return out


def _under(path: Path, roots) -> bool:
    return any(path == root or root in path.parents for root in roots)


def _is_dir(path) -> bool:
    try:
        return os.path.isdir(path)
    except (TypeError, ValueError):
        return False
