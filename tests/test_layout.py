"""The architecture, checked by a tool (import-linter, contracts in
``pyproject.toml``): the layers (cli over web, bench and scenarios, over
actors, over runtime) and no import cycle inside a package -- on this tree,
and broken on a copy of it that breaks each rule."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "actors", "web", "cli", "bench", "scenarios")
LINT = Path(sys.executable).with_name("lint-imports")

pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def lint(tree: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def copy_of_the_tree(tmp_path: Path) -> Path:
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_tree_keeps_its_layers_and_has_no_import_cycle():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 kept, 0 broken" in result.stdout


@pytest.mark.parametrize("module, line, broken", [
    ("runtime/errors.py", "import actors.errors", "cli over web, bench and scenarios, over actors, over runtime"),
    ("web/sse.py", "import cli.main", "cli over web, bench and scenarios, over actors, over runtime"),
    ("runtime/json_reader.py", "import runtime.engine", "no import cycle between the modules of a package"),
], ids=["runtime imports actors", "web imports cli", "a cycle in runtime"])
def test_an_import_that_breaks_a_rule_fails_the_check(tmp_path, module, line, broken):
    tree = copy_of_the_tree(tmp_path)
    path = tree / module
    path.write_text(path.read_text() + f"\n{line}  # breaks the rule\n")
    result = lint(tree)
    assert result.returncode != 0
    assert f"{broken} BROKEN" in result.stdout
