"""``semantic``: run, inspect and measure Semantic from the command line.

Each subcommand imports what it needs when it runs, so ``--help`` is instant.
A user error prints one line and exits 2; no tracebacks for things a user can fix.
"""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="smollm2",
        help="'smollm2' (embedded, default), a local mlx-lm model directory, or a Hugging Face repo id",
    )


def _add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", action="store_true", help=f"print {what} as one JSON object")


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(
        prog="semantic",
        description="Many LLM agents on one machine, each with a persistent 4-bit KV cache.",
    )
    sub = top.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("doctor", help="check the device, BLAS speed and embedded model")
    _add_json(p, "the report")

    p = sub.add_parser("prepare", help="prepare a model once (the embedded one by default)")
    _add_model(p)

    p = sub.add_parser("generate", help="stream one reply to a prompt")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", help="a system prompt")
    _add_model(p)
    p.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate (default 256)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default 1.0 = off)")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling")

    from .serve import parse_bytes, parse_duration, parse_positive_int  # argparse only: cheap

    cache = sub.add_parser("cache", help="agents' cache files on disk: ls, verify, rm, du, prune, export, import")
    cache.add_argument("--cache-dir", help="where agent caches live (default ~/.cache/semantic/agents)")
    actions = cache.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = actions.add_parser("ls", help="list agents on disk: agent, model, tokens, bytes, tier, last use")
    _add_json(p, "the list")
    actions.add_parser("verify", help="check every cache file in full (exit 1 if any is bad)")
    p = actions.add_parser("rm", help="delete an agent: its cache files and its history")
    p.add_argument("agent")
    p.add_argument("--model", help="only this model's cache; the history stays (default: every model and the history)")
    actions.add_parser("du", help="disk use per model")
    p = actions.add_parser("prune", help="remove old caches and conversations, or least recently used caches to fit")
    p.add_argument("--older-than", type=parse_duration, metavar="DURATION",
                   help="remove cache files not used for this long (e.g. 30d), and conv-* agents unused this long "
                        "with their history")
    p.add_argument("--to", type=parse_bytes, metavar="BYTES",
                   help="then remove quarantined files and the least recently used caches until the directory "
                        "holds at most this much (e.g. 10G)")
    p.add_argument("--dry-run", action="store_true", help="only say what would be removed")
    p = actions.add_parser("export", help="write an agent (its history and its cache for every model) to one archive, "
                                          "to move it to another server (docs/scaling.md)")
    p.add_argument("agent")
    p.add_argument("-o", "--output", required=True, metavar="FILE", help="the archive to write (a tar)")
    p = actions.add_parser("import", help="put an agent from an archive of 'cache export' into the cache directory, "
                                          "checked first (the server on it stopped; a running one: docs/scaling.md)")
    p.add_argument("archive", metavar="FILE")
    p.add_argument("--replace", action="store_true", help="replace the agent if the directory holds one of its id")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True, metavar="BENCH")
    p = bench.add_parser("model", help="prefill and decode tokens/s of one sequence (median of runs)")
    _add_model(p)
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--runs", type=int, default=3)
    _add_json(p, "the results")

    p = bench.add_parser("batch", help="batched Q4 decode vs mlx-lm's BatchGenerator at batch 1, 2, 4, 8")
    _add_model(p)
    p.add_argument("--context", type=int, default=1024, help="tokens of context per sequence (default 1024)")
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (< 5 minutes on 2 cores)")
    p.add_argument("--decode-rows", type=parse_positive_int, metavar="N",
                   help="token slots of our decode forwards (default: the engine's, 8)")
    _add_json(p, "the results")

    p = bench.add_parser("ttft", help="time to first token: cold vs hot (memory) vs warm (disk, fresh process)")
    _add_model(p)
    p.add_argument("--contexts", help="comma-separated context lengths (default 1024,2048,4096,8192)")
    p.add_argument("--repeats", type=int, default=3, help="runs per context; medians are reported (default 3)")
    p.add_argument("--quick", action="store_true", help="contexts 1024,2048,4096")
    _add_json(p, "the results")

    p = bench.add_parser("concurrency",
                         help="agents at once through the actor runtime: throughput, TTFT, loop lateness")
    _add_model(p)
    p.add_argument("--context", type=int, help="prompt tokens per agent (default 1024; --quick 256)")
    p.add_argument("--tokens", type=int, help="tokens each agent generates (default 128; --quick 64)")
    p.add_argument("--repeats", type=int, help="rounds; medians are reported (default 3)")
    p.add_argument("--backend", choices=("asyncio", "trio"), default="asyncio", help="event loop (default asyncio)")
    p.add_argument("--quick", action="store_true", help="256-token prompts, 64 tokens each (a few minutes on 2 cores)")
    _add_json(p, "the results")

    p = bench.add_parser("soak", help="many agents over a long run: memory and disk stay in budget, no turn fails")
    _add_model(p)
    p.add_argument("--agents", type=int, default=300, help="agents, 3 turns each (default 300)")
    p.add_argument("--concurrency", type=int, default=8, help="agents taking turns at once (default 8)")
    p.add_argument("--hot-agents", type=int, default=10,
                   help="the KV budget holds this many agents, the turns in progress among them (default 10)")
    p.add_argument("--tokens", type=int, default=8, help="tokens per reply (default 8)")
    _add_json(p, "the results")

    p = bench.add_parser("overlap", help="a warm load and a large write while another agent decodes: its step time")
    _add_model(p)
    p.add_argument("--context", type=int, default=4096, help="tokens of the cache loaded and written (default 4096)")
    p.add_argument("--tokens", type=int, default=48, help="tokens the decoding agent generates (default 48)")
    p.add_argument("--rounds", type=int, default=10, help="rounds; medians are reported (default 10)")
    _add_json(p, "the results")

    p = bench.add_parser("structured", help="what a JSON-schema grammar costs a decode step, against free decoding")
    _add_model(p)
    p.add_argument("--batch", type=parse_positive_int, nargs="+", default=[1, 8], help="agents at once (default 1 8)")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per round (default 24)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each, alternating (default 3)")
    p.add_argument("--parse", action="store_true",
                   help="instead: the openai SDK's chat.completions.parse with five Pydantic models against a "
                        "semantic serve: replies parsed per model, and what each miss was (needs openai)")
    p.add_argument("--tries", type=parse_positive_int, default=20, help="--parse: tries per model (default 20)")
    p.add_argument("--max-tokens", type=parse_positive_int, default=300,
                   help="--parse: max_tokens of each reply (default 300)")
    p.add_argument("--asks", choices=("extract", "describe"), default="extract",
                   help="--parse: extract each object from a short text (default), or only name the thing")
    _add_json(p, "the results")

    p = bench.add_parser("fidelity", help="perplexity through the KV cache at 16, 8 and 4 bits, and after a restart")
    _add_model(p)
    p.add_argument("--text", nargs="+", metavar="FILE",
                   help="texts to score (default: an English text and a Python module, shipped)")
    p.add_argument("--tokens", type=parse_positive_int, default=4096, help="most tokens of each text (default 4096)")
    _add_json(p, "the results")

    p = bench.add_parser("attention", help="a long agent's decode: its past read from a float copy or packed")
    _add_model(p)
    p.add_argument("--contexts", default="1024,4096,16384,32768,65536",
                   help="keys of one layer's attention, comma-separated (default 1024,4096,16384,32768,65536)")
    p.add_argument("--chunk-keys", type=parse_positive_int, default=8192,
                   help="keys a prompt chunk attends over (default 8192)")
    p.add_argument("--chunk-rows", default="1,4,8,16,64,256",
                   help="a prompt chunk's rows, comma-separated (default 1,4,8,16,64,256)")
    p.add_argument("--engine-contexts", default="4096,16384,32768",
                   help="tokens of the agent the engine decodes, comma-separated (default 4096,16384,32768)")
    p.add_argument("--tokens", type=parse_positive_int, default=16, help="tokens decoded at each (default 16)")
    p.add_argument("--rounds", type=parse_positive_int, default=9, help="rounds of each layer timing (default 9)")
    _add_json(p, "the results")

    p = bench.add_parser("speculation", help="decode tokens/s with speculation (drafts from history) on vs off")
    _add_model(p)
    p.add_argument("--quick", action="store_true", help="2 rounds (about 8 minutes on 2 cores)")
    p.add_argument("--rounds", type=parse_positive_int,
                   help="rounds of each, alternating (default 3; --quick 2); shorter workloads take more")
    p.add_argument("--peer", action="store_true",
                   help="also `semantic serve` against mlx_lm.server over HTTP on the same workloads")
    _add_json(p, "the results")

    p = bench.add_parser("sharded", help="decode with the model sharded over ranks (mlx.launch) vs one process")
    _add_model(p)
    p.add_argument("--ranks", type=int, default=3, help="processes the model is sharded over (default 3)")
    p.add_argument("--context", type=int, default=512, help="tokens of context per sequence (default 512)")
    p.add_argument("--quick", action="store_true", help="fewer steps and repeats (a few minutes on 2 cores)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank, under mlx.launch
    p.add_argument("--steps", type=int, default=24, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3, help=argparse.SUPPRESS)
    _add_json(p, "the results")

    p = bench.add_parser("compare", help="`semantic serve` against mlx_lm.server over HTTP, side by side")
    _add_model(p)
    p.add_argument("--quick", action="store_true", help="a reduced set (< 10 minutes on 2 cores; full run < 45)")
    p.add_argument("--out", default="docs/benchmarks", help="where the JSON, Markdown table and PNG plots go "
                   "(default docs/benchmarks)")
    p.add_argument("--only", metavar="W[,W]", help="only these workloads: multi-turn, restart, many-agents, "
                   "concurrency, memory, long-context (default: all but long-context)")
    p.add_argument("--long-contexts", type=lambda t: tuple(map(parse_positive_int, t.split(","))), metavar="N[,N]",
                   help="long-context's contexts in tokens (default 8192,16384,32768; 65536 too without --quick)")
    p.add_argument("--decode-rows", type=parse_positive_int, metavar="N",
                   help="run ours with 'semantic serve --decode-rows N' (default: serve's default)")
    p.add_argument("--stand-in", action="store_true", help=argparse.SUPPRESS)  # mlx_lm.server plays ours too
    _add_json(p, "the results (only that on stdout; progress goes to stderr)")

    from .serve import add_parser as add_serve_parser  # argparse only: cheap

    add_serve_parser(sub)

    from semantic.scenarios.cli import add_parser as add_scenario_parser  # argparse only: cheap

    add_scenario_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    from semantic.runtime.errors import SemanticError

    try:
        return _run(args)
    except SemanticError as e:
        print(f"semantic: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0


def _warn_if_slow() -> None:
    """Users must hear it when the fast CPU path is missing: everything runs ~50x slower."""
    from semantic.runtime.model import blas

    status = blas.status()
    if not status.fast and sys.platform == "linux":
        print(f"semantic: warning: slow BLAS ({status.note or status.name}); "
              f"for the fast CPU path: {blas.INSTALL_HINT}", file=sys.stderr)


def _run(args: argparse.Namespace) -> int:
    if args.command in ("generate", "bench", "scenario", "serve"):
        _warn_if_slow()
    if args.command == "doctor":
        from .doctor import doctor

        return doctor(as_json=args.json)
    if args.command == "prepare":
        from semantic.runtime.model.models import resolve

        print(resolve(args.model))
        return 0
    if args.command == "generate":
        from .generate import generate

        return generate(args)
    if args.command == "cache":
        from .cache import run

        return run(args)
    if args.command == "bench":
        import importlib

        return importlib.import_module(f"semantic.bench.{args.bench}").run(args)
    if args.command == "serve":
        from .serve import run

        return run(args)
    if args.command == "scenario":
        from semantic.scenarios.cli import run

        return run(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
