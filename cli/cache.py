"""``semantic cache``: see and manage the agents' cache files and histories on disk."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from semantic.runtime.store import disk
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import validate_agent_id
from semantic.runtime.store.disk import human_bytes as _size
from semantic.runtime.errors import SemanticError
from semantic.runtime.paths import agents_dir, usable_dir

HISTORY_ONLY = "history only"


def run(args: argparse.Namespace) -> int:
    root = usable_dir(args.cache_dir or agents_dir())
    store = CacheStore(root)
    histories = root / "histories"
    out = Console(highlight=False)
    if args.action == "ls":
        entries = _listing(store, histories)
        if args.json:
            print(json.dumps([dict(e, path=str(e["path"])) for e in entries]))
            return 0
        table = Table(title=f"Agents in {root}")
        for col in ("agent", "model", "tokens", "bytes", "tier", "last use"):
            table.add_column(col, justify="right" if col in ("tokens", "bytes") else "left")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e["updated"]).strftime("%Y-%m-%d %H:%M:%S")
            tier = "warm (disk)" if e["tier"] == "warm" else e["tier"]
            tokens = "-" if e["tokens"] is None else str(e["tokens"])
            table.add_row(e["agent"], e["model"] or "-", tokens, _size(e["bytes"]), tier, when)
        out.print(table if entries else f"no agents in {root}")
        return 0
    if args.action == "verify":
        results = store.verify()
        for path, ok, reason in results:
            out.print(f"{'[green]ok[/]' if ok else '[red]bad[/]'}  {path.relative_to(root)}  {reason}")
        bad = sum(not ok for _, ok, _ in results)
        out.print(f"{len(results)} file(s), {bad} bad")
        return 1 if bad else 0
    if args.action == "rm":
        caches, history = disk.remove_agent(store, histories, validate_agent_id(args.agent), args.model)
        if not caches and not history:
            raise SemanticError(f"no cache for agent {args.agent!r} and model {args.model!r}" if args.model
                                else f"no cache or history for agent {args.agent!r}")
        parts = ([f"{caches} cache file(s)"] if caches else []) + (["the history"] if history else [])
        kept = "; its history stays" if args.model else ""
        out.print(f"removed {' and '.join(parts)} of {args.agent}{kept}")
        return 0
    if args.action == "du":
        entries = store.entries()
        by_model: dict[str, list[int]] = {}
        for e in entries:
            by_model.setdefault(e["model"], []).append(e["bytes"])
        for model, sizes in sorted(by_model.items()):
            out.print(f"{_size(sum(sizes)):>10}  {len(sizes)} agent(s)  {model}")
        out.print(f"{_size(store.disk_bytes()):>10}  total in {root} (quarantine and histories included)")
        return 0
    if args.action == "prune":
        return _prune(args, root, histories)
    if args.action in ("export", "import"):
        return _move(args, root)
    raise AssertionError(args.action)


def _move(args: argparse.Namespace, root: Path) -> int:
    """``export``: one agent's files to an archive; ``import``: an archive's agent into ``root``."""
    from semantic.actors.archive import ArchiveError, export_agent, import_agent

    try:
        if args.action == "export":
            summary, left_out = export_agent(root, validate_agent_id(args.agent), Path(args.output))
            for note in left_out:  # plain print: one line each, whatever the terminal's width
                print(f"left out {note}")
            print(f"exported {summary.agent_id} to {args.output}: {summary.describe()}")
        else:
            summary = import_agent(root, Path(args.archive), replace=args.replace)
            print(f"imported {summary.agent_id} into {root}: {summary.describe()}")
    except ArchiveError as e:
        raise SemanticError(f"{args.archive}: {e}" if args.action == "import" else str(e)) from None
    except OSError as e:
        raise SemanticError(f"cache {args.action}: {e}") from None
    return 0


def _listing(store: CacheStore, histories: Path) -> list[dict]:
    """One entry per cache file, and one per agent with a history but no cache; latest first."""
    entries = [dict(e, tier="warm") for e in store.entries()]
    cached = {e["agent"] for e in entries}
    files, _ = disk.scan(store.root, histories)
    for f in files:
        if f.kind == disk.HISTORY and f.agent not in cached:
            entries.append(dict(agent=f.agent, model=None, tokens=None, bytes=f.bytes, updated=f.mtime,
                                path=f.path, tier=HISTORY_ONLY))
    return sorted(entries, key=lambda e: e["updated"], reverse=True)


def _prune(args: argparse.Namespace, root: Path, histories: Path) -> int:
    if args.older_than is None and args.to is None:
        raise SemanticError("cache prune: say what to remove: --older-than DURATION and/or --to BYTES")
    files, _ = disk.scan(root, histories)
    plan = disk.plan(files, budget=args.to, older_than=args.older_than)
    verb = "would remove" if args.dry_run else "removed"
    removed = [f for f, _ in plan.removals] if args.dry_run else disk.apply(plan)
    why = {f.path: reason for f, reason in plan.removals}
    for f in removed:  # plain print: one line per file, whatever the terminal's width
        print(f"{verb} {f.path.relative_to(root)}  {_size(f.bytes)}  ({why[f.path]})")
    freed = sum(f.bytes for f in removed)
    holds = "would hold" if args.dry_run else "holds"
    print(f"{verb} {len(removed)} file(s), {_size(freed)}; {root} {holds} {_size(plan.total - freed)}")
    if args.to is not None and plan.total - freed > args.to:
        print(f"still over {_size(args.to)}: the rest is histories, which --to never removes, and temp or other files")
    return 0
