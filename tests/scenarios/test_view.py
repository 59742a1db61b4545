"""The live view: plain lines off a terminal, a rich Live region on one."""

import io

import pytest

from semantic.scenarios.runner import run
from semantic.scenarios.schema import loads
from semantic.scenarios.view import View

from .fake import FakeBackend
from .test_schema import BASE

pytestmark = pytest.mark.anyio


async def watch(file, live=None):
    s = loads(BASE)
    fake = FakeBackend()
    with View(s, file=file, live=live) as view:
        def on_event(event):
            fake.observe(event)
            view(event)

        result = await run(s, fake, run_id="t", on_event=on_event)
    view.summary(result)
    return result


async def test_plain_lines_when_not_a_terminal():
    out = io.StringIO()  # not a terminal
    result = await watch(out)
    lines = out.getvalue().splitlines()
    assert lines[0] == "# Gossip (9 turns)"
    assert lines[1] == "== alice_bob (Alice, Bob; 2 round(s))"
    assert lines[2].startswith("Alice: «alice_bob|alice|1» alice speaks")
    assert lines[3] == "   [alice #1] prompt 16 tok · reused 0 (0%) · prefilled 16 · ttft 9 ms · 100.0 tok/s"
    assert "\x1b[" not in out.getvalue()  # no escape codes
    assert sum(line.startswith("   [") for line in lines) == len(result.turns)
    assert lines[-1].startswith("total: 9 turns, prompt ")


async def test_live_view_on_a_terminal_streams_and_reports():
    out = io.StringIO()
    out.isatty = lambda: True  # rich asks the file
    await watch(out)
    text = out.getvalue()
    assert "\x1b[" in text  # styled
    assert "cache reuse" in text and "alice_eve" in text and "reused" in text
