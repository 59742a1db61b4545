"""``semantic bench attention``: a long agent's decode step, its past read
from a float working copy or packed (``kv.DequantizingKVCache``).

* per layer: one decode token's attention over a past of each context, its
  keys and values in float (``runtime.model.attention.attend_each``) against read
  packed from 4-bit blocks (``PackedPast``: the CPU kernels where they run,
  and MLX's quantized matmul), with the model's head counts; medians and the
  ratios;
* a prompt chunk: one layer's attention of a chunk of each row count over
  a past past the device's float head (``kv.float_head``), those blocks read
  packed against unpacked for the chunk (``UnpackedPast``, what the CPU does
  from ``kv.unpacked_rows()`` rows), the unpacking timed with it;
* the engine: decode ms a token for one agent at each context, with the
  device's float head (``kv.device_float_head``) and with every closed block
  in float, and the memory its decode holds beyond the cache of record. Its cache is filled with random
  keys and values, not prefilled: what a step costs does not depend on what
  the keys say, and a 32K-token prefill would take most of an hour here.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
import mlx.core as mx


def _median_us(f, rounds: int) -> float:
    f()
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        f()
        times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


def _filled(keys: mx.array, values: mx.array, float_head, n: int):
    """A working copy (float head ``float_head``) over the first ``n`` of
    ``keys`` and ``values``, written a block a chunk, as the engine attends."""
    from semantic.runtime.kv import SequenceQuantizedKVCache

    view = SequenceQuantizedKVCache().view(float_head)
    for a in range(0, n, 256):
        view.update_and_fetch(keys[..., a : min(n, a + 256), :], values[..., a : min(n, a + 256), :])
    return view


@contextlib.contextmanager
def _mlx_packed():
    """PackedPast read by MLX's quantized matmul, as where the CPU kernels are not built."""
    from semantic.runtime.model import attention

    kernels, attention.CPU_KERNELS = attention.CPU_KERNELS, None
    try:
        yield
    finally:
        attention.CPU_KERNELS = kernels


def per_layer(spec, heads: int, contexts: list[int], rounds: int) -> dict:
    """Microseconds of one layer's decode attention over each context, float
    against packed (and packed by MLX's quantized matmul)."""
    from semantic.runtime.model.attention import attend_each

    out = {}
    for n in contexts:
        k, v = (mx.random.normal((1, spec.n_kv_heads, n, spec.head_dim), key=mx.random.key(i)) for i in (1, 2))
        q = mx.random.normal((1, heads, 1, spec.head_dim), key=mx.random.key(3))
        fetched = {}
        for head in (None, 256):
            view = _filled(k, v, head, n - 1)
            fetched[head] = view.update_and_fetch_past(k[..., n - 1 :, :], v[..., n - 1 :, :])
            mx.eval(fetched[head], view.arrays)
        float_us, packed_us = (_median_us(lambda f=f: mx.eval(attend_each(q, [f], 0.125)), rounds)
                               for f in (fetched[None], fetched[256]))
        with _mlx_packed():
            mlx_us = _median_us(lambda: mx.eval(attend_each(q, [fetched[256]], 0.125)), rounds)
        out[n] = {"float_us": round(float_us, 1), "packed_us": round(packed_us, 1), "mlx_packed_us": round(mlx_us, 1),
                  "packed_over_float": round(packed_us / float_us, 2)}
    return out


def chunk_rows(spec, heads: int, keys: int, rows: list[int], rounds: int) -> dict:
    """Milliseconds of one layer's attention of a prompt chunk of each row
    count over ``keys`` keys, those past the CPU's float head read packed
    against unpacked for the chunk."""
    from semantic.runtime.model.attention import UnpackedPast, attend
    from semantic.runtime.kv import float_head

    out = {}
    for r in rows:
        k, v = (mx.random.normal((1, spec.n_kv_heads, keys, spec.head_dim), key=mx.random.key(i)) for i in (1, 2))
        q = mx.random.normal((1, heads, r, spec.head_dim), key=mx.random.key(3))
        view = _filled(k, v, float_head(), keys - r)
        fk, fv, _ = view.update_and_fetch_past(k[..., keys - r :, :], v[..., keys - r :, :])
        mx.eval(fk, fv, view.arrays)
        record = view.quantized

        def packed():
            return attend(q, fk, fv, 0.125, "causal", record.packed_past(view.head, view.synced))

        def unpacked():
            return attend(q, fk, fv, 0.125, "causal",
                          UnpackedPast(*record.unpacked(view.head, view.synced, mx.float32)))

        packed_ms, unpacked_ms = (_median_us(lambda f=f: mx.eval(f()), rounds) / 1e3 for f in (packed, unpacked))
        out[r] = {"packed_ms": round(packed_ms, 2), "unpacked_ms": round(unpacked_ms, 2),
                  "unpacked_over_packed": round(unpacked_ms / packed_ms, 2)}
    return out


