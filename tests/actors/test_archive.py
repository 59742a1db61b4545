"""Moving an agent's files between cache directories (``actors.archive``,
``semantic cache export`` / ``import``): the whole agent goes, checked; a bad
archive is one clear error and changes nothing."""

from __future__ import annotations

import functools
import io
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from semantic.actors import Message
from semantic.actors.archive import INDEX, ArchiveError, agent_files, export_agent, import_agent
from semantic.actors.errors import AgentExists
from semantic.actors.history import encode_history
from semantic.runtime.store.cache_file import CacheStore, model_key
from semantic.runtime.cache_records import CacheRecord, InvalidAgentId
from semantic.runtime.model.model_spec import ModelCacheSpec

ROOT = Path(__file__).resolve().parents[2]
HISTORY = (Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello."))


@functools.cache
def _computed():
    """A real cache of a tiny model (token ids, layers, spec hash), computed once."""
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from tests.runtime.test_engine import ByteTokenizer, drain
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    engine = Engine(model, ByteTokenizer())
    sid = engine.add(list(range(1, 300)), SamplingParams(max_tokens=3))  # two blocks
    f = drain(engine)[sid]
    return ModelCacheSpec.from_model(model).hash, list(f.cache_tokens), f.cache


def put_agent(root: Path, agent: str, models=("tiny", "other")) -> None:
    """An agent in the cache directory ``root``: its history and a cache per model."""
    spec, tokens, cache = _computed()
    store = CacheStore(root)
    for model in models:
        store.save(CacheRecord(agent, model, spec, tokens, "some prompt text", 1.0, 2.0, cache))
    (root / "histories").mkdir(exist_ok=True)
    (root / "histories" / f"{agent}.json").write_bytes(encode_history(agent, HISTORY))


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture
def archive(tmp_path) -> Path:
    src = tmp_path / "src"
    put_agent(src, "ada")
    put_agent(src, "bo", models=("tiny",))
    export_agent(src, "ada", tmp_path / "ada.tar")
    return tmp_path / "ada.tar"


@pytest.mark.slow
def test_an_agent_moves_whole_between_cache_directories(tmp_path, archive):
    src, dst = tmp_path / "src", tmp_path / "dst"
    names = tarfile.open(archive).getnames()
    assert names[-1] == INDEX and all("ada" in n for n in names[:-1]) and len(names) == len(set(names))
    summary = import_agent(dst, archive)
    n = len(_computed()[1])
    assert (summary.agent_id, summary.messages, sorted(summary.caches)) == ("ada", 3, [("other", n), ("tiny", n)])
    ada = {k: v for k, v in tree(src).items() if "ada" in k}
    assert tree(dst) == ada  # byte for byte: the history and each model's cache; nothing of bo
    spec = _computed()[0]
    assert CacheStore(dst).read("ada", "tiny", spec).record.tokens == _computed()[1]  # loads as a cache does
    assert not list(dst.glob(".tmp-*")) and not list(tmp_path.glob(".ada.tar.tmp-*"))


def test_export_says_what_is_wrong_and_leaves_out_a_damaged_cache(tmp_path):
    src = tmp_path / "src"
    put_agent(src, "ada")
    with pytest.raises(ArchiveError, match="no agent 'zed' in"):
        export_agent(src, "zed", tmp_path / "zed.tar")
    with pytest.raises(InvalidAgentId, match="may not contain '/'"):
        export_agent(src, "../etc", tmp_path / "x.tar")
    with pytest.raises(ArchiveError, match="no directory .*/nowhere to write ada.tar in"):
        export_agent(src, "ada", tmp_path / "nowhere" / "ada.tar")
    assert not (tmp_path / "zed.tar").exists() and not (tmp_path / "x.tar").exists()
    block = next((src / model_key("other") / "ada.kv").glob("*.block"))
    data = bytearray(block.read_bytes())
    data[100] ^= 0xFF
    block.write_bytes(bytes(data))
    summary, left_out = export_agent(src, "ada", tmp_path / "ada.tar")
    assert summary.caches == (("tiny", len(_computed()[1])),) and len(left_out) == 1
    assert left_out[0].startswith(model_key("other")) and "bad checksum" in left_out[0]
    assert import_agent(tmp_path / "dst", tmp_path / "ada.tar").caches == summary.caches


def test_import_replaces_an_agent_only_when_asked(tmp_path, archive):
    dst = tmp_path / "dst"
    put_agent(dst, "ada", models=("third",))  # another version of ada, with a cache the archive lacks
    before = tree(dst)
    with pytest.raises(AgentExists, match="agent 'ada' exists in .*--replace"):
        import_agent(dst, archive)
    assert tree(dst) == before
    import_agent(dst, archive, replace=True)
    assert {p.parent.name for p in agent_files(dst, "ada") if p.name.endswith(".kv")} == \
        {model_key("tiny"), model_key("other")}  # exactly the archive's agent: the third cache went
    assert not list(dst.glob(".tmp-*"))


def _members(path: Path) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar}


