"""The dashboard: the event hub, the snapshot JSON and the ``/v1/events`` stream
on a live server (trio and asyncio), and the page itself in a headless
chromium (selenium; asyncio only: skipped, saying why, without a browser).

The browser test saves screenshots under ``artifacts/`` at the repository
root (git-ignored) and prints where, and the render time with 300 agents."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import anyio
import httpx
import pytest

from semantic.runtime.outcome import TurnResult
from semantic.web.dashboard import agent_row, turn_record
from semantic.web.events import EventHub

from .live import client, live_server, tiny_loaded

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "artifacts"
KEY = "dash-key"


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()


# -- the hub and the JSON (no server) ---------------------------------------------------


async def test_hub_fans_out_drops_slow_subscribers_and_keeps_recent_turns():
    hub = EventHub(queue_size=4, recent_turns=3)
    async with hub.subscribe() as fast, hub.subscribe() as slow:
        assert hub.subscribers == 2
        for i in range(4):
            hub.publish("tick", {"i": i})
            assert (await fast.receive())["i"] == i  # fast keeps up
        hub.publish("tick", {"i": 4})  # slow has 4 queued: the fifth drops it, without waiting
        assert hub.subscribers == 1 and hub.dropped == 1
        assert [(await slow.receive())["i"] for _ in range(4)] == [0, 1, 2, 3]
        with pytest.raises(anyio.EndOfStream):
            await slow.receive()
        event = await fast.receive()
        assert event["type"] == "tick" and event["i"] == 4 and event["at"] > 0
        for n in range(5):
            hub.turn({"agent": f"a{n}"})
        assert [t["agent"] for t in hub.turns] == ["a2", "a3", "a4"]
    assert hub.subscribers == 0
    hub.publish("nobody", {})  # no subscribers: fine


def test_turn_record_and_agent_row_json():
    result = TurnResult("stop", "hi", prompt_tokens=100, reused_tokens=75, prefilled_tokens=25, output_tokens=9,
                        queued_s=0.0, ttft_s=0.0123456, decode_s=0.5, drafted_tokens=6, accepted_tokens=4)
    record = turn_record("alice", "openai", 7, result, "hot")
    assert record == {"agent": "alice", "route": "openai", "turn_id": 7, "reason": "stop", "prompt_tokens": 100,
                      "prefilled_tokens": 25, "reused_tokens": 75, "output_tokens": 9, "reuse": 0.75,
                      "ttft_s": 0.0123, "decode_tps": 16.0, "cache": "hot", "drafted_tokens": 6,
                      "accepted_tokens": 4}
    from semantic.actors import AgentInfo, Message
    info = AgentInfo("alice", (Message("system", "s"), Message("user", "u"), Message("assistant", "a")),
                     "tiny", 40, 4096, "hot", 1.5)
    row = agent_row(info, record)
    assert row == {"id": "alice", "model": "tiny", "tier": "hot", "tokens_cached": 40, "bytes": 4096,
                   "last_use": 1.5, "turns": 1, "messages": 3, "reuse": 0.75, "ttft_s": 0.0123, "route": "openai"}
    assert agent_row(info, None)["reuse"] is None
    json.dumps(record), json.dumps(row)


def test_the_page_is_package_data():
    from importlib.resources import files

    static = files("semantic.web.static")  # and in the wheel: tests/test_layout.py
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert (static / name).is_file(), name


# -- live: the snapshot and the stream ---------------------------------------------------


async def _events(http: httpx.AsyncClient, into: list, ready: anyio.Event):
    async with http.stream("GET", "/v1/events") as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        async for line in r.aiter_lines():
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                into.append((event, json.loads(line[6:])))
                ready.set()


async def _until(check, timeout=5.0):
    with anyio.fail_after(timeout):
        while not check():
            await anyio.sleep(0.02)


@pytest.mark.slow
async def test_snapshot_and_events_follow_turns_tiers_and_deletes(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        seen: list = []
        ready = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(_events, http, seen, ready)
            await ready.wait()
            assert seen[0][0] == "snapshot" and seen[0][1]["agents"] == []
            assert (await http.post("/v1/agents", json={"id": "alice"})).status_code == 201
            r = await http.post("/v1/agents/alice/messages", json={"content": "Hello", "max_tokens": 8})
            assert r.status_code == 200
            r = await http.post("/v1/chat/completions", headers={"x-agent-id": "bob"},
                                json={"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200

            def kinds(kind):
                return [d for e, d in seen if e == kind]

            await _until(lambda: {d["agent"]["id"] for d in kinds("agent") if d["agent"]["tier"] == "hot"}
                         >= {"alice", "bob"})
            started = kinds("turn_started")
            assert [(d["agent"], d["route"]) for d in started] == [("alice", "agent"), ("bob", "openai")]
            ended = {d["agent"]: d for d in kinds("turn_ended")}
            assert ended["alice"]["route"] == "agent" and ended["alice"]["output_tokens"] > 0
            assert ended["bob"]["prefilled_tokens"] > 0 and ended["bob"]["ttft_s"] > 0
            await _until(lambda: kinds("memory") and kinds("memory")[-1]["memory"]["hot_bytes"] > 0)
            await _until(lambda: any(d["generated_tokens"] > 0 for d in kinds("batch")))

            # the snapshot: the same numbers as /health and the agent API
            snap = (await http.get("/v1/dashboard")).json()
            health = (await http.get("/health")).json()
            for k in ("hot_bytes", "budget_bytes", "prefix_bytes", "demotions"):
                assert snap["memory"][k] == health["memory"][k], k
            assert snap["disk"]["budget_bytes"] == health["disk"]["budget_bytes"]
            assert snap["queue_depth"] == health["queue_depth"] == 0
            listed = {a["id"]: a for a in (await http.get("/v1/agents")).json()["agents"]}
            rows = {a["id"]: a for a in snap["agents"]}
            assert set(rows) == set(listed) == {"alice", "bob"}
            for agent_id, row in rows.items():
                for k in ("tier", "tokens_cached", "bytes", "last_use", "model"):
                    assert row[k] == listed[agent_id][k], (agent_id, k)
                assert row["turns"] == 1 and row["ttft_s"] > 0 and row["reuse"] is not None
            assert [t["agent"] for t in snap["turns"]] == ["alice", "bob"]
            assert snap["batch"]["generated_tokens"] > 0 and isinstance(snap["throughput"], list)

            # a longer turn: the batch shows it decoding, with its tokens so far and speed
            t0 = time.perf_counter()
            r = await http.post("/v1/agents/alice/messages", json={"content": "Tell me more", "max_tokens": 300})
            took, out = time.perf_counter() - t0, r.json()["usage"]["output_tokens"]
            decoding = [s for d in kinds("batch") for s in d["decoding"] if s["agent"] == "alice"]
            print(f"\n[dashboard] a {out}-token turn took {took:.2f} s; the batch saw it decoding: {decoding[-1:]}")
            if took > 1.2:  # batch events come at 2 Hz: a turn this long is seen decoding
                assert decoding and 0 < decoding[-1]["tokens"] <= out and decoding[-1]["tokens_per_s"] > 0

            # demote: a tier event (hot -> warm); delete: agent_deleted
            r = await http.post("/v1/agents/bob/demote")
            assert r.status_code == 202, r.text
            await _until(lambda: any(d == {**d, "agent": "bob", "tier": "warm", "previous": "hot"}
                                     for d in kinds("tier")))
            assert (await http.delete("/v1/agents/alice")).status_code == 200
            await _until(lambda: any(d["agent"] == "alice" for d in kinds("agent_deleted")))
            assert (await http.post("/v1/agents/ghost/demote")).status_code == 404
            tg.cancel_scope.cancel()


async def test_the_key_guards_data_but_not_the_page(tmp_path):
    async with live_server(tmp_path, api_key=KEY) as url, client(url) as http:
        page = await http.get("/")
        assert page.status_code == 200 and "<title>Semantic dashboard</title>" in page.text
        assert (await http.get("/dashboard/static/dashboard.js")).status_code == 200
        for path in ("/v1/dashboard", "/v1/events"):
            assert (await http.get(path)).status_code == 401, path
        assert (await http.get("/v1/dashboard", headers={"x-api-key": KEY})).status_code == 200


async def test_in_process_turns_show_as_such(tmp_path):
    """Turns of the runtime's own API (no route) come through the runtime's observer."""
    from semantic.web.app import ServerConfig, create_app

    app = create_app(ServerConfig(model=tiny_loaded(), cache_dir=tmp_path, budget=256 << 20))
    async with app.router.lifespan_context(app):
        server = app.state.server
        agent = await server.rt.agent("solo")
        await agent.reply("Hello", max_tokens=4)
        [turn] = server.hub.turns
        assert turn["agent"] == "solo" and turn["route"] == "in-process" and turn["output_tokens"] > 0


# -- the page in a browser ------------------------------------------------------------------


def _browser():
    """A headless chromium driven by selenium, or a skip saying what is missing."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("selenium is not installed: pip install -e '.[dev]'")
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("no chromium/chromedriver: run scripts/setup-browser.sh (make test does)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1280,1000", "--hide-scrollbars"):
        options.add_argument(arg)
    try:
        return webdriver.Chrome(service=Service(driver), options=options)
    except Exception as e:  # noqa: BLE001 - a browser that cannot start is a skip, with its reason
        pytest.skip(f"chromium did not start: {e}")


