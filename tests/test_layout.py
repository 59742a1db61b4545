"""The architecture, checked by a tool (import-linter, contracts in
``pyproject.toml``): the layers (cli over web, bench and scenarios, over
actors, over runtime; inside runtime, its rooms) and no import cycle inside
a package -- on this tree,
and broken on a copy of it that breaks each rule. The install: one package,
``semantic``, whose folders are the repo's. And what the architecture's
words claim: who may set what, who tells cache kinds apart, that a
package's docstring lists its modules, and that the docs name code that
exists (docs/architecture.md, "Packages")."""

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
    assert "5 kept, 0 broken" in result.stdout


@needs_lint
@pytest.mark.parametrize("module, line, broken", [
    ("runtime/errors.py", "import semantic.actors.errors", "cli over web, bench and scenarios, over actors, over runtime"),
    ("web/sse.py", "import semantic.cli.main", "cli over web, bench and scenarios, over actors, over runtime"),
    ("runtime/text/json_reader.py", "import semantic.runtime.engine.engine", "no import cycle between the modules of a package"),
    ("web/sse.py", "import semantic.runtime.kv.quantized", "web through one door"),
    ("web/sse.py", "from semantic.actors.gpu import GpuActor", "web through one door"),
    ("runtime/engine/prefill.py", "import semantic.runtime.engine.decode", "the engine over its parts"),
    ("runtime/kv/layer.py", "import semantic.runtime.engine.sequence", "the engine over its parts"),
    ("runtime/store/cache_v1.py", "import semantic.runtime.store.cache_file", "no import cycle"),
    ("runtime/kv/layer.py", "import semantic.runtime.store.cache_file", "the runtime's rooms"),
    ("runtime/model/attention.py", "import semantic.runtime.kv", "the runtime's rooms"),
    ("runtime/engine/decode.py", "import semantic.runtime.store.disk", "the runtime's rooms"),
    ("runtime/store/disk.py", "import semantic.runtime.memory.agent_cache", "the runtime's rooms"),
    ("runtime/text/prefix.py", "import semantic.runtime.model.models", "the runtime's rooms"),
    ("runtime/errors.py", "import semantic.runtime.text.json_reader", "the runtime's rooms"),
], ids=["runtime imports actors", "web imports cli", "a cycle in runtime", "web imports the runtime's internals",
        "web imports past actors' door", "prefill imports decode", "the KV cache imports the sequence",
        "a cycle inside a room", "the KV cache imports the store", "the model imports the KV cache",
        "the engine imports the store", "the store imports agents' memory", "text imports the model",
        "a top module imports a room"])
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


MAX_MODULE_LINES = 500  # a module a newcomer reads in one sitting (CONTRIBUTING.md)


def test_no_module_is_over_500_lines():
    long = {path.relative_to(ROOT).as_posix(): n for package in PACKAGES for path in (ROOT / package).rglob("*.py")
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES}
    assert long == {}, f"split these along their seams: {long}"


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


# What the hot set knows of one agent's cache (``runtime.memory.agent_cache.AgentEntry``).
ENTRY = {"memory", "busy", "dirty", "pending", "on_disk", "reading", "fetched"}


def test_one_writer_of_an_agents_cache_state():
    """An agent's cache state on the GPU thread is one record, and only the hot set
    (``runtime/memory/agent_cache.py``) changes it: no other module assigns its fields."""
    from semantic.runtime.memory.agent_cache import AgentEntry

    assert {f.name for f in dataclasses.fields(AgentEntry)} == ENTRY | {"agent_id"}
    owner = ROOT / "runtime" / "memory" / "agent_cache.py"
    found = [f"{path.relative_to(ROOT)}:{node.lineno} {ast.unparse(t)}"
             for path, tree in _python(*PACKAGES) if path != owner for node, t, _ in _assigned(tree, ENTRY)]
    assert found == []


