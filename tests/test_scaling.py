"""Many servers behind HAProxy (``scripts/haproxy.cfg``, ``docs/scaling.md``).

* ``test_the_balancer_routes_every_api_by_its_agent``: the configuration in
  the real haproxy in front of two stub servers: the route key of every API
  and client (the ``X-Semantic-Route-Key`` header) against ``route_scope``;
  a silent reply and a stream with pauses get through; a connection refused
  goes to the other server, a dead server leaves the pool, and once back it
  gets its keys back.
* ``test_agents_stay_on_one_server_and_move_when_it_dies``: two ``semantic
  serve`` and the real haproxy: agents (agent API, Anthropic with Claude
  Code's session header, Responses with ``prompt_cache_key`` then
  ``previous_response_id``, a fork) each reach one server on every turn with
  their cache warm; one server is killed, its agents exported from its
  directory and imported over HTTP through the balancer, and they go on warm
  on the other; what was not moved goes on cold, or is gone.

haproxy comes from ``scripts/setup-haproxy.sh`` (``make test`` runs it, and
so does this module once when it is missing); without it the tests skip.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from tests.clients.conftest import Server
from semantic.web.identity import route_scope

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "scripts" / "haproxy.cfg"
SETUP = ROOT / "scripts" / "setup-haproxy.sh"


@functools.cache
def _haproxy() -> tuple[str | None, str]:
    """The haproxy binary (installed by the setup script if missing), or None and why."""
    def find():
        return shutil.which("haproxy") or next(
            (p for p in ("/usr/sbin/haproxy", "/usr/local/sbin/haproxy") if os.access(p, os.X_OK)), None)

    if found := find():
        return found, ""
    try:
        out = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=600)
        log = (out.stdout + out.stderr).strip()
    except subprocess.TimeoutExpired:
        log = f"{SETUP.name} timed out"
    return find(), log


@pytest.fixture
def haproxy_bin() -> str:
    path, log = _haproxy()
    if path is None:
        pytest.skip(f"no haproxy, and scripts/setup-haproxy.sh could not install it (apt-get install haproxy): {log}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Balancer:
    """haproxy on ``scripts/haproxy.cfg`` in front of ``servers`` (host:port, in order: s1, s2, ...)."""

    def __init__(self, binary: str, servers: list[str], log_path: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        env = dict(os.environ, SEMANTIC_LB_BIND=self.url.removeprefix("http://"))
        env.update({f"SEMANTIC_SERVER_{i}": s for i, s in enumerate(servers, 1)})
        check = subprocess.run([binary, "-c", "-f", str(CONFIG)], env=env, capture_output=True, text=True)
        assert check.returncode == 0, check.stdout + check.stderr
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen([binary, "-db", "-f", str(CONFIG)], env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", int(self.url.rsplit(":", 1)[1])), timeout=1).close()
                break
            except OSError:
                assert self.proc.poll() is None and time.monotonic() < deadline, self.log()
                time.sleep(0.05)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for(self, text: str, timeout: float = 30) -> None:
        """Wait until haproxy has logged ``text`` (e.g. "semantic/s1 is DOWN")."""
        deadline = time.monotonic() + timeout
        while text not in self.log():
            assert time.monotonic() < deadline, f"haproxy did not log {text!r}:\n{self.log()}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)
        self._log.close()


# -- the configuration, on stub servers ---------------------------------------------


class _Stub(BaseHTTPRequestHandler):
    """Answers every request with its server's name and closes the connection (so
    that a stopped stub refuses the next one); ``/slow``: silent for 2 s first;
    ``/stream``: three SSE events 1.5 s apart."""

    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def _answer(self):
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.path == "/stream":
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.end_headers()
            for i in range(3):
                time.sleep(1.5)
                self.wfile.write(f"data: {i}\n\n".encode())
                self.wfile.flush()
            return
        if self.path == "/slow":
            time.sleep(2)
        body = json.dumps({"server": self.server.name}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = _answer


class _StubServer(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # health checks hang up without reading: nothing to report


def stub_server(name: str, port: int = 0) -> ThreadingHTTPServer:
    server = _StubServer(("127.0.0.1", port), _Stub)
    server.name = name
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def scope(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


ROUTES = [  # (method, path, JSON body, headers, the route key haproxy must compute)
    ("POST", "/v1/agents/alice/messages", {"content": "hi"}, {}, route_scope("alice")),
    ("GET", "/v1/agents/alice", None, {}, route_scope("alice")),
    ("POST", "/v1/agents/alice/fork", {"id": "bob"}, {}, route_scope("alice")),
    ("POST", "/v1/agents/alice/import", None, {}, route_scope("alice")),
    ("DELETE", "/v1/agents/al%40ice", None, {}, route_scope("al@ice")),
    ("POST", "/v1/agents", {"id": "alice", "system": "s"}, {}, route_scope("alice")),
    ("POST", "/v1/messages", {"messages": []}, {"X-Agent-Id": "alice"}, route_scope("alice")),
    ("POST", "/v1/chat/completions", {"messages": [], "session_id": "alice"}, {}, route_scope("alice")),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_alice_3_0123456789ab"}, {},
     route_scope("alice")),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_a_b_9_0123456789ab"}, {},
     route_scope("a_b")),
    ("GET", "/v1/responses/resp_alice_3_0123456789ab", None, {}, route_scope("alice")),
    ("DELETE", "/v1/responses/resp_alice_3_0123456789ab", None, {}, route_scope("alice")),
    # a session's conversations go where their session hint goes
    ("POST", "/v1/responses", {"input": "hi", "prompt_cache_key": "K"}, {}, scope("K")),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": f"resp_conv-{scope('K')}-0a1b2c3d_3_01234567"
                                                                    "89ab"}, {}, scope("K")),
    ("POST", "/v1/responses", {"input": "x" * 400_000, "prompt_cache_key": "K"}, {"session-id": "K"}, scope("K")),
    ("POST", "/v1/chat/completions", {"messages": [], "user": "U"}, {}, scope("U")),
    ("POST", "/v1/chat/completions", {"messages": [], "user": "U", "prompt_cache_key": "K"}, {}, scope("K")),
    ("POST", "/v1/messages", {"messages": []}, {"X-Claude-Code-Session-Id": "S"}, scope("S")),
    ("POST", "/v1/messages", {"messages": [], "metadata": {"user_id": json.dumps(
        {"device_id": "d", "account_uuid": "", "session_id": "127bddbe-b24f-5bb2"}, separators=(",", ":"))}},
     {}, scope("127bddbe-b24f-5bb2")),
    ("POST", "/v1/messages", {"messages": [], "metadata": {"user_id": "user_ab_account_cd_session_0123abcd-ef"}},
     {}, scope("0123abcd-ef")),
    ("POST", "/v1/messages", {"messages": [], "metadata": {"user_id": json.dumps({"session_id": "ab-12"})}},
     {"X-Claude-Code-Session-Id": ""}, scope("ab-12")),  # an empty header: the server reads the metadata too
    # nothing to go by: the client's address
    ("POST", "/v1/messages", {"messages": [], "metadata": {"user_id": "someone"}}, {}, "127.0.0.1"),
    ("POST", "/v1/responses", {"input": "hi", "previous_response_id": "resp_conv-0123456789abcdef_3_0123456789ab"},
     {}, "127.0.0.1"),
    ("POST", "/v1/responses", {"input": "hi", "prompt_cache_key": ""}, {}, "127.0.0.1"),
    ("POST", "/v1/responses", {"input": "x" * 400_000, "prompt_cache_key": "K"}, {}, "127.0.0.1"),
    ("GET", "/v1/agents", None, {}, "127.0.0.1"),
]


def timed(http: httpx.Client, path: str) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = http.get(path)
    return r, time.monotonic() - t0


@pytest.mark.slow
def test_the_balancer_routes_every_api_by_its_agent(haproxy_bin, tmp_path):
    stubs = [stub_server("one"), stub_server("two")]
    lb = Balancer(haproxy_bin, [f"127.0.0.1:{s.server_address[1]}" for s in stubs], tmp_path / "haproxy.log")
    try:
        with httpx.Client(base_url=lb.url, timeout=30) as http, ThreadPoolExecutor(2) as pool:
            # a silent reply and a stream with pauses are not cut by the balancer's timeouts
            silent, stream = pool.submit(timed, http, "/slow"), pool.submit(timed, http, "/stream")
            seen = {}
            for method, path, body, headers, key in ROUTES:
                r = http.request(method, path, json=body, headers=headers)
                assert r.status_code == 200, (path, r.text)
                assert r.headers["x-semantic-route-key"] == key, (method, path, headers, body and str(body)[:200])
                assert r.headers["x-semantic-server"] == {"one": "s1", "two": "s2"}[r.json()["server"]]
                seen.setdefault(key, set()).add(r.json()["server"])
            assert all(len(servers) == 1 for servers in seen.values()), seen  # one key, one server
            assert set().union(*seen.values()) == {"one", "two"}  # and both servers are used

            assert silent.result()[0].status_code == 200 and silent.result()[1] >= 2
            assert stream.result()[0].text == "".join(f"data: {i}\n\n" for i in range(3))

            # a server gone: its keys go to the other at once (retried there), and it leaves the pool
            gone = next(k for k, s in seen.items() if s == {"one"})
            stubs[0].shutdown()
            stubs[0].server_close()
            for method, path, body, headers, key in ROUTES:
                if key == gone:
                    r = http.request(method, path, json=body, headers=headers)
                    assert r.status_code == 200 and r.json()["server"] == "two", r.text
                    break
            lb.wait_for("semantic/s1 is DOWN")

            # back on its port: once up again, its keys come back to it
            stubs[0] = stub_server("one", port=stubs[0].server_address[1])
            lb.wait_for("semantic/s1 is UP")
            r = next(http.request(m, p, json=b, headers=h) for m, p, b, h, key in ROUTES if key == gone)
            assert r.json()["server"] == "one"
    finally:
        lb.stop()
        for s in stubs:
            s.shutdown()


def test_the_balancer_waits_long_enough_for_any_turn():
    """A turn answered in one piece is silent until it ends: the configuration waits an hour."""
    text = CONFIG.read_text()
    assert "timeout server 1h" in text and "balance hash var(txn.route_key)" in text and "hash-type consistent" in text


# -- two real servers ----------------------------------------------------------------

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
QUESTIONS = ["What is the capital of France?", "And of Italy?", "And of Spain?", "And of Germany?"]
AGENTS = [f"agent-{i}" for i in range(10)]  # the agent API, by path
SESSIONS = [f"session-{i}" for i in range(4)]  # Anthropic, as Claude Code: X-Claude-Code-Session-Id
CACHE_KEYS = ["thread-0", "thread-2", "thread-3"]  # Responses: prompt_cache_key, then previous_response_id
# (names that put each kind on both servers with this configuration's hash: asserted below)
MAX_TOKENS = 4


class Conversation:
    """One conversation through the balancer: its turns' servers and usage."""

    def __init__(self, name: str, kind: str):
        self.name, self.kind = name, kind
        self.servers: list[str] = []  # X-Semantic-Server of each turn
        self.keys: list[str] = []  # X-Semantic-Route-Key of each turn
        self.agents: list[str] = []  # X-Agent-Id of each turn
        self.prompts: list[int] = []  # prompt tokens of each turn
        self.cached: list[int] = []  # of them, read from the cache
        self.outputs: list[int] = []
        self.messages: list[dict] = []  # Anthropic: the conversation so far
        self.response_ids: list[str] = []  # Responses: each turn's response id
        self.status: list[int] = []

    def turn(self, http: httpx.Client, n: int, previous: str | None = None) -> httpx.Response:
        question = f"{QUESTIONS[n]} ({self.name})"
        if self.kind == "agent":
            r = http.post(f"/v1/agents/{self.name}/messages", json={"content": question, "max_tokens": MAX_TOKENS})
        elif self.kind == "anthropic":
            self.messages.append({"role": "user", "content": question})
            r = http.post("/v1/messages", headers={"X-Claude-Code-Session-Id": self.name},
                          json={"model": "claude-x", "max_tokens": MAX_TOKENS, "system": SYSTEM,
                                "messages": self.messages})
        else:
            body = {"model": "gpt-x", "input": question, "max_output_tokens": MAX_TOKENS}
            previous = previous or (self.response_ids[-1] if self.response_ids else None)
            if previous:
                body["previous_response_id"] = previous
            else:
                body.update(instructions=SYSTEM, prompt_cache_key=self.name)
            r = http.post("/v1/responses", json=body)
        self.status.append(r.status_code)
        self.servers.append(r.headers.get("x-semantic-server"))
        self.keys.append(r.headers.get("x-semantic-route-key"))
        self.agents.append(r.headers.get("x-agent-id"))
        if r.status_code != 200:
            return r
        body = r.json()
        if self.kind == "agent":
            u = body["usage"]
            self._usage(u["prompt_tokens"], u["reused_tokens"], u["output_tokens"])
        elif self.kind == "anthropic":
            u = body["usage"]
            self._usage(u["input_tokens"] + u["cache_read_input_tokens"], u["cache_read_input_tokens"],
                        u["output_tokens"])
            self.messages.append({"role": "assistant", "content": body["content"][0]["text"]})
        else:
            u = body["usage"]
            self._usage(u["input_tokens"], u["input_tokens_details"]["cached_tokens"], u["output_tokens"])
            self.response_ids.append(body["id"])
        return r

    def _usage(self, prompt: int, cached: int, output: int) -> None:
        self.prompts.append(prompt)
        self.cached.append(cached)
        self.outputs.append(output)

    def warm(self, turn: int) -> bool:
        """Whether ``turn`` read the whole conversation before it from the cache: the
        previous turn's prompt and reply (but its last token, which no forward has seen)."""
        return self.cached[turn] >= self.prompts[turn - 1] + self.outputs[turn - 1] - 1

    def __repr__(self) -> str:
        return (f"<{self.kind} {self.name}: servers {self.servers}, keys {self.keys}, agents {self.agents}, "
                f"prompts {self.prompts}, cached {self.cached}, status {self.status}>")


