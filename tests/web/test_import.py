"""``POST /v1/agents/{id}/import``: an agent exported from one server goes on,
warm, on another that is running -- its stateless client included -- and a
bad or unwanted archive is a clear 4xx that changes nothing."""

from __future__ import annotations

import anyio
import pytest

from semantic.actors.archive import export_agent

from .live import client, live_server, tiny_loaded

pytestmark = pytest.mark.anyio

SYSTEM = "You are terse."
KEY = {"x-api-key": "k"}


@pytest.fixture(scope="module", autouse=True)
def _model():
    tiny_loaded()


async def raw_request(url: str, line: str, headers: dict) -> bytes:
    """A request whose body never comes (as no HTTP client library sends it): what the server answers."""
    host, port = url.removeprefix("http://").split(":")
    async with await anyio.connect_tcp(host, int(port)) as sock:
        head = "".join(f"{k}: {v}\r\n" for k, v in {"host": host, **headers}.items())
        await sock.send(f"{line} HTTP/1.1\r\n{head}\r\n".encode())
        answer = b""
        with anyio.fail_after(30):
            while not answer.endswith(b"}}"):
                answer += await sock.receive()
        return answer


@pytest.mark.slow
async def test_an_agent_imported_into_a_running_server_goes_on_warm(tmp_path):
    session = {"X-Claude-Code-Session-Id": "s-1"}
    chat = [{"role": "user", "content": "Hello there"}]
    async with live_server(tmp_path / "a") as url, client(url) as http:  # the server it leaves
        await http.post("/v1/agents", json={"id": "ada", "system": SYSTEM})
        first = (await http.post("/v1/agents/ada/messages", json={"content": "Hi", "max_tokens": 8})).json()
        r = await http.post("/v1/messages", headers=session,
                            json={"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": chat})
        chat += [{"role": "assistant", "content": r.json()["content"][0]["text"]},
                 {"role": "user", "content": "And then?"}]
        conversation = r.headers["x-agent-id"]
    export_agent(tmp_path / "a", "ada", tmp_path / "ada.tar")
    export_agent(tmp_path / "a", conversation, tmp_path / "conv.tar")
    archive = (tmp_path / "ada.tar").read_bytes()

    # the server it goes to runs already; its body limit does not apply to an archive
    async with live_server(tmp_path / "b", api_key="k", max_body_bytes=1024, body_timeout_s=1) as url, \
            client(url, **KEY) as http:
        assert len(archive) > 1024
        r = await http.post("/v1/agents/ada/import", content=archive)
        assert r.status_code == 201, r.text
        body = r.json()
        assert body["id"] == "ada" and body["system"] == SYSTEM and body["messages"] == 3
        assert body["imported"]["caches"] == [{"model": "tiny", "tokens": first["usage"]["prompt_tokens"]
                                               + first["usage"]["output_tokens"] - 1}]
        turn = (await http.post("/v1/agents/ada/messages", json={"content": "More", "max_tokens": 8})).json()
        assert turn["usage"]["reused_tokens"] >= first["usage"]["prompt_tokens"]  # warm: from the files moved

        # a stateless client's conversation: found by its content at once, no restart
        r = await http.post(f"/v1/agents/{conversation}/import", content=(tmp_path / "conv.tar").read_bytes())
        assert r.status_code == 201, r.text
        r = await http.post("/v1/messages", headers=session,
                            json={"model": "m", "max_tokens": 8, "system": SYSTEM, "messages": chat})
        assert r.headers["x-agent-id"] == conversation and r.json()["usage"]["cache_read_input_tokens"] > 0

        async def refused(status: int, path: str, content: bytes, needle: str, **headers) -> None:
            r = await http.post(path, content=content, headers=headers)
            assert r.status_code == status and needle in r.json()["error"]["message"], r.text

        await refused(409, "/v1/agents/ada/import", archive, "agent 'ada' exists on this server; delete it first")
        assert (await http.delete("/v1/agents/ada")).status_code == 200
        assert (await http.post("/v1/agents/ada/import", content=archive)).status_code == 201  # replaced
        await refused(400, "/v1/agents/bo/import", archive, "the archive holds agent 'ada', not 'bo'")
        await refused(400, "/v1/agents/bo/import", b"not a tar" * 200, "the archive is not a whole tar archive")
        await refused(400, "/v1/agents/bo/import", archive[: len(archive) // 2], "the archive is not a whole tar")
        await refused(400, "/v1/agents/.bo/import", archive, "agent id may not start with '.'")
        await refused(401, "/v1/agents/bo/import", archive, "invalid or missing API key", **{"x-api-key": "no"})
        head = await raw_request(url, "POST /v1/agents/bo/import", {"x-api-key": "k", "content-length": 1 << 60})
        assert head.startswith(b"HTTP/1.1 507") and b"no room for the archive" in head, head  # before any byte
        head = await raw_request(url, "POST /v1/agents/bo/import", {"x-api-key": "k", "content-length": 100})
        assert head.startswith(b"HTTP/1.1 408") and b"the archive stopped arriving for 1 s" in head, head
        assert (await http.get("/v1/agents/bo")).status_code == 404
        assert not list((tmp_path / "b").glob(".tmp-*"))  # no upload or unpacked archive left behind

    # a server of another model: the history moves; the cache, kept per model, waits unused (cold there)
    async with live_server(tmp_path / "c", model=tiny_loaded(1)) as url, client(url) as http:
        r = await http.post("/v1/agents/ada/import", content=archive)
        assert r.status_code == 201 and r.json()["messages"] == 3 and r.json()["tier"] is None, r.text
        turn = await http.post("/v1/agents/ada/messages", json={"content": "More", "max_tokens": 8})
        assert turn.status_code == 200 and turn.json()["usage"]["reused_tokens"] == 0, turn.text
