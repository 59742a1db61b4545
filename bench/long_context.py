"""``semantic bench compare --only long-context``: one agent a context, ours
against the peer, at 8K-64K tokens.

Both servers load the same float32 model directory as the other workloads,
with its context **stretched** (``stretch``: ``max_position_embeddings``
raised, nothing else): SmolLM2-135M was trained to 8K, so what it says past
that means nothing, but a long agent's arithmetic -- prefill, attention over
the past, the bytes held and written -- does not depend on it. Per context,
both servers, alternating:

* **cold** -- a fresh agent whose prompt is the whole context: TTFT;
* **follow-up** -- the same agent's ~50-token follow-up: TTFT, and the
  decode time per token after the first (median over both turns);
* **peak RSS** -- the server's VmHWM (process tree) after that context's
  turns, and our cache's bytes on disk;
* **after a restart** -- ours is restarted once all contexts have run and
  each agent sends one more turn (its cache read from disk). The peer keeps
  nothing across a restart: its TTFT after one is a cold prefill of the
  whole conversation, so its cold TTFT stands for it (not measured twice).

Then **four agents** at once (the largest context up to 16K; none in a run
of longer contexts only, where four cold prefills would take hours), on both
servers restarted (so their peaks are this part's): four fresh agents
prefilled together, then one follow-up each, all at once: system tokens/s
of that round and each server's peak RSS.
"""

from __future__ import annotations

import json
import shutil
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from . import report
from .client import Turn, chat
from .servers import Server, ours_spec, peer_spec

__all__ = ["four_agents_context", "measure", "stretch"]

OURS, PEER = report.OURS, report.PEER
SYSTEM = "You are a careful reader who answers briefly."
ASK = "In one sentence: what is the text above about?"
FOLLOW_UP = "Thank you. Which detail above matters most to a ship's captain, and why?"
AGAIN = "And which detail matters least?"
TIMEOUT = httpx.Timeout(connect=10.0, read=3600.0, write=60.0, pool=60.0)  # a 64K cold prefill takes long
FOUR = 4
FOUR_TOKENS = 32  # each of the four agents' follow-up: long enough to time decoding together


def stretch(model_dir: str | Path, out: Path, context: int) -> Path:
    """``model_dir`` with its context window raised to ``context`` tokens:
    the weights linked, ``config.json`` (and the tokenizer's
    ``model_max_length``) rewritten."""
    out.mkdir(parents=True, exist_ok=True)
    for f in Path(model_dir).iterdir():
        target = out / f.name
        if f.name in ("config.json", "tokenizer_config.json"):
            data = json.loads(f.read_text())
            data["max_position_embeddings" if f.name == "config.json" else "model_max_length"] = context
            target.write_text(json.dumps(data, indent=1))
        elif not target.exists():
            try:
                target.symlink_to(f.resolve())
            except OSError:
                shutil.copy2(f, target)
    return out


def four_agents_context(contexts: tuple) -> int | None:
    """The four agents' context: the largest measured up to 16K (None: none is)."""
    return max((c for c in contexts if c <= 16384), default=None)


def disk_usage_by_agent(root: Path) -> dict[str, int]:
    """Bytes of each agent's caches under ``root``."""
    from semantic.runtime.store.cache_file import CacheStore

    out: dict[str, int] = {}
    for e in CacheStore(root).entries():
        out[e["agent"]] = out.get(e["agent"], 0) + e["bytes"]
    return out


def _decode_ms(turn: Turn) -> float | None:
    n = turn.completion_tokens
    return (turn.e2e - turn.ttft) / (n - 1) * 1000 if n > 1 else None


