"""The pure parts of ``semantic bench compare``: statistics, ratios, targets,
the Markdown table, the JSON shape, the plots, the SSE client -- no servers."""

import json
import os

import httpx
import pytest

from semantic.bench import report
from semantic.bench.client import chat
from semantic.bench.compare import Log, disk_usage
from semantic.bench.servers import process_memory
from semantic.bench.workloads import RERUNS, Bench, Plan, Texts


def raw_fixture():
    """Raw measurements as the workloads record them (seconds)."""
    turns = range(1, 7)
    return {
        "multi_turn": {
            # (ttft, e2e, cached tokens, prompt tokens, tokens out)
            "semantic": {t: [(0.5, 2.0, 400, 600, 31), (0.6, 2.1, 400, 600, 31), (0.4, 1.9, 400, 600, 31)]
                         for t in turns},
            "peer": {t: [(0.5, 2.0, 400, 600, 16), (0.55, 2.2, 400, 600, 16), (0.5, 2.0, 400, 600, 16)]
                     for t in turns},
        },
        "many_agents": {
            "semantic": {n: [{"ttft": 0.3 + i / 1000, "prompt_tokens": 500, "cached_tokens": 480} for i in range(n)]
                         for n in (4, 16, 64)},
            "peer": {n: [{"ttft": (0.3 if n == 4 else 4.0) + i / 1000, "prompt_tokens": 500,
                          "cached_tokens": 480 if n == 4 else 0} for i in range(n)] for n in (4, 16, 64)},
        },
        "restart": {
            "semantic": {"turn3": [0.5, 0.5, 0.6], "turn4": [0.6, 0.7, 0.5], "turn4_cached": [600, 600, 600],
                         "restart_s": [9.0]},
            "peer": {"turn3": [0.5, 0.4, 0.5], "turn4": [5.0, 6.0, 5.5], "turn4_cached": [0, 0, 0], "restart_s": [3.0]},
        },
        "concurrency": {
            side: {c: [{"system_tps": f * c ** 0.5, "per_stream_tps": f / c ** 0.3, "ttft": c * 1.0, "tokens": 32 * c}] * 3
                   for c in (1, 2, 4, 8)}
            for side, f in (("semantic", 9.0), ("peer", 10.0))
        },
        "memory": {
            "semantic": {"before": {"rss_bytes": 700 << 20}, "after": {"rss_bytes": 800 << 20, "hwm_bytes": 900 << 20},
                         "history_tokens": 32000, "agents": 64, "disk_bytes": 200 << 20, "disk_tokens": 32000},
            "peer": {"before": {"rss_bytes": 700 << 20}, "after": {"rss_bytes": 1200 << 20, "hwm_bytes": 1300 << 20},
                     "history_tokens": 32000, "agents": 64},
            "peer_kv4": {"before": {"rss_bytes": 700 << 20}, "after": {"rss_bytes": 760 << 20, "hwm_bytes": 800 << 20},
                         "history_tokens": 8000, "agents": 16},
        },
    }


def test_statistics():
    assert report.median([3, 1, 2]) == 2
    assert report.median([None, 4, 2]) == 3
    assert report.median([]) is None
    assert report.percentile(list(range(1, 101)), 95) == pytest.approx(95.05)
    assert report.percentile([7], 95) == 7
    assert report.percentile([1, 2], 50) == 1.5
    assert report.ratio(1, 4) == 0.25
    assert report.ratio(1, 0) is None and report.ratio(None, 1) is None


def test_summary_has_ours_peer_and_ratio_per_workload():
    summary = report.summarize(raw_fixture())
    assert set(summary) == {"multi_turn", "many_agents", "restart", "concurrency", "memory"}
    for name, w in summary.items():
        assert {"semantic", "peer", "ratio"} <= w.keys(), name
    ma = summary["many_agents"]
    assert ma["ratio"]["p50_ttft"][64] < 0.1
    assert ma["semantic"]["cache_hit_rate"][64] == 1.0 and ma["peer"]["cache_hit_rate"][64] == 0.0
    assert ma["ratio"]["p50_ttft"][4] == pytest.approx(1.0, abs=0.01)
    mt = summary["multi_turn"]
    assert mt["runs"] == 3 and mt["turns"] == 6
    assert mt["semantic"]["ttft_ms"][2] == 500.0
    assert mt["semantic"]["turns_2_on_ttft_ms"] == pytest.approx(2500.0)
    # Same end-to-end, but the peer's replies were half as long: it decodes at half the speed.
    assert mt["semantic"]["tokens_out"][2] == 31 and mt["peer"]["tokens_out"][2] == 16
    assert mt["semantic"]["turns_2_on_decode_ms_per_token"] == pytest.approx(50.0)
    assert mt["ratio"]["turns_2_on_decode_per_token"] == pytest.approx(0.5)
    assert mt["semantic"]["cached_share"][2] == pytest.approx(0.667, abs=1e-3)
    assert summary["restart"]["ratio"]["turn4_ttft"] == pytest.approx(0.6 / 5.5, abs=1e-3)
    assert summary["concurrency"]["ratio"]["system_tps"][4] == pytest.approx(0.9)
    mem = summary["memory"]
    assert mem["semantic"]["bytes_per_history_token"] == pytest.approx((100 << 20) / 32000, abs=0.1)
    assert mem["semantic"]["disk_bytes_per_token"] == pytest.approx((200 << 20) / 32000, abs=0.1)
    assert mem["ratio"]["rss"] == pytest.approx(800 / 1200, abs=1e-3)
    # The whole document is plain JSON.
    json.loads(json.dumps(summary))


