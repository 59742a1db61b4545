"""The two servers behind ``semantic bench compare``: ours (``semantic serve``)
and the peer (``mlx_lm.server``), each a subprocess on a free loopback port
with its own temporary cache directory.

Both compute with the same weights in the same precision and the same BLAS:

* on the CPU, ours dequantizes the model to float32 at load; the peer gets a
  float32 mlx-lm model directory written from those very weights
  (``write_float32``, with mlx-lm's own ``save``) -- on Metal it gets the
  model directory ours loads, unchanged;
* the peer is started through ``python -m semantic.bench.servers peer ...``, which
  activates the fast BLAS exactly as ``runtime`` does (before MLX is
  imported) and then runs ``mlx_lm.server``'s own ``main`` -- nothing of
  mlx-lm is patched.

Processes start in their own session, so a Ctrl-C in the terminal reaches
the benchmark (which stops them in order) and not the servers directly;
``Server.stop`` sends SIGINT to ours (it flushes its caches to disk) and
SIGTERM to the peer, then SIGTERM, then SIGKILL, to the process group it created.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

__all__ = ["Server", "ServerSpec", "free_port", "ours_spec", "peer_spec", "write_float32", "process_memory"]

ROOT = Path(__file__).resolve().parent.parent  # the repository (for ``python -m``)
PEER_CACHE_SIZE_DEFAULT = 10  # mlx_lm.server --prompt-cache-size default (0.32.2)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerSpec:
    """How to start one server: ``argv`` with ``{port}`` filled in at start."""

    name: str  # "semantic", "mlx_lm.server", "mlx_lm.server --kv-bits 4"
    argv: list[str]
    ready_path: str  # GET until it answers: /health (ours), /v1/models (peer)
    body_model: str | None = None  # "model" in request bodies (None: left out)
    env: dict = field(default_factory=dict)
    settings: dict = field(default_factory=dict)  # reported in the JSON
    # SIGINT for ours (it writes every hot cache to disk, then exits); SIGTERM for the
    # peer, whose SIGINT handler calls httpd.shutdown() on the serving thread and hangs.
    stop_signal: int = signal.SIGINT


def ours_spec(model: str, cache_dir: Path, *, stand_in: str | None = None, budget: int | None = None,
              decode_rows: int | None = None) -> ServerSpec:
    """``semantic serve``; with ``stand_in`` (a model directory) mlx_lm.server
    plays our part instead -- for developing the harness before ``serve`` exists."""
    if stand_in is not None:
        spec = peer_spec(stand_in, cache_dir)
        spec.name = "semantic (stand-in: mlx_lm.server)"
        return spec
    argv = [sys.executable, "-m", "semantic.cli.main", "serve", "--model", model, "--host", "127.0.0.1",
            "--port", "{port}", "--cache-dir", str(cache_dir)]
    if budget is not None:
        argv += ["--budget", str(budget)]
    if decode_rows is not None:
        argv += ["--decode-rows", str(decode_rows)]
    settings = {"model": model, "budget": budget, "decode_rows": decode_rows}
    return ServerSpec("semantic", argv, "/health", settings=settings)


def peer_spec(model_dir: str, cache_dir: Path, *, kv_bits: int | None = None,
              prompt_cache_size: int | None = None) -> ServerSpec:
    argv = [sys.executable, "-m", "semantic.bench.servers", "peer", "--model", model_dir, "--host", "127.0.0.1",
            "--port", "{port}", "--log-level", "WARNING"]
    if kv_bits is not None:
        argv += ["--kv-bits", str(kv_bits)]
    if prompt_cache_size is not None:
        argv += ["--prompt-cache-size", str(prompt_cache_size)]
    name = "mlx_lm.server" + (f" --kv-bits {kv_bits}" if kv_bits else "")
    # The peer has nothing on disk; HF_HOME keeps its hub scans inside the temp dir.
    env = {"HF_HOME": str(cache_dir / "hf"), "HF_HUB_OFFLINE": "1"}
    settings = {
        "prompt_cache_size": prompt_cache_size or PEER_CACHE_SIZE_DEFAULT,
        "prompt_cache_bytes": None,
        "kv_bits": kv_bits,
        "batching": kv_bits is None,  # mlx_lm.server serves one request at a time with --kv-bits
    }
    return ServerSpec(name, argv, "/v1/models", body_model=None, env=env, settings=settings,
                      stop_signal=signal.SIGTERM)


class Server:
    """One running server process; ``start``/``stop``/``restart``; always stopped on exit."""

    def __init__(self, spec: ServerSpec, log_path: Path):
        self.spec = spec
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0
        self.starts: list[float] = []  # seconds from spawn to ready, per start

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def start(self, timeout: float = 300.0) -> None:
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.spec.argv]
        env = {**os.environ, **self.spec.env, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
        log = open(self.log_path, "ab")
        log.write(f"\n--- start: {' '.join(argv)}\n".encode())
        log.flush()
        began = time.perf_counter()
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=5.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.spec.name} exited with {self.proc.returncode} while starting; "
                                       f"see {self.log_path.name}:\n{self.tail()}")
                try:
                    r = client.get(self.url + self.spec.ready_path)
                    if r.status_code < 500:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"{self.spec.name} was not ready after {timeout:.0f} s:\n{self.tail()}")
                time.sleep(0.2)
        self.starts.append(time.perf_counter() - began)

    def stop(self, timeout: float = 60.0) -> None:
        """The spec's stop signal (ours: SIGINT, graceful), then SIGTERM, then SIGKILL, to the group."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig, wait in ((self.spec.stop_signal, timeout), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, sig)
            try:
                proc.wait(wait)
                break
            except subprocess.TimeoutExpired:
                continue
        # Children the server left in its group (none expected).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)

    def restart(self) -> None:
        self.stop()
        self.start()

    def memory(self) -> dict:
        return process_memory(self.pid) if self.pid else {}

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in task.read_text().split()]
    return out


