import pytest

from semantic.actors import Runtime


@pytest.fixture
def open_runtime(smollm2, tmp_path):
    """``open_runtime(**options)``: a runtime on the session's SmolLM2 (loaded once)
    with its caches under ``tmp_path/cache``."""

    def open_(**options):
        options.setdefault("cache_dir", tmp_path / "cache")
        options.setdefault("budget", 256 << 20)
        return Runtime.open(smollm2, **options)

    return open_
