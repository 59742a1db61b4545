"""What every test shares.

The run is isolated (``tests/isolation.py``): one temporary ``SEMANTIC_HOME``
and ``HOME`` for the whole run, and a check at its end that the user's cache
home is byte for byte as it was.

Backends: async tests that exercise the backend run on both asyncio and trio:
the actors (all of ``tests/actors``), the SSE transport (``tests/web/test_sse.py``),
the scenario runner (``tests/scenarios/test_runner.py``) and the tests of
cancellation and disconnects in ``tests/web`` (marked ``both_backends``). The
rest, whose code only runs over the backend, run on asyncio, the server's
default (``semantic serve --backend``).

OpenBLAS's idle threads sleep after a short spin here (``OPENBLAS_THREAD_TIMEOUT``,
read when it loads): it changes no result, and the run's many processes and
threads stop spinning against each other on two cores (docs/testing.md).
"""

import os
import shutil
from pathlib import Path

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # before OpenBLAS loads (semantic.runtime below)

import pytest  # noqa: E402

import semantic.runtime  # noqa: E402, F401  (fast BLAS before anything imports mlx)
from tests import isolation  # noqa: E402

ISOLATION = isolation.enter()
WORKER = os.environ.get("PYTEST_XDIST_WORKER")
ACTORS = Path(__file__).parent / "actors"
_BEFORE: dict[str, str] = {}


def pytest_sessionstart(session):
    if not WORKER:
        _BEFORE.update(ISOLATION.snapshot())


def pytest_sessionfinish(session, exitstatus):
    if WORKER:  # a pytest-xdist worker: its controller cleans up and compares
        return
    shutil.rmtree(ISOLATION.run_home, ignore_errors=True)
    after = ISOLATION.snapshot()
    changed = sorted(k for k in _BEFORE.keys() | after.keys() if _BEFORE.get(k) != after.get(k))
    problems = [f"the run changed {ISOLATION.user_cache / k}" for k in changed[:20]]
    if problems:
        session.config.get_terminal_writer().line("\n".join(["", "Isolation:", *problems]), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_collection_modifyitems(items):
    """Slow tests first: pytest-xdist's workers then end the run on short ones,
    not one worker on a long test while the other waits."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def stays_in_its_folders():
    """A test fails when the isolation hook refused something it did (even where the
    code under test caught the error)."""
    before = len(ISOLATION.refused)
    yield
    assert ISOLATION.refused[before:] == [], "the test reached outside its folders"


@pytest.fixture(autouse=True)
def kernels_stay_as_chosen():
    """No test leaves ``OPENBLAS_CORETYPE`` otherwise than it found it: every later
    child process (servers, the CLI) would run other kernels, or die of an illegal
    instruction where they need AVX-512 and the CPU has none."""
    before = os.environ.get("OPENBLAS_CORETYPE")
    yield
    assert os.environ.get("OPENBLAS_CORETYPE") == before, "a test left OPENBLAS_CORETYPE changed"


@pytest.fixture
def anyio_backend():
    """Async tests run on asyncio unless they run on both (``pytest_generate_tests``)."""
    return "asyncio"


def pytest_generate_tests(metafunc):
    """The actors (``tests/actors``) and tests marked ``both_backends`` run on
    asyncio and trio, unless a test names its backend itself."""
    if "anyio_backend" not in metafunc.fixturenames:
        return
    if any("anyio_backend" in m.args[0] for m in metafunc.definition.iter_markers("parametrize")):
        return
    if ACTORS in Path(metafunc.definition.fspath).parents or metafunc.definition.get_closest_marker("both_backends"):
        metafunc.parametrize("anyio_backend", ["asyncio", "trio"])


@pytest.fixture(scope="session")
def smollm2():
    """The real embedded model, prepared once per machine and loaded once per run."""
    from semantic.runtime.model.models import load

    return load("smollm2", progress=False)
