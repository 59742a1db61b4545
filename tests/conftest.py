import os

import pytest

import semantic.runtime  # noqa: F401  (fast BLAS before anything imports mlx)


@pytest.fixture(autouse=True)
def kernels_stay_as_chosen():
    """No test leaves ``OPENBLAS_CORETYPE`` otherwise than it found it: every later
    child process (servers, the CLI) would run other kernels, or die of an illegal
    instruction where they need AVX-512 and the CPU has none."""
    before = os.environ.get("OPENBLAS_CORETYPE")
    yield
    assert os.environ.get("OPENBLAS_CORETYPE") == before, "a test left OPENBLAS_CORETYPE changed"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    """Every async test runs on both backends."""
    return request.param


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model, prepared once per machine and loaded once per run."""
    from semantic.runtime.models import load

    return load("smollm2", progress=False)