# What is set on another object's collaborator from outside it (``self.<collaborator>.<attribute> = ...``):
# each is named in docs/architecture.md ("Wiring, in constructors only"), and a new one must be too.
SET_THROUGH_A_COLLABORATOR = {
    "actors/agent.py": {"self.slot.history", "self.slot.last_result", "self.slot.deleted"},  # the agent's slot
    "actors/gpu_thread.py": {"self.registry.loaded", "self.registry.engine", "self.registry.caches"},  # at a stop
    "web/app.py": {"app.state.server"},  # Starlette's place for what the routes share
    "web/chat.py": {"self.index.fmt"},  # the conversation index's call format, once a model is loaded
}


def test_state_set_from_outside_is_only_what_the_architecture_names():
    found: dict[str, set[str]] = {}
    for path, tree in _python(*PACKAGES):
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            for target in targets:
                for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Attribute):
                        found.setdefault(path.relative_to(ROOT).as_posix(), set()).add(ast.unparse(t))
    assert found == SET_THROUGH_A_COLLABORATOR


def test_every_message_is_a_frozen_dataclass_of_one_mailbox_union():
    """docs/architecture.md: every message is a frozen dataclass in
    ``messages.py``, one union per mailbox."""
    import typing

    import semantic.actors.messages as messages

    classes = [c for c in vars(messages).values() if isinstance(c, type) and c.__module__ == messages.__name__]
    assert classes and all(dataclasses.is_dataclass(c) and c.__dataclass_params__.frozen for c in classes)
    for mailbox in ("GpuCommand", "AgentCommand", "PersistCommand", "EvictCommand"):
        assert typing.get_origin(getattr(messages, mailbox)) is typing.Union


# -- package docstrings ----------------------------------------------------------------------------

# Packages whose docstring lists its modules, one bullet each (``* ``name`` ...`` or ``- ``name`` ...``).
LISTED = ("actors", "web", "runtime", "runtime/memory", "runtime/engine", "runtime/store", "runtime/kv",
          "runtime/model", "runtime/text", "scenarios")


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


# -- cache kinds -------------------------------------------------------------------------------------

KIND_NAMES = {"QUANTIZED", "WINDOW", "STATE", "ROTATING"}  # the manifest's kinds, each in its class's module
# Where kinds are still told apart outside ``runtime/kv/`` (docs/architecture.md, "The KV cache has a type"):
# the reader of version 1 files, with its own kinds.
TELLS_KINDS_APART = {"runtime/store/cache_v1.py"}


def test_the_cache_files_ask_the_kind_and_only_version_1_names_kinds():
    """``runtime.store.cache_codec`` writes what a layer ``describe``s and reads through
    the class ``BY_KIND`` registers for the entry; ``runtime.store.cache_file`` checks
    an entry and lays out its tensors through that class too: neither names a
    kind. The one module outside ``runtime/kv/`` that names one is the reader
    of version 1 files."""
    naming = set()
    for path, tree in _python(*PACKAGES):
        if path.is_relative_to(ROOT / "runtime" / "kv"):
            continue
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        if names & KIND_NAMES:
            naming.add(path.relative_to(ROOT).as_posix())
    assert "runtime/store/cache_codec.py" not in naming and "runtime/store/cache_file.py" not in naming
    assert naming == TELLS_KINDS_APART


# -- the docs name code that exists ------------------------------------------------------------------

DOCS = ("docs/architecture.md", "docs/api.md", "docs/cache-format.md", "docs/scaling.md", "docs/testing.md",
        "README.md", "CONTRIBUTING.md")


