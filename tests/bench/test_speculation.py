"""``semantic bench speculation`` on a tiny random-weight model: every workload
runs with speculation on and off, and each gives positive figures."""

import pytest

from semantic.bench.speculation import TARGETS, in_process, over_http  # noqa: F401  (--peer's path imports)
from semantic.cli.main import parser
from tests.web.live import tiny_loaded


@pytest.mark.slow
def test_speculation_bench_times_every_workload_on_and_off():
    result = in_process(tiny_loaded(), rounds=1, max_tokens=12)
    assert set(result["workloads"]) == set(TARGETS)
    for name, w in result["workloads"].items():
        assert w["figure"] == ("system_tps" if name == "edit x4" else "decode_tps")
        assert len(w["prompt_tokens"]) == (4 if name == "edit x4" else 1) and w["max_tokens"] == 12
        for side in (w["on"], w["off"]):
            assert side["tps"] > 0 and 0 < side["tokens"] <= 12 * len(w["prompt_tokens"])
            assert 0 <= side["accepted"] <= side["drafted"]
        assert w["off"]["drafted"] == 0 and w["ratio"] > 0 and w["target"] == TARGETS[name]
    assert result["row_counts"]["counts"] and result["row_counts"]["ms"]
    rounds = {name: w["rounds"] for name, w in result["workloads"].items()}
    # the shorter workloads run more rounds: about as many tokens timed as the edit's
    assert rounds["edit"] == rounds["edit x4"] == 1 and rounds["multi-turn"] == rounds["prose"] == 3


def test_speculation_bench_is_a_subcommand():
    args = parser().parse_args(["bench", "speculation", "--quick", "--peer", "--json"])
    assert (args.bench, args.quick, args.peer, args.json, args.rounds) == ("speculation", True, True, True, None)
