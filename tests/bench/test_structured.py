"""``semantic bench structured`` on a tiny random-weight model: both kinds of
step are timed at every batch size, and the mask's own cost comes out, and
what keeping a reply closable within its limit costs a token."""

import pytest

from semantic.bench.structured import structured
from tests.web.live import tiny_loaded


@pytest.mark.slow
def test_structured_bench_times_free_and_constrained_steps():
    result = structured(tiny_loaded(), (1, 3), steps=6, rounds=2)
    assert [row["batch"] for row in result["batches"]] == [1, 3]
    for row in result["batches"]:
        # The schema's 50 items keep every reply going: each round times all its steps but the first.
        assert row["steps_timed"]["grammar"] == 10 and row["grammar_step_ms"] > 0
        assert row["steps_timed"]["free"] <= 10
    assert result["mask_us_per_row"] > 0
    kept = result["closing_us_per_row"]
    assert kept["closing"]["median"] > 0 and kept["advance"]["median"] > 0
    assert 0 < result["closing_search_ms"]["median"] <= result["closing_search_ms"]["max"]
