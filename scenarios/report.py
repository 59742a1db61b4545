"""A run's outputs: the per-turn report (JSON), the transcript (JSON and Markdown)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from .runner import Result, TurnRecord

__all__ = ["report", "totals", "transcript", "transcript_markdown", "turn_row", "write"]


def _ms(seconds: float | None) -> float:
    """Milliseconds, 0 for a time not measured (nothing was decoded)."""
    return 1000 * (seconds or 0.0)


def totals(turns: Sequence[TurnRecord]) -> dict:
    """Sums over ``turns``; ``reuse`` is reused / prompt tokens, ``decode_tps`` is
    the turns' decode rates weighted by their decode time."""
    results = [t.result for t in turns]
    prompt = sum(r.prompt_tokens for r in results)
    reused = sum(r.reused_tokens for r in results)
    decoding = [r for r in results if r.decode_tps is not None]
    decode_s = sum(r.decode_s for r in decoding)
    return {
        "turns": len(turns),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefilled_tokens": sum(r.prefilled_tokens for r in results),
        "reuse": round(reused / prompt, 4) if prompt else 0.0,
        "ttft_ms": round(sum(_ms(r.ttft_s) for r in results), 1),
        "prefill_ms": round(sum(_ms(r.prefill_s) for r in results), 1),
        "generated_tokens": sum(r.output_tokens for r in results),
        "decode_tps": round(sum(r.decode_tps * r.decode_s for r in decoding) / decode_s, 1) if decode_s else 0.0,
    }


def report(result: Result, **meta) -> dict:
    """The report as one JSON-able object: ``turns``, ``totals`` and ``agents``
    (per agent: its totals and the lowest reuse share from its second turn on
    each cache key).  ``meta`` (model, backend, ...) is added at the top."""
    agents = {}
    for key, agent in result.scenario.agents.items():
        mine = [t for t in result.turns if t.agent == key]
        later = [t.result.reuse for t in mine if t.agent_turn > 1]
        agents[key] = {"lifecycle": agent.lifecycle, **totals(mine),
                       "min_reuse_after_first_turn": round(min(later), 4) if later else None}
    return {
        "scenario": result.scenario.id,
        "title": result.scenario.title,
        "run_id": result.run_id,
        "use_cache": result.use_cache,
        "seed": result.seed,
        **meta,
        "turns": [turn_row(t) for t in result.turns],
        "totals": totals(result.turns),
        "agents": agents,
    }


def turn_row(t: TurnRecord) -> dict:
    """One turn of the report: the scenario's fields, then its result in the report's units."""
    r = t.result
    return {
        "index": t.index, "phase": t.phase, "agent": t.agent, "name": t.name, "round": t.round,
        "lifecycle": t.lifecycle, "cache_key": t.cache_key, "agent_turn": t.agent_turn,
        "prompt_tokens": r.prompt_tokens, "reused_tokens": r.reused_tokens, "prefilled_tokens": r.prefilled_tokens,
        "ttft_ms": round(_ms(r.ttft_s), 1), "prefill_ms": round(_ms(r.prefill_s), 1),
        "generated_tokens": r.output_tokens, "decode_tps": round(r.decode_tps or 0.0, 1),
        "prompt": t.prompt, "text": r.text, "reuse": round(r.reuse, 4),
    }


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
