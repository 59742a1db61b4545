"""The workloads ``semantic bench compare`` runs on its two servers, ours and
the peer (``bench.compare`` starts them, picks the workloads and writes the
report): their sizes (``Plan``), their prompts (``Texts``) and their runs
(``Bench``: multi-turn, restart, many agents, concurrency, each request
alternating between the servers; long-context is ``bench.long_context``).
"""

from __future__ import annotations

import itertools
import statistics
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

from . import report
from .client import Turn, chat
from .servers import Server

TEXT = Path(__file__).parent / "data" / "lighthouses.txt"
SYSTEM = "You are a careful reader who answers briefly."
FOLLOW_UP = "Thank you. In one short sentence: which detail above matters most to a ship's captain, and why?"
RETELL = "Retell the text above in detail, paragraph by paragraph."
OURS, PEER = report.OURS, report.PEER
RERUNS = 3  # concurrency rounds run again on other prompts where a reply ended short (``_full_round``)
TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)


@dataclass
class Plan:
    """Workload sizes.  ``--quick`` fits < 10 minutes on 2 cores, the full run < 45."""

    runs: int = 3  # multi-turn and restart: fresh agents, medians over them
    turns: int = 6
    turn_tokens: int = 200
    turn_max_tokens: int = 32
    restart_turn: int = 4  # the turn after the restart
    agents: tuple = (4, 16, 64)
    history: int = 1024  # tokens of each agent's history
    setup_max_tokens: int = 8
    follow_max_tokens: int = 4
    setup_clients: int = 4  # setup requests in flight at once per server (not timed)
    clients: tuple = (1, 2, 4, 8)
    context: int = 1024
    tokens: int = 128
    repeats: int = 3
    # The peer once more with --kv-bits 4 (memory): its histories only; one past its
    # 10-entry LRU, its RSS has plateaued.
    kv4_agents: int = 11
    long_contexts: tuple = (8192, 16384, 32768, 65536)
    long_tokens: int = 16  # each long-context turn's reply

    @classmethod
    def quick(cls) -> Plan:
        # 16 agents are past the peer's 10-entry LRU, where N = 64 differs only in count;
        # 64 histories would cost more than the whole budget on two cores.
        return cls(turn_max_tokens=8, agents=(4, 16), history=512, clients=(1, 4), context=256,
                   tokens=32, long_contexts=(8192, 16384, 32768))

    @classmethod
    def full(cls) -> Plan:
        # 64 agents x 1K tokens of history costs ~15 minutes of setup per server pair on
        # two cores, plus ~8 minutes of the peer re-prefilling them: 512 tokens fits.
        return cls(history=512)


# --- prompts ---------------------------------------------------------------------


class Texts:
    """Passages of about n tokens of ``bench/data/lighthouses.txt``, stable per key;
    different keys start at different words."""

    def __init__(self, tokenizer_json: Path | None):
        self.words = TEXT.read_text().split()
        self.starts: dict[tuple, int] = {}
        self.tok = None
        if tokenizer_json is not None and tokenizer_json.is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(tokenizer_json))

    def count(self, text: str) -> int:
        return len(self.tok.encode(text).ids) if self.tok else int(len(text.split()) * 1.3)

    def passage(self, tokens: int, *key) -> str:
        start = self._start(key)
        n = max(8, int(tokens / 1.4))
        text = " ".join(self.words[(start + i) % len(self.words)] for i in range(n))
        while self.count(text) < tokens:
            n += 8
            text = " ".join(self.words[(start + i) % len(self.words)] for i in range(n))
        return text

    def _start(self, key: tuple) -> int:
        """The key's first word. Two keys on one word would be one prompt twice (1 client's
        rounds 2 and 3 were), which the peer's prompt cache serves across agents."""
        if key not in self.starts:
            start = zlib.crc32(repr(key).encode()) % len(self.words)
            taken = set(self.starts.values())
            while start in taken:
                start = (start + 1) % len(self.words)
            self.starts[key] = start
        return self.starts[key]


# --- the runs -----------------------------------------------------------------------