class LongContext:
    def __init__(self, servers: dict[str, Server], texts, log, tokens: int):
        self.servers, self.texts, self.log, self.tokens = servers, texts, log, tokens
        self.client = httpx.Client(timeout=TIMEOUT)
        self.history: dict = {}
        self.step = 0

    def order(self) -> list[str]:
        """A B, then B A, ...: who goes first alternates step by step."""
        self.step += 1
        return [OURS, PEER] if self.step % 2 else [PEER, OURS]

    def close(self) -> None:
        self.client.close()

    def send(self, side: str, agent: str, messages: list[dict], max_tokens: int, client=None) -> Turn:
        s = self.servers[side]
        return chat(client or self.client, s.url, agent, messages, max_tokens, s.spec.body_model)

    def prompt(self, context: int, *key) -> list[dict]:
        text = self.texts.passage(context - 60, "long", context, *key)
        return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"{text}\n\n{ASK}"}]

    def one_context(self, context: int) -> dict:
        """Cold turn and follow-up of a fresh agent on each side."""
        out = {}
        for side in self.order():
            agent, msgs = f"long-{context}", self.prompt(context)
            cold = self.send(side, agent, msgs, self.tokens)
            msgs += [{"role": "assistant", "content": cold.text}, {"role": "user", "content": FOLLOW_UP}]
            follow = self.send(side, agent, msgs, self.tokens)
            self.history[side, context] = msgs + [{"role": "assistant", "content": follow.text}]
            memory = self.servers[side].memory()
            out[side] = {"cold_ttft": cold.ttft, "followup_ttft": follow.ttft, "prompt_tokens": cold.prompt_tokens,
                         "followup_cached": follow.cached_tokens,
                         "decode_ms": [x for x in map(_decode_ms, (cold, follow)) if x is not None],
                         "hwm_bytes": memory.get("hwm_bytes"), "rss_bytes": memory.get("rss_bytes")}
        self.log(f"long context {context}: cold TTFT " + ", ".join(
            f"{s} {out[s]['cold_ttft']:.1f} s" for s in out) + "; follow-up " + ", ".join(
            f"{s} {out[s]['followup_ttft'] * 1000:.0f} ms" for s in out))
        return out

    def after_restart(self, context: int) -> float:
        msgs = self.history[OURS, context] + [{"role": "user", "content": AGAIN}]
        turn = self.send(OURS, f"long-{context}", msgs, 1)
        self.log(f"long context {context}: ours after a restart {turn.ttft * 1000:.0f} ms "
                 f"({turn.cached_tokens} of {turn.prompt_tokens} tokens cached)")
        return turn.ttft

    def four_agents(self, side: str, context: int) -> dict:
        """Four fresh agents prefilled together, then their follow-ups at once."""
        prompts = [self.prompt(context, "four", j) for j in range(FOUR)]
        with ThreadPoolExecutor(FOUR) as pool:
            firsts = list(pool.map(lambda j: self.send(side, f"four-{context}-{j}", prompts[j], 1), range(FOUR)))
        barrier = threading.Barrier(FOUR)

        def follow(j):
            msgs = prompts[j] + [{"role": "assistant", "content": firsts[j].text},
                                 {"role": "user", "content": FOLLOW_UP}]
            with httpx.Client(timeout=TIMEOUT) as client:
                barrier.wait()
                return self.send(side, f"four-{context}-{j}", msgs, FOUR_TOKENS, client)

        with ThreadPoolExecutor(FOUR) as pool:
            turns = list(pool.map(follow, range(FOUR)))
        start, end = min(t.start for t in turns), max(t.end for t in turns)
        memory = self.servers[side].memory()
        row = {"system_tps": sum(t.completion_tokens for t in turns) / (end - start),
               "tokens": sum(t.completion_tokens for t in turns), "hwm_bytes": memory.get("hwm_bytes"),
               "context": context}
        self.log(f"four agents at {context} on {self.servers[side].spec.name}: {row['system_tps']:.1f} tok/s, "
                 f"peak RSS {row['hwm_bytes'] / 2**20:.0f} MiB")
        return row


def measure(plan, model_dir: str, texts, log, workdir: Path) -> dict:
    """The workload's raw figures: {"contexts": {side: {context: {...}}}, "restart_ttft": {context: s},
    "disk_bytes": {context: n}, "four_agents": {side: {...}}, "servers": {side: what it ran}}."""
    contexts = tuple(plan.long_contexts)
    four_context = four_agents_context(contexts)
    model = stretch(model_dir, workdir / "long-model", max(contexts) + 1024)
    log(f"long context: {', '.join(map(str, contexts))} tokens, the model stretched to {max(contexts) + 1024}")
    ours_cache = workdir / "long-semantic-cache"
    servers = {OURS: Server(ours_spec(str(model), ours_cache), workdir / "long-semantic.log"),
               PEER: Server(peer_spec(str(model), workdir / "long-peer"), workdir / "long-peer.log")}
    bench = LongContext(servers, texts, log, plan.long_tokens)
    raw: dict = {"contexts": {OURS: {}, PEER: {}}, "restart_ttft": {}, "four_agents": {},
                 "servers": {side: {"name": s.spec.name, "model": str(model), **s.spec.settings}
                             for side, s in servers.items()}}
    try:
        for s in servers.values():
            s.start(timeout=600.0)
        for c in contexts:
            for side, row in bench.one_context(c).items():
                raw["contexts"][side][c] = row
        servers[OURS].restart()
        for c in contexts:
            raw["restart_ttft"][c] = bench.after_restart(c)
        servers[OURS].stop()
        by_agent = disk_usage_by_agent(ours_cache)
        raw["disk_bytes"] = {c: by_agent.get(f"long-{c}") for c in contexts}
        if four_context is not None:
            for side in bench.order():
                for s in servers.values():
                    s.stop()
                servers[side].start(timeout=600.0)
                raw["four_agents"][side] = bench.four_agents(side, four_context)
    finally:
        bench.close()
        for s in servers.values():
            s.stop()
    return raw
