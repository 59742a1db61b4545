"""``semantic scenario validate|run``, as a user runs them (``python -m semantic.scenarios.cli``)."""

import argparse
import subprocess
import sys

import pytest

from semantic.scenarios.cli import LIBRARY, add_parser, resolve

from .test_schema import BASE


def scenario(*args):
    return subprocess.run([sys.executable, "-m", "semantic.scenarios.cli", *args], capture_output=True, text=True, timeout=60)


def test_validate_prints_a_summary():
    out = scenario("validate", str(LIBRARY / "prisoners_dilemma.yaml"))
    assert out.returncode == 0, out.stderr
    assert "prisoners_dilemma.yaml: ok" in out.stdout
    assert "5 phases, 23 turns" in out.stdout and "Analyst (analyst, ephemeral)" in out.stdout


def test_validate_finds_shipped_scenarios_by_name():
    out = scenario("validate", "gossip_network")
    assert out.returncode == 0 and "3 phases, 18 turns" in out.stdout


def test_validate_error_is_one_line_with_file_and_line(tmp_path):
    bad = tmp_path / "gossip.yaml"
    bad.write_text(BASE.replace("agents: [alice, eve]", "agents: [alice, eve2]"))
    out = scenario("validate", str(bad))
    assert out.returncode == 2
    assert out.stderr == f"semantic: error: {bad}:16: phases[1].agents: unknown agent 'eve2' (known: alice, bob, eve)\n"


def test_missing_file_is_one_line():
    out = scenario("validate", "no_such_scenario")
    assert out.returncode == 2 and "no scenario file 'no_such_scenario' (shipped scenarios: " in out.stderr
    assert len(out.stderr.splitlines()) == 1


def test_run_against_no_server_is_one_clear_line():
    out = scenario("run", "town_council", "--json", "--url", "http://127.0.0.1:9")
    assert out.returncode == 2
    assert out.stderr.startswith("semantic: error: cannot reach semantic serve at http://127.0.0.1:9")
    assert len(out.stderr.splitlines()) == 1


@pytest.mark.parametrize("args, message", [
    (["--url", "localhost:8000"], "--url must start with http:// or https://"),
    (["--url", "http://localhost:8000", "--model", "smollm2"], "--model cannot be used with --url"),
])
def test_run_checks_its_arguments_before_the_backend(args, message):
    out = scenario("run", "gossip_network", *args)
    assert out.returncode == 2 and message in out.stderr


def test_run_reports_a_broken_file_before_the_backend(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text(BASE.replace("lifecycle: permanent", "lifecycle: later"))
    out = scenario("run", str(bad))
    assert out.returncode == 2 and f"{bad}:9: agents.eve.lifecycle:" in out.stderr


def test_add_parser_wires_into_semantic():
    top = argparse.ArgumentParser(prog="semantic")
    add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["scenario", "run", "f.yaml", "--model", "m", "--seed", "5", "--url", "http://x",
                           "--no-cache", "--json", "--out", "d"])
    assert (args.command, args.action, args.file, args.model, args.seed, args.url, args.no_cache, args.json, args.out) \
        == ("scenario", "run", "f.yaml", "m", 5, "http://x", True, True, "d")
    args = top.parse_args(["scenario", "run", "f.yaml"])
    defaults = (args.model, args.seed, args.url, args.no_cache, args.json, args.out)
    assert defaults == (None, None, None, False, False, None)
    assert top.parse_args(["scenario", "validate", "f.yaml"]).action == "validate"


def test_importing_the_cli_is_cheap():
    out = subprocess.run([sys.executable, "-c", "import sys, scenarios.cli; "
                          "print(sorted(m for m in ('yaml', 'rich', 'anyio', 'mlx') if m in sys.modules))"],
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


def test_resolve_prefers_a_real_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "gossip_network").write_text("x")
    assert resolve("gossip_network").resolve() == tmp_path / "gossip_network"
    assert resolve("town_council.yaml") == LIBRARY / "town_council.yaml"