def _start_servers(tmp_path: Path) -> list[Server]:
    with ThreadPoolExecutor(2) as pool:  # both load the model at once
        return list(pool.map(lambda name: Server(tmp_path / name / "agents", tmp_path / f"{name}.log"), ("a", "b")))


def _run(conversations: list[Conversation], url: str, turns: range) -> None:
    """Each conversation's ``turns`` in order; conversations side by side."""
    def run(c: Conversation) -> None:
        with httpx.Client(base_url=url, timeout=120) as http:
            for n in turns:
                c.turn(http, n)

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(run, conversations))


def _written(server: Server, cache_dir: Path, conversations: list[Conversation]) -> bool:
    """Whether every cache the server holds in memory for these agents is on disk as it is now."""
    from semantic.runtime.store.cache_file import CacheStore

    on_disk = {e["agent"]: e["tokens"] for e in CacheStore(cache_dir).entries()}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        listed = {a["id"]: a for a in http.get("/v1/agents").json()["agents"]}
    return all(on_disk.get(c.agents[-1]) == listed[c.agents[-1]]["tokens_cached"] for c in conversations)


def import_over_http(url: str, agent: str, archive: Path) -> tuple[int, str, dict]:
    """``POST /v1/agents/{agent}/import`` with curl as docs/scaling.md shows it (httpx
    where there is no curl): the status, the server that answered, the body."""
    if shutil.which("curl") is None:
        r = httpx.post(f"{url}/v1/agents/{agent}/import", content=archive.read_bytes(), timeout=60,
                       headers={"content-type": "application/x-tar"})
        return r.status_code, r.headers.get("x-semantic-server"), r.json()
    headers, body = archive.with_suffix(".headers"), archive.with_suffix(".json")
    subprocess.run(["curl", "-sS", "-T", archive, "-X", "POST", "-H", "content-type: application/x-tar",
                    "-D", headers, "-o", body, f"{url}/v1/agents/{agent}/import"], check=True, timeout=60)
    lines = headers.read_text().splitlines()
    status = int([line for line in lines if line.startswith("HTTP/")][-1].split()[1])
    server = next(line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("x-semantic-server:"))
    return status, server, json.loads(body.read_text())


