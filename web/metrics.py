"""Prometheus metrics of one server: observed per turn, sampled per scrape.

Each app has its own ``CollectorRegistry`` (two servers in one process, as in
tests, never share counters). Names and what they measure:

    semantic_ttft_seconds                 histogram  request received -> first token
    semantic_decode_tokens_per_second     histogram  one turn's decode speed
    semantic_prompt_tokens_total{kind}    counter    prefilled | reused (served from a cache)
    semantic_output_tokens_total          counter
    semantic_draft_tokens_total{verdict}  counter    accepted | rejected: drafts decode steps verified
    semantic_turns_total{cache}           counter    hot | warm (disk) | prefix (shared system
                                                     prompt) | miss: where the reused tokens came from
    semantic_batch_size                   gauge      sequences decoding together (at scrape)
    semantic_queue_depth                  gauge      turns waiting for admission (at scrape)
    semantic_hot_cache_bytes              gauge      KV bytes held in memory
    semantic_kv_budget_bytes              gauge      the budget they live in
    semantic_mlx_active_bytes             gauge      MLX's active memory (weights, caches, activations)
    semantic_mlx_peak_bytes               gauge      MLX's peak memory since start
    semantic_demotions_total              counter    idle agents' caches moved to disk to make room
    semantic_prefix_drops_total           counter    shared prefixes dropped to make room
    semantic_preemptions_total            counter    turns paused (cache to disk) while others grew
    semantic_disk_cache_bytes             gauge      bytes under the cache directory
    semantic_disk_budget_bytes            gauge      what it may hold (+Inf: no cap)
    semantic_disk_free_bytes              gauge      free space on its filesystem
    semantic_disk_pruned_files_total      counter    files removed by the disk budget or the TTL
    semantic_disk_failed_writes_total     counter    writes refused for lack of space, or failed
"""

from __future__ import annotations

import math

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from semantic.actors import FinishReason, TurnResult

__all__ = ["CONTENT_TYPE_LATEST", "Metrics"]

_TTFT = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
_TPS = (1, 2, 5, 10, 20, 50, 100, 200, 500)


class Metrics:
    def __init__(self):
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("semantic_ttft_seconds", "Time to first token", buckets=_TTFT, registry=r)
        self.decode = Histogram("semantic_decode_tokens_per_second", "Decode speed of one turn",
                                buckets=_TPS, registry=r)
        self.prompt = Counter("semantic_prompt_tokens", "Prompt tokens by how they were served", ["kind"], registry=r)
        self.output = Counter("semantic_output_tokens", "Generated tokens", registry=r)
        self.drafts = Counter("semantic_draft_tokens", "Drafted tokens verified, by verdict", ["verdict"], registry=r)
        self.turns = Counter("semantic_turns", "Turns by where their reused tokens came from", ["cache"], registry=r)
        self.batch = Gauge("semantic_batch_size", "Sequences decoding together", registry=r)
        self.queue = Gauge("semantic_queue_depth", "Turns waiting for admission", registry=r)
        self.hot = Gauge("semantic_hot_cache_bytes", "KV cache bytes in memory", registry=r)
        self.budget = Gauge("semantic_kv_budget_bytes", "KV cache budget", registry=r)
        self.mlx_active = Gauge("semantic_mlx_active_bytes", "MLX active memory", registry=r)
        self.mlx_peak = Gauge("semantic_mlx_peak_bytes", "MLX peak memory", registry=r)
        self.demotions = Counter("semantic_demotions", "Idle caches moved to disk to make room", registry=r)
        self.prefix_drops = Counter("semantic_prefix_drops", "Shared prefixes dropped to make room", registry=r)
        self.preemptions = Counter("semantic_preemptions", "Turns paused while others grew", registry=r)
        self.disk = Gauge("semantic_disk_cache_bytes", "Bytes under the cache directory", registry=r)
        self.disk_budget = Gauge("semantic_disk_budget_bytes", "Bytes the cache directory may hold", registry=r)
        self.disk_free = Gauge("semantic_disk_free_bytes", "Free bytes on the cache directory's filesystem",
                               registry=r)
        self.pruned = Counter("semantic_disk_pruned_files", "Files removed by the disk budget or the TTL",
                              registry=r)
        self.failed_writes = Counter("semantic_disk_failed_writes", "Writes refused for lack of space, or failed",
                                     registry=r)
        self._totals: dict[Counter, int] = {}
        for kind in ("prefilled", "reused"):
            self.prompt.labels(kind)
        for verdict in ("accepted", "rejected"):
            self.drafts.labels(verdict)
        for cache in ("hot", "warm", "prefix", "miss"):
            self.turns.labels(cache)

    def turn(self, result: TurnResult | None, tier: str | None) -> None:
        """Count a finished turn; ``tier`` is where the agent's cache was when it began."""
        if result is None or result.reason == FinishReason.CANCELLED:
            return
        if result.ttft_s is not None:
            self.ttft.observe(result.ttft_s)
        if result.decode_tps is not None:
            self.decode.observe(result.decode_tps)
        self.prompt.labels("prefilled").inc(result.prefilled_tokens)
        self.prompt.labels("reused").inc(result.reused_tokens)
        for reply in (result, *result.choices):  # (a turn of several choices: each one's output)
            self.output.inc(reply.output_tokens)
            self.drafts.labels("accepted").inc(reply.accepted_tokens)
            self.drafts.labels("rejected").inc(reply.drafted_tokens - reply.accepted_tokens)
        self.turns.labels("miss" if not result.reused_tokens else tier or "prefix").inc()

    def render(self, stats: dict, memory: dict, disk: dict) -> bytes:
        """The exposition text, sampled from ``Runtime.stats()``, ``memory()`` and ``disk()``."""
        self.batch.set(stats.get("decoding", 0))
        self.queue.set(stats.get("waiting", 0))
        self.hot.set(memory["hot_bytes"])
        self.budget.set(memory["budget_bytes"])
        self.mlx_active.set(memory["mlx_active_bytes"])
        self.mlx_peak.set(memory["mlx_peak_bytes"])
        for counter, key in ((self.demotions, "demotions"), (self.prefix_drops, "prefix_drops"),
                             (self.preemptions, "preemptions")):
            self._catch_up(counter, memory[key])
        self.disk.set(memory["disk_bytes"])
        self.disk_budget.set(math.inf if disk["budget_bytes"] is None else disk["budget_bytes"])
        self.disk_free.set(disk["free_bytes"])
        self._catch_up(self.pruned, disk["pruned_files"])
        self._catch_up(self.failed_writes, disk["failed_writes"])
        return generate_latest(self.registry)

    def _catch_up(self, counter: Counter, total: int) -> None:
        """Advance a counter to a total counted elsewhere (by the persistence actor)."""
        seen = self._totals.get(counter, 0)
        if total > seen:
            counter.inc(total - seen)
            self._totals[counter] = total
