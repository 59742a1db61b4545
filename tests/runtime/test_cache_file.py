"""Cache files: saved caches load bit for bit and continue exactly, Q4 stays Q4
on disk, every kind of damage ends in quarantine and a cold start, agent ids
cannot escape the store, and a writer killed mid-save never leaves a wrong cache."""

from __future__ import annotations

import runtime  # noqa: F401  (fast BLAS before mlx)

import dataclasses
import logging
import os
import random
import struct
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import QuantizedKVCache, RotatingKVCache
from safetensors import safe_open

from runtime.batch_cache import DequantizingKVCache, attention_view, copy_cache
from runtime.cache_file import (
    CacheFileError,
    CacheRecord,
    CacheStore,
    InvalidAgentId,
    encode,
    load,
    model_key,
    read_meta,
    save,
    validate_agent_id,
    write_atomic,
)
from runtime.engine import Engine, SamplingParams
from runtime.model_spec import ModelCacheSpec
from tests.runtime import cache_writer as writer
from tests.runtime.test_engine import ByteTokenizer, drain, prompts
from tests.tiny import tiny_model

ARCHS = ["llama", "qwen2", "gemma3_text", "gpt_oss"]
REPO = Path(__file__).resolve().parents[2]


def _quantized(c) -> QuantizedKVCache | None:
    return c.quantized if isinstance(c, DequantizingKVCache) else c if isinstance(c, QuantizedKVCache) else None


def _arrays(c) -> list[mx.array]:
    """The live arrays of one layer's cache: what must survive a round trip bit for bit."""
    if (q := _quantized(c)) is not None:
        return [x[..., : q.offset, :] for x in (*q.keys, *q.values)] if q.offset else []
    live = min(c.offset, c.keys.shape[2])
    return [c.keys[..., :live, :], c.values[..., :live, :]]


def assert_same_cache(saved: list, loaded: list) -> None:
    assert [type(c) for c in loaded] == [type(c) for c in saved]
    for a, b in zip(saved, loaded):
        assert a.offset == b.offset
        if isinstance(a, RotatingKVCache):
            assert (a._idx, a.max_size, a.keep) == (b._idx, b.max_size, b.keep)
        for x, y in zip(_arrays(a), _arrays(b), strict=True):
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()


def finished(model, tok, prompt, max_tokens, **engine_args):
    engine = Engine(model, tok, **engine_args)
    sid = engine.add(prompt, SamplingParams(max_tokens=max_tokens))
    f = drain(engine)[sid]
    return f.cache, list(f.cache_tokens)


def continue_from(model, tok, cache, tokens, extra=(7, 8, 9)) -> tuple[int, ...]:
    engine = Engine(model, tok)
    sid = engine.add(list(tokens) + list(extra), SamplingParams(max_tokens=6), cache, len(tokens))
    return drain(engine)[sid].output_tokens


@pytest.mark.parametrize("arch", ARCHS)
def test_round_trip_is_bit_identical_and_continues_the_same(arch, tmp_path):
    model, tok = tiny_model(arch), ByteTokenizer()
    spec = ModelCacheSpec.from_model(model).hash
    prompt = prompts(1, seed=5)[0]  # 41 tokens: the 16-token windows have wrapped
    prefilled = finished(model, tok, prompt, 1)  # one chunk: a ring holds more than its window
    decoded = finished(model, tok, prompt, 6)  # extracted from the decode batch, ring unrolled
    stepped = copy_cache(prefilled[0])
    for t in (11, 12, 13):  # single tokens rotate a ring in place: its index lands mid-buffer
        model(mx.array([[t]]), cache=attention_view(stepped, True))
    mx.eval([c.state for c in stepped])
    cases = {"prefilled": prefilled, "decoded": decoded, "stepped": (stepped, prefilled[1] + [11, 12, 13])}
    if arch in ("gemma3_text", "gpt_oss"):
        rings = [c for c in stepped if isinstance(c, RotatingKVCache)]
        assert rings and all(c.offset > c.max_size and 0 < c._idx < c.max_size for c in rings)
    for name, (cache, tokens) in cases.items():
        rec = CacheRecord("agent-1", f"tiny/{arch}", spec, tokens, tok.decode(tokens), 10.5, 20.25, cache)
        path = tmp_path / f"{name}.safetensors"
        save(path, rec)
        back = load(path, model_id=rec.model_id, spec_hash=spec)
        assert dataclasses.replace(back, cache=None) == dataclasses.replace(rec, cache=None), name
        assert_same_cache(cache, back.cache)
        original = continue_from(model, tok, copy_cache(cache), tokens)
        assert continue_from(model, tok, back.cache, tokens) == original, name


