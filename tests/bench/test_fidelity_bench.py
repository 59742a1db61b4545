"""``semantic bench fidelity`` on a tiny random-weight model: the JSON the issue
names, the engine's chunks, and the restart's disk round trip inside a block."""

from types import SimpleNamespace

from semantic.bench.fidelity import chunks, fidelity
from tests.runtime.test_engine import ByteTokenizer
from tests.tiny import VOCAB, tiny_model


def test_chunks_end_at_blocks_and_at_the_restart():
    assert chunks(600, None, 256) == [(0, 256), (256, 512), (512, 600)]
    assert chunks(600, 301, 256) == [(0, 256), (256, 301), (301, 512), (512, 600)]


def test_fidelity_reports_each_text_at_16_8_and_4_bits():
    loaded = SimpleNamespace(name="tiny", model=tiny_model("llama"), tokenizer=ByteTokenizer())
    text = [1 + (i * 7919) % (VOCAB - 1) for i in range(600)]
    out = fidelity(loaded, [("t", text)])
    (row,) = out["texts"]
    assert set(row) == {"name", "tokens", "ppl", "ratio", "ratio_after_restart"} and row["tokens"] == 600
    assert set(row["ppl"]) == {"16", "8", "4"} and set(row["ratio"]) == set(row["ratio_after_restart"]) == {"8", "4"}
    assert all(v > 1 for v in row["ppl"].values())
    for bits in ("8", "4"):  # the disk round trip changes nothing but the chunk cut at the restart
        assert abs(row["ratio_after_restart"][bits] - row["ratio"][bits]) < 1e-3
