"""The soak on the embedded model: 40 agents with system prompts of their own,
3 turns each, 8 at a time, in a KV budget of ~10 agents and a disk budget of
~30% of their files: no turn fails, memory and disk stay in their budgets, and
every history is complete (``semantic bench soak`` runs 100 agents)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from semantic.bench.soak import soak

pytestmark = [pytest.mark.model, pytest.mark.anyio, pytest.mark.parametrize("anyio_backend", ["trio"])]


@pytest.mark.slow
async def test_forty_agents_stay_in_their_budgets(smollm2, tmp_path):
    r = await soak(smollm2, tmp_path, agents=40, turns=3, concurrency=8, max_tokens=6, hot_agents=10,
                   disk_share=0.3, log=print)
    print("\nsoak:", {k: v for k, v in r.items() if k != "failures"})
    assert r["failed"] == 0, r["failures"]
    assert r["histories"] == 40 and not r["incomplete_histories"]
    assert r["kv_peak_bytes"] <= r["kv_budget_bytes"]
    # MLX's own count: caches and working copies (in the budget) plus activations.
    assert r["mlx_above_baseline_peak_bytes"] <= r["kv_budget_bytes"] + (256 << 20)
    assert r["disk_peak_bytes"] <= r["disk_budget_bytes"]
    assert r["demotions"] > 0  # the budget was small enough to matter
    assert mx.get_active_memory() > 0