def _write(path: Path, members: dict[str, bytes], reindex: bool = False, extra: list[tarfile.TarInfo] = ()) -> Path:
    """A tar of ``members`` (the index recomputed when ``reindex``), plus ``extra`` entries."""
    import hashlib

    if reindex:
        index = json.loads(members[INDEX])
        index["files"] = {k: {"bytes": len(v), "sha256": hashlib.sha256(v).hexdigest()}
                          for k, v in members.items() if k != INDEX}
        members = {**members, INDEX: json.dumps(index).encode()}
    with tarfile.open(path, "w") as tar:
        for info in extra:
            tar.addfile(info, io.BytesIO(b"x" * info.size) if info.isreg() else None)
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _entry(name: str, kind=tarfile.REGTYPE, link: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type, info.linkname, info.size = kind, link, 1 if kind == tarfile.REGTYPE else 0
    return info


def _flip_a_block_byte(path: Path) -> Path:
    with tarfile.open(path) as tar:
        block = next(m for m in tar if m.name.endswith(".block"))
    data = bytearray(path.read_bytes())
    data[block.offset_data + 7] ^= 0x01
    path.write_bytes(bytes(data))
    return path


def _edited(path: Path, name_end: str, edit) -> Path:
    members = _members(path)
    name = next(n for n in members if n.endswith(name_end))
    return _write(path, {**members, name: edit(members[name])}, reindex=True)


def _renamed_agent(path: Path, new: str) -> Path:
    members = _members(path)
    index = json.loads(members[INDEX])
    index["agent_id"] = new
    members[INDEX] = json.dumps(index).encode()
    return _write(path, {k.replace("ada", new): v for k, v in members.items()}, reindex=True)


BAD = {  # how an archive is spoiled -> what the error says
    "missing": (lambda p: p.with_name("gone.tar"), "no such archive"),
    "not a tar": (lambda p: (p.write_bytes(b"hello" * 1000), p)[1], "is not a whole tar archive"),
    "cut short": (lambda p: (p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]), p)[1],
                  "is not a whole tar archive|cut short|no semantic-archive.json"),
    "a flipped bit": (_flip_a_block_byte, "is damaged: its bytes are not the ones exported"),
    "no index": (lambda p: _write(p, {k: v for k, v in _members(p).items() if k != INDEX}), "not an agent archive"),
    "a file missing": (lambda p: _write(p, {k: v for k, v in _members(p).items() if not k.endswith(".block")}),
                       "is listed in semantic-archive.json but missing"),
    "a path that escapes": (lambda p: _write(p, _members(p), extra=[_entry("histories/../../evil.json")]),
                            "leads outside the cache directory"),
    "an absolute path": (lambda p: _write(p, _members(p), extra=[_entry("/tmp/evil.json")]), "absolute path"),
    "a symlink": (lambda p: _write(p, _members(p), extra=[_entry("histories/x.json", tarfile.SYMTYPE, "/etc/passwd")]),
                  "is a link, a sparse or a special file"),
    "a hard link": (lambda p: _write(p, _members(p), extra=[_entry("histories/x.json", tarfile.LNKTYPE, "etc")]),
                    "is a link, a sparse or a special file"),
    "a stray file": (lambda p: _write(p, _members(p), extra=[_entry("notes.txt")]),
                     "is not an agent's history or cache file"),
    "another agent's file": (lambda p: _write(p, {**_members(p), "histories/bo.json": encode_history("bo", HISTORY)},
                                              reindex=True), "belongs to another agent than 'ada'"),
    "an invalid agent id": (lambda p: _renamed_agent(p, ".hidden"),
                            "agent id '.hidden' is not valid: .*start with '.'"),
    "an unreadable history": (lambda p: _edited(p, "ada.json", lambda b: b"{not json"), "history of agent 'ada'"),
    "an unusable cache": (lambda p: _edited(p, "manifest.json", lambda b: re.sub(rb'"token_count":\d+',
                                                                                  b'"token_count":1', b)),
                          r"cache for .* is unusable \(bad checksum\)"),
    "another agent than the one named": (lambda p: p, "the archive holds agent 'ada', not 'bo'"),
}


@pytest.mark.parametrize("how", BAD)
def test_a_bad_archive_is_one_clear_error_and_changes_nothing(tmp_path, archive, how):
    spoil, message = BAD[how]
    dst = tmp_path / "dst"
    put_agent(dst, "bo", models=("tiny",))
    before = tree(dst)
    with pytest.raises(ArchiveError, match=message):
        import_agent(dst, spoil(archive), agent_id="bo" if how.startswith("another agent than") else None)
    assert tree(dst) == before and not list(dst.glob(".tmp-*"))


def test_an_import_that_died_leaves_nothing_the_next_one_keeps(tmp_path, archive):
    dst = tmp_path / "dst"
    dead = dst / ".tmp-import-999999999-0a1b2c3d"  # no such process
    (dead / "histories").mkdir(parents=True)
    (dead / "histories" / "ada.json").write_text("{}")
    import_agent(dst, archive)
    assert not dead.exists()


def semantic(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "semantic.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "COLUMNS": "60"})


@pytest.mark.slow
def test_the_cache_commands_export_and_import(tmp_path):
    src, dst, out = tmp_path / "src", tmp_path / "dst", tmp_path / "ada.tar"
    put_agent(src, "ada", models=("tiny",))
    done = semantic("cache", "--cache-dir", src, "export", "ada", "-o", out)
    assert done.returncode == 0 and done.stdout.startswith(f"exported ada to {out}: history (3 messages) and 1 "
                                                           f"cache(s) (tiny: {len(_computed()[1])} tokens)"), \
        done.stdout + done.stderr
    done = semantic("cache", "--cache-dir", dst, "import", out)
    assert done.returncode == 0 and done.stdout.startswith(f"imported ada into {dst}: history"), done.stderr
    for args, message in [
        (("--cache-dir", dst, "import", out), f"agent 'ada' exists in {dst}; replace it with --replace"),
        (("--cache-dir", src, "export", "zed", "-o", out), "no agent 'zed' in"),
        (("--cache-dir", dst, "import", tmp_path / "gone.tar"), f"{tmp_path / 'gone.tar'}: no such archive"),
    ]:
        done = semantic("cache", *args)
        assert done.returncode == 2 and done.stderr.startswith(f"semantic: error: {message}"), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert semantic("cache", "--cache-dir", dst, "import", out, "--replace").returncode == 0