def test_targets_met_and_missed():
    goals = report.targets(report.summarize({**raw_fixture(), "long_context": long_context_raw()}))
    assert set(goals) == set(report.TARGETS)
    assert goals["many_agents_p50"]["met"] and goals["many_agents_p50"]["N"] == 64
    assert goals["restart_turn4"]["met"]
    assert goals["concurrency_1"]["clients"] == 1 and not goals["concurrency_1"]["met"]  # 0.9 < 1.0
    assert not goals["concurrency_4"]["met"]  # 0.9 < 1.2
    raw = raw_fixture()
    raw["restart"]["semantic"]["turn4"] = [2.0, 2.0, 2.0]
    assert report.targets(report.summarize(raw))["restart_turn4"]["met"] is False


def test_markdown_table_has_a_row_per_figure_and_the_verdicts():
    summary = report.summarize(raw_fixture())
    table = report.markdown_table(summary, report.targets(summary))
    lines = table.strip().splitlines()
    assert lines[0].startswith("| workload | figure | semantic | mlx_lm.server | ours / peer | target |")
    assert all(line.count("|") == 7 for line in lines)
    assert "N = 64: p50 TTFT" in table and "**met**" in table
    assert "turn 4 TTFT (after the restart)" in table
    assert "better" in table


def test_plots_one_png_per_workload(tmp_path):
    from semantic.bench.plots import write_plots

    summary = report.summarize(raw_fixture())
    # JSON round trip: plots work from the written document (string keys) too.
    written = write_plots(json.loads(json.dumps(summary)), tmp_path, lru=10)
    assert [p.name for p in written] == [
        "compare-multi-turn.png", "compare-many-agents.png", "compare-restart.png",
        "compare-concurrency.png", "compare-memory.png",
    ]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 5000


def test_plans_fit_the_issue():
    full, quick = Plan.full(), Plan.quick()
    assert full.agents == (4, 16, 64) and full.clients == (1, 2, 4, 8) and full.turns == 6
    assert full.context == 1024 and full.tokens == 128 and full.runs >= 3 and full.repeats >= 3
    assert quick.runs >= 3 and quick.repeats >= 3 and 4 in quick.clients
    assert quick.kv4_agents > 10  # beyond the peer's LRU, so its RSS is at its plateau


def test_texts_are_stable_and_about_the_size_asked():
    texts = Texts(None)
    a = texts.passage(200, "x", 1)
    assert a == texts.passage(200, "x", 1) and a != texts.passage(200, "x", 2)
    assert 200 <= texts.count(a) <= 230


def test_texts_of_different_keys_never_start_alike():
    """Two keys whose hash lands on one word (the 1-client rounds 2 and 3 of a
    quick run did) still get different prompts: else the second is a prompt
    the peer's prompt cache already holds, from another agent."""
    texts = Texts(None)
    keys = [("cc", c, rep, j) for c in (1, 2, 4, 8) for rep in range(3) for j in range(c)]
    firsts = [texts.passage(50, *k).split()[:3] for k in keys]
    assert len({tuple(f) for f in firsts}) == len(keys)
    assert texts.passage(50, *keys[1]).split()[:3] == firsts[1]  # and each key keeps its own


def sse(*events, keepalive=True):
    body = b": keepalive 1/2\n\n" if keepalive else b""
    for e in events:
        body += b"data: " + (e if isinstance(e, bytes) else json.dumps(e).encode()) + b"\n\n"
    return body


