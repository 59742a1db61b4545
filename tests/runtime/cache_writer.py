"""The process the crash test kills: saves cache files in a loop until SIGKILL.

    python -m tests.runtime.cache_writer ROOT FIRST_VERSION

Builds its caches, prints ``ready``, waits for a line on stdin, then saves
versions FIRST_VERSION, FIRST_VERSION + 1, ... of the agents in turn into a
``CacheStore(ROOT)``, printing ``start AGENT V`` before and ``done AGENT V``
after each save. ``record(v)`` rebuilds any version, so a test can tell what
a file should hold.
"""

from __future__ import annotations

import runtime  # noqa: F401  (fast BLAS before mlx)

import functools
import sys

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from runtime.batch_cache import SequenceQuantizedKVCache
from runtime.cache_file import CacheRecord, CacheStore

AGENTS = ("a0", "a1", "a2", "a3")
TOKENS = (16, 500, 1500, 3000)  # per agent; a second variant doubles it: 0.02 to 5.5 MB a file
MODEL_ID, SPEC = "crash/model", "crashspec"
H, D, FULL, WINDOW = 2, 64, 3, 32


@functools.lru_cache(maxsize=None)
def layers(agent: int, variant: int) -> tuple:
    """Deterministic per-layer caches: FULL Q4 layers then one sliding ring, float16 scales
    for even agents and bfloat16 for odd ones."""
    n = TOKENS[agent] * (1 + variant) + variant
    dtype = mx.float32 if agent % 2 == 0 else mx.bfloat16
    key = mx.random.key(1000 * agent + variant)
    caches = []
    for i, k in enumerate(mx.random.split(key, FULL + 1)):
        x = mx.random.uniform(-2, 2, (2, 1, H, n, D), key=k).astype(dtype)
        if i < FULL:
            c = SequenceQuantizedKVCache(64, 4)
        else:
            c = RotatingKVCache(WINDOW)
        c.update_and_fetch(x[0], x[1])
        mx.eval(c.state)
        caches.append(c)
    return tuple(caches)


def record(version: int) -> CacheRecord:
    agent, variant = version % len(AGENTS), version // len(AGENTS) % 2
    cache = layers(agent, variant)
    n = cache[0].offset
    return CacheRecord(
        agent_id=AGENTS[agent],
        model_id=MODEL_ID,
        spec_hash=SPEC,
        tokens=[(version * 31 + j) % 50_000 for j in range(n)],
        text=f"{AGENTS[agent]} v{version}",
        created=1000.0,
        updated=1000.0 + version,
        cache=list(cache),
    )


def main() -> None:
    root, first = sys.argv[1], int(sys.argv[2])
    for a in range(len(AGENTS)):
        for variant in (0, 1):
            layers(a, variant)
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
