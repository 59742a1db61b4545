"""Where Semantic keeps its files: ``$SEMANTIC_HOME``, else
``$XDG_CACHE_HOME/semantic``, else ``~/.cache/semantic``."""

from __future__ import annotations

import errno
import os
from pathlib import Path

from .errors import SemanticError

__all__ = ["agents_dir", "cache_home", "models_dir", "usable_dir"]


def cache_home() -> Path:
    if home := os.environ.get("SEMANTIC_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "semantic"


def models_dir() -> Path:
    return cache_home() / "models"


def agents_dir() -> Path:
    """Agents' KV cache files (``runtime.store.cache_file.CacheStore``)."""
    return cache_home() / "agents"


def usable_dir(path: os.PathLike | str) -> Path:
    """``path`` as a directory this process may write in, made if missing;
    else ``SemanticError`` saying why (a file there, no permission, ...)."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as e:
        reason = "a file, not a directory" if isinstance(e, FileExistsError) else e.strerror or str(e)
        raise SemanticError(f"cannot keep files in {path}: {reason}") from None
    return path
