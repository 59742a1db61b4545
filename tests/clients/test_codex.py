"""The real Codex CLI (``codex exec``) against ``semantic serve``'s Responses
API: two turns of one session (``codex exec``, then ``codex exec resume
--last``), the second served from the agent's cache.

What Codex 0.169.0 sends is in ``tests/web/data/codex_requests.json``: no
``previous_response_id`` and ``store: false`` -- the whole input every turn,
with ``prompt_cache_key`` (and the ``session-id`` header) naming the session;
no top-level ``instructions`` (its base instructions are the first
``developer`` message of ``input``); no ``max_output_tokens`` (the server's
``--max-tokens-cap`` bounds the reply, where the server has it). Its defaults
come to about 4.5K tokens of messages and 4.3K of tool definitions (SmolLM2
tokenizer); the configuration below brings them to ~330 tokens of messages
plus ~1.1K of tools (which SmolLM2's template drops anyway).

Codex fails a turn whose reply was cut at the cap (``response.incomplete``), and
whether SmolLM2 stops within it depends on the BLAS kernels; so the server ends
each reply at its first word (``conftest.first_word_model``).
"""

from __future__ import annotations

import json

import pytest

from .conftest import TERSE_RULES, base_env, client_bin, report, run_cli

pytestmark = [pytest.mark.model]

TURN_TIMEOUT = 120

INSTRUCTIONS = "\n".join(["You are Terse, a coding assistant in a terminal. You answer in one short sentence.",
                          *TERSE_RULES])


def codex_config(url: str, instructions_file) -> str:
    """A model provider for the server, and what keeps Codex's requests small (see the module docstring)."""
    return f"""\
model = "smollm2"
model_provider = "semantic"
model_instructions_file = "{instructions_file}"
model_context_window = 8192
web_search = "disabled"
include_environment_context = false

[features]
goals = false

[agents]
enabled = false

[skills]
include_instructions = false

[model_providers.semantic]
name = "Semantic"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "SEMANTIC_API_KEY"
request_max_retries = 0
stream_max_retries = 0
"""


def codex_turn(codex, server, tmp_path, args: list[str]) -> dict:
    """One ``codex exec --json`` turn; its ``turn.completed`` usage (the thread's so far), after checking
    that it succeeded."""
    home = tmp_path / "codex-home"
    env = dict(base_env(tmp_path / "home"), CODEX_HOME=str(home), SEMANTIC_API_KEY="none")
    argv = [codex, "exec", *args[:-1], "--json", "--skip-git-repo-check", "--strict-config", args[-1]]
    out = run_cli(argv, env=env, cwd=tmp_path / "work", timeout=TURN_TIMEOUT, server=server)
    events = []
    for line in out.stdout.splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            pass
    failed = [e for e in events if e.get("type") in ("error", "turn.failed")]
    done = [e for e in events if e.get("type") == "turn.completed"]
    assert out.returncode == 0 and done and not failed, (
        f"codex {' '.join(args[:-1]) or 'exec'} failed (exit {out.returncode}): {failed}\n"
        + report(out.stdout, out.stderr, server))
    return done[-1]["usage"]


@pytest.mark.slow
def test_two_exec_turns_continue_one_session(server, tmp_path):
    codex = client_bin("codex")
    (tmp_path / "work").mkdir()
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "instructions.md").write_text(INSTRUCTIONS + "\n")
    (home / "config.toml").write_text(codex_config(server.url, (home / "instructions.md").as_posix()))
    first = codex_turn(codex, server, tmp_path, ["What is the capital of France?"])
    total = codex_turn(codex, server, tmp_path, ["resume", "--last", "What is the capital of Italy?"])
    # `turn.completed` usage counts the whole thread (a resumed one included): turn 2's is the difference.
    # Responses-API usage: input_tokens counts the whole prompt, cached ones included.
    prompt = total["input_tokens"] - first["input_tokens"]
    cached = total["cached_input_tokens"] - first["cached_input_tokens"]
    print(f"codex exec resume: turn 2 read {cached} of {prompt} prompt tokens from the cache")
    assert prompt > 0 and cached >= 0.9 * prompt, (
        f"turn 2 read {cached} of its {prompt} prompt tokens from the cache; usage after turn 1: {first}, "
        f"after turn 2: {total}\n--- server log (tail) ---\n{server.tail()}")
