"""A real server for tests: the app of ``web.app`` over a real ``Runtime``,
served by hypercorn in the test's event loop on a free loopback port.

``tiny_loaded()`` is a random-weight Llama small enough to generate hundreds
of tokens a second, with the embedded model's tokenizer and chat template (so
prompts render as they do for SmolLM2) and a 512-token context (so a prompt
over the context is cheap to send).

``first_word_only(loaded)`` is a model that ends every reply by itself within
a word or so: what a client that takes a reply cut at ``max_tokens`` for a
failure needs, whatever the model would have said (greedy replies of a real
model depend on the BLAS kernels' rounding, so no prompt is known to end)."""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import httpx
import mlx.core as mx

from semantic.runtime.model import embedded
from semantic.runtime.model.model_spec import ModelCacheSpec
from semantic.runtime.model.models import LoadedModel
from tests.tiny import TINY_CONFIGS, embedded_tokenizer, tiny_from_config
from semantic.web.app import ServerConfig
from semantic.web.server import bind, serve

CONTEXT = 512
LIMIT = 2048  # the servers' max_tokens limit in these tests


@functools.cache
def tiny_loaded(seed: int = 0) -> LoadedModel:
    """Named "tiny" (seed 0) or "tiny-SEED": other seeds are other models."""
    tokenizer = embedded_tokenizer()
    config = dict(TINY_CONFIGS["llama"], vocab_size=len(tokenizer.get_vocab()), max_position_embeddings=CONTEXT)
    model = tiny_from_config(config, seed)
    name = f"tiny-{seed}" if seed else "tiny"
    path = Path(embedded.prepare(progress=False))
    return LoadedModel(name, path, model, tokenizer, config, ModelCacheSpec.from_model(model), mx.float32)


@functools.cache
def tiny_with_template(template: str, parser: str | None = None) -> LoadedModel:
    """``tiny_loaded()`` with another chat template (its tokenizer copied, the
    model shared), whose calls mlx-lm reads with ``parser`` when one is named."""
    loaded = tiny_loaded()
    wrapper = copy.copy(loaded.tokenizer)
    wrapper._tokenizer = copy.copy(loaded.tokenizer._tokenizer)
    wrapper._tokenizer.chat_template = template
    if parser is not None:
        from mlx_lm.tokenizer_utils import TokenizerWrapper

        module = importlib.import_module(f"mlx_lm.tool_parsers.{parser}")
        wrapper = TokenizerWrapper(wrapper._tokenizer, type(loaded.tokenizer._detokenizer),
                                   eos_token_ids=loaded.tokenizer.eos_token_ids, tool_parser=module.parse_tool_call,
                                   tool_call_start=module.tool_call_start, tool_call_end=module.tool_call_end)
    return dataclasses.replace(loaded, tokenizer=wrapper)


def word_break_ids(tokenizer) -> set[int]:
    """The ids of the tokens whose text holds whitespace (a space, a newline ...)."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    texts = hf.batch_decode([[i] for i in range(len(hf))])
    return {i for i, text in enumerate(texts) if any(c.isspace() for c in text)}


def first_word_only(loaded: LoadedModel) -> LoadedModel:
    """``loaded`` (its weights, template and name) with every token that holds whitespace an
    end-of-turn token too: a reply ends, with reason "stop", where its second word would start,
    and is the text before it ("The", "I'm", "Paris." ...; "" when it starts with whitespace).
    Only a first "word" longer than the cap (a run of tokens with no whitespace in any; about
    two thirds of SmolLM2's 49K tokens hold some) is cut there."""
    wrapper = copy.copy(loaded.tokenizer)
    wrapper.eos_token_ids = set(loaded.tokenizer.eos_token_ids) | word_break_ids(loaded.tokenizer)
    return dataclasses.replace(loaded, tokenizer=wrapper)


def kv_bytes(blocks: int, running: bool = True) -> int:
    """Bytes of ``blocks`` 256-token blocks of a ``tiny_loaded()`` agent: a running
    turn's (with its float working copy), or an idle cache's."""
    from semantic.runtime.memory.model_caches import kv_budget

    return kv_budget(tiny_loaded(), 1 << 30).bytes_for(256 * blocks, running)


@asynccontextmanager
async def live_server(cache_dir: Path, model=None, **options) -> AsyncIterator[str]:
    """Serve a fresh app for the duration; yields its base URL once the model is loaded."""
    options.setdefault("max_tokens_cap", LIMIT)
    options.setdefault("budget", 256 << 20)
    config = ServerConfig(model=model or tiny_loaded(), cache_dir=cache_dir, **options)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    ready, stop = anyio.Event(), anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(functools.partial(serve, config, sock, on_ready=lambda rt: ready.set(), shutdown=stop.wait))
        try:
            with anyio.fail_after(120):
                await ready.wait()
            yield f"http://127.0.0.1:{port}"
        finally:
            stop.set()


def client(url: str, **headers) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=60, headers=headers)
