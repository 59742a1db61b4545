"""A terminal view of a run: phases, who speaks, the reply as it streams, and
each turn's cache reuse as soon as it ends.

On a terminal it uses a ``rich.live.Live`` region for the turn in progress;
finished turns are printed above it and stay.  Anywhere else (a pipe, a
file, CI) it prints plain lines, one per phase, turn and stats, and never
streams partial text.
"""

from __future__ import annotations

import sys
from typing import TextIO

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from .report import totals, turn_row
from .runner import Event, PhaseFinished, PhaseStarted, Result, TurnFinished, TurnRecord, TurnStarted, TurnText
from .schema import Scenario

__all__ = ["View"]


def stats_line(t: TurnRecord) -> str:
    r = turn_row(t)  # the report's figures: the two agree
    return (f"[{t.agent} #{t.agent_turn}] prompt {r['prompt_tokens']} tok · reused {r['reused_tokens']} "
            f"({r['reuse']:.0%}) · prefilled {r['prefilled_tokens']} · ttft {r['ttft_ms']:.0f} ms · "
            f"{r['decode_tps']:.1f} tok/s")


class View:
    """Call with each runner ``Event``; use as a context manager around the run.

    ``live`` defaults to whether ``file`` is a terminal.
    """

    def __init__(self, scenario: Scenario, file: TextIO | None = None, live: bool | None = None):
        self._scenario = scenario
        self._file = file or sys.stdout
        self._console = Console(file=self._file, highlight=False)
        self._live_mode = self._console.is_terminal if live is None else live
        self._live: Live | None = None
        self._speaker: TurnStarted | None = None
        self._text: list[str] = []
        self._done = 0

    def __enter__(self) -> View:
        if self._live_mode:
            self._console.rule(Text(self._scenario.title, style="bold"))
            self._live = Live(self._panel(), console=self._console, refresh_per_second=12, transient=True)
            self._live.start()
        else:
            self._line(f"# {self._scenario.title} ({self._scenario.turns} turns)")
        return self

    def __exit__(self, *exc) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __call__(self, event: Event) -> None:
        match event:
            case PhaseStarted(phase=phase):
                who = ", ".join(self._scenario.agents[a].name for a in phase.agents)
                if self._live_mode:
                    self._console.print()
                    self._console.rule(Text(phase.label, style="bold cyan"))
                    self._console.print(Text(f"{who} · {phase.rounds} round(s)", style="dim"))
                else:
                    self._line(f"== {phase.label} ({who}; {phase.rounds} round(s))")
            case TurnStarted():
                self._speaker, self._text = event, []
                self._refresh()
            case TurnText(text=text):
                self._text.append(text)
                self._refresh()
            case TurnFinished(record=t):
                self._done += 1
                self._speaker, self._text = None, []
                text = " ".join(t.result.text.split()) or "(says nothing)"
                if self._live_mode:
                    self._console.print(Text.assemble((f"{t.name}: ", "bold"), text))
                    self._console.print(Text("   " + stats_line(t), style=_reuse_style(t)))
                    self._refresh()
                else:
                    self._line(f"{t.name}: {text}")
                    self._line("   " + stats_line(t))
            case PhaseFinished():
                pass

    def summary(self, result: Result) -> None:
        """The per-agent and total numbers, once the run is over."""
        rows = []
        for key, agent in self._scenario.agents.items():
            mine = [t for t in result.turns if t.agent == key]
            later = [t.result.reuse for t in mine if t.agent_turn > 1]
            rows.append((agent.name, agent.lifecycle, totals(mine), f"{min(later):.0%}" if later else "-"))
        total = totals(result.turns)
        if not self._live_mode:
            for name, lifecycle, s, low in rows:
                self._line(f"{name} ({lifecycle}): {s['turns']} turns, prompt {s['prompt_tokens']}, "
                           f"reused {s['reused_tokens']} ({s['reuse']:.0%}), prefilled {s['prefilled_tokens']}, "
                           f"lowest reuse after first turn {low}")
            self._line(f"total: {total['turns']} turns, prompt {total['prompt_tokens']}, "
                       f"reused {total['reused_tokens']} ({total['reuse']:.0%}), "
                       f"prefilled {total['prefilled_tokens']}, "
                       f"prefill {total['prefill_ms']:.0f} ms, "
                       f"ttft {total['ttft_ms']:.0f} ms, decode {total['decode_tps']:.1f} tok/s")
            if result.verdict is not None:
                self._line(f"verdict: {' '.join(result.verdict.split())}")
            return
        table = Table(title=f"{self._scenario.title}: cache reuse" + ("" if result.use_cache else " (--no-cache)"))
        for col in ("agent", "lifecycle", "turns", "prompt", "reused", "prefilled", "reuse", "lowest after 1st"):
            table.add_column(col, justify="left" if col in ("agent", "lifecycle") else "right")
        for name, lifecycle, s, low in rows:
            table.add_row(name, lifecycle, str(s["turns"]), str(s["prompt_tokens"]), str(s["reused_tokens"]),
                          str(s["prefilled_tokens"]), f"{s['reuse']:.0%}", low)
        table.add_row("total", "", str(total["turns"]), str(total["prompt_tokens"]), str(total["reused_tokens"]),
                      str(total["prefilled_tokens"]), f"{total['reuse']:.0%}", "", style="bold")
        self._console.print()
        self._console.print(table)
        self._console.print(Text(f"prefill {total['prefill_ms']:.0f} ms · ttft {total['ttft_ms']:.0f} ms · "
                                 f"decode {total['decode_tps']:.1f} tok/s", style="dim"))
        if result.verdict is not None:
            self._console.print(Panel(Text(result.verdict.strip()), title="Verdict"))

    # -- live region

    def _panel(self):
        progress = Text(f"turn {self._done}/{self._scenario.turns}", style="dim")
        if self._speaker is None:
            return progress
        s = self._speaker
        title = f"{s.name} · {s.phase} · round {s.round}" + (" · new conversation" if s.reopened else "")
        return Group(Panel(Text("".join(self._text)), title=title, title_align="left"), progress)

    def _refresh(self) -> None:
        if self._live is not None:
            self._live.update(self._panel())

    def _line(self, text: str) -> None:
        print(text, file=self._file, flush=True)


def _reuse_style(t: TurnRecord) -> str:
    if t.agent_turn == 1:
        return "dim"
    return "green" if t.result.reuse >= 0.9 else "yellow" if t.result.reuse >= 0.5 else "red"