def test_client_times_first_content_chunk_and_reads_usage():
    chunks = [
        {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
        {"choices": [{"delta": {"content": "Hel"}}]},
        {"choices": [{"delta": {"content": "lo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 12, "completion_tokens": 2,
                                  "prompt_tokens_details": {"cached_tokens": 9}}},
        b"[DONE]",
    ]
    seen = {}

    def handler(request):
        seen["agent"] = request.headers["x-agent-id"]
        seen["body"] = json.loads(request.content)
        return httpx.Response(200, content=sse(*chunks), headers={"content-type": "text/event-stream"})

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        turn = chat(client, "http://x", "agent-7", [{"role": "user", "content": "hi"}], 5)
    assert turn.text == "Hello" and turn.completion_tokens == 2
    assert turn.prompt_tokens == 12 and turn.cached_tokens == 9
    assert 0 <= turn.ttft <= turn.e2e
    assert seen["agent"] == "agent-7"
    assert seen["body"]["temperature"] == 0.0 and seen["body"]["stream"] is True and "model" not in seen["body"]


def test_client_raises_on_http_and_stream_errors():
    def handler(request):
        if "bad" in request.headers["x-agent-id"]:
            return httpx.Response(400, json={"error": "nope"})
        return httpx.Response(200, content=sse({"error": {"message": "boom"}}))

    with httpx.Client(transport=httpx.MockTransport(handler)) as client:
        with pytest.raises(RuntimeError, match="HTTP 400"):
            chat(client, "http://x", "bad", [], 1)
        with pytest.raises(RuntimeError, match="boom"):
            chat(client, "http://x", "good", [], 1)


def test_disk_usage_counts_the_caches_and_their_tokens(tmp_path):
    from semantic.runtime.store.cache_file import CacheStore
    from tests.runtime import cache_writer

    store = CacheStore(tmp_path)
    for version in (0, 1):  # 16 and 500 tokens
        store.save(cache_writer.record(version))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "junk.kv").mkdir()  # no manifest: not a cache
    size, tokens = disk_usage(tmp_path)
    assert tokens == 516 and size == sum(e["bytes"] for e in store.entries()) > 0


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux /proc")
def test_process_memory_of_this_process():
    mem = process_memory(os.getpid())
    assert mem["rss_bytes"] > 1 << 20 and mem["hwm_bytes"] >= mem["rss_bytes"] and mem["processes"] >= 1
    assert process_memory(2**22 + 12345) == {}


def test_server_starts_on_a_free_port_and_stops_its_process_group(tmp_path):
    """A stand-in server (Python's http.server) through the same start/stop code."""
    import signal
    import sys

    from semantic.bench.servers import Server, ServerSpec

    spec = ServerSpec("http.server", [sys.executable, "-m", "http.server", "{port}", "--bind", "127.0.0.1"], "/",
                      stop_signal=signal.SIGTERM)
    server = Server(spec, tmp_path / "server.log")
    server.start(timeout=30)
    try:
        assert httpx.get(server.url + "/").status_code == 200
        pid = server.pid
        if os.path.exists("/proc/self/status"):
            assert server.memory()["rss_bytes"] > 0
    finally:
        server.stop()
    assert server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_table_and_targets_from_the_written_json_match_the_live_ones():
    summary = report.summarize(raw_fixture())
    written = json.loads(json.dumps(summary))  # keys "4", "16", "64"
    assert report.targets(written) == report.targets(summary)
    assert report.markdown_table(written, report.targets(written)) == report.markdown_table(summary, report.targets(summary))
    assert "turn 4 TTFT without a restart" in report.markdown_table(summary)


def test_a_concurrency_round_with_a_short_reply_runs_again_on_other_prompts():
    """Both sides answer each round's prompts; where a reply on either side
    ends before the tokens asked, the round's tokens fall but not its time,
    so both sides' round runs again on other prompts (a bounded number of
    times), and what is kept is a round whose replies all went the length."""
    plan = Plan.quick()
    bench = Bench({}, plan, None, Log(quiet=True))
    short = {("semantic", 4, 2), ("peer", 4, 3)}  # our round 3 ended a reply early, then the peer's rerun did
    ran = []

    def round_(side, c, rep):
        ran.append((side, c, rep))
        tokens = c * plan.tokens - (10 if (side, c, rep) in short else 0)
        return {"system_tps": tokens / 5.0, "per_stream_tps": 1.0, "ttft": 1.0, "tokens": tokens}

    bench._concurrent_round = round_
    raw = bench.concurrency()
    bench.close()
    assert [rep for side, c, rep in ran if c == 4 and side == "semantic"] == [0, 1, 2, 3, 4]
    assert [rep for side, c, rep in ran if c == 1 and side == "peer"] == [0, 1, 2]
    for side in ("semantic", "peer"):
        assert [row["tokens"] for row in raw[side][4]] == [4 * plan.tokens] * 3
        assert [row["reruns"] for row in raw[side][4]] == [0, 0, 2]

    always = Bench({}, plan, None, Log(quiet=True))
    always._concurrent_round = lambda side, c, rep: {"system_tps": 1.0, "per_stream_tps": 1.0, "ttft": 1.0, "tokens": 1}
    assert [row["reruns"] for row in always.concurrency()["peer"][4]] == [RERUNS] * 3  # bounded: kept as it is
    always.close()


def long_context_raw():
    """The long-context workload's raw figures (seconds, bytes)."""
    def row(cold, follow, decode, hwm):
        return {"cold_ttft": cold, "followup_ttft": follow, "prompt_tokens": 1000, "followup_cached": 990,
                "decode_ms": decode, "hwm_bytes": hwm, "rss_bytes": hwm // 2}

    return {
        "contexts": {"semantic": {8192: row(50.0, 0.4, [70.0, 80.0], 900 << 20),
                                  32768: row(600.0, 1.0, [150.0, 170.0], 1200 << 20)},
                     "peer": {8192: row(130.0, 1.0, [110.0, 110.0], 1500 << 20),
                              32768: row(1500.0, 5.0, [400.0, 400.0], 3000 << 20)}},
        "restart_ttft": {8192: 0.7, 32768: 2.0},
        "disk_bytes": {8192: 60 << 20, 32768: 240 << 20},
        "four_agents": {"semantic": {"system_tps": 30.0, "tokens": 128, "hwm_bytes": 1000 << 20, "context": 16384},
                        "peer": {"system_tps": 15.0, "tokens": 128, "hwm_bytes": 4000 << 20, "context": 16384}},
    }


def test_long_context_summary_keys_ratios_by_context_and_four_agents():
    summary = json.loads(json.dumps(report.summarize({"long_context": long_context_raw()})))  # as written
    r = summary["long_context"]["ratio"]
    assert r["decode_ms_per_token"] == {"8192": 0.682, "32768": 0.4}  # medians of each side's turns
    assert r["followup_ttft"]["32768"] == 0.2 and r["peak_rss"]["32768"] == 0.4
    assert r["restart_ttft"]["32768"] == round(2.0 / 1500.0, 3)  # the peer's cold prefill stands for its restart
    assert r["four_agents"] == {"peak_rss": 0.25, "system_tps": 2.0}
    assert summary["long_context"]["semantic"]["disk_bytes"]["32768"] == 240 << 20
    goals = report.targets(summary)
    assert {n: (g["ratio"], g["met"], g.get("context")) for n, g in goals.items()} == {
        "long_decode": (0.4, True, 32768), "long_followup": (0.2, True, 32768),
        "long_restart": (0.001, True, 32768), "long_peak_rss": (0.4, True, 32768),
        "four_agents_rss": (0.25, True, 16384), "four_agents_tps": (2.0, True, 16384)}
    table = report.markdown_table(summary, goals)
    assert "| long context | 32,768: decode, ms per token | 160 | 400 |" in table
    assert "four agents at 16,384: system tok/s" in table and table.count("**met**") == 6


def test_one_long_agents_targets_are_judged_at_32k_only():
    raw = long_context_raw()
    for side in raw["contexts"].values():
        del side[32768]
    summary = report.summarize({"long_context": raw})
    goals = report.targets(summary)
    assert set(goals) == {"four_agents_rss", "four_agents_tps"}  # 8K alone: no one-agent goal to meet or miss
    table = report.markdown_table(summary, goals)
    assert table.count("**met**") == 2 and "missed" not in table


def test_long_context_runs_alone_and_on_a_stretched_model(tmp_path):
    from semantic.bench import long_context
    from semantic.bench.compare import DEFAULT, WORKLOADS

    assert "long-context" in WORKLOADS and "long-context" not in DEFAULT
    assert Plan.quick().long_contexts == (8192, 16384, 32768) and max(Plan.full().long_contexts) == 65536
    assert long_context.four_agents_context((8192, 16384, 32768)) == 16384
    assert long_context.four_agents_context((1024, 2048)) == 2048
    assert long_context.four_agents_context((32768,)) is None
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "hidden_size": 576}))
    (model / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 8192}))
    (model / "model.safetensors").write_bytes(b"weights")
    out = long_context.stretch(model, tmp_path / "long", 66560)
    assert json.loads((out / "config.json").read_text()) == {"max_position_embeddings": 66560, "hidden_size": 576}
    assert json.loads((out / "tokenizer_config.json").read_text())["model_max_length"] == 66560
    assert (out / "model.safetensors").read_bytes() == b"weights"
    assert json.loads((model / "config.json").read_text())["max_position_embeddings"] == 8192  # untouched
