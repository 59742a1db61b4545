"""``semantic bench overlap`` end to end on a tiny random-weight model: a warm
load and a fork's write run while another agent decodes, and the figures come out."""

import pytest

from semantic.bench.overlap import overlap
from tests.web.live import tiny_loaded

pytestmark = pytest.mark.anyio


@pytest.mark.slow
async def test_overlap_bench_measures_steps_beside_the_disk_work(tmp_path):
    # Enough tokens that the decode outlasts the disk work on a loaded machine too (24 did not in one CI run).
    result = await overlap(tiny_loaded(), tmp_path, context=300, tokens=200, rounds=2)
    assert result["rounds"] == 2 and result["undisturbed_step_ms"] > 0
    assert result["disturbed_steps"] > 0 and result["ratio"] > 0
    assert result["writes"] >= 2  # the forks' caches, written while the other agent decoded
