"""The run stays out of the user's files (``tests/isolation.py``)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from semantic.runtime.paths import cache_home
from tests import isolation
from tests.conftest import ISOLATION


def test_the_run_has_a_home_of_its_own():
    assert cache_home() == ISOLATION.run_home == Path(os.environ["HOME"])
    assert ISOLATION.user_cache not in cache_home().parents and cache_home() != ISOLATION.user_cache
    for name in isolation.LINKED:  # the prepared model and the client CLIs, linked, never copied
        linked = ISOLATION.run_home / name
        assert not linked.exists() or linked.resolve() == ISOLATION.user_cache / name


def test_the_hook_refuses_the_users_files_and_writes_outside_the_runs_folders(tmp_path):
    user = isolation.Isolation(tmp_path / "user", tmp_path / "user/.cache/semantic", tmp_path / "run")
    check = user.check
    with pytest.raises(PermissionError, match="the user's own files"):
        check("open", (str(tmp_path / "user/.cache/semantic/row-counts/x.json"), "r", os.O_RDONLY))
    with pytest.raises(PermissionError, match="the user's own files"):
        check("open", (str(tmp_path / "user/.codex/config.toml"), "r", os.O_RDONLY))
    with pytest.raises(PermissionError, match="the user's own files"):  # linked folders: read, never written
        check("open", (str(tmp_path / "user/.cache/semantic/models/m/config.json"), "w", os.O_WRONLY))
    with pytest.raises(PermissionError, match="outside the run's temporary folders"):
        check("os.rename", ("/etc/passwd-", "/etc/passwd"))
    with pytest.raises(PermissionError, match="the user's own files"):  # into the user's cache from the run's
        check("os.rename", (str(tmp_path / "run/x.json"), str(tmp_path / "user/.cache/semantic/x.json")))
    check("open", (str(tmp_path / "user/.cache/semantic/models/m/config.json"), "r", os.O_RDONLY))
    check("shutil.copyfile", (str(tmp_path / "user/.cache/semantic/models/m/tokenizer.json"), str(tmp_path / "t")))
    check("open", (str(tmp_path / "run/agents/a.kv"), "wb", os.O_WRONLY))
    assert len(user.refused) == 5


def test_a_snapshot_sees_one_byte_changed(tmp_path):
    (tmp_path / "row-counts").mkdir()
    f = tmp_path / "row-counts/k.json"
    f.write_bytes(b"{}")
    before = isolation.snapshot(tmp_path)
    assert before == isolation.snapshot(tmp_path)
    os.utime(f, ns=(0, os.stat(f).st_mtime_ns))  # same bytes, same time: the same
    assert before == isolation.snapshot(tmp_path)
    st = os.stat(f)
    f.write_bytes(b"[]")
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))  # other bytes behind the same size and time
    assert isolation.snapshot(tmp_path) != before


LEAKS = '''
import os, subprocess

def test_a_child_process_writes_into_the_users_cache():
    subprocess.run(["sh", "-c", 'printf x >> "$LEAK"'], check=True)  # past the hook: another process
'''
KEEPS = '''
def test_nothing_leaves_the_run():
    import os, pathlib
    assert pathlib.Path(os.environ["LEAK"]).is_file()  # the file is there, and left as it was
'''


@pytest.mark.slow
@pytest.mark.parametrize("body, fails", [(LEAKS, True), (KEEPS, False)], ids=["leaks", "keeps"])
def test_a_run_that_changed_the_users_cache_by_a_byte_fails(tmp_path, body, fails):
    """The end-of-run comparison, through pytest itself: a run whose test (here
    a child process, out of the hook's reach) appends one byte to a file of the
    user's cache home fails and names the file; a run that does not passes."""
    user = tmp_path / "user"
    kept = user / ".cache/semantic/row-counts/k.json"
    kept.parent.mkdir(parents=True)
    kept.write_text("{}")
    (tmp_path / "test_case.py").write_text(body)
    env = {k: v for k, v in os.environ.items()
           if k not in ("SEMANTIC_HOME", "XDG_CACHE_HOME", isolation._RUN) and not k.startswith("PYTEST_")}
    env.update(HOME=str(user), LEAK=str(kept))
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest",
                          str(tmp_path / "test_case.py")], cwd=isolation.ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert (out.returncode != 0) == fails, out.stdout + out.stderr
    assert ("the run changed " + str(kept) in out.stdout) == fails, out.stdout
    assert kept.read_text() == ("{}x" if fails else "{}")