def engine_decode(loaded, contexts: list[int], tokens: int) -> dict:
    """Decode ms a token for one agent whose cache holds each context, with the
    device's float head and with none (every closed block in float)."""
    from semantic.runtime.engine.engine import Engine, SamplingParams
    from semantic.runtime.kv import device_float_head

    spec, out = loaded.spec, {}
    if spec.n_full != len(spec.layers):
        raise SystemExit("bench attention: the engine part is for models of full attention layers only")
    for n in contexts:
        cache = Engine(loaded.model, loaded.tokenizer).new_cache()
        for i, layer in enumerate(cache):
            k, v = (mx.random.normal((1, spec.n_kv_heads, n, spec.head_dim), key=mx.random.key(2 * i + j))
                    for j in (0, 1))
            layer.append(k.astype(loaded.dtype), v.astype(loaded.dtype))
            mx.eval(layer.arrays)
        row = {}
        for name, head in (("head", device_float_head(loaded.model)), ("all_float", None)):
            engine = Engine(loaded.model, loaded.tokenizer, float_head=head, speculation=False)
            prompt = [1 + (i * 7919) % 1000 for i in range(n + 1)]
            record = cache.clone()
            mx.eval(record.arrays())
            before, held = mx.get_active_memory(), 0
            engine.add(prompt, SamplingParams(max_tokens=tokens + 2), record, n)
            steps = []
            while not engine.idle:
                start = time.perf_counter()
                engine.prefill_step()
                engine.step_once()
                steps.append((time.perf_counter() - start) * 1e3)
                held = max(held, mx.get_active_memory() - before)
            row[name] = {"decode_ms": round(statistics.median(steps[2:]), 1), "held_mb": round(held / 2**20)}
        row["head_over_all_float"] = round(row["head"]["decode_ms"] / row["all_float"]["decode_ms"], 2)
        out[n] = row
    return out


def run(args: argparse.Namespace) -> int:
    from semantic.runtime.model.models import load

    loaded = load(args.model, progress=False)
    contexts = [int(c) for c in args.contexts.split(",")]
    attn = loaded.model.layers[0].self_attn
    heads = getattr(attn, "n_heads", None) or attn.num_attention_heads
    log = (lambda line: print(line, file=sys.stderr, flush=True)) if not args.json else (lambda line: None)
    layer = per_layer(loaded.spec, heads, contexts, args.rounds)
    for n, r in layer.items():
        log(f"{n:>6} keys: one layer's decode attention, float {r['float_us']:8.0f} us, packed {r['packed_us']:8.0f} us"
            f" ({r['packed_over_float']:.2f}x; MLX's quantized matmul {r['mlx_packed_us']:8.0f} us)")
    chunk = chunk_rows(loaded.spec, heads, args.chunk_keys, [int(r) for r in args.chunk_rows.split(",")], args.rounds)
    for r, c in chunk.items():
        log(f"{r:>6} rows over {args.chunk_keys} keys: one layer's prompt chunk, past the float head packed "
            f"{c['packed_ms']:7.1f} ms, unpacked for the chunk {c['unpacked_ms']:7.1f} ms ({c['unpacked_over_packed']:.2f}x)")
    engine = engine_decode(loaded, [int(c) for c in args.engine_contexts.split(",")], args.tokens)
    for n, r in engine.items():
        log(f"{n:>6} tokens: decode {r['head']['decode_ms']:.1f} ms a token with the float head "
            f"({r['head']['held_mb']} MB held beyond the record), {r['all_float']['decode_ms']:.1f} ms all in "
            f"float ({r['all_float']['held_mb']} MB): {r['head_over_all_float']:.2f}x")
    if args.json:
        print(json.dumps({"model": loaded.name, "device": str(mx.default_device()), "per_layer": layer,
                          "chunk_keys": args.chunk_keys, "chunk": chunk, "engine": engine}))
    return 0
