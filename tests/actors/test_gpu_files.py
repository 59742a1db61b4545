"""The GPU thread only computes: with every file operation on that thread made
to raise (a Python audit hook), agents go through everything that touches
their files -- turns that demote others to disk, warm loads, preemption and
resume, a fork of a cache on disk, a delete, a restart -- and every reply is
the one it is without the hook."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import anyio
import pytest

from semantic.actors import Runtime
from tests.web.live import kv_bytes, tiny_loaded

pytestmark = pytest.mark.anyio

_touched: list[tuple[str, object]] = []
_armed = threading.Event()


_recording = threading.Event()  # record what the GPU thread touches, without refusing it


def _no_files_on_the_gpu_thread(event: str, args: tuple) -> None:
    if (_armed.is_set() or _recording.is_set()) and threading.current_thread().name == "semantic-gpu" \
            and (event == "open" or event.startswith(("os.", "shutil.", "glob."))):
        _touched.append((event, args[:1]))
        if _armed.is_set():
            raise PermissionError(f"the GPU thread touched a file: {event} {args[:1]}")


sys.addaudithook(_no_files_on_the_gpu_thread)  # once per process; inert unless armed

SYSTEMS = ["You count sheep.", "You count stars.", "You count waves."]


async def workload(root, hooked: bool) -> dict[str, list[tuple[str, int]]]:
    """Everything that reads, writes or deletes an agent's files, in a 3-block
    budget: each agent's replies with the prompt tokens its cache served."""
    out: dict[str, list[tuple[str, int]]] = {}
    loaded = tiny_loaded()

    async def turn(agent, text: str, max_tokens: int) -> None:
        async with agent.send(text, max_tokens=max_tokens) as reply:
            answer = await reply.text()
        out.setdefault(agent.id, []).append((answer, reply.result.reused_tokens))

    async with Runtime.open(loaded, root, kv_bytes(3)) as rt:
        if hooked:
            _armed.set()
        agents = [await rt.agent(f"agent-{i}", system=s) for i, s in enumerate(SYSTEMS)]
        async with anyio.create_task_group() as tg:  # together they outgrow the budget: preemption
            for agent in agents:
                tg.start_soon(turn, agent, "Start counting.", 300)
        for agent in agents:  # one at a time: each demotes another, and comes back from disk
            await turn(agent, "Go on.", 8)
        await rt.demote("agent-0")
        with anyio.fail_after(10):
            while rt.cache_tier("agent-0") != "warm":
                await anyio.sleep(0.01)
        fork = await agents[0].fork("agent-0-fork")  # its source comes from disk
        await turn(fork, "And then?", 8)
        await agents[1].delete()
        stats = rt.stats()
    async with Runtime.open(loaded, root, kv_bytes(3)) as rt:  # a restart: warm loads only
        for agent_id in ("agent-0", "agent-2", "agent-0-fork"):
            await turn(await rt.agent(agent_id), "Once more.", 8)
    _armed.clear()
    assert stats["preemptions"] >= 1
    return out


@pytest.mark.slow
async def test_the_gpu_thread_opens_no_file(tmp_path):
    _touched.clear()
    try:
        hooked = await workload(tmp_path / "hooked", hooked=True)
    finally:
        _armed.clear()
    assert _touched == []
    assert hooked == await workload(tmp_path / "plain", hooked=False)
    # after the restart every turn came from disk (random weights' replies may not re-tokenize
    # the same, so a turn after such a reply may go cold: the reuse tests cover reuse)
    assert all(hooked[a][-1][1] > 0 for a in ("agent-0", "agent-2", "agent-0-fork")), hooked


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("anyio_backend", ["trio"])  # loading SmolLM2 three times: one backend
async def test_the_gpu_thread_reads_only_a_model_it_loads_by_name(smollm2, tmp_path):
    """Loading a model by name is the one time the GPU thread reads files (mlx-lm's
    loader makes MLX arrays as it reads: ``docs/architecture.md``): at start-up, on
    a swap and on a reload after ``model_idle_s``, it opens that model's directory
    and the Python code it imports, nothing of the cache directory or the cache home."""
    name, tiny = smollm2.name, tiny_loaded()
    _touched.clear()
    _recording.set()
    try:
        async with Runtime.open(name, tmp_path / "cache", 256 << 20, models=[tiny], model_idle_s=0.5) as rt:
            agent = await rt.agent("reader", system="You are terse.")
            await agent.reply("Hi.", max_tokens=2)  # start-up: loaded by name
            await agent.reply("Hi.", model=tiny.name, max_tokens=2)  # a swap to a model in memory
            await agent.reply("Hi.", model=name, max_tokens=2)  # and back: loaded by name
            with anyio.fail_after(60):
                while rt.stats()["loaded"]:
                    await anyio.sleep(0.05)
            await agent.reply("Hi.", max_tokens=2)  # reloaded after idle
    finally:
        _recording.clear()
    code = tuple(str(p) for p in {Path(sys.prefix), Path(sys.base_prefix), Path(__file__).parents[2]})
    model_dir = str(smollm2.path)
    data = [(e, a) for e, a in _touched if a and not str(a[0]).startswith(model_dir)
            and not (str(a[0]).startswith(code) and (str(a[0]).endswith((".py", ".pyc", ".so"))
                                                      or e in ("os.listdir", "os.scandir")))]
    assert data == [], data
    assert sum(e == "open" and str(a[0]).endswith("config.json") for e, a in _touched) >= 3, "three loads by name"
