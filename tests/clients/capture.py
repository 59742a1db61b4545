"""A capturing HTTP proxy: what does a real client send?

Logs each request (method, path with query string, headers, JSON body) as one
JSON line, then either forwards it to a real server (``--upstream``) and
streams the answer back, or -- for ``POST /v1/responses``, or everything
without an upstream -- answers a minimal valid reply itself: a Responses-API
SSE stream, or an Anthropic message. Used to record the fixtures in
``tests/web/data/`` from Claude Code and Codex:

    python -m tests.clients.capture --port 9000 --log requests.jsonl \\
        [--upstream http://127.0.0.1:8000] [--reply "OK."]

Standard library only; one thread per connection; HTTP/1.0 replies (the body
ends when the connection closes), which every client here accepts.
"""

from __future__ import annotations

import argparse
import http.client
import itertools
import json
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

__all__ = ["CaptureServer", "responses_sse"]

_ids = itertools.count(1)


def responses_sse(body: dict, text: str) -> bytes:
    """A minimal Responses-API stream answering ``body`` with ``text`` (what Codex accepts)."""
    n = next(_ids)
    rid, mid = f"resp_{n:04d}", f"msg_{n:04d}"
    words = max(1, len(text.split()))
    usage = {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": words, "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": 100 + words,
    }
    base = {"id": rid, "object": "response", "created_at": int(time.time()), "model": body.get("model", "m"),
            "output": [], "status": "in_progress"}
    item = {"type": "message", "id": mid, "role": "assistant", "status": "in_progress", "content": []}
    done_item = dict(item, status="completed",
                     content=[{"type": "output_text", "text": text, "annotations": []}])
    events = [
        ("response.created", {"response": base}),
        ("response.in_progress", {"response": base}),
        ("response.output_item.added", {"output_index": 0, "item": item}),
        ("response.content_part.added", {"item_id": mid, "output_index": 0, "content_index": 0,
                                         "part": {"type": "output_text", "text": "", "annotations": []}}),
        ("response.output_text.delta", {"item_id": mid, "output_index": 0, "content_index": 0, "delta": text}),
        ("response.output_text.done", {"item_id": mid, "output_index": 0, "content_index": 0, "text": text}),
        ("response.content_part.done", {"item_id": mid, "output_index": 0, "content_index": 0,
                                        "part": {"type": "output_text", "text": text, "annotations": []}}),
        ("response.output_item.done", {"output_index": 0, "item": done_item}),
        ("response.completed", {"response": dict(base, status="completed", output=[done_item], usage=usage)}),
    ]
    out = []
    for seq, (name, data) in enumerate(events):
        out.append(f"event: {name}\ndata: {json.dumps(dict(type=name, sequence_number=seq, **data))}\n\n")
    return "".join(out).encode()


def anthropic_message(body: dict, text: str) -> dict:
    return {
        "id": f"msg_{next(_ids):04d}", "type": "message", "role": "assistant", "model": body.get("model", "m"),
        "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 100, "output_tokens": 2, "cache_read_input_tokens": 0,
                  "cache_creation_input_tokens": 0},
    }


def anthropic_sse(body: dict, text: str) -> bytes:
    msg = anthropic_message(body, text)
    start = dict(msg, content=[], stop_reason=None)
    events = [
        ("message_start", {"message": start}),
        ("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}}),
        ("content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": text}}),
        ("content_block_stop", {"index": 0}),
        ("message_delta", {"delta": {"stop_reason": "end_turn", "stop_sequence": None}, "usage": msg["usage"]}),
        ("message_stop", {}),
    ]
    return "".join(f"event: {n}\ndata: {json.dumps(dict(type=n, **d))}\n\n" for n, d in events).encode()


class CaptureServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, port: int, log_path: str | None, upstream: str | None, reply: str = "OK."):
        super().__init__(("127.0.0.1", port), _Handler)
        self.log_path, self.upstream, self.reply = log_path, upstream, reply
        self.records: list[dict] = []
        self.lock = threading.Lock()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def record(self, entry: dict) -> None:
        with self.lock:
            self.records.append(entry)
            if self.log_path:
                with open(self.log_path, "a") as f:
                    f.write(json.dumps(entry) + "\n")


class _Handler(BaseHTTPRequestHandler):
    server: CaptureServer

    def log_message(self, *args):  # quiet
        pass

    def _handle(self):
        length = int(self.headers.get("content-length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = {"_raw": raw.decode("utf-8", "replace")}
        entry = {"t": time.time(), "method": self.command, "path": self.path,
                 "headers": {k.lower(): v for k, v in self.headers.items()}, "body": body}
        path = urllib.parse.urlsplit(self.path).path
        if self.server.upstream and not path.endswith("/responses"):
            entry["status"] = self._forward(raw)
        else:
            entry["status"] = self._answer(path, body or {})
        self.server.record(entry)

    do_GET = do_POST = do_PUT = do_DELETE = do_HEAD = _handle

    def _answer(self, path: str, body: dict) -> int:
        if path.endswith("/responses"):
            data, ctype = responses_sse(body, self.server.reply), "text/event-stream"
        elif path.endswith("/messages") and body.get("stream"):
            data, ctype = anthropic_sse(body, self.server.reply), "text/event-stream"
        elif path.endswith("/messages"):
            data, ctype = json.dumps(anthropic_message(body, self.server.reply)).encode(), "application/json"
        else:
            data, ctype = b'{"data": []}', "application/json"
        self.send_response(200)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        return 200

    def _forward(self, raw: bytes) -> int:
        up = urllib.parse.urlsplit(self.server.upstream)
        conn = http.client.HTTPConnection(up.hostname, up.port, timeout=600)
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() not in ("host", "connection", "content-length", "accept-encoding")}
        headers["content-length"] = str(len(raw))
        conn.request(self.command, self.path, body=raw, headers=headers)
        resp = conn.getresponse()
        self.send_response(resp.status)
        for k, v in resp.getheaders():
            if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                self.send_header(k, v)
        self.end_headers()
        while chunk := resp.read1(65536):
            self.wfile.write(chunk)
            self.wfile.flush()
        conn.close()
        return resp.status


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--log", help="append one JSON line per request here")
    p.add_argument("--upstream", help="forward everything but /v1/responses to this base URL")
    p.add_argument("--reply", default="OK.", help="the text of replies answered here")
    args = p.parse_args()
    server = CaptureServer(args.port, args.log, args.upstream, args.reply)
    print(server.url, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
