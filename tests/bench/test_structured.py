"""``semantic bench structured`` on a tiny random-weight model: both kinds of
step are timed at every batch size, and the mask's own cost comes out, and
what keeping a reply closable within its limit costs a token; and ``--parse``
(the openai SDK's ``parse`` over HTTP) counts what parsed and names each miss."""

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


@pytest.mark.slow
@pytest.mark.anyio
async def test_parse_counts_parsed_replies_and_says_what_each_miss_was(tmp_path):
    """``--parse`` over HTTP on the tiny random-weight model, whose strings run on: each reply
    comes back parsed or a miss that says what filled it; a reply cut at the limit is still JSON
    its model validates (the grammar closes it), and no number has more digits than an int64."""
    import anyio

    pytest.importorskip("openai")
    from semantic.bench.structured import parse_models, parse_run
    from tests.web.live import live_server

    async with live_server(tmp_path) as url:
        result = await anyio.to_thread.run_sync(lambda: parse_run(url, "tiny", tries=2, max_tokens=40))
    models = parse_models()
    assert [row["model"] for row in result["models"]] == list(models)
    for row in result["models"]:
        assert row["parsed"] + len(row["misses"]) == 2
        for miss in row["misses"]:
            assert (miss["reason"], miss["tokens"]) == ("length", 40), miss
            models[row["model"]].model_validate_json(miss["content"])
            assert miss["what"] and "never ends" not in miss["what"]
    assert 0 < result["longest_number"][1] <= 19


def test_a_miss_names_what_ran_on():
    from semantic.bench.structured import reply_parts, what_ran_on

    text = '{"name": "' + "la" * 200 + '", "n": -0.000123e5, "items": [1, 2]}'
    parts = reply_parts(text)
    assert parts == {"string": ["name", 400], "number": ["n", 3], "list": ["items", 2]}
    assert what_ran_on(text, parts) == "a string ran on (name: 400 characters)"
    text = '{"items": [' + ", ".join(['{"t": "ab", "q": 12345678901234567890}'] * 6) + "]}"
    assert what_ran_on(text, reply_parts(text)) == "a number that never ends (items[0].q: 20 digits)"
    text = '{"items": [' + ", ".join(['{"t": "ab", "q": 1}'] * 6) + "]}"
    assert what_ran_on(text, reply_parts(text)) == "a list ran on (items: 6 items)"
