"""The cache directory's bounds without actors: what ``runtime.store.disk`` scans,
plans and removes (the budget in LRU order, the conversations' TTL, quarantine
first, never a named agent's history), and the free-space check."""

from __future__ import annotations

import os
import shutil
import time
from collections import namedtuple

import pytest

from semantic.runtime.store import disk
from semantic.runtime.store.cache_file import CacheStore, model_key
from semantic.runtime.cache_records import MANIFEST

DAY = 86400.0
NOW = time.time()


def put(path, size: int, age_days: float) -> None:
    """A file of ``size`` bytes last written ``age_days`` ago."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    os.utime(path, (NOW - age_days * DAY, NOW - age_days * DAY))


def put_cache(store: CacheStore, agent: str, model: str, size: int, age_days: float) -> None:
    """An agent's cache directory of ``size`` bytes whose manifest was written ``age_days`` ago
    (its block just now: the manifest's mtime is the cache's last use)."""
    d = store.agent_dir(agent, model)
    put(d / f"{'0' * 64}.block", size - 300, 0)
    put(d / MANIFEST, 300, age_days)


@pytest.fixture
def root(tmp_path):
    """A directory with named agents ada (2 days) and bo (5 days, two models), a
    conversation used 10 days ago and one used 1 day ago, and a quarantined file.
    Caches are block directories, bo's for m2 and conv-new's are version 1 files."""
    store = CacheStore(tmp_path)
    put_cache(store, "ada", "m1", 1000, 2)
    put_cache(store, "bo", "m1", 1000, 5)
    put(store.legacy_path("bo", "m2"), 1000, 4)
    put_cache(store, "conv-old", "m1", 1000, 10)
    put(store.legacy_path("conv-new", "m1"), 1000, 1)
    for agent, age in (("ada", 2), ("bo", 4), ("conv-old", 10), ("conv-new", 1)):
        put(disk.history_path(tmp_path / "histories", agent), 100, age)
    put(tmp_path / "quarantine" / "m1--x--stamp--bad-checksum", 500, 3)
    put(store.agent_dir("ada", "m1").parent / ".tmp-1-abcd-ada", 50, 0)  # a write in progress
    return tmp_path


def plan(root, **kw):
    files, _ = disk.scan(root, root / "histories")
    return disk.plan(files, now=NOW, **kw)


def removed(p) -> set[str]:
    return {f"{f.kind}:{f.agent or f.path.name}:{f.path.parent.name}" for f, _ in p.removals}


def test_scan_classifies_every_file_and_counts_them_all(root):
    files, total = disk.scan(root, root / "histories")
    kinds = sorted((f.kind, f.agent) for f in files)
    assert kinds.count(("cache", "bo")) == 2 and ("quarantine", None) in kinds and ("other", None) in kinds
    assert sum(k == "history" for k, _ in kinds) == 4
    assert total == 5 * 1000 + 4 * 100 + 500 + 50 == CacheStore(root).disk_bytes()


def test_over_budget_removes_quarantine_then_least_recently_used_caches(root):
    total = plan(root).total
    p = plan(root, budget=total - 1200)  # quarantine (500) and one cache (1000) must go
    assert [f.kind for f, _ in p.removals] == ["quarantine", "cache"]
    assert p.removals[1][0].agent == "conv-old"  # the least recently written cache
    assert p.after <= total - 1200
    p = plan(root, budget=total - 2600)
    assert [(f.agent, f.path.parent.name) for f, _ in p.removals[1:]] == [
        ("conv-old", model_key("m1")),
        ("bo", model_key("m1")),
        ("bo", model_key("m2")),  # 4 days: after bo's m1 cache (5 days)
    ]
    assert "over the disk budget" in p.removals[1][1]
    # applied: the directory is under the budget and every history is still there
    disk.apply(p)
    assert CacheStore(root).disk_bytes() <= total - 2600
    assert sorted(h.name for h in (root / "histories").iterdir()) == [
        "ada.json", "bo.json", "conv-new.json", "conv-old.json"]


def test_the_budget_never_removes_histories_or_temp_files(root):
    p = plan(root, budget=1)
    assert {f.kind for f, _ in p.removals} == {"cache", "quarantine"}
    assert p.after == 4 * 100 + 50  # what is left: histories and the temp file
    disk.apply(p)
    assert len(list((root / "histories").iterdir())) == 4 and list(root.rglob(".tmp-*"))


def test_a_target_below_the_budget_prunes_further(root):
    total = plan(root).total
    assert len(plan(root, budget=total - 1).removals) == 1  # the quarantined file
    assert len(plan(root, budget=total - 1, target=total - 2000).removals) == 3


def test_conversation_ttl_removes_old_conversations_whole_and_never_named_agents(root):
    p = plan(root, conversation_ttl=7 * DAY)
    assert removed(p) == {"cache:conv-old:" + model_key("m1"),
                          "history:conv-old:histories"}
    assert p.agents_removed == ["conv-old"]
    assert p.next_expiry == pytest.approx(NOW - 1 * DAY + 7 * DAY)  # conv-new's turn comes in 6 days
    assert "conversation unused for 10.0 d" in p.removals[0][1]
    old = plan(root, conversation_ttl=1 * DAY / 2)  # ada and bo are older than that, and named: kept
    assert {f.agent for f, _ in old.removals} == {"conv-old", "conv-new"}


def test_protected_agents_keep_every_file(root):
    p = plan(root, conversation_ttl=DAY / 2, budget=1, protected={"conv-old", "bo"})
    assert {f.agent for f, _ in p.removals} == {"ada", "conv-new", None}
    assert p.agents_removed == ["conv-new"]


def test_older_than_removes_old_caches_and_quarantine_and_old_conversations(root):
    p = plan(root, older_than=3.5 * DAY)
    assert {(f.kind, f.agent) for f, _ in p.removals} == {
        ("cache", "bo"), ("cache", "conv-old"), ("history", "conv-old")}
    assert len(p.removals) == 4  # both of bo's caches; bo's history stays
    p = plan(root, older_than=2.5 * DAY)
    assert ("quarantine", None) in {(f.kind, f.agent) for f, _ in p.removals}
    assert "history" not in {f.kind for f, _ in p.removals if f.agent in ("ada", "bo")}


def test_apply_leaves_a_file_written_again_since_the_scan(root):
    p = plan(root, budget=1)
    victim = next(f for f, _ in p.removals if f.agent == "conv-old")
    put(victim.path / MANIFEST, 1234, 0)  # a writer replaced it meanwhile
    gone = disk.apply(p)
    assert victim.path.exists() and victim not in gone
    assert len(gone) == len(p.removals) - 1


def test_remove_agent_takes_the_history_unless_one_model_is_named(root):
    store = CacheStore(root)
    assert disk.remove_agent(store, root / "histories", "bo", "m1") == (1, False)
    assert disk.history_path(root / "histories", "bo").exists() and store.exists("bo", "m2")
    assert disk.remove_agent(store, root / "histories", "bo") == (1, True)
    assert not disk.history_path(root / "histories", "bo").exists()
    assert disk.remove_agent(store, root / "histories", "nobody") == (0, False)


Usage = namedtuple("Usage", "total used free")


def test_check_room_refuses_a_write_that_would_leave_too_little_free(tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, disk.FREE_MARGIN + 1000))
    disk.check_room(tmp_path, 1000)  # exactly fits
    with pytest.raises(disk.NoRoom) as e:
        disk.check_room(tmp_path, 1001)
    assert "64.0 MiB free" in e.value.strerror and isinstance(e.value, OSError)


def test_the_default_budget_is_half_of_use_plus_free_space(root, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: Usage(10 << 30, 0, 1 << 20))
    used = CacheStore(root).disk_bytes()
    assert disk.default_budget(root) == (used + (1 << 20)) // 2
    assert disk.default_budget(root / "not" / "yet") == (1 << 20) // 2  # a directory still to be made