def _defines(tree: ast.AST, name: str) -> bool:
    """Whether ``tree`` (a module or a class) defines ``name``: a def, a class, an
    assignment, an import, or (in a class) an attribute of ``self``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == name:
            return True
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.ctx, ast.Store):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)) and any((a.asname or a.name) == name for a in node.names):
            return True
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name:
            return True
    return False


def _code_index():
    """Modules by dotted name (``runtime.kv.quantized``), the runtime's also by
    their last name when unique (``quantized``), and our classes by name."""
    modules, classes = {}, {}
    for path, tree in _python(*PACKAGES):
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        modules[dotted] = tree
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                classes.setdefault(node.name, []).append(node)
    short: dict[str, list] = {}
    for dotted, tree in modules.items():  # the runtime's modules go by their last name in the docs
        if dotted.startswith("runtime.") and not (len(tree.body) == 1 and ast.get_docstring(tree)):
            short.setdefault(dotted.rsplit(".", 1)[-1], []).append(tree)
    return modules, {k: v[0] for k, v in short.items() if len(v) == 1}, classes


def _class_defines(node: ast.ClassDef, name: str, classes: dict) -> bool:
    if _defines(node, name):
        return True
    bases = [getattr(b, "id", None) or getattr(b, "attr", None) for b in node.bases]
    return any(_class_defines(c, name, classes) for b in bases for c in classes.get(b, []))


def _unresolved(ref: str, modules: dict, short: dict, classes: dict) -> bool:
    """Whether ``ref`` (``runtime.text.prefix.plan``, ``prefix.plan``, ``Engine.add``)
    names something of ours that is not there. Names that are not ours (mlx-lm's,
    MLX's, the standard library's) are left alone."""
    parts = ref.removeprefix("semantic.").split(".")
    for i in range(len(parts), 0, -1):  # the longest module prefix
        if ".".join(parts[:i]) in modules:
            tree, rest = modules[".".join(parts[:i])], parts[i:]
            break
    else:
        if parts[0] in classes and len(parts) > 1:
            return not any(_class_defines(c, parts[1], classes) for c in classes[parts[0]])
        if parts[0] in short and len(parts) > 1 and parts[0] not in classes:
            tree, rest = short[parts[0]], parts[1:]
        else:
            return False
    if not rest:
        return False
    if not _defines(tree, rest[0]):
        return True
    if len(rest) > 1:  # Class.attr inside the module
        owners = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == rest[0]]
        return bool(owners) and not any(_class_defines(c, rest[1], classes) for c in owners)
    return False


def test_the_docs_name_files_modules_and_names_that_exist():
    """Every file, module, class member and test a doc names in backticks is
    there: a doc that names code the code no longer has fails here."""
    modules, short, classes = _code_index()
    tests = {n.name for _, tree in _python("tests") for n in ast.walk(tree)
             if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    missing = []
    for doc in DOCS:
        text = (ROOT / doc).read_text()
        for span in sorted(set(re.findall(r"`([^`\n]+)`", text))):
            span = span.strip()
            if "<" in span:  # a placeholder: ``web/<name>.py``
                continue
            for path in re.findall(r"(?<![\w/.-])((?:runtime|actors|web|cli|bench|scenarios|tests|scripts|docs)"
                                   r"/[\w./-]*\w)", span):
                module, _, name = path.rpartition(".")  # a module's name: ``web/identity.forked_conversation_id``
                if not (ROOT / path).exists() and not ((ROOT / f"{module}.py").exists() and
                                                       _defines(ast.parse((ROOT / f"{module}.py").read_text()), name)):
                    missing.append(f"{doc}: {path}")
            for name in re.findall(r"\btest_\w+\b", span):
                if name not in tests and not any((ROOT / "tests").rglob(f"{name}.py")):
                    missing.append(f"{doc}: {name}")
            if "/" in span or " " in span.split("(")[0]:
                continue
            for ref in re.findall(r"\b([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)\b", span):
                if ref.rsplit(".", 1)[-1] in {"py", "md", "json", "toml", "yaml", "txt", "sh"}:
                    continue
                if _unresolved(ref, modules, short, classes):
                    missing.append(f"{doc}: {ref}")
    assert missing == []

def test_todays_benchmark_figures_cover_every_bench_with_commands_that_parse():
    """``docs/benchmarks.md`` opens with a table per benchmark, each row with
    the command that made it: every ``semantic bench`` there parses as the
    CLI stands, and every benchmark the CLI has is there."""
    import argparse
    import shlex

    from semantic.cli.main import parser

    text = (ROOT / "docs" / "benchmarks.md").read_text()
    today = text[text.index("## Today's figures"):text.index("## History")]
    benches = set()
    for command in re.findall(r"`(semantic bench [^`]+)`", today):
        benches.add(parser().parse_args(shlex.split(command)[1:]).bench)  # SystemExit(2) where it does not parse
    top = parser()
    (commands,) = [a for a in top._actions if isinstance(a, argparse._SubParsersAction)]
    (bench,) = [a for a in commands.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)]
    assert benches == set(bench.choices)