def process_memory(pid: int) -> dict:
    """VmRSS and VmHWM in bytes, of the process and its children together (Linux
    /proc; elsewhere an empty dict)."""
    total = {"rss_bytes": 0, "hwm_bytes": 0, "processes": 0}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                total["rss_bytes" if key == "VmRSS" else "hwm_bytes"] += int(value.split()[0]) * 1024
        total["processes"] += 1
        todo += _children(p)
    return total if total["processes"] else {}


# --- run in a subprocess: python -m semantic.bench.servers ... -------------------------


def write_float32(model: str, out: Path) -> Path:
    """Write the weights ours computes with (runtime.model.models.load: float32 on the
    CPU) as an mlx-lm model directory the peer can load."""
    import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
    from mlx_lm.utils import save

    from semantic.runtime.model.models import load

    loaded = load(model, progress=False)
    config = {k: v for k, v in loaded.config.items() if k not in ("quantization", "quantization_config")}
    config["torch_dtype"] = "float32"
    save(out, loaded.path, loaded.model, loaded.tokenizer, config, donate_model=True)
    return out


def peer_dir(model: str, out: Path) -> str:
    """What the peer loads: on the CPU, the float32 weights we compute with
    (written to ``out``); on Metal, the same model directory ours loads."""
    code = (
        "import semantic.runtime, mlx.core as mx, sys; from semantic.runtime.model.models import resolve; "
        "print('cpu' if mx.default_device() == mx.cpu else resolve(sys.argv[1], progress=False))"
    )
    where = subprocess.run([sys.executable, "-c", code, model], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.strip().splitlines()[-1]
    if where != "cpu":
        return where
    subprocess.run([sys.executable, "-m", "semantic.bench.servers", "write-float32", model, str(out)], cwd=ROOT,
                   check=True, capture_output=True)
    return str(out)


def _peer_main(argv: list[str]) -> None:
    import semantic.runtime  # noqa: F401  (the same fast BLAS as ours, before mlx is imported)
    from mlx_lm.server import main

    sys.argv = ["mlx_lm.server", *argv]
    main()


if __name__ == "__main__":
    if sys.argv[1] == "peer":
        _peer_main(sys.argv[2:])
    elif sys.argv[1] == "write-float32":
        print(write_float32(sys.argv[2], Path(sys.argv[3])))
    else:
        raise SystemExit("usage: python -m semantic.bench.servers peer ARGS... | write-float32 MODEL OUT")
