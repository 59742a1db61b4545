"""Where Semantic keeps its files: ``$SEMANTIC_HOME``, else
``$XDG_CACHE_HOME/semantic``, else ``~/.cache/semantic``."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["agents_dir", "cache_home", "models_dir"]


def cache_home() -> Path:
    if home := os.environ.get("SEMANTIC_HOME"):
        return Path(home).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(xdg).expanduser() / "semantic"


def models_dir() -> Path:
    return cache_home() / "models"


def agents_dir() -> Path:
    """Agents' KV cache files (``runtime.cache_file.CacheStore``)."""
    return cache_home() / "agents"
