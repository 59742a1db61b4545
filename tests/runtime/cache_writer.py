"""The process the crash test kills: saves cache files in a loop until SIGKILL.

    python -m tests.runtime.cache_writer ROOT FIRST_VERSION

Builds its K/V, prints ``ready``, waits for a line on stdin, then saves
versions FIRST_VERSION, FIRST_VERSION + 1, ... of the agents in turn into a
``CacheStore(ROOT)``, printing ``start AGENT V`` before and ``done AGENT V``
after each save. An agent's versions share their leading blocks, so a save
writes the blocks it appends, the ring, the text and the manifest.
``record(v)`` rebuilds any version, so a test can tell what a cache should hold.
"""

from __future__ import annotations

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)

import functools
import sys

import mlx.core as mx
from semantic.runtime.kv import SequenceQuantizedKVCache, WindowKVCache
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import CacheRecord

AGENTS = ("a0", "a1", "a2", "a3")
TOKENS = (16, 500, 1500, 3000)  # per agent, first version; later ones append blocks, then trim back
GROWTH = 300  # tokens a version adds to its agent's previous one (every fourth trims back to TOKENS)
MODEL_ID, SPEC = "crash/model", "crashspec"
H, D, FULL, WINDOW, SPARE = 2, 64, 3, 32, 8  # a small window layer: the blocks dominate what a save writes


@functools.lru_cache(maxsize=None)
def keys_and_values(agent: int) -> tuple:
    """Deterministic K/V for as many tokens as any version of the agent holds: every
    version's cache is a prefix of these (float32 for even agents, bfloat16 for odd)."""
    n = TOKENS[agent] + 3 * GROWTH
    dtype = mx.float32 if agent % 2 == 0 else mx.bfloat16
    keys = mx.random.split(mx.random.key(1000 * agent), FULL + 1)
    out = tuple(mx.random.uniform(-2, 2, (2, 1, H, n, D), key=k).astype(dtype) for k in keys)
    mx.eval(out)
    return out


def layers(agent: int, n: int, kv=None) -> list:
    """FULL Q4 layers then one sliding-window layer, holding the first ``n`` tokens of ``kv``
    (the agent's own by default)."""
    caches = []
    for i, x in enumerate(kv or keys_and_values(agent)):
        c = SequenceQuantizedKVCache(64, 4) if i < FULL else WindowKVCache(WINDOW, spare=SPARE)
        step = n if i < FULL else WINDOW  # a window layer fed a window at a time
        for lo in range(0, n, step):
            c.update_and_fetch(x[0][..., lo : min(n, lo + step), :], x[1][..., lo : min(n, lo + step), :])
        mx.eval(c.state)
        caches.append(c)
    return caches


@functools.lru_cache(maxsize=None)
def _versions(agent: int, n: int) -> tuple:
    """The agent's own layers at ``n`` tokens, built once: saves, not building, fill the loop."""
    return tuple(layers(agent, n))


def token_ids(agent: int, n: int) -> list[int]:
    return [(agent * 7919 + j * 31) % 50_000 for j in range(n)]


def record(version: int) -> CacheRecord:
    """Version ``version``: agent version % 4, its tokens grown by GROWTH per version, trimmed back every fourth."""
    agent, rounds = version % len(AGENTS), version // len(AGENTS)
    n = TOKENS[agent] + GROWTH * (rounds % 4)
    return CacheRecord(
        agent_id=AGENTS[agent],
        model_id=MODEL_ID,
        spec_hash=SPEC,
        tokens=token_ids(agent, n),
        text=f"{AGENTS[agent]} v{version}",
        created=1000.0,
        updated=1000.0 + version,
        cache=list(_versions(agent, n)),
    )


def main() -> None:
    root, first = sys.argv[1], int(sys.argv[2])
    for v in range(4 * len(AGENTS)):  # every version's layers, before "ready"
        record(v)
    print("ready", flush=True)
    sys.stdin.readline()
    store = CacheStore(root)
    v = first
    while True:
        rec = record(v)
        print("start", rec.agent_id, v, flush=True)
        store.save(rec)
        print("done", rec.agent_id, v, flush=True)
        v += 1


if __name__ == "__main__":
    main()