def test_empty_cache_round_trips(tmp_path):
    model, tok = tiny_model("gemma3_text"), ByteTokenizer()
    empty = Engine(model, tok).new_cache()
    save(tmp_path / "a.safetensors", CacheRecord("a", "m", "s", [], "", 0.0, 0.0, empty))
    back = load(tmp_path / "a.safetensors", model_id="m", spec_hash="s")
    assert [type(c) for c in back.cache] == [type(c) for c in empty] and all(c.offset == 0 for c in back.cache)
    prompt = prompts(1, seed=8)[0]
    assert continue_from(model, tok, back.cache, [], prompt) == continue_from(model, tok, empty, [], prompt)


def test_bfloat16_triples_and_rings_round_trip(tmp_path):
    rec = writer.record(1)  # bfloat16 scales and ring
    assert rec.cache[0].keys[1].dtype == mx.bfloat16 and rec.cache[-1].keys.dtype == mx.bfloat16
    save(tmp_path / "a.safetensors", rec)
    back = load(tmp_path / "a.safetensors", model_id=rec.model_id, spec_hash=rec.spec_hash)
    assert back.tokens == rec.tokens
    assert_same_cache(rec.cache, back.cache)


def test_encoded_bytes_are_the_saved_file(tmp_path):
    """``encode`` + ``write_atomic`` (bytes made on the MLX thread, written on
    another) give exactly the file ``save`` streams."""
    rec = writer.record(2)
    save(tmp_path / "saved.safetensors", rec)
    data = encode(rec)
    assert bytes(data) == (tmp_path / "saved.safetensors").read_bytes()
    store = CacheStore(tmp_path / "store")
    path = store.write_encoded(rec.agent_id, rec.model_id, data)
    assert path == store.path(rec.agent_id, rec.model_id)
    assert_same_cache(rec.cache, store.load(rec.agent_id, rec.model_id, rec.spec_hash).cache)
    write_atomic(tmp_path / "plain.json", b"{}")
    assert (tmp_path / "plain.json").read_bytes() == b"{}" and not list(tmp_path.glob(".tmp-*"))


