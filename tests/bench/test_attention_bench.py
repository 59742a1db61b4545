"""``semantic bench attention``'s prompt-chunk part: a chunk of each row
count over a past beyond the device's float head, packed against unpacked."""

from types import SimpleNamespace

from semantic.bench.attention import chunk_rows
from semantic.cli.main import parser
from semantic.runtime.kv import float_head


def test_chunk_rows_times_the_past_packed_and_unpacked():
    spec = SimpleNamespace(n_kv_heads=1, head_dim=64)
    result = chunk_rows(spec, heads=2, keys=float_head() + 512, rows=[1, 4], rounds=1)
    assert list(result) == [1, 4]
    for r in result.values():
        assert r["packed_ms"] > 0 and r["unpacked_ms"] > 0 and r["unpacked_over_packed"] > 0


def test_attention_bench_takes_chunk_keys_and_rows():
    args = parser().parse_args(["bench", "attention", "--chunk-keys", "16384", "--chunk-rows", "2,8"])
    assert (args.chunk_keys, args.chunk_rows) == (16384, "2,8")
