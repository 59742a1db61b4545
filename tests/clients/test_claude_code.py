"""The real Claude Code CLI (print mode) against ``semantic serve``: a two-turn
session (``--session-id``, then ``--resume``) whose second turn is served
from the agent's cache.

What Claude Code 2.1.330 sends is in ``tests/web/data/claude_code_requests.json``:
unless ``--bare``, every request carries a ``system``-role message inside
``messages`` (its environment section, after the first user message), with
``--tools=Bash`` as with ``--tools=Bash,Agent``. SmolLM2's chat template takes
no tools, so the server drops the definitions and the prompt is the system
prompt and the messages (a few hundred tokens).

A reply must end by itself: Claude Code answers ``stop_reason: max_tokens``
with up to three "resume" requests and then fails the turn ("response exceeded
the N output token maximum"). What SmolLM2 says, and whether it stops within
the cap, depends on the BLAS kernels; so the server ends each reply at its first
word (``conftest.first_word_model``), and the turns succeed whatever it says.
"""

from __future__ import annotations

import json
import uuid

import pytest

from .conftest import MAX_OUTPUT_TOKENS, TERSE_RULES, base_env, client_bin, report, run_cli

pytestmark = pytest.mark.model

TURN_TIMEOUT = 120

# Long enough that turn 2's new tokens (the reply and a short question) are
# under a tenth of its prompt; the rest should come from the cache.
SYSTEM_PROMPT = "You are Terse, a careful assistant that answers in one short sentence. You work inside a " \
    "sandbox on a developer's machine and help with small questions about shell commands, files and programs. " \
    + " ".join(TERSE_RULES)


QUESTIONS = ("What is the capital of France?", "What is the capital of Italy?")


def claude_env(url: str, home) -> dict:
    return dict(
        base_env(home),
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY="none",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        CLAUDE_CODE_MAX_OUTPUT_TOKENS=str(MAX_OUTPUT_TOKENS),
    )


def claude_turn(claude, server, tmp_path, prompt: str, session: list[str], tools: str) -> dict:
    """One ``claude -p`` turn; its JSON result, after checking that it succeeded."""
    argv = [claude, "-p", prompt, *session, "--output-format", "json", "--model", "smollm2",
            "--tools", tools, "--system-prompt", SYSTEM_PROMPT, "--max-turns", "2", "--strict-mcp-config"]
    work = tmp_path / "work"
    work.mkdir(exist_ok=True)
    out = run_cli(argv, env=claude_env(server.url, tmp_path / "home"), cwd=work, timeout=TURN_TIMEOUT,
                  server=server)
    try:
        result = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        pytest.fail(f"claude printed no JSON result (exit {out.returncode})\n" + report(out.stdout, out.stderr, server))
    assert out.returncode == 0 and result.get("is_error") is False, (
        f"claude {session[0]} turn failed (exit {out.returncode}): {result.get('result')!r} "
        f"(api_error {result.get('api_error')!r}; usage {result.get('usage')})\n"
        + report(out.stdout, out.stderr, server))
    return result


@pytest.mark.slow
@pytest.mark.parametrize("tools, extra", [
    ("Bash", ["--bare"]),  # no system-role message in `messages`
    ("Bash", []),  # a system-role message after the first user message
    ("Bash,Agent", []),  # the same, with the Agent tool's definition too
], ids=["bare-Bash", "Bash", "Bash,Agent"])
def test_two_turn_session_reads_turn_one_from_the_cache(server, tmp_path, tools, extra):
    claude = client_bin("claude")
    ask, follow_up = QUESTIONS
    session = str(uuid.uuid5(uuid.NAMESPACE_URL, f"semantic-test-claude-code-{tools}-{extra}"))
    first = claude_turn(claude, server, tmp_path, ask, ["--session-id", session, *extra], tools)
    assert first["session_id"] == session
    second = claude_turn(claude, server, tmp_path, follow_up, ["--resume", session, *extra], tools)
    assert second["session_id"] == session
    u = second["usage"]
    prompt = u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]
    print(f"claude --tools {tools} {' '.join(extra)}: replies {first['result']!r}, {second['result']!r}; "
          f"turn 2 read {u['cache_read_input_tokens']} of {prompt} prompt tokens from the cache")
    assert u["cache_read_input_tokens"] >= 0.9 * prompt, (
        f"turn 2 read {u['cache_read_input_tokens']} of its {prompt} prompt tokens from the cache: {u}\n"
        f"turn 1 usage: {first['usage']}\n--- server log (tail) ---\n{server.tail()}")