@pytest.mark.parametrize("bits, fraction", [(4, 0.29), (8, 0.54)])
def test_quantized_triples_are_stored_as_they_are(bits, fraction, tmp_path):
    model, tok = tiny_model("llama"), ByteTokenizer()
    cache, tokens = finished(model, tok, prompts(1, seed=6)[0], 4, kv_bits=bits)
    path = tmp_path / "a.safetensors"
    save(path, CacheRecord("a", "tiny/llama", "s", tokens, "", 0.0, 0.0, cache))
    data = sum(x.nbytes for c in cache for x in _arrays(c))
    header = 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert path.stat().st_size - header == data  # the triples and nothing else
    n, H, D = len(tokens), cache[0].keys[0].shape[1], 64
    fp16 = len(cache) * 2 * H * n * D * 2
    assert data <= fraction * fp16  # bits/8 per element + a 16-bit scale and bias per 64
    with safe_open(path, framework="numpy") as f:  # plain safetensors, readable by anyone
        w, s = f.get_tensor("layer_1_v_weights"), f.get_tensor("layer_1_v_scales")
        assert w.dtype == np.uint32 and w.shape == (1, H, n, D * bits // 32)
        assert s.dtype == np.float16 and s.shape == (1, H, n, D // 64)
        assert np.array_equal(w, np.asarray(cache[1].values[0][..., :n, :]))
        assert f.metadata()["token_count"] == str(n) and f.metadata()["bits"] == str(bits)


# -- damage ----------------------------------------------------------------

MODEL, SPEC = "org/model", "spec-a"


def _record(agent="alice", model=MODEL) -> CacheRecord:
    return dataclasses.replace(writer.record(4), agent_id=agent, model_id=model, spec_hash=SPEC)


def _rewrite(path: Path, edit) -> None:
    data = bytearray(path.read_bytes())
    path.write_bytes(bytes(edit(data)))


def _flip_token_digit(data: bytearray) -> bytearray:
    at = data.index(b'"tokens":"[') + len(b'"tokens":"[')
    while chr(data[at + 1]).isdigit():
        at += 1
    data[at] = ord("0") + (data[at] - ord("0") + 1) % 10  # still valid JSON, another token id
    return data


def _patch(old: bytes, new: bytes):
    def edit(data: bytearray) -> bytes:
        assert len(old) == len(new) and data.count(old) == 1
        return bytes(data).replace(old, new)

    return edit


def _flip(at: int):
    def edit(data: bytearray) -> bytearray:
        data[at] ^= 0x40
        return data

    return edit


DAMAGE = {  # name: (how, spec the loader asks for, reason)
    "truncated": (lambda p: _rewrite(p, lambda d: d[: len(d) // 2]), SPEC, "truncated"),
    "data byte flipped": (lambda p: _rewrite(p, _flip(-100)), SPEC, "bad checksum"),
    "token id in header changed": (lambda p: _rewrite(p, _flip_token_digit), SPEC, "bad checksum"),
    "header JSON broken": (lambda p: _rewrite(p, _flip(8)), SPEC, "unparsable"),
    "other model id": (lambda p: save(p, _record(model="org/other")), SPEC, "other model"),
    "other spec hash": (lambda p: None, "spec-b", "other spec"),
    "old format version": (
        lambda p: _rewrite(p, _patch(b'"format_version":"1"', b'"format_version":"0"')), SPEC, "old format"),
    "another agent's file": (lambda p: save(p, _record(agent="bob")), SPEC, "other agent"),
    "zero length": (lambda p: p.write_bytes(b""), SPEC, "truncated"),
    "garbage": (lambda p: p.write_bytes(b"not a cache file, just text\n" * 40), SPEC, "unparsable"),
}


@pytest.mark.parametrize("damage", DAMAGE)
def test_damaged_file_is_quarantined_and_the_agent_starts_cold(damage, tmp_path, caplog):
    how, spec, reason = DAMAGE[damage]
    store = CacheStore(tmp_path)
    path = store.save(_record())
    how(path)
    with caplog.at_level(logging.WARNING, logger="semantic.cache"):
        assert store.load("alice", MODEL, spec) is None
    warnings = [r for r in caplog.records if r.name == "semantic.cache"]
    assert len(warnings) == 1 and f"({reason}:" in warnings[0].getMessage()
    assert not path.exists()
    (moved,) = (tmp_path / "quarantine").iterdir()
    assert moved.name.startswith(f"{path.parent.name}--alice--") and moved.name.endswith(reason.replace(" ", "-"))
    assert store.load("alice", MODEL, spec) is None  # now simply absent
    store.save(_record())
    assert store.load("alice", MODEL, SPEC).tokens == _record().tokens


def test_load_raises_only_cache_file_errors(tmp_path):
    with pytest.raises(CacheFileError) as e:
        load(tmp_path / "none.safetensors", model_id=MODEL, spec_hash=SPEC)
    assert e.value.reason == "missing"
    (tmp_path / "dir.safetensors").mkdir()
    with pytest.raises(CacheFileError) as e:
        load(tmp_path / "dir.safetensors", model_id=MODEL, spec_hash=SPEC)
    assert e.value.reason == "unreadable"


def test_save_refuses_a_cache_that_does_not_match_its_tokens(tmp_path):
    rec = _record()
    n = len(rec.tokens)
    with pytest.raises(ValueError, match=f"holds {n} tokens but the record lists {n - 1}"):
        save(tmp_path / "a.safetensors", dataclasses.replace(rec, tokens=rec.tokens[:-1]))
    assert list(tmp_path.iterdir()) == []  # no temp file left behind


# -- agent ids and the store -----------------------------------------------


@pytest.mark.parametrize("agent_id", ["alice", "Agent_7", "a.b", "a..b", "x-y", "user@host", "ns:agent", "x" * 128])
def test_valid_agent_ids(agent_id):
    assert validate_agent_id(agent_id) == agent_id


@pytest.mark.parametrize(
    "agent_id, rule",
    [
        ("", "may not be empty"),
        ("x" * 129, "at most 128 characters"),
        ("x" * 10_240, "at most 128 characters"),
        ("a\x00b", "NUL"),
        ("a\nb", "control characters"),
        ("a\x7fb", "control characters"),
        ("a/b", "may not contain '/'"),
        ("../../etc/passwd", "may not contain '/'"),
        ("a\\b", r"may not contain '\\\\'"),
        (".", "may not be '.' or '..'"),
        ("..", "may not be '.' or '..'"),
        (".hidden", "may not start with '.'"),
        ("émile", "only A-Z a-z 0-9 . _ : @ -, not 'é'"),
        ("名前", "only A-Z"),
        ("a\u202eb", "only A-Z"),  # right-to-left override
        ("a b", "only A-Z"),
        ("a*b", "only A-Z"),
        (5, "must be a string"),
    ],
)
def test_invalid_agent_ids(agent_id, rule):
    with pytest.raises(InvalidAgentId, match=rule):
        validate_agent_id(agent_id)


def test_store_never_takes_an_invalid_id_to_the_disk(tmp_path):
    store = CacheStore(tmp_path / "root")
    for bad in ("../escape", "..", "a/b"):
        with pytest.raises(InvalidAgentId):
            store.save(_record(agent=bad))
        with pytest.raises(InvalidAgentId):
            store.load(bad, MODEL, SPEC)
        with pytest.raises(InvalidAgentId):
            store.delete(bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["root"] and list((tmp_path / "root").iterdir()) == []
    for model in ("../../etc", "/abs/path", "..", "quarantine", "mlx-community/Llama-3.2-1B-Instruct-4bit"):
        key = model_key(model)
        assert "/" not in key and not key.startswith(".") and key != "quarantine"
    assert model_key("a/b") != model_key("a-b")


def test_store_lists_verifies_deletes_and_cleans_temp_files(tmp_path):
    store = CacheStore(tmp_path)
    a = store.save(_record("alice"))
    b = store.save(_record("bob"))
    c = store.save(_record("alice", model="org/other"))
    stale = a.parent / f".tmp-{2**22 + 12345}-0bad-alice"  # pid above Linux's pid_max: dead
    live = a.parent / f".tmp-{os.getpid()}-0bad-bob"  # a writer in this process, mid-save
    stale.write_bytes(b"half")
    live.write_bytes(b"half")
    store = CacheStore(tmp_path)
    assert not stale.exists() and live.exists()
    live.unlink()

    entries = sorted(store.entries(), key=lambda e: (e["model"], e["agent"]))
    assert [(e["agent"], e["model"], e["path"]) for e in entries] == [
        ("alice", "org/model", a), ("bob", "org/model", b), ("alice", "org/other", c)]
    assert all(e["tokens"] == len(_record().tokens) and e["bytes"] == a.stat().st_size for e in entries)
    assert read_meta(a)["updated"] == entries[0]["updated"] == _record().updated

    _rewrite(b, _flip(-1))
    assert {(p.name, ok, why) for p, ok, why in store.verify()} == {
        ("alice.safetensors", True, "ok"), ("bob.safetensors", False, "bad checksum")}
    assert store.disk_bytes() == sum(p.stat().st_size for p in (a, b, c))
    assert store.delete("alice") == 2 and store.delete("alice") == 0
    assert store.delete("bob", "org/other") == 0 and store.delete("bob", MODEL) == 1
    assert store.entries() == []


# -- a writer killed at random points --------------------------------------


def test_writer_killed_at_random_never_leaves_a_wrong_cache(tmp_path):
    """SIGKILL a process that saves caches in a loop, at random moments; after each
    kill every agent's file loads and holds a version that was written: the last
    save that finished, or the one cut short. Nothing is quarantined, no temp
    file survives reopening the store or is ever listed as a cache."""
    rng, root, trials = random.Random(7), tmp_path / "store", 22
    env = dict(os.environ, PYTHONPATH=str(REPO))

    def spawn(k: int) -> subprocess.Popen:
        # Children start (and import MLX) ahead of their turn so trials stay short.
        args = [sys.executable, "-m", "tests.runtime.cache_writer", str(root), str(k * 10_000)]
        with open(tmp_path / f"stderr-{k}", "w") as err:
            return subprocess.Popen(
                args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, cwd=REPO, env=env
            )

    pool, on_disk, mid_write, in_save, saves = deque(spawn(k) for k in range(3)), {}, 0, 0, 0
    try:
        for k in range(trials):
            proc = pool.popleft()
            if k + len(pool) + 1 < trials:
                pool.append(spawn(k + len(pool) + 1))
            assert proc.stdout.readline().strip() == "ready", (tmp_path / f"stderr-{k}").read_text()
            proc.stdin.write("go\n")
            proc.stdin.flush()
            time.sleep(rng.uniform(0.03, 0.3))
            proc.kill()  # SIGKILL: no cleanup, no flush, no finally
            proc.wait()
            done, cut = {}, None
            for line in proc.stdout.read().splitlines():
                what, agent, v = line.split()
                if what == "done":
                    done[agent], cut, saves = int(v), None, saves + 1
                else:
                    cut = (agent, int(v))
            temps = list(root.rglob(".tmp-*"))
            mid_write += bool(temps)
            in_save += cut is not None

            store = CacheStore(root)
            assert not list(root.rglob(".tmp-*"))  # the dead writer's temp file is gone
            assert all(e["path"].name == f"{e['agent']}.safetensors" for e in store.entries())
            for agent in writer.AGENTS:
                allowed = {done.get(agent, on_disk.get(agent))} | ({cut[1]} if cut and cut[0] == agent else set())
                rec = store.load(agent, writer.MODEL_ID, writer.SPEC)
                version = None if rec is None else int(rec.text.rsplit(" v", 1)[1])
                assert version in allowed, (agent, version, allowed)
                if rec is not None:
                    want = writer.record(version)
                    assert (rec.tokens, rec.updated) == (want.tokens, want.updated)
                    assert_same_cache(want.cache, rec.cache)
                on_disk[agent] = version
            assert not (root / "quarantine").exists()
    finally:
        for p in pool:
            p.kill()
            p.wait()
    print(f"\n{trials} kills, {saves} saves completed; {in_save} kills inside save(), "
          f"{mid_write} left a temp file (killed mid-write)")
    assert mid_write >= 3  # the test must really hit writes in progress
