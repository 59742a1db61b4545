"""``semantic generate``: one reply, streamed to stdout as it is produced."""

from __future__ import annotations

import argparse
import sys

import semantic.runtime  # noqa: F401  (fast BLAS before mlx)
from semantic.runtime.errors import SemanticError
from semantic.runtime.model.models import load


def generate(args: argparse.Namespace) -> int:
    import mlx.core as mx
    from mlx_lm import stream_generate
    from mlx_lm.sample_utils import make_sampler

    if args.max_tokens <= 0:
        raise SemanticError("--max-tokens must be at least 1")
    loaded = load(args.model)
    messages = [{"role": "user", "content": args.prompt}]
    if args.system:
        messages.insert(0, {"role": "system", "content": args.system})
    prompt = loaded.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    if args.seed is not None:
        mx.random.seed(args.seed)
    sampler = make_sampler(temp=args.temperature, top_p=args.top_p)
    for response in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler):
        sys.stdout.write(response.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0