class Bench:
    def __init__(self, servers: dict[str, Server], plan: Plan, texts: Texts, log: Callable[[str], None]):
        self.servers = servers
        self.plan = plan
        self.texts = texts
        self.log = log
        self.client = httpx.Client(timeout=TIMEOUT)
        self.step = 0

    def close(self):
        self.client.close()

    def order(self) -> list[str]:
        """A B, then B A, then A B ...: who goes first alternates step by step."""
        self.step += 1
        names = [OURS, PEER]
        return names if self.step % 2 else names[::-1]

    def send(self, side: str, agent: str, messages: list[dict], max_tokens: int) -> Turn:
        s = self.servers[side]
        return chat(self.client, s.url, agent, messages, max_tokens, s.spec.body_model)

    def warm_up(self, side: str, tag: str = "") -> None:
        """Load the model and warm its kernels at a few prompt sizes (agents used only here)."""
        for n in (16, 120, 300):
            text = self.texts.passage(n, "warm-up", tag)
            self.send(side, f"bench-warm-up-{n}{tag}", [{"role": "user", "content": text}], 4)

    # multi-turn and restart share the conversation shape
    def _turn_text(self, run: str, t: int) -> str:
        return (f"Part {t} of my notes:\n{self.texts.passage(self.plan.turn_tokens - 25, run, t)}\n\n"
                f"In one sentence, what does part {t} add?")

    def _turn(self, side: str, agent: str, history: list[dict], run: str, t: int) -> Turn:
        history.append({"role": "user", "content": self._turn_text(run, t)})
        turn = self.send(side, agent, history, self.plan.turn_max_tokens)
        history.append({"role": "assistant", "content": turn.text})
        return turn

    def multi_turn(self) -> dict:
        p = self.plan
        raw = {OURS: {t: [] for t in range(1, p.turns + 1)}, PEER: {t: [] for t in range(1, p.turns + 1)}}
        for r in range(p.runs):
            agent = f"mt-{r}"
            hist = {side: [{"role": "system", "content": SYSTEM}] for side in raw}
            for t in range(1, p.turns + 1):
                for side in self.order():
                    turn = self._turn(side, agent, hist[side], agent, t)
                    raw[side][t].append((turn.ttft, turn.e2e, turn.cached_tokens, turn.prompt_tokens,
                                         turn.completion_tokens))
                self.log(f"multi-turn run {r + 1}/{p.runs}, turn {t}: TTFT "
                         + ", ".join(f"{s} {raw[s][t][-1][0] * 1000:.0f} ms" for s in raw))
        return raw

    def restart(self) -> dict:
        p = self.plan
        raw = {side: {"turn3": [], "turn4": [], "turn4_cached": [], "turn4_prompt": [], "restart_s": []}
               for side in (OURS, PEER)}
        hist = {(r, side): [{"role": "system", "content": SYSTEM}] for r in range(p.runs) for side in raw}
        for r in range(p.runs):
            for t in range(1, p.restart_turn):
                for side in self.order():
                    turn = self._turn(side, f"rs-{r}", hist[r, side], f"rs-{r}", t)
                    if t == p.restart_turn - 1:
                        raw[side]["turn3"].append(turn.ttft)
            self.log(f"restart: agent {r + 1}/{p.runs} has {p.restart_turn - 1} turns on both servers")
        for side in (OURS, PEER):
            began = time.perf_counter()
            self.servers[side].restart()
            self.warm_up(side, "-again")  # the model is loaded and warm; the agents' caches are not touched
            raw[side]["restart_s"].append(time.perf_counter() - began)
            self.log(f"restart: {self.servers[side].spec.name} restarted in "
                     f"{raw[side]['restart_s'][-1]:.1f} s (incl. warm-up)")
        for r in range(p.runs):
            for side in self.order():
                turn = self._turn(side, f"rs-{r}", hist[r, side], f"rs-{r}", p.restart_turn)
                raw[side]["turn4"].append(turn.ttft)
                raw[side]["turn4_cached"].append(turn.cached_tokens)
                raw[side]["turn4_prompt"].append(turn.prompt_tokens)
            self.log(f"restart: turn {p.restart_turn} of agent {r + 1}: TTFT "
                     + ", ".join(f"{s} {raw[s]['turn4'][-1] * 1000:.0f} ms" for s in raw))
        return raw

    def many_agents(self, sides: list[str], counts: tuple, tag: str = "ma",
                    follow_ups: bool = True) -> tuple[dict, dict]:
        """Returns (raw TTFTs per side and N, {side: history tokens of all agents})."""
        p = self.plan
        hist: dict = {}
        raw = {side: {} for side in sides}
        made = 0
        for n in counts:
            # Setup, not timed: each new agent's history, on both servers at once (a
            # server's prefill keeps about one of the two cores busy).
            start = time.perf_counter()
            jobs = [(side, i) for i in range(made, n) for side in sides]
            with ThreadPoolExecutor(p.setup_clients * len(sides)) as pool:
                list(pool.map(lambda job: self._setup_agent(job[0], tag, job[1], hist), jobs))
            self.log(f"many agents: {n - made} histories of ~{p.history} tokens on "
                     f"{' and '.join(self.servers[s].spec.name for s in sides)} "
                     f"in {time.perf_counter() - start:.0f} s")
            made = n
            for side in sides:
                raw[side][n] = []
                for i in range(n):
                    hist.setdefault((side, i, "tokens"), hist[side, i, "setup_tokens"])
            if not follow_ups:
                continue
            for i in range(n):  # round-robin follow-ups, timed
                order = self.order() if len(sides) == 2 else sides
                for side in order:
                    msgs = hist[side, i] + [{"role": "user", "content": FOLLOW_UP}]
                    turn = self.send(side, f"{tag}-{i}", msgs, p.follow_max_tokens)
                    hist[side, i] = msgs + [{"role": "assistant", "content": turn.text}]
                    hist[side, i, "tokens"] = (turn.prompt_tokens or 0) + turn.completion_tokens
                    raw[side][n].append({"ttft": turn.ttft, "prompt_tokens": turn.prompt_tokens,
                                         "cached_tokens": turn.cached_tokens})
            self.log(f"many agents N = {n}: p50 TTFT " + ", ".join(
                f"{self.servers[s].spec.name} {report.median(r['ttft'] for r in raw[s][n]) * 1000:.0f} ms"
                for s in sides))
        tokens = {side: sum(hist.get((side, i, "tokens"), 0) for i in range(made)) for side in sides}
        return raw, tokens

    def _setup_agent(self, side: str, tag: str, i: int, hist: dict) -> None:
        msgs = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Agent {i}, read these notes:\n"
                 f"{self.texts.passage(self.plan.history - 30, tag, i)}\n\nReply with one word."}]
        turn = self.send(side, f"{tag}-{i}", msgs, self.plan.setup_max_tokens)
        hist[side, i] = msgs + [{"role": "assistant", "content": turn.text}]
        hist[side, i, "setup_tokens"] = (turn.prompt_tokens or 0) + turn.completion_tokens

    def concurrency(self) -> dict:
        p = self.plan
        raw = {OURS: {c: [] for c in p.clients}, PEER: {c: [] for c in p.clients}}
        spare = itertools.count(p.repeats)  # the keys of rounds run again
        for rep in range(p.repeats):
            for c in p.clients:
                for side, row in self._full_round(c, rep, spare).items():
                    raw[side][c].append(row)
                self.log(f"concurrency round {rep + 1}/{p.repeats}, {c} client(s): system tok/s "
                         + ", ".join(f"{s} {raw[s][c][-1]['system_tps']:.1f}" for s in raw))
        return raw

    def _full_round(self, c: int, rep: int, spare: Iterator[int]) -> dict[str, dict]:
        """Both sides' round of ``c`` clients on the same prompts, run again on
        other prompts (``RERUNS`` times at most) while a reply on either side
        ended before ``tokens``: a reply that ends early lowers its round's
        tokens but hardly its time, so such a round weighs the two models'
        reply lengths, not the servers' speed (Q4 and float K/V may end a
        reply at different tokens)."""
        for rerun in range(RERUNS + 1):
            rows = {side: self._concurrent_round(side, c, rep) for side in self.order()}
            short = [side for side, row in rows.items() if row["tokens"] < c * self.plan.tokens]
            if not short or rerun == RERUNS:
                return {side: {**row, "reruns": rerun} for side, row in rows.items()}
            self.log(f"concurrency, {c} client(s): a reply of {' and '.join(short)} ended before "
                     f"{self.plan.tokens} tokens; the round again on other prompts")
            rep = next(spare)

    def _concurrent_round(self, side: str, c: int, rep: int) -> dict:
        p = self.plan
        # The same prompts on both sides, as every other part: a reply that ends early
        # lowers its round's tokens, not its time, so different texts would weigh unequally.
        texts = [f"{self.texts.passage(p.context - 30, 'cc', c, rep, j)}\n\n{RETELL}" for j in range(c)]
        barrier = threading.Barrier(c)
        s = self.servers[side]

        def one(j):
            msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": texts[j]}]
            with httpx.Client(timeout=TIMEOUT) as client:
                barrier.wait()
                return chat(client, s.url, f"cc-{c}-{rep}-{j}", msgs, p.tokens, s.spec.body_model)

        with ThreadPoolExecutor(c) as pool:
            turns = list(pool.map(one, range(c)))
        start, end = min(t.start for t in turns), max(t.end for t in turns)
        return {
            "system_tps": sum(t.completion_tokens for t in turns) / (end - start),
            "per_stream_tps": statistics.median(t.decode_tps or 0.0 for t in turns),
            "ttft": statistics.median(t.ttft for t in turns),
            "tokens": sum(t.completion_tokens for t in turns),
        }
