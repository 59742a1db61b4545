"""``semantic scenario run FILE`` and ``semantic scenario validate FILE``.

Importing this module is cheap (argparse only), so ``cli/main.py`` can call
``add_parser`` while building its parser; YAML, rich, anyio and the backends
are imported when a command runs.  Users' mistakes raise ``SemanticError``,
which ``cli/main.py`` prints as one line with exit status 2.

FILE is a path, or the name of a shipped scenario (``gossip_network``, ...).
"""

from __future__ import annotations

import argparse
import sys
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .backend import Backend
    from .schema import Scenario

__all__ = ["add_parser", "compare_scenario", "library", "main", "make_backend", "resolve", "run"]

LIBRARY = Path(__file__).parent / "library"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``scenario`` (with actions ``run`` and ``validate``) to ``semantic``'s subcommands."""
    top = sub.add_parser("scenario", help="multi-agent YAML scenarios: run, compare, validate")
    actions = top.add_subparsers(dest="action", required=True, metavar="ACTION")
    shipped = ", ".join(library()) or "none"
    p = actions.add_parser("run", help="run a scenario: live view, transcript and per-turn cache report")
    p.add_argument("file", metavar="FILE", help=f"a scenario YAML file, or a shipped one by name ({shipped})")
    p.add_argument("--model", default=None,
                   help="'smollm2' (embedded, default), a local mlx-lm model directory, or a Hugging Face repo id")
    p.add_argument("--seed", type=int, default=None, help="sampling seed; turn i samples with seed + i")
    p.add_argument("--url", default=None, help="run through a running `semantic serve` at this URL")
    p.add_argument("--no-cache", action="store_true", help="disable cache reuse: every turn prefills its whole prompt")
    p.add_argument("--out", default=None, help="directory for transcript.json, transcript.md and report.json "
                                               "(default ./scenario-runs/ID-RUN)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object (no live view)")
    p = actions.add_parser("compare", help="run a scenario twice, cached and --no-cache, with the same seed: "
                                           "prefill work and identical replies side by side")
    p.add_argument("file", metavar="FILE", help=f"a scenario YAML file, or a shipped one by name ({shipped})")
    p.add_argument("--model", default=None, help="as for run")
    p.add_argument("--seed", type=int, default=0, help="sampling seed for both runs (default 0)")
    p.add_argument("--url", default=None, help="run both through a running `semantic serve` at this URL")
    p.add_argument("--out", default=None, help="directory for both runs' outputs and compare.json "
                                               "(default ./scenario-runs/ID-RUN-compare)")
    p.add_argument("--json", action="store_true", help="print the comparison as one JSON object")
    p = actions.add_parser("validate", help="check a scenario file; print its phases and turns")
    p.add_argument("file", metavar="FILE", help=f"a scenario YAML file, or a shipped one by name ({shipped})")
    return top


def run(args: argparse.Namespace) -> int:
    """Dispatch ``semantic scenario ACTION``."""
    if args.action == "validate":
        return validate(args)
    if args.action == "run":
        return run_scenario(args)
    if args.action == "compare":
        return compare_scenario(args)
    raise AssertionError(f"unhandled scenario action {args.action}")


def library() -> list[str]:
    """Names of the shipped scenarios."""
    return sorted(p.stem for p in LIBRARY.glob("*.yaml"))


def resolve(file: str) -> Path:
    """``file`` if it exists, else the shipped scenario of that name."""
    from semantic.runtime.errors import SemanticError

    path = Path(file)
    if path.exists():
        return path
    shipped = LIBRARY / f"{file.removesuffix('.yaml')}.yaml"
    if "/" not in file and shipped.exists():
        return shipped
    raise SemanticError(f"no scenario file {file!r} (shipped scenarios: {', '.join(library())})")


def validate(args: argparse.Namespace) -> int:
    from .schema import load

    path = resolve(args.file)
    scenario = load(path)  # ScenarioError: file:line: field: message, exit 2
    print(f"{path}: ok")
    print(summary(scenario))
    return 0


def summary(scenario: Scenario) -> str:
    lines = [f"{scenario.id}: {scenario.title}"]
    lines.append("agents: " + ", ".join(f"{a.name} ({k}, {a.lifecycle})" for k, a in scenario.agents.items()))
    for i, p in enumerate(scenario.phases, 1):
        extra = []
        if p.private:
            extra.append(f"{len(p.private)} private block(s)")
        if p.prompts:
            extra.append("own prompts for " + ", ".join(p.prompts))
        if p.judge is not None:
            matrix = len(p.judge.payoff_matrix)
            extra.append("judging phase" + (f", payoff matrix of {matrix}" if matrix else ""))
        lines.append(f"  {i}. {p.name}: {p.label} | {', '.join(p.order)} x {p.rounds} round(s) = {p.turns} turns"
                     + (f" | {'; '.join(extra)}" if extra else ""))
    lines.append(f"{len(scenario.phases)} phases, {scenario.turns} turns")
    return "\n".join(lines)


