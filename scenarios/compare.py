"""A cached run against a ``--no-cache`` run of the same scenario and seed.

For each turn: is the reply text identical, and if not, why?  ``input``: the
agent's conversation up to this turn already differed (an earlier reply
differed, so the model saw other tokens); ``numerics``: the model saw the same
text, and the difference comes from computing it another way (attention over
the reused Q4 cache, built token by token while decoding, against one fresh
prefill of the whole prompt).
"""

from __future__ import annotations

from .report import totals
from .runner import Result, TurnRecord

__all__ = ["compare", "render"]


def compare(cached: Result, uncached: Result) -> dict:
    """Side-by-side totals and per-turn agreement of two runs of one scenario."""
    if [(t.agent, t.phase) for t in cached.turns] != [(t.agent, t.phase) for t in uncached.turns]:
        raise ValueError("the two runs did not play the same turns")
    same_so_far: dict[tuple, bool] = {}  # conversation -> identical in both runs up to now
    rows = []
    for a, b in zip(cached.turns, uncached.turns):
        conversation = _conversation(a)
        same_input = same_so_far.get(conversation, True) and a.prompt == b.prompt
        same_text = a.result.text == b.result.text
        same_so_far[conversation] = same_input and same_text
        rows.append({"index": a.index, "agent": a.agent, "phase": a.phase, "identical": same_text,
                     "cause": None if same_text else ("numerics" if same_input else "input")})
    identical = sum(r["identical"] for r in rows)
    return {
        "scenario": cached.scenario.id,
        "seed": cached.seed,
        "cached": totals(cached.turns),
        "uncached": totals(uncached.turns),
        "identical_turns": identical,
        "identical_share": round(identical / len(rows), 4) if rows else 1.0,
        "differ_by": {cause: sum(r["cause"] == cause for r in rows) for cause in ("input", "numerics")},
        "turns": rows,
    }


def _conversation(t: TurnRecord) -> tuple:
    """The conversation a turn belongs to, named the same way in both runs (cache keys hold the run id)."""
    return (t.agent,) if t.lifecycle == "permanent" else (t.agent, t.phase)


def render(c: dict) -> str:
    """The comparison as a few aligned lines for the terminal."""
    a, b = c["cached"], c["uncached"]
    rows = [
        ("", "cached", "--no-cache", "ratio"),
        ("prefilled tokens", f"{a['prefilled_tokens']}", f"{b['prefilled_tokens']}",
         _ratio(b["prefilled_tokens"], a["prefilled_tokens"])),
        ("prefill time", f"{a['prefill_ms'] / 1000:.1f} s", f"{b['prefill_ms'] / 1000:.1f} s",
         _ratio(b["prefill_ms"], a["prefill_ms"])),
        ("time to first token, summed", f"{a['ttft_ms'] / 1000:.1f} s", f"{b['ttft_ms'] / 1000:.1f} s",
         _ratio(b["ttft_ms"], a["ttft_ms"])),
        ("prompt tokens reused", f"{a['reuse']:.1%}", f"{b['reuse']:.1%}", ""),
    ]
    lines = [f"{r[0]:<30}{r[1]:>12}{r[2]:>14}{r[3]:>10}" for r in rows]
    n, d = len(c["turns"]), c["differ_by"]
    lines.append(f"identical replies: {c['identical_turns']}/{n} ({c['identical_share']:.0%}); "
                 f"differing after different input: {d['input']}, with the same input (numerics): {d['numerics']}")
    return "\n".join(lines)


def _ratio(uncached: float, cached: float) -> str:
    return f"{uncached / cached:.1f}x" if cached else ""