@pytest.mark.slow
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # selenium blocks: its calls run on worker threads
async def test_dashboard_in_a_browser(tmp_path):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver = await anyio.to_thread.run_sync(_browser)
    ARTIFACTS.mkdir(exist_ok=True)

    async def on(fn, *args):
        return await anyio.to_thread.run_sync(fn, *args)

    async def wait_for(check, timeout=2.0, what=""):
        """``check(driver)`` true within ``timeout`` s (polled in the browser thread)."""
        def run():
            return WebDriverWait(driver, timeout, poll_frequency=0.05,  # rows are re-rendered under it
                                 ignored_exceptions=(StaleElementReferenceException,)).until(check, what)
        return await on(run)

    def js(script, *args):
        return driver.execute_script(script, *args)

    def open_agent(agent_id):
        js("document.querySelector(`#agents tr.agent[data-id='${arguments[0]}'] td`).click()", agent_id)

    def row(d, agent_id):
        found = d.find_elements(By.CSS_SELECTOR, f'#agents tr.agent[data-id="{agent_id}"]')
        return found[0] if found else None

    try:
        async with live_server(tmp_path, api_key=KEY, budget=4 << 20) as url, \
                client(url, **{"x-api-key": KEY}) as http:
            # without the key: a prompt, no data
            await on(driver.get, url + "/")
            await wait_for(lambda d: d.find_element(By.ID, "key-form").is_displayed(), 5, "the key prompt")
            assert not await on(lambda: driver.find_element(By.ID, "main").is_displayed())
            assert await on(js, "return window.dashboard.state.agents.size") == 0
            # a wrong key is refused; the right one connects
            await on(lambda: driver.find_element(By.ID, "key-input").send_keys("wrong\n"))
            await wait_for(lambda d: "refused" in d.find_element(By.ID, "key-error").text, 5, "refused")
            await on(lambda: driver.find_element(By.ID, "key-input").send_keys(KEY + "\n"))
            await wait_for(lambda d: d.find_element(By.ID, "main").is_displayed()
                           and d.find_element(By.ID, "status").get_attribute("data-state") == "live", 5, "live")
            used_before = int(await on(lambda: driver.find_element(By.ID, "kv-bar").get_attribute("data-used")))

            # two agents take turns through the API (the agent API and OpenAI's)
            await http.post("/v1/agents", json={"id": "alice", "system": "Be brief."})
            r1 = await http.post("/v1/agents/alice/messages", json={"content": "Hello alice", "max_tokens": 12})
            r2 = await http.post("/v1/chat/completions", headers={"x-agent-id": "bob"},
                                 json={"model": "m", "max_tokens": 12,
                                       "messages": [{"role": "user", "content": "Hello bob"}]})
            assert r1.status_code == r2.status_code == 200
            t0 = time.perf_counter()
            listed = {a["id"]: a for a in (await http.get("/v1/agents")).json()["agents"]}

            def shows_both(d):
                for agent_id in ("alice", "bob"):
                    tr = row(d, agent_id)
                    want = listed[agent_id]
                    if tr is None or tr.get_attribute("data-tier") != want["tier"] \
                            or tr.get_attribute("data-tokens") != str(want["tokens_cached"]):
                        return False
                return True

            await wait_for(shows_both, 2.0, "both agents with their tiers and token counts")
            await wait_for(lambda d: int(d.find_element(By.ID, "kv-bar").get_attribute("data-used")) != used_before,
                           2.0, "the budget bar changed")
            turns = '#turns tr[data-agent="{}"][data-route="{}"]'
            await wait_for(lambda d: d.find_elements(By.CSS_SELECTOR, turns.format("alice", "agent"))
                           and d.find_elements(By.CSS_SELECTOR, turns.format("bob", "openai")),
                           2.0, "the turns in recent turns")
            shown = time.perf_counter() - t0
            print(f"\n[dashboard] agents, budget bar and recent turns shown {shown:.2f} s after the turns")
            text = await on(lambda: driver.find_element(By.ID, "turns").text)
            assert "OpenAI" in text and "agent API" in text

            # the chat box: one turn through the agent API, streamed into the page
            await on(open_agent, "alice")
            await wait_for(lambda d: "Hello alice" in d.find_element(By.ID, "history").text, 5, "alice's history")
            await on(lambda: driver.find_element(By.ID, "chat-input").send_keys("How are you?"))
            await on(lambda: driver.find_element(By.ID, "chat-send").click())
            await wait_for(lambda d: d.find_element(By.ID, "chat-reply").get_attribute("data-state")
                           in ("done", "error"), 30, "the streamed reply")
            assert await on(lambda: driver.find_element(By.ID, "chat-reply").get_attribute("data-state")) == "done"
            reply = await on(js, "return document.getElementById('chat-reply').textContent")
            history = (await http.get("/v1/agents/alice")).json()["history"]
            assert history[-2] == {"role": "user", "content": "How are you?"}
            assert reply and reply == history[-1]["content"]
            await wait_for(lambda d: len(d.find_elements(By.CSS_SELECTOR, '#turns tr[data-agent="alice"]')) == 2,
                           2.0, "the chat turn in recent turns")

            # demote bob from the page: warm
            await on(open_agent, "bob")
            await wait_for(lambda d: d.find_element(By.ID, "detail-id").text == "bob", 2, "bob opened")
            await on(lambda: driver.find_element(By.ID, "demote").click())
            await wait_for(lambda d: row(d, "bob") is not None and row(d, "bob").get_attribute("data-tier") == "warm",
                           5, "bob demoted")

            # screenshots: desktop, then a phone's width
            await on(lambda: driver.find_element(By.ID, "detail-close").click())
            desktop, phone = ARTIFACTS / "dashboard-desktop.png", ARTIFACTS / "dashboard-phone.png"
            await on(driver.save_screenshot, str(desktop))
            await on(driver.set_window_size, 390, 1400)
            await anyio.sleep(0.3)
            await on(driver.save_screenshot, str(phone))
            await on(driver.set_window_size, 1280, 1000)
            print(f"[dashboard] screenshots: {desktop} and {phone}")

            # delete alice from the page: gone from the API
            await on(open_agent, "alice")
            await wait_for(lambda d: d.find_element(By.ID, "detail-id").text == "alice", 2, "alice opened")
            await on(lambda: driver.find_element(By.ID, "delete").click())
            await on(lambda: driver.find_element(By.ID, "delete").click())  # "Really delete?"
            await wait_for(lambda d: row(d, "alice") is None, 5, "alice gone from the page")
            assert "alice" not in {a["id"] for a in (await http.get("/v1/agents")).json()["agents"]}

            # 300 agents: the page stays responsive
            n = 300
            limit = anyio.CapacityLimiter(8)

            async def create(i):
                async with limit:
                    agent_id = f"conv-{i:04x}load" if i % 2 else f"agent-{i:03d}"
                    assert (await http.post("/v1/agents", json={"id": agent_id})).status_code == 201

            async with anyio.create_task_group() as tg:
                for i in range(n):
                    tg.start_soon(create, i)
            await wait_for(lambda d: d.execute_script("return window.dashboard.state.agents.size") == n + 1,
                           10, "300 agents listed")
            await anyio.sleep(0.2)
            timings = await on(js, """
                const d = window.dashboard, t = [];
                const filter = document.getElementById('filter');
                let t0 = performance.now();
                filter.value = 'agent-1'; filter.dispatchEvent(new Event('input'));
                t.push(performance.now() - t0);
                filter.value = ''; filter.dispatchEvent(new Event('input'));
                t0 = performance.now();
                document.querySelector('#agents th[data-sort="id"]').click();
                t.push(performance.now() - t0);
                document.querySelector('#agents tr.group').click();   // open the conv-* group
                t0 = performance.now();
                document.querySelector('#agents th[data-sort="tokens_cached"]').click();
                t.push(performance.now() - t0);
                return {filter: t[0], sort: t[1], expanded_sort: t[2],
                        rows: document.querySelectorAll('#agents tbody tr').length};""")
            group = await on(lambda: driver.find_element(By.CSS_SELECTOR, "#agents tr.group").text)
            assert "150 anonymous conversations" in group
            print(f"[dashboard] {n} agents: render {timings['filter']:.1f} ms (filter), "
                  f"{timings['sort']:.1f} ms (sort, conv-* grouped), {timings['expanded_sort']:.1f} ms "
                  f"(sort, all {timings['rows']} rows)")
            assert timings["rows"] == n + 2  # bob, 300 agents, the group row
            assert max(timings["filter"], timings["sort"], timings["expanded_sort"]) < 250
            await on(driver.save_screenshot, str(ARTIFACTS / "dashboard-300-agents.png"))
            if os.environ.get("SEMANTIC_DOCS_SCREENSHOT"):  # refresh the README's picture
                shutil.copy(desktop, ROOT / "docs" / "dashboard.png")
            await on(driver.get, "about:blank")  # the page's stream ends before the server does
    finally:
        await on(driver.quit)
