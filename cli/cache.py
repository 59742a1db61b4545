"""``semantic cache``: see and manage the agents' cache files on disk."""

from __future__ import annotations

import argparse
import datetime
import json
from pathlib import Path

from rich.console import Console
from rich.table import Table

from runtime.cache_file import CacheStore
from runtime.errors import SemanticError
from runtime.paths import agents_dir


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError


def run(args: argparse.Namespace) -> int:
    root = Path(args.cache_dir) if args.cache_dir else agents_dir()
    store = CacheStore(root)
    out = Console(highlight=False)
    if args.action == "ls":
        entries = sorted(store.entries(), key=lambda e: e["updated"], reverse=True)
        if args.json:
            print(json.dumps([dict(e, path=str(e["path"]), tier="warm") for e in entries]))
            return 0
        table = Table(title=f"Agent caches in {root}")
        for col in ("agent", "model", "tokens", "bytes", "tier", "last use"):
            table.add_column(col, justify="right" if col in ("tokens", "bytes") else "left")
        for e in entries:
            when = datetime.datetime.fromtimestamp(e["updated"]).strftime("%Y-%m-%d %H:%M:%S")
            table.add_row(e["agent"], e["model"], str(e["tokens"]), _size(e["bytes"]), "warm (disk)", when)
        out.print(table if entries else f"no agent caches in {root}")
        return 0
    if args.action == "verify":
        results = store.verify()
        for path, ok, reason in results:
            out.print(f"{'[green]ok[/]' if ok else '[red]bad[/]'}  {path.relative_to(root)}  {'' if ok else reason}")
        bad = sum(not ok for _, ok, _ in results)
        out.print(f"{len(results)} file(s), {bad} bad")
        return 1 if bad else 0
    if args.action == "rm":
        removed = store.delete(args.agent, args.model)
        if not removed:
            raise SemanticError(f"no cache for agent {args.agent!r}" + (f" and model {args.model!r}" if args.model else ""))
        out.print(f"removed {removed} cache file(s) of {args.agent}")
        return 0
    if args.action == "du":
        entries = store.entries()
        by_model: dict[str, list[int]] = {}
        for e in entries:
            by_model.setdefault(e["model"], []).append(e["bytes"])
        for model, sizes in sorted(by_model.items()):
            out.print(f"{_size(sum(sizes)):>10}  {len(sizes)} agent(s)  {model}")
        out.print(f"{_size(store.disk_bytes()):>10}  total in {root} (quarantine included)")
        return 0
    raise AssertionError(args.action)
