import pytest

import semantic.runtime  # noqa: F401  (fast BLAS before anything imports mlx)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Every async test runs on both backends."""
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model, prepared once per machine and loaded once per run."""
    from semantic.runtime.models import load

    return load("smollm2", progress=False)