def run_scenario(args: argparse.Namespace) -> int:
    import secrets

    import anyio

    from .schema import load

    scenario = load(resolve(args.file))
    _check_url(args)
    run_id = secrets.token_hex(4)
    out = Path(args.out) if args.out else Path("scenario-runs") / f"{scenario.id}-{run_id}"
    backend = make_backend(args)
    return anyio.run(_play, scenario, backend, args, run_id, out)


def compare_scenario(args: argparse.Namespace) -> int:
    import secrets

    import anyio

    from .schema import load

    scenario = load(resolve(args.file))
    _check_url(args)
    run_id = secrets.token_hex(4)
    out = Path(args.out) if args.out else Path("scenario-runs") / f"{scenario.id}-{run_id}-compare"
    return anyio.run(_compare, scenario, make_backend(args), args, run_id, out)


def _check_url(args: argparse.Namespace) -> None:
    from semantic.runtime.errors import SemanticError

    if args.url is not None:
        if not args.url.startswith(("http://", "https://")):
            raise SemanticError(f"--url must start with http:// or https:// (got {args.url!r})")
        if args.model is not None:
            raise SemanticError("--model cannot be used with --url: the server runs its own model")


def make_backend(args: argparse.Namespace) -> AbstractAsyncContextManager[Backend]:
    """The backend for ``args``: HTTP to ``args.url`` if given, else in process
    with ``args.model`` (None = the embedded SmolLM2).

    Returns an async context manager: entering starts the backend (the runtime
    and its model, or the HTTP client), leaving stops it.  ``args.no_cache``
    needs no handling here: the runner passes ``use_cache`` to every ``open_agent``.
    """
    if args.url is not None:
        from .remote import remote_backend

        return remote_backend(args.url)
    from .local import local_backend

    if not args.json:
        print(f"loading {args.model or 'smollm2'} ...", file=sys.stderr, flush=True)
    return local_backend(args.model)


async def _play(scenario: Scenario, backend_cm: AbstractAsyncContextManager[Backend], args: argparse.Namespace,
                run_id: str, out: Path) -> int:
    import json

    from . import report

    async with backend_cm as backend:
        result = await _run_once(scenario, backend, args, run_id, use_cache=not args.no_cache)
    rep = report.write(result, out, **_meta(args))
    if args.json:
        print(json.dumps({**rep, "output_dir": str(out)}))
    else:
        print(f"transcript and report in {out}/")
    return 0


async def _compare(scenario: Scenario, backend_cm: AbstractAsyncContextManager[Backend], args: argparse.Namespace,
                   run_id: str, out: Path) -> int:
    import json

    from . import compare, report

    async with backend_cm as backend:
        cached = await _run_once(scenario, backend, args, f"{run_id}c", use_cache=True)
        uncached = await _run_once(scenario, backend, args, f"{run_id}n", use_cache=False)
    report.write(cached, out / "cached", **_meta(args))
    report.write(uncached, out / "no-cache", **_meta(args))
    comparison = compare.compare(cached, uncached)
    (out / "compare.json").write_text(json.dumps(comparison, indent=2) + "\n")
    if args.json:
        print(json.dumps({**comparison, "output_dir": str(out)}))
    else:
        print(compare.render(comparison))
        print(f"both runs and compare.json in {out}/")
    return 0


async def _run_once(scenario: Scenario, backend: Backend, args: argparse.Namespace, run_id: str, use_cache: bool):
    from . import runner
    from .view import View

    if args.json:
        return await runner.run(scenario, backend, run_id=run_id, seed=args.seed, use_cache=use_cache)
    with View(scenario) as view:
        result = await runner.run(scenario, backend, run_id=run_id, seed=args.seed, use_cache=use_cache,
                                  on_event=view)
    view.summary(result)
    return result


def _meta(args: argparse.Namespace) -> dict:
    return {"model": None if args.url else (args.model or "smollm2"), "backend": "http" if args.url else "in-process",
            "url": args.url}


def main(argv: list[str] | None = None) -> int:
    """``python -m semantic.scenarios.cli ACTION ...``: the same as ``semantic scenario ACTION ...``."""
    from semantic.runtime.errors import SemanticError

    top = argparse.ArgumentParser(prog="semantic")
    add_parser(top.add_subparsers(dest="command", required=True))
    args = top.parse_args(["scenario", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except SemanticError as e:
        print(f"semantic: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
