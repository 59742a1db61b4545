"""``semantic serve``: the HTTP server (Anthropic, OpenAI and agent APIs)."""

from __future__ import annotations

import argparse
import re
import sys
import time

from semantic.runtime.errors import SemanticError

EMBEDDED_MAX_TOKENS = 1024  # Claude Code asks for 32000; a 135M model that never stops would hold a request minutes
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
_SECONDS = {"s": 1, "m": 60, "min": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_bytes(text: str) -> int:
    """``4096``, ``512M``, ``8GiB``, ``2g`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 4096, 512M or 8G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_positive_bytes(text: str) -> int:
    """``parse_bytes``, refusing 0."""
    n = parse_bytes(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 bytes, not {text!r}")
    return n


def parse_positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {text!r}")
    return n


def parse_duration(text: str) -> float:
    """``7d``, ``12h``, ``30m``, ``90s``, ``2w``, ``3600`` (seconds) -> seconds, more than 0."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*(s|m|min|h|d|w)?\s*", text, re.I)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 7d, 12h or 30m)")
    seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"must be longer than 0, not {text!r}")
    return seconds


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="serve the Anthropic, OpenAI and agent HTTP APIs")
    p.add_argument("--model", action="append", metavar="[NAME=]MODEL",
                   help="'smollm2' (embedded, default), a local mlx-lm model directory, or a Hugging Face repo id; "
                        "NAME= names it for requests. Repeat it to serve several: a request's 'model' picks one "
                        "(the first is loaded at start, and serves requests that name none)")
    p.add_argument("--model-idle", type=parse_duration, metavar="DURATION",
                   help="unload the model after this long without turns, e.g. 10m (default: never); "
                        "the next turn loads it again")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one)")
    p.add_argument("--cache-dir", help="where agents' caches and histories live (default ~/.cache/semantic/agents)")
    p.add_argument("--budget", type=parse_bytes, help="bytes of hot KV cache, e.g. 2G (default: memory less weights)")
    p.add_argument("--kv-bits", type=int, choices=(4, 8, 16), default=4,
                   help="quantize agents' KV caches to 4 (default) or 8 bits, or keep them as the model computes "
                        "them (16: full precision); each setting keeps its own cache files")
    p.add_argument("--disk-budget", type=parse_positive_bytes, metavar="BYTES",
                   help="bytes the cache directory may hold, e.g. 20G; the least recently used caches go first "
                        "(default: half of its size plus its filesystem's free space at start-up)")
    p.add_argument("--conversation-ttl", type=parse_duration, default=7 * 86400, metavar="DURATION",
                   help="remove anonymous conversations (conv-* agents) unused this long, e.g. 7d, 12h, 30m "
                        "(default 7d)")
    p.add_argument("--decode-rows", type=parse_positive_int, metavar="N",
                   help="the most token slots of a decode forward (default 8); more decoding agents take more "
                        "forwards. Which counts up to N leave a reply unchanged by its neighbours is measured when "
                        "the model loads and shown by /health (docs/architecture.md)")
    p.add_argument("--speculation", choices=("on", "off"), default="on",
                   help="decoding agents verify drafts from their own history in the same forwards, which changes "
                        "no reply (default on; docs/architecture.md)")
    p.add_argument("--api-key", help="require this key (x-api-key or 'Authorization: Bearer'); default: none")
    p.add_argument("--backend", choices=("trio", "asyncio"), default="trio", help="event loop (default trio)")
    p.add_argument("--max-tokens-cap", type=int, metavar="N",
                   help="clamp a request's max_tokens to N; the reply then stops with max_tokens "
                        f"(default: {EMBEDDED_MAX_TOKENS} on the embedded model, else the model's context length)")
    p.add_argument("--max-body-bytes", type=parse_bytes, default=32 << 20,
                   help="largest request body (default 32M)")
    p.add_argument("--distributed", action="store_true",
                   help="run under mlx.launch: the model is sharded over the ranks (tensor parallel); rank 0 "
                        "serves HTTP, the others follow it (docs/scaling.md)")
    p.add_argument("--rank-timeout", type=parse_duration, default=120, metavar="DURATION",
                   help="with --distributed: end the group when one engine step waits this long for the other ranks "
                        "(a rank died), e.g. 2m (default 2m)")


