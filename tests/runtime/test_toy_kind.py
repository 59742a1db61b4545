"""A new cache kind needs no edit outside its own module: a toy kind defined
in this test module alone, joined with ``kv.register``, is made by
``make_sequence_cache``, written to an agent's files beside a quantized
layer, read back as it was, and its manifest entry is checked by its own
class; unregistered, its files are a kind the reader does not know."""

from __future__ import annotations

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import json
import types

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ConcatenateKVCache, KVCache, _BaseCache

from semantic.runtime.store import cache_manifest
from semantic.runtime import kv
from semantic.runtime.store.cache_file import CacheStore, load, read_manifest
from semantic.runtime.cache_records import MANIFEST, CacheFileError, CacheRecord
from semantic.runtime.kv.layer import Trimmed

TOY = "toy"


class ToyKVCache(Trimmed, _BaseCache):
    """Every token's keys and values in float, in the block files, and their
    mean key in the ring: a full-attention cache that never quantizes, in
    place of mlx-lm's ``ConcatenateKVCache``."""

    KINDS = (TOY,)
    float_keys, attends_new, blocked = True, False, True

    def __init__(self):
        self.keys = self.values = self.mean_key = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        if self.offset:
            keys, values = mx.concatenate([self.keys, keys], axis=2), mx.concatenate([self.values, values], axis=2)
        self.keys, self.values, self.offset = keys, values, keys.shape[2]
        self.mean_key = keys.mean(axis=2)
        return keys, values

    @property
    def trimmable_tokens(self) -> int:
        return self.offset

    def is_trimmable(self):
        return True

    def trim(self, n):
        n = min(n, self.offset)
        self.offset -= n
        self.keys, self.values = self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return n

    def view(self, float_head=None):
        return self

    @property
    def arrays(self):
        return [self.keys, self.values, self.mean_key]

    def describe(self):
        entry = {"kind": TOY, "offset": self.offset}
        if not self.offset:
            return entry, {}, {}
        return entry, {"k": (0, self.keys), "v": (0, self.values)}, {"mean_key": self.mean_key}

    @classmethod
    def rebuild(cls, entry, arrays):
        c = cls()
        if entry["offset"]:
            c.keys, c.values, c.mean_key = arrays["k"], arrays["v"], arrays["mean_key"]
            c.offset = entry["offset"]
        return c

    @classmethod
    def check_entry(cls, entry, n):
        tensors = entry["tensors"]
        if set(tensors) != ({"k", "v", "mean_key"} if n else set()):
            raise ValueError("missing or extra toy tensors")
        if n and any(len(tensors[name]) != 5 or tensors[name][3:] != [0, n] for name in ("k", "v")):
            raise ValueError("toy tensors that do not cover their tokens")

    @classmethod
    def blocked_names(cls, entry):
        return ["k", "v"]

    @classmethod
    def ring_names(cls, entry):
        return ["mean_key"]

    @classmethod
    def replacing(cls, cache, bits, group_size):
        return cls() if type(cache) is ConcatenateKVCache else None


MODEL = types.SimpleNamespace(make_cache=lambda: [ConcatenateKVCache(), KVCache()])  # what mlx-lm makes: one toy layer
H, D, N = 2, 64, 300  # tokens past a block's end: the toy's rows span two block files


@pytest.fixture
def toy():
    kv.register(ToyKVCache)
    yield ToyKVCache
    kv.unregister(ToyKVCache)


def saved(root, toy) -> tuple[CacheRecord, CacheStore]:
    """A record of the toy layer and a quantized one, ``N`` tokens fed in two chunks, saved under ``root``."""
    cache = kv.make_sequence_cache(MODEL)
    assert [type(c) for c in cache] == [toy, kv.SequenceQuantizedKVCache]
    keys, values = (mx.random.normal((1, H, N, D), key=mx.random.key(seed)) for seed in (1, 2))
    for lo, hi in ((0, 200), (200, N)):
        for c in cache:
            c.update_and_fetch(keys[..., lo:hi, :], values[..., lo:hi, :])
    mx.eval(cache.arrays())
    record = CacheRecord("toy-agent", "toy/model", "toyspec", list(range(N)), "toy text", 1.0, 2.0, cache)
    store = CacheStore(root)
    store.save(record)
    return record, store


def test_a_kind_registered_here_is_made_written_and_read_back(tmp_path, toy):
    record, store = saved(tmp_path, toy)
    d = store.agent_dir(record.agent_id, record.model_id)
    m = read_manifest(d)
    assert [e["kind"] for e in m["layers"]] == [TOY, "quantized"]
    assert m["layers"][0]["tensors"]["k"] == ["F32", H, D, 0, N] and len(m["blocks"]) == 2 and m["ring"]

    back = load(d, model_id=record.model_id, spec_hash=record.spec_hash)
    assert back.tokens == record.tokens and back.text == record.text
    assert [type(c) for c in back.cache] == [toy, kv.SequenceQuantizedKVCache]
    assert [c.offset for c in back.cache] == [N, N]
    for a, b in zip(record.cache[0].arrays, back.cache[0].arrays, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and mx.array_equal(a, b).item()
    for a, b in zip(record.cache[1].floats(), back.cache[1].floats(), strict=True):
        assert mx.array_equal(a, b).item()


def test_a_kind_checks_its_own_manifest_entry(tmp_path, toy):
    record, store = saved(tmp_path, toy)
    d = store.agent_dir(record.agent_id, record.model_id)
    m = json.loads((d / MANIFEST).read_bytes())
    m["layers"][0]["tensors"]["v"][4] = N - 1  # the toy's values stop a token short
    (d / MANIFEST).write_bytes(cache_manifest.seal(m))
    with pytest.raises(CacheFileError) as e:
        read_manifest(d)
    assert e.value.reason == "bad layout" and e.value.detail == "layer 0: toy tensors that do not cover their tokens"
    assert store.read(record.agent_id, record.model_id, record.spec_hash) is None  # quarantined: the agent starts cold


def test_unregistered_a_kind_is_unknown_to_the_files_and_the_factory(tmp_path):
    kv.register(ToyKVCache)
    try:
        record, store = saved(tmp_path, ToyKVCache)
    finally:
        kv.unregister(ToyKVCache)
    assert TOY not in kv.BY_KIND
    with pytest.raises(CacheFileError) as e:  # no kind's: its blocked tensor entries fail as a ring's
        read_manifest(store.agent_dir(record.agent_id, record.model_id))
    assert e.value.reason == "bad layout" and e.value.detail.startswith("layer 0: ")
    with pytest.raises(ValueError, match="unsupported cache type ConcatenateKVCache"):
        kv.make_sequence_cache(MODEL)


def test_a_tag_another_kind_holds_is_refused():
    clash = type("Clash", (ToyKVCache,), {"KINDS": ("window",)})
    with pytest.raises(ValueError, match="already another kind's"):
        kv.register(clash)
    assert kv.BY_KIND["window"] is kv.WindowKVCache
