"""A run's outputs: the per-turn report (JSON), the transcript (JSON and Markdown)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from .runner import Result, TurnRecord

__all__ = ["report", "totals", "transcript", "transcript_markdown", "write"]


def totals(turns: Sequence[TurnRecord]) -> dict:
    """Sums over ``turns``; ``reuse`` is reused / prompt tokens, ``decode_tps`` is
    generated tokens over the summed decode time."""
    prompt = sum(t.prompt_tokens for t in turns)
    reused = sum(t.reused_tokens for t in turns)
    generated = sum(t.generated_tokens for t in turns)
    decode_s = sum(t.generated_tokens / t.decode_tps for t in turns if t.decode_tps > 0)
    return {
        "turns": len(turns),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefilled_tokens": sum(t.prefilled_tokens for t in turns),
        "reuse": round(reused / prompt, 4) if prompt else 0.0,
        "ttft_ms": round(sum(t.ttft_ms for t in turns), 1),
        "prefill_ms": round(sum(t.prefill_ms for t in turns), 1),
        "generated_tokens": generated,
        "decode_tps": round(generated / decode_s, 1) if decode_s else 0.0,
    }


def report(result: Result, **meta) -> dict:
    """The report as one JSON-able object: ``turns``, ``totals`` and ``agents``
    (per agent: its totals and the lowest reuse share from its second turn on
    each cache key).  ``meta`` (model, backend, ...) is added at the top."""
    agents = {}
    for key, agent in result.scenario.agents.items():
        mine = [t for t in result.turns if t.agent == key]
        later = [t.reuse for t in mine if t.agent_turn > 1]
        agents[key] = {"lifecycle": agent.lifecycle, **totals(mine),
                       "min_reuse_after_first_turn": round(min(later), 4) if later else None}
    return {
        "scenario": result.scenario.id,
        "title": result.scenario.title,
        "run_id": result.run_id,
        "use_cache": result.use_cache,
        "seed": result.seed,
        **meta,
        "turns": [_turn(t) for t in result.turns],
        "totals": totals(result.turns),
        "agents": agents,
    }


def _turn(t: TurnRecord) -> dict:
    d = asdict(t)
    d["reuse"] = round(t.reuse, 4)
    d["ttft_ms"], d["prefill_ms"], d["decode_tps"] = round(t.ttft_ms, 1), round(t.prefill_ms, 1), round(t.decode_tps, 1)
    return d


def transcript(result: Result) -> dict:
    """What was said, phase by phase (private blocks are context, not speech, and are left out)."""
    s = result.scenario
    return {
        "scenario": s.id,
        "title": s.title,
        "description": s.description,
        "agents": {k: {"name": a.name, "lifecycle": a.lifecycle} for k, a in s.agents.items()},
        "phases": [
            {"name": p.name, "label": p.label, "agents": list(p.agents), "judge": p.judge is not None,
             "lines": [{"agent": ln.agent, "name": s.agents[ln.agent].name, "round": ln.round, "text": ln.text}
                       for ln in result.transcript[p.name]]}
            for p in s.phases
        ],
        "verdict": result.verdict,
    }


def transcript_markdown(result: Result) -> str:
    s = result.scenario
    out = [f"# {s.title}", ""]
    if s.description:
        out += [s.description, ""]
    for p in s.phases:
        names = ", ".join(s.agents[a].name for a in p.agents)
        out += [f"## {p.label}", "", f"*{names}*", ""]
        for ln in result.transcript[p.name]:
            out += [f"**{s.agents[ln.agent].name}:** {' '.join(ln.text.split()) or '*(says nothing)*'}", ""]
    if result.verdict is not None:
        out += ["## Verdict", "", result.verdict.strip(), ""]
    return "\n".join(out)


def write(result: Result, directory: Path, **meta) -> dict:
    """Write ``transcript.json``, ``transcript.md`` and ``report.json`` into
    ``directory`` (created if needed); returns the report."""
    directory.mkdir(parents=True, exist_ok=True)
    rep = report(result, **meta)
    (directory / "transcript.json").write_text(json.dumps(transcript(result), indent=2, ensure_ascii=False) + "\n")
    (directory / "transcript.md").write_text(transcript_markdown(result))
    (directory / "report.json").write_text(json.dumps(rep, indent=2, ensure_ascii=False) + "\n")
    return rep