def run(args: argparse.Namespace) -> int:
    import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
    from semantic.runtime.store import disk
    from semantic.runtime.model import embedded
    from semantic.runtime.model.models import catalogue, resolve
    from semantic.runtime.paths import agents_dir, usable_dir
    from semantic.web.app import ServerConfig
    from semantic.web.server import bind, run as run_server

    cache_dir = usable_dir(args.cache_dir or agents_dir())
    first, *more = args.model or [embedded.NAME]
    group = _join_group() if args.distributed else None
    if group is not None and group.rank() != 0:
        return _follow(args, group, cache_dir, first, more)
    disk_budget = args.disk_budget or disk.default_budget(cache_dir)
    try:
        models = catalogue([first, *more])
        config = ServerConfig(model=first, models=tuple(more), model_idle_s=args.model_idle, cache_dir=cache_dir,
                              budget=args.budget, engine=_engine_options(args), api_key=args.api_key,
                              max_tokens_cap=args.max_tokens_cap or _default_cap(models),
                              max_body_bytes=args.max_body_bytes,
                              disk_budget=disk_budget, conversation_ttl_s=args.conversation_ttl,
                              runtime_options=_runtime_options(args, group))
    except ValueError as e:
        raise SemanticError(str(e)) from None
    sock = bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}"
    say(f"caches in {cache_dir}: disk budget {disk.human_bytes(disk_budget)}; "
        f"anonymous conversations unused for {disk.human_duration(args.conversation_ttl)} are removed")
    for name, source in models.items():  # a model that is not there is refused now, not at its first request
        say(f"preparing {name} ...")
        resolve(source, progress=True)  # the embedded model is converted once, with a progress bar
    _other_layouts(cache_dir, first, args.kv_bits, group.size() if group is not None else 1)
    say(f"loading {next(iter(models))} ...")
    t0 = time.perf_counter()

    def ready(rt) -> None:
        key = "<your --api-key>" if args.api_key else "none"
        choice = f" (requests choose among {', '.join(rt.models)} by 'model')" if len(rt.models) > 1 else ""
        say(f"{rt.model} loaded in {time.perf_counter() - t0:.1f} s{choice}; listening on {url} -- "
            f"Claude Code: ANTHROPIC_BASE_URL={url} ANTHROPIC_API_KEY={key} claude -- "
            f"OpenAI SDK: OpenAI(base_url=\"{url}/v1\", api_key=\"{key}\") -- Ctrl-C stops")

    run_server(config, sock, backend=args.backend, on_ready=ready)
    say("stopped; caches are on disk")
    return 0


def _engine_options(args: argparse.Namespace):
    """The engine's settings the flags choose (the runtime's defaults for the rest)."""
    from semantic.runtime.engine.engine import DECODE_ROWS
    from semantic.runtime.engine.engine_options import EngineOptions

    return EngineOptions(kv_bits=args.kv_bits, decode_rows=args.decode_rows or DECODE_ROWS,
                         speculation=args.speculation == "on")


def _runtime_options(args: argparse.Namespace, group) -> dict:
    """More ``Runtime.open`` keywords: the group this is rank 0 of."""
    return {} if group is None else {"group": group, "rank_timeout_s": args.rank_timeout}


def _other_layouts(cache_dir, model: str, kv_bits: int, ranks: int) -> None:
    """Say so when the cache directory holds this model's caches of another layout:
    they are not read here (each layout keeps its own files)."""
    from pathlib import Path

    from semantic.runtime.memory.model_caches import cache_layouts

    def layout(n: int) -> str:
        return "one process" if n == 1 else f"{n} ranks"

    for n in sorted(cache_layouts(Path(cache_dir), model, kv_bits) - {ranks}):
        say(f"note: {cache_dir} holds caches of {model} kept by {layout(n)}; this server runs it on {layout(ranks)}, "
            f"so those agents start cold here (serve them with that layout to use them)")


def _join_group():
    """This process's group under ``mlx.launch``; SemanticError when it was not launched so."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() < 2:
        raise SemanticError("--distributed runs under mlx.launch, one process per rank, e.g. "
                            "'mlx.launch --backend ring -n 3 semantic serve --distributed' (docs/scaling.md)")
    return group


def _follow(args: argparse.Namespace, group, cache_dir, first: str, more: list[str]) -> int:
    """A rank other than 0: no HTTP; it follows rank 0 until rank 0 stops."""
    import signal

    from semantic.actors.runtime import Runtime

    # Ctrl-C reaches every rank of mlx.launch: rank 0 stops the group, in order.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    say(f"rank {group.rank()} of {group.size()}: following rank 0")
    Runtime.follow(group, first, cache_dir, args.budget, models=more, engine=_engine_options(args))
    say(f"rank {group.rank()} stopped; its caches are on disk")
    return 0


def _default_cap(models: dict) -> int | None:
    from semantic.runtime.model.embedded import NAME

    return EMBEDDED_MAX_TOKENS if NAME in models.values() else None  # a 135M model that never stops


def say(line: str) -> None:
    print(f"semantic: {line}", file=sys.stdout, flush=True)
