"""The architecture, checked by a tool (import-linter, contracts in
``pyproject.toml``): the layers (cli over web, bench and scenarios, over
actors, over runtime) and no import cycle inside a package -- on this tree,
and broken on a copy of it that breaks each rule. The install: one package,
``semantic``, whose folders are the repo's. And that a package's docstring
lists its modules."""

from __future__ import annotations

import ast
import dataclasses
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "actors", "web", "cli", "bench", "scenarios")
LINT = Path(sys.executable).with_name("lint-imports")

needs_lint = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def lint(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the ``semantic`` under ``tree``, or on the installed one."""
    return subprocess.run([str(LINT), "--no-cache"], cwd=tree, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(tree), "PATH": "/usr/bin:/bin"})


def copy_of_the_tree(tmp_path: Path) -> Path:
    """The repo's folders as the installed package lays them out: ``semantic/runtime``, ..."""
    for package in PACKAGES:
        shutil.copytree(ROOT / package, tmp_path / "semantic" / package,
                        ignore=shutil.ignore_patterns("__pycache__", "static"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


@needs_lint
def test_the_tree_keeps_its_layers_and_has_no_import_cycle():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "3 kept, 0 broken" in result.stdout


@needs_lint
@pytest.mark.parametrize("module, line, broken", [
    ("runtime/errors.py", "import semantic.actors.errors", "cli over web, bench and scenarios, over actors, over runtime"),
    ("web/sse.py", "import semantic.cli.main", "cli over web, bench and scenarios, over actors, over runtime"),
    ("runtime/json_reader.py", "import semantic.runtime.engine", "no import cycle between the modules of a package"),
    ("web/sse.py", "import semantic.runtime.kv.quantized", "web through one door"),
    ("web/sse.py", "from semantic.actors.gpu import GpuActor", "web through one door"),
], ids=["runtime imports actors", "web imports cli", "a cycle in runtime", "web imports the runtime's internals",
        "web imports past actors' door"])
def test_an_import_that_breaks_a_rule_fails_the_check(tmp_path, module, line, broken):
    tree = copy_of_the_tree(tmp_path)
    path = tree / "semantic" / module
    path.write_text(path.read_text() + f"\n{line}  # breaks the rule\n")
    result = lint(tree)
    assert result.returncode != 0
    assert broken in result.stdout and "BROKEN" in result.stdout


@pytest.mark.slow
def test_the_wheel_installs_one_package_and_the_command(tmp_path):
    """``pip install .`` adds ``semantic`` (the repo's folders, with their data) and the
    ``semantic`` command, and no generic top-level name such as ``web`` or ``cli``."""
    source = tmp_path / "source"  # built from a copy: pip writes build/ beside the sources
    for package in PACKAGES:
        shutil.copytree(ROOT / package, source / package, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(source)], check=True, capture_output=True, timeout=300)
    (wheel,) = tmp_path.glob("semantic-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert {name.split("/")[0] for name in names} == {"semantic", wheel.name.rsplit("-", 3)[0] + ".dist-info"}
    for package in PACKAGES:  # every module of the repo's folders
        for module in (ROOT / package).rglob("*.py"):
            assert f"semantic/{module.relative_to(ROOT).as_posix()}" in names, module
    for data in ("web/static/index.html", "web/static/dashboard.js", "bench/data/lighthouses.txt",
                 "scenarios/library/town_council.yaml"):
        assert f"semantic/{data}" in names
    entry_points = next(n for n in names if n.endswith("entry_points.txt"))
    assert "semantic = semantic.cli.main:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def _python(*packages: str):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text())


def test_no_code_outside_runtime_kv_asks_a_layer_cache_its_kind():
    """Code asks a layer cache (``runtime.kv.LayerCache``) what it can do, never
    which kind it is: an ``isinstance`` over our layer kinds lives only in
    ``runtime/kv/``."""
    import semantic.runtime.kv as kv

    kinds = {cls.__name__ for cls in kv.BY_KIND.values()} | {"SequenceQuantizedKVCache", "DequantizingKVCache"}
    found = []
    for path, tree in _python(*PACKAGES):
        if path.is_relative_to(ROOT / "runtime" / "kv"):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
                named = {n.id if isinstance(n, ast.Name) else getattr(n, "attr", None) for n in ast.walk(node.args[1])}
                if named & kinds:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert found == []


# What actors and caches are wired with: given in their constructors, never set from outside afterwards.
COLLABORATORS = {"gpu", "live", "hot", "batch", "on_pruned", "disk", "target", "row_counts", "demotions",
                 "prefix_drops"}


def _assigned(tree: ast.AST, names: set[str]):
    """The attributes named ``names`` that ``tree`` assigns, with the name each is reached from."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Attribute) and t.attr in names:
                    root = t
                    while isinstance(root, ast.Attribute):
                        root = root.value
                    yield node, t, root.id if isinstance(root, ast.Name) else None


def test_actors_get_their_collaborators_in_their_constructors():
    found = []
    for path, tree in _python(*PACKAGES):
        if path.is_relative_to(ROOT / "runtime" / "kv"):  # a kind's ``rebuild`` fills the cache it made
            continue
        for node, t, root in _assigned(tree, COLLABORATORS):
            if root not in ("self", "cls"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}")
    assert found == []


# What the hot set knows of one agent's cache (``runtime.agent_cache.AgentEntry``).
ENTRY = {"memory", "busy", "dirty", "pending", "on_disk", "reading", "fetched"}


def test_one_writer_of_an_agents_cache_state():
    """An agent's cache state on the GPU thread is one record, and only the hot set
    (``runtime/agent_cache.py``) changes it: no other module assigns its fields."""
    from semantic.runtime.agent_cache import AgentEntry

    assert {f.name for f in dataclasses.fields(AgentEntry)} == ENTRY | {"agent_id"}
    owner = ROOT / "runtime" / "agent_cache.py"
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}"
             for path, tree in _python(*PACKAGES) if path != owner for node, t, _ in _assigned(tree, ENTRY)]
    assert found == []


# -- package docstrings ----------------------------------------------------------------------------

# Packages whose docstring lists its modules, one bullet each (``* ``name`` ...`` or ``- ``name`` ...``).
LISTED = ("actors", "web", "runtime/kv", "scenarios")


@pytest.mark.parametrize("package", LISTED)
def test_a_package_docstring_names_every_module_it_holds(package):
    """The layout a package's docstring gives is the package: every module and
    folder named, and nothing named that is not there."""
    folder = ROOT / package
    doc = ast.get_docstring(ast.parse((folder / "__init__.py").read_text()))
    named = set(re.findall(r"^\s*[*-] ``([\w/]+)``", doc, re.M))
    held = {p.stem for p in folder.glob("*.py") if p.stem != "__init__"}
    held |= {f"{p.name}/" for p in folder.iterdir() if p.is_dir() and p.name != "__pycache__"}
    assert named == held, f"not named: {sorted(held - named)}; named, not there: {sorted(named - held)}"
