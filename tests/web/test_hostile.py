"""Hostile input over a real socket: JSON nested past the limit, in a body or
inside a string field or an archive, is a 400 in the route's own shape; an
answer sent before the body has arrived leaves the connection usable, and
comes at once where the body declared is more than would be drained; an
archive member no file system holds is a 400 (and one CLI line); imports
stay within the disk budget; and generated bodies and headers at every JSON
route never make a 5xx."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
import tempfile
from datetime import timedelta
from pathlib import Path

import anyio
import httpx
import pytest

from semantic.actors.archive import INDEX, export_agent
from semantic.runtime.text.json_reader import MAX_DEPTH

from .live import client, live_server, tiny_loaded

DEEP = "[" * 100_000 + "]" * 100_000  # 200 KB; json.loads: RecursionError
TOO_DEEP = f"more than {MAX_DEPTH} deep"
ASK = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}
JSON_ROUTES = ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions", "/v1/responses", "/v1/agents",
               "/v1/agents/ada/messages")


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()


def _message(r: httpx.Response) -> str:
    return r.json()["error"]["message"]


@pytest.mark.anyio
async def test_json_nested_past_the_limit_is_a_400_everywhere(tmp_path):
    async with live_server(tmp_path) as url, client(url) as http:
        await http.post("/v1/agents", json={"id": "ada"})
        for path in JSON_ROUTES:
            for body in (DEEP, json.dumps({**ASK, "messages": [{"role": "user", "content": "x"}]})[:-1]
                         + ', "extra": ' + DEEP + "}"):
                r = await http.post(path, content=body)
                assert r.status_code == 400 and TOO_DEEP in _message(r), (path, r.text[:300])
        anthropic_shape = (await http.post("/v1/messages", content=DEEP)).json()
        assert anthropic_shape["type"] == "error" and anthropic_shape["error"]["type"] == "invalid_request_error"

        # JSON inside string fields: a tool call's arguments (chat, Responses) ...
        call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
        r = await http.post("/v1/chat/completions", json={**ASK, "messages": [
            {"role": "user", "content": "Hi"}, {"role": "assistant", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]})
        assert r.status_code == 400 and TOO_DEEP in _message(r) and "arguments" in _message(r), r.text[:300]
        r = await http.post("/v1/responses", json={"model": "m", "max_output_tokens": 4, "input": [
            {"type": "function_call", "call_id": "c1", "name": "f", "arguments": DEEP},
            {"type": "function_call_output", "call_id": "c1", "output": "ok"}]})
        assert r.status_code == 400 and TOO_DEEP in _message(r), r.text[:300]
        # ... and Claude Code's metadata.user_id, which is only a hint: not JSON, so no session
        r = await http.post("/v1/messages", json={**ASK, "metadata": {"user_id": DEEP}})
        assert r.status_code == 200, r.text[:300]

        # an archive whose index nests past the limit
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as t:
            info = tarfile.TarInfo(INDEX)
            info.size = len(DEEP)
            t.addfile(info, io.BytesIO(DEEP.encode()))
        r = await http.post("/v1/agents/bo/import", content=tar.getvalue())
        assert r.status_code == 400 and TOO_DEEP in _message(r), r.text[:300]
        assert (await http.get("/health")).status_code == 200


@pytest.mark.anyio
@pytest.mark.parametrize("refusal", ["import into an agent that exists", "import under an invalid id", "wrong API key",
                                     "over the body limit", "no such route"])
async def test_an_answer_before_the_body_leaves_the_connection_usable(tmp_path, refusal):
    """The refused body is read and dropped (up to twice the body limit), so the
    keep-alive connection answers its next request; the client reads the refusal."""
    limit = 4 << 20
    async with live_server(tmp_path, api_key="k", max_body_bytes=limit) as url:
        async with httpx.AsyncClient(base_url=url, timeout=20, headers={"x-api-key": "k"},
                                     limits=httpx.Limits(max_connections=1)) as http:
            assert (await http.post("/v1/agents", json={"id": "ada"})).status_code == 201
            path, status, headers, size = {
                "import into an agent that exists": ("/v1/agents/ada/import", 409, {}, 6 << 20),
                "import under an invalid id": ("/v1/agents/a%20b/import", 400, {}, 6 << 20),
                "no such route": ("/v1/nothing", 404, {}, 2 << 20),
                "wrong API key": ("/v1/messages", 401, {"x-api-key": "bad"}, 6 << 20),
                "over the body limit": ("/v1/messages", 413, {}, 6 << 20),
            }[refusal]
            r = await http.post(path, content=b"x" * size, headers=headers)
            assert r.status_code == status and "connection" not in r.headers, (r.status_code, r.headers)
            for _ in range(2):
                assert (await http.get("/health")).status_code == 200
            assert (await http.post("/v1/agents/ada/messages", json={"content": "Hi", "max_tokens": 2})).is_success


@pytest.mark.anyio
async def test_a_body_past_what_is_drained_closes_the_connection(tmp_path):
    """A refusal whose body keeps coming past twice the limit (or past the body
    timeout) says ``Connection: close`` and closes."""
    async with live_server(tmp_path, api_key="k", max_body_bytes=1024, body_timeout_s=1) as url:
        host, port = url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as sock:
            await sock.send(f"POST /v1/messages HTTP/1.1\r\nhost: {host}\r\nx-api-key: k\r\n"
                            f"content-length: {100 << 20}\r\n\r\n".encode() + b"x" * 4096)
            answer = b""
            with anyio.fail_after(30):
                while chunk := await _receive(sock):
                    answer += chunk
        head = answer.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 413") and b"connection: close" in head, answer[:300]


@pytest.mark.anyio
@pytest.mark.parametrize("expect", [False, True], ids=["a few KB sent", "expect: 100-continue"])
@pytest.mark.parametrize("path, status", [("/v1/messages", 413), ("/v1/agents/bo/import", 507)],
                         ids=["over the body limit", "an import over the disk"])
async def test_a_body_declared_past_what_is_drained_is_refused_at_once(tmp_path, path, status, expect):
    """A client that declares 1 TiB and waits for the status (a few KB sent,
    or none, as one that sends ``Expect: 100-continue`` does) gets its answer
    at once -- a 413 by the body limit, a 507 by the disk an import needs --
    with ``Connection: close``, and the server closes without reading on.
    (hypercorn answers ``100 Continue`` as soon as it reads the head, before
    the app sees the request: the refusal follows it.)"""
    async with live_server(tmp_path) as url:
        host, port = url.removeprefix("http://").split(":")
        async with await anyio.connect_tcp(host, int(port)) as sock:
            start = anyio.current_time()
            expectation = "expect: 100-continue\r\n" if expect else ""
            head = (f"POST {path} HTTP/1.1\r\nhost: {host}\r\ncontent-type: application/json\r\n"
                    f"content-length: {1 << 40}\r\n{expectation}\r\n")
            await sock.send(head.encode() + (b"" if expect else b"x" * 4096))
            answer = b""
            with anyio.fail_after(5):
                while chunk := await _receive(sock):
                    answer += chunk
            took = anyio.current_time() - start
    if expect and answer.startswith(b"HTTP/1.1 100"):
        answer = answer.partition(b"\r\n\r\n")[2]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode()) and b"connection: close" in head.lower(), answer[:300]
    assert json.loads(body)["error"]["message"] and took < 1, (took, answer[:300])


async def _receive(sock) -> bytes:
    try:
        return await sock.receive()
    except (anyio.EndOfStream, anyio.BrokenResourceError, ConnectionError):
        return b""


# -- generated bodies ---------------------------------------------------------------------------------------------

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_leaf = (st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
         | st.text(max_size=40) | st.sampled_from(["user", "assistant", "system", "tool", "text", "image", "m"]))
_key = st.sampled_from(["role", "content", "type", "text", "name", "arguments", "tool_calls", "id", "input"]) \
    | st.text(max_size=8)


def _nested(inner):
    return st.lists(inner, max_size=4) | st.dictionaries(_key, inner, max_size=4)


_value = st.recursive(_leaf, _nested, max_leaves=12)
_fields = st.fixed_dictionaries({}, optional={
    k: _value | st.integers(-5, 40) for k in ("model", "max_tokens", "max_output_tokens", "messages", "input",
                                              "content", "system", "tools", "tool_choice", "temperature", "top_p",
                                              "stop", "id", "metadata", "stream", "instructions", "seed")})
_bodies = (_fields.map(lambda d: json.dumps(d).encode())
           | _value.map(lambda v: json.dumps(v).encode())
           | st.binary(max_size=64)
           | st.integers(MAX_DEPTH - 2, 300).map(lambda n: ("[" * n + "]" * n).encode())
           | st.just(DEEP.encode()))


_header_value = st.text(st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"),
                        max_size=300).map(lambda t: t.strip().encode("latin-1"))
_headers = st.fixed_dictionaries({}, optional={name: _header_value for name in (
    "x-agent-id", "x-claude-code-session-id", "anthropic-version", "anthropic-beta", "openai-beta")})


@pytest.fixture(scope="module")
def running(tmp_path_factory) -> str:
    """A live server on a portal thread (Hypothesis runs the requests synchronously), with agent ``ada``."""
    with anyio.from_thread.start_blocking_portal() as portal, portal.wrap_async_context_manager(
            live_server(tmp_path_factory.mktemp("fuzz"), max_tokens_cap=4)) as url:
        httpx.post(f"{url}/v1/agents", json={"id": "ada"}, timeout=30).raise_for_status()
        yield url


@pytest.mark.slow
@settings(max_examples=150, deadline=timedelta(seconds=20), derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(path=st.sampled_from(JSON_ROUTES), body=_bodies, headers=_headers)
def test_generated_bodies_never_make_a_5xx(running, path, body, headers):
    with httpx.Client(base_url=running, timeout=60) as http:
        r = http.post(path, content=body, headers={"content-type": "application/json", **headers})
        assert r.status_code < 500, (path, body[:200], r.text[:300])
        assert http.get("/health").status_code == 200


def _archive(member: tarfile.TarInfo, data: bytes = b"{}", fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt, encoding="utf-8", errors="surrogateescape") as t:
        member.size = len(data)
        t.addfile(member, io.BytesIO(data))
    return out.getvalue()


def _member(name: str, kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.pax_headers = {"path": name}  # as given: a ustar name field would end at a NUL
    return info


@pytest.mark.anyio
async def test_archive_members_with_hostile_names_or_kinds_are_a_400(tmp_path):
    cases = {
        "NUL": (_archive(_member("histories/a\x00b.json")), "NUL or control character"),
        "long": (_archive(_member("histories/" + "a" * 300 + ".json")), "longer than 255 bytes"),
        "not UTF-8": (_archive(_member("histories/a\udcffb.json")), "not UTF-8"),
        "sparse": (_archive(_member("histories/ada.json", tarfile.GNUTYPE_SPARSE), fmt=tarfile.GNU_FORMAT),
                   "a sparse or a special file"),
        "link": (_archive(_member("histories/ada.json", tarfile.SYMTYPE), b""), "a link"),
    }
    async with live_server(tmp_path) as url, client(url) as http:
        for case, (body, needle) in cases.items():
            r = await http.post("/v1/agents/ada/import", content=body)
            assert r.status_code == 400 and needle in _message(r), (case, r.status_code, r.text[:300])
        assert (await http.get("/health")).status_code == 200
    assert not list(tmp_path.glob("histories/*")), "nothing of a refused archive is left"


@pytest.mark.slow
def test_semantic_cache_import_refuses_the_same_archives_in_one_line(tmp_path):
    deep = _member(INDEX)
    for name, body in (("nul", _archive(_member("histories/a\x00b.json"))), ("deep", _archive(deep, DEEP.encode()))):
        (tmp_path / f"{name}.tar").write_bytes(body)
        r = subprocess.run([sys.executable, "-m", "semantic.cli.main", "cache", "--cache-dir", str(tmp_path / "cache"),
                            "import", str(tmp_path / f"{name}.tar")], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parents[2])
        assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr[-500:]
        assert ("has a NUL" if name == "nul" else TOO_DEEP) in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def _tree_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


@pytest.mark.anyio
async def test_imports_stay_within_the_disk_budget(tmp_path):
    """Imports go through the persistence actor: it prunes older caches to make
    room for each archive, or refuses it (507), so the directory never holds
    more than the budget; an archive larger than the whole budget is a 507 at once."""
    async with live_server(tmp_path / "a") as url, client(url) as http:
        for i in range(5):
            assert (await http.post("/v1/agents", json={"id": f"ag{i}", "system": f"Agent {i}. " + "word " * 200})
                    ).status_code == 201
            assert (await http.post(f"/v1/agents/ag{i}/messages", json={"content": "Hi", "max_tokens": 2})).is_success
    archives = []
    for i in range(5):
        export_agent(tmp_path / "a", f"ag{i}", tmp_path / f"ag{i}.tar")
        archives.append((tmp_path / f"ag{i}.tar").read_bytes())
    budget = int(max(map(len, archives)) * 2.5)
    async with live_server(tmp_path / "b", disk_budget=budget) as url, client(url) as http:
        imported = []
        for i, body in enumerate(archives):
            r = await http.post(f"/v1/agents/ag{i}/import", content=body)
            assert r.status_code in (201, 507), r.text
            imported.append(r.status_code == 201)
            assert _tree_bytes(tmp_path / "b") <= budget, (i, _tree_bytes(tmp_path / "b"), budget)
        assert sum(imported) >= 3, imported  # older caches made room for later archives
        r = await http.post("/v1/agents/big/import", content=b"x" * (budget + 1))
        assert r.status_code == 507 and "disk budget" in _message(r), r.text
        assert _tree_bytes(tmp_path / "b") <= budget


@pytest.mark.anyio
async def test_uploads_go_outside_the_cache_directory_and_abandoned_ones_are_swept(tmp_path, monkeypatch):
    """An upload is received outside the cache directory and removed after its
    import; one left by a server that died (its pid gone) goes at the next import."""
    uploads = tmp_path / "tmp"
    uploads.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(uploads))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    abandoned = uploads / f".tmp-import-{int(dead.stdout)}-0000.tar"
    abandoned.write_bytes(b"x" * 100)
    async with live_server(tmp_path / "a") as url, client(url) as http:
        assert (await http.post("/v1/agents", json={"id": "ada"})).status_code == 201
        assert (await http.post("/v1/agents/ada/messages", json={"content": "Hi", "max_tokens": 2})).is_success
    export_agent(tmp_path / "a", "ada", tmp_path / "ada.tar")
    async with live_server(tmp_path / "b") as url, client(url) as http:
        r = await http.post("/v1/agents/ada/import", content=(tmp_path / "ada.tar").read_bytes())
        assert r.status_code == 201, r.text
    assert list(uploads.iterdir()) == [], "the upload removed, the abandoned one swept"
    assert not list((tmp_path / "b").glob(".tmp-import-*")), "nothing staged is left in the cache directory"
