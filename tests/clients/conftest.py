"""Real coding-agent CLIs against a real ``semantic serve``.

``scripts/setup-clients.sh`` (run by ``make test``, and here once per session
when something is missing) installs the pinned Claude Code and Codex CLIs under
the cache home. A test that needs one skips only when it cannot be installed
(no npm, and none to be had from apt); an install that fails with npm present
is a failure. ``SEMANTIC_SKIP_CLIENTS=1`` skips them all.

The server is a subprocess on a free loopback port with a temporary cache
directory, one per test module; failures quote the CLI's output and the tail
of the server's log.

Both CLIs take a reply cut at ``max_tokens`` for a failure (Claude Code asks to
resume, then fails the turn; Codex fails it on ``response.incomplete``), and
where SmolLM2 stops depends on the BLAS kernels, not only on the prompt. So the
server runs SmolLM2 as a model directory (``first_word_model``) whose config
makes every token that holds whitespace an end-of-turn token too: each reply
ends by itself at its first word (``tests.web.live.first_word_only``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from semantic.runtime.model.models import load_tokenizer, resolve
from semantic.runtime.paths import cache_home
from tests.web.live import word_break_ids

ROOT = Path(__file__).resolve().parents[2]
SETUP = ROOT / "scripts" / "setup-clients.sh"
# A system prompt (instructions) for a terse assistant, a few hundred tokens long.
TERSE_RULES = (
    "Rules you always follow:",
    "1. Answer the question that was asked and nothing else.",
    "2. Never invent file names, command output or facts you have not seen.",
    "3. When a question is ambiguous, give the most common reading and say so in a few words.",
    "4. Prefer plain words to jargon, and short words to long ones.",
    "5. Do not apologise, do not thank the user, do not repeat the question.",
    "6. When asked for a greeting or a farewell, give exactly one word.",
    "7. Keep code in backticks and keep it to one line.",
    "8. If a command could delete or overwrite data, say so before anything else.",
    "9. Numbers are written as digits; units follow the number with a space.",
    "10. If you do not know, say 'I do not know.' and stop.",
    "The user is a programmer who values brevity over completeness, reads every word you write,",
    "and will ask a follow-up question when they need more detail. A good answer is a single line.",
)
MAX_OUTPUT_TOKENS = 64  # a reply of SmolLM2 on two CPU cores stays within seconds
START_TIMEOUT = 180


def clients_dir() -> Path:
    return cache_home() / "clients"


@functools.cache
def _setup() -> str:
    """Run the install script once per session; its output (for skip and failure messages)."""
    try:
        out = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as e:
        return f"{SETUP.name} timed out: {e}"
    return (out.stdout + out.stderr).strip()


def client_bin(name: str) -> Path:
    """The installed CLI ``name`` (claude, codex), installing it if missing; skips or fails as above."""
    if os.environ.get("SEMANTIC_SKIP_CLIENTS"):
        pytest.skip("SEMANTIC_SKIP_CLIENTS is set")
    path = clients_dir() / "node_modules" / ".bin" / name
    if not _runs(path):
        log = _setup()
        if not _runs(path):
            if shutil.which("npm") is None:
                pytest.skip(f"{name} cannot be installed here: no npm, and apt could not install it "
                            f"(install Node.js and npm, then run scripts/setup-clients.sh): {log}")
            pytest.fail(f"{name} did not install into {clients_dir()} (scripts/setup-clients.sh):\n{log}")
    return path


@functools.cache
def _runs(path: Path) -> bool:
    if not path.exists():
        return False
    try:
        return subprocess.run([str(path), "--version"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@functools.cache
def serve_help() -> str:
    out = subprocess.run([sys.executable, "-m", "semantic.cli.main", "serve", "--help"], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    return out.stdout


def first_word_model(root: Path) -> Path:
    """A model directory of the embedded model's files (linked) whose ``config.json`` makes
    every token that holds whitespace an end-of-turn token too (see the module docstring)."""
    source = Path(resolve("smollm2", progress=False))
    root.mkdir(parents=True, exist_ok=True)
    for f in source.iterdir():
        if f.name != "config.json":
            (root / f.name).symlink_to(f)
    config = json.loads((source / "config.json").read_text())
    eos = config.get("eos_token_id")
    eos = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    config["eos_token_id"] = sorted(eos | word_break_ids(load_tokenizer("smollm2")))
    (root / "config.json").write_text(json.dumps(config))
    return root


class Server:
    """``semantic serve`` on the embedded model (or ``model``, a directory served as smollm2:
    ``first_word_model``), a free loopback port and ``cache_dir``."""

    def __init__(self, cache_dir: Path, log_path: Path, model: Path | None = None):
        self.log_path = log_path
        args = [sys.executable, "-m", "semantic.cli.main", "serve", "--port", "0", "--cache-dir", str(cache_dir)]
        if model is not None:
            args += ["--model", f"smollm2={model}"]
        if "--max-tokens-cap" in serve_help():  # clamps what a client asks for (Claude Code: 32000; Codex: none)
            args += ["--max-tokens-cap", str(MAX_OUTPUT_TOKENS)]
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.url = self._wait_ready()

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if m := re.search(r"listening on (http://\S+)", self.log_path.read_text()):
                return m.group(1)
            if self.proc.poll() is not None:
                self.stop()
                pytest.fail(f"semantic serve exited ({self.proc.returncode}) before it was ready:\n{self.tail()}")
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"semantic serve was not ready within {START_TIMEOUT} s:\n{self.tail()}")

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as e:
            return f"(no server log: {e})"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # Ctrl-C: flushes the caches and exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    s = Server(tmp / "agents", tmp / "server.log", first_word_model(tmp / "smollm2"))
    yield s
    s.stop()


def run_cli(argv: list, *, env: dict, cwd: Path, timeout: float, server: Server) -> subprocess.CompletedProcess:
    """Run a CLI; a timeout fails the test with what it printed and the server's log."""
    try:
        return subprocess.run([str(a) for a in argv], env=env, cwd=cwd, capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{Path(argv[0]).name} ran past {timeout} s: {argv[1:]}\n"
                    + report(e.stdout, e.stderr, server))


def report(stdout, stderr, server: Server) -> str:
    def tail(text, n=3000):
        if isinstance(text, bytes):
            text = text.decode(errors="replace")
        text = text or ""
        return text if len(text) <= n else "..." + text[-n:]

    return (f"--- stdout (tail) ---\n{tail(stdout)}\n--- stderr (tail) ---\n{tail(stderr)}\n"
            f"--- server log (tail) ---\n{server.tail()}")


def base_env(home: Path) -> dict:
    """A clean environment: nothing of this machine's (keys, configs, proxies) leaks into a client."""
    home.mkdir(parents=True, exist_ok=True)
    env = {"HOME": str(home), "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
           "TMPDIR": str(home), "NO_COLOR": "1", "TERM": "dumb"}
    return env