def semantic(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "semantic.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


@pytest.mark.slow
def test_agents_stay_on_one_server_and_move_when_it_dies(haproxy_bin, tmp_path):
    servers = _start_servers(tmp_path)
    lb = Balancer(haproxy_bin, [s.url.removeprefix("http://") for s in servers], tmp_path / "haproxy.log")
    try:
        with httpx.Client(base_url=lb.url, timeout=120) as http:
            for name in AGENTS:
                r = http.post("/v1/agents", json={"id": name, "system": SYSTEM})
                assert r.status_code == 201, r.text
        agents = [Conversation(name, "agent") for name in AGENTS]
        sessions = [Conversation(name, "anthropic") for name in SESSIONS]
        threads = [Conversation(name, "responses") for name in CACHE_KEYS]
        everyone = agents + sessions + threads
        t0 = time.monotonic()
        _run(everyone, lb.url, range(3))
        print(f"\n3 turns of {len(everyone)} conversations through haproxy: {time.monotonic() - t0:.1f} s")

        # every conversation on one server, on every turn, routed by the key its agent's id implies
        for c in everyone:
            assert c.status == [200] * 3 and len(set(c.servers)) == 1 and len(set(c.agents)) == 1, c
            assert set(c.keys) == {route_scope(c.agents[0])}, c
            assert c.warm(1) and c.warm(2), c  # turns 2 and 3 read the whole conversation before from the cache
        for c in sessions + threads:
            assert route_scope(c.agents[0]) == scope(c.name), c  # conv-<scope of the session>-...
        by_server = {name: {c.agents[0] for c in everyone if c.servers[0] == name} for name in ("s1", "s2")}
        for name, server in zip(("s1", "s2"), servers):  # each server's own listing says the same
            with httpx.Client(base_url=server.url, timeout=30) as direct:
                assert {a["id"] for a in direct.get("/v1/agents").json()["agents"]} == by_server[name]

        # a stream passes through the balancer whole
        with httpx.Client(base_url=lb.url, timeout=120) as http:
            assert http.post("/v1/agents", json={"id": "streamer", "system": SYSTEM}).status_code == 201
            r = http.post("/v1/agents/streamer/messages", json={"content": "Count to ten.", "max_tokens": 24,
                                                                  "stream": True})
            assert r.status_code == 200 and "event: delta" in r.text and "event: done" in r.text, r.text

        # a fork (an older response id continued) stays where its source is
        thread = threads[0]
        with httpx.Client(base_url=lb.url, timeout=120) as http:
            r = thread.turn(http, 3, previous=thread.response_ids[0])
            fork = r.headers["x-agent-id"]
            assert r.status_code == 200 and fork != thread.agents[0] and thread.servers[-1] == thread.servers[0]
            assert route_scope(fork) == route_scope(thread.agents[0]), thread

        # the server with the most sessions dies; most of its agents move to the other
        dead = max(("s1", "s2"), key=lambda s: (sum(c.servers[0] == s for c in sessions),
                                                sum(c.servers[0] == s for c in agents)))
        dead_server, alive = servers[int(dead[1]) - 1], "s2" if dead == "s1" else "s1"
        dead_dir = tmp_path / f"{'ab'[int(dead[1]) - 1]}" / "agents"
        on_dead = [c for c in everyone if c.servers[0] == dead and c is not thread]
        lost_agent, lost_session, lost_thread = lost = [  # of each kind, one whose files stay behind
            next(c for c in on_dead if c.kind == kind) for kind in ("agent", "anthropic", "responses")]
        moved = [c for c in on_dead if c not in lost]
        assert {c.kind for c in moved} == {"agent", "anthropic", "responses"}, on_dead
        deadline = time.monotonic() + 30
        while not _written(dead_server, dead_dir, on_dead):  # caches are written behind the turns
            assert time.monotonic() < deadline, "the caches did not reach the disk"
            time.sleep(0.2)
        dead_server.proc.kill()  # a crash
        dead_server.proc.wait(10)
        t0 = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            exports = list(pool.map(lambda c: semantic("cache", "--cache-dir", dead_dir, "export", c.agents[0],
                                                       "-o", tmp_path / f"{c.agents[0]}.tar"), moved))
        assert all(e.returncode == 0 for e in exports), [e.stdout + e.stderr for e in exports]
        lb.wait_for(f"semantic/{dead} is DOWN")  # before the imports: they go where the keys go now
        for c in moved:  # through the balancer: each lands where its key routes now
            status, server, body = import_over_http(lb.url, c.agents[0], tmp_path / f"{c.agents[0]}.tar")
            assert status == 201 and server == alive and body["imported"]["caches"][0]["tokens"] > 0, body
        print(f"{dead} killed; {', '.join(c.name for c in moved)} exported and imported through haproxy: "
              f"{time.monotonic() - t0:.1f} s")

        _run(moved + [lost_session], lb.url, range(3, 4))
        for c in moved:  # the fourth turn: on the other server, warm from the files moved
            assert c.status[-1] == 200 and c.servers[-1] == alive and c.agents[-1] == c.agents[0], c
            assert c.warm(3), c
        # not moved: a stateless client sends its whole conversation and goes on cold, on a new agent (reading
        # from the cache no more than a first turn does: the system prompt, which conversations share)
        assert lost_session.status[-1] == 200 and lost_session.servers[-1] == alive, lost_session
        assert lost_session.agents[-1] != lost_session.agents[0], lost_session
        assert lost_session.cached[-1] <= lost_session.cached[0] < lost_session.prompts[2], lost_session
        with httpx.Client(base_url=lb.url, timeout=120) as http:
            r = lost_agent.turn(http, 3)  # an agent API agent is gone
            assert r.status_code == 404 and r.headers["x-semantic-server"] == alive
            assert r.json()["error"]["message"] == f"no agent {lost_agent.name!r}; create it with POST /v1/agents"
            r = lost_thread.turn(http, 3)  # a response id names a state only the dead server had
            assert r.status_code == 404 and r.headers["x-semantic-server"] == alive
            assert r.json()["error"]["code"] == "previous_response_not_found", r.text
    finally:
        lb.stop()
        for s in servers:
            s.stop()
