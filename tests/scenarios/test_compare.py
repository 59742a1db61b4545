"""Cached against --no-cache: which turns agree, and why the others do not."""

from dataclasses import replace

import pytest

from semantic.runtime.outcome import TurnResult
from semantic.scenarios import compare
from semantic.scenarios.runner import Result, TurnRecord
from semantic.scenarios.schema import loads

from .test_schema import BASE

SCENARIO = loads(BASE)


def record(index, agent, phase, prompt, text, lifecycle="permanent", reused=0, prompt_tokens=10):
    return TurnRecord(index, phase, agent, agent.title(), 1, lifecycle, f"key.{agent}", 1, prompt,
                      TurnResult("stop", text, prompt_tokens, reused, prompt_tokens - reused, 3, queued_s=0.0,
                                 ttft_s=0.005, prefill_s=0.004, decode_s=0.2))


def result(turns) -> Result:
    return Result(SCENARIO, "run", True, 1, tuple(turns), {}, None)


def test_a_difference_is_numerics_until_the_conversation_differs():
    cached = [record(0, "alice", "p", "hi", "A"), record(1, "bob", "p", "hi", "B"),
              record(2, "alice", "p", "more", "C"), record(3, "bob", "p", "more", "D")]
    uncached = [record(0, "alice", "p", "hi", "A2"), cached[1], cached[2], replace(cached[3], prompt="more!")]
    c = compare.compare(result(cached), result(uncached))
    assert [r["cause"] for r in c["turns"]] == ["numerics", None, None, None]
    assert c["identical_turns"] == 3 and c["identical_share"] == 0.75
    # alice's first reply differed, so her next turn saw other tokens even with an equal prompt and reply text.
    uncached[2] = record(2, "alice", "p", "more", "C2")
    uncached[3] = record(3, "bob", "p", "more!", "D2")
    c = compare.compare(result(cached), result(uncached))
    assert [r["cause"] for r in c["turns"]] == ["numerics", None, "input", "input"]
    assert c["differ_by"] == {"input": 2, "numerics": 1}


def test_totals_side_by_side():
    cached = [record(0, "alice", "p", "hi", "A"), record(1, "alice", "p", "x", "B", reused=8)]
    uncached = [record(0, "alice", "p", "hi", "A"), record(1, "alice", "p", "x", "B")]
    c = compare.compare(result(cached), result(uncached))
    assert (c["cached"]["prefilled_tokens"], c["uncached"]["prefilled_tokens"]) == (12, 20)
    text = compare.render(c)
    assert "prefilled tokens" in text and "1.7x" in text and "identical replies: 2/2 (100%)" in text


def test_runs_of_different_turns_are_refused():
    with pytest.raises(ValueError, match="same turns"):
        compare.compare(result([record(0, "alice", "p", "hi", "A")]), result([record(0, "bob", "p", "hi", "A")]))
