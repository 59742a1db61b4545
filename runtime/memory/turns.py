"""One agent turn over its cache: render, match the prefix, run, store.

``begin`` decides what the engine must prefill for a prompt given the
agent's cache (hot, warm on disk, a shared prefix, or nothing); ``end`` turns
the engine's ``Finished`` record into the agent's new memory.  ``run_turn``
drives an engine to completion for synchronous callers (tests, benchmarks)
and reports the turn as the runtime does (a ``TurnResult``);
the actor runtime calls ``begin``/``end`` around its own scheduling.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from jinja2 import TemplateError

from .agent_cache import AgentCaches, AgentMemory, OutOfMemory
from ..engine.engine import Engine, Finished, SamplingParams
from ..errors import ContextTooLong
from ..kv import SequenceCache
from ..outcome import TurnResult
from ..text.prefix import COLD, PrefixPlan, encode, plan

__all__ = ["Turn", "begin", "end", "fold_system", "raw_prompt", "render", "run_turn", "system_prefix"]


def render(tokenizer, messages: list[dict], tools: list[dict] | tuple[dict, ...] | None = None) -> str:
    """The prompt text for ``messages`` (and the ``tools`` the model may call, for
    templates that take them), ending with the assistant's turn opener.

    A template that refuses a ``system`` message after the first (Gemma's,
    Mistral's) gets it folded into the user turn around it instead; one that
    writes a call's arguments as text (DeepSeek's: ``name + sep + arguments``)
    gets them as JSON text."""
    try:
        return _apply_template(tokenizer, messages, tools)
    except (TemplateError, TypeError) as e:
        retry = fold_system(messages) if isinstance(e, TemplateError) else arguments_as_json(messages)
        if retry == messages:
            raise
        return render(tokenizer, retry, tools)


def _apply_template(tokenizer, messages: list[dict], tools) -> str:
    if tools:
        return tokenizer.apply_chat_template(messages, tools=list(tools), tokenize=False, add_generation_prompt=True)
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def raw_prompt(tokenizer, text: str) -> str:
    """The prompt text of a raw completion: ``text`` as it is, after the text of
    the special tokens the tokenizer puts before every encoding (a BOS:
    ``<|begin_of_text|>``, ``<bos>``), as a chat template writes them; so it
    prefills what ``tokenizer.encode(text)`` gives, as mlx-lm's and vLLM's
    completions do."""
    plain, ids = encode(tokenizer, text), list(tokenizer.encode(text))
    lead = len(ids) - len(plain)
    return tokenizer.decode(ids[:lead]) + text if lead > 0 and ids[lead:] == plain else text


def fold_system(messages: list[dict]) -> list[dict]:
    """``messages`` with every system message after the first made a user
    message and merged with the user messages next to it."""
    out: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "system" and i > 0:
            m = {"role": "user", "content": m["content"]}
        if out and m["role"] == "user" == out[-1]["role"] and set(m) == set(out[-1]) == {"role", "content"}:
            out[-1] = {"role": "user", "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append(m)
    return out


def arguments_as_json(messages: list[dict]) -> list[dict]:
    """``messages`` with each call's arguments (a dict) as JSON text."""
    def call(c: dict) -> dict:
        args = c.get("function", {}).get("arguments")
        return c if isinstance(args, str) else {**c, "function": {**c["function"], "arguments": json.dumps(
            args, ensure_ascii=False)}}

    return [{**m, "tool_calls": [call(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m for m in messages]


def system_prefix(tokenizer, messages: list[dict], prompt_text: str) -> str | None:
    """The rendered system message, when the prompt starts with it (agents that
    share a system prompt share this text and its cache)."""
    if not messages or messages[0].get("role") != "system":
        return None
    text = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=False)
    return text if text and prompt_text.startswith(text) and text != prompt_text else None


@dataclass
class Turn:
    agent_id: str
    prompt_text: str
    plan: PrefixPlan
    cache: list | None  # the cache to start from (``begin`` trims it to plan.keep)
    new_prefix: str | None = None  # a system prefix to register once this turn has run

    @property
    def prompt(self) -> list[int]:
        return self.plan.prompt


def begin(
    caches: AgentCaches,
    tokenizer,
    agent_id: str,
    prompt_text: str,
    prefix_text: str | None = None,
    min_share: float = 0.5,
    use_cache: bool = True,
    context_length: int | None = None,
) -> Turn:
    """Check out the agent's cache and plan the prefill of ``prompt_text``.

    Reserves budget for the prompt and the first reply token before anything
    runs (raises ``OutOfMemory`` if that cannot fit, ``ContextTooLong`` if the
    prompt fills ``context_length``; the agent keeps its cache); the reply's
    tokens are reserved as they come (``AgentCaches.grow``), block by block.
    Every ``begin`` must be followed by ``end`` or ``caches.abandon``.
    """
    memory = caches.checkout(agent_id)
    try:
        turn = _plan(caches, tokenizer, agent_id, prompt_text, memory if use_cache else None,
                     prefix_text, min_share, use_cache)
        n = len(turn.prompt)
        if context_length is not None and n >= context_length:  # not even one reply token fits
            raise ContextTooLong(
                f"the prompt has {n} tokens, more than fit the model's {context_length}-token context "
                f"(at most {context_length - 1} leave room for a reply): shorten it or start a new agent"
            )
        caches.grow(agent_id, n + 1)
    except (OutOfMemory, ContextTooLong):
        caches.putback(agent_id, memory)  # it did not run: the agent keeps its cache
        raise
    except BaseException:
        caches.abandon(agent_id)
        raise
    if turn.cache:  # only now that it runs: the kept prefix
        turn.cache.rewind(turn.plan.keep)
    return turn


def _plan(caches, tokenizer, agent_id, prompt_text, memory, prefix_text, min_share, use_cache) -> Turn:
    new_prefix = None
    if memory is None and use_cache and prefix_text:
        if (shared := caches.shared_prefix(prefix_text)) is not None:
            memory = caches.from_prefix(agent_id, shared)
        else:
            new_prefix = prefix_text
    if memory is None:
        if new_prefix:  # tokenize the prefix on its own so its ids can be shared
            ids = encode(tokenizer, new_prefix) + encode(tokenizer, prompt_text[len(new_prefix):])
            p = PrefixPlan(COLD, 0, ids)
        else:
            p = plan(tokenizer, prompt_text)
        return Turn(agent_id, prompt_text, p, None, new_prefix)
    p = plan(tokenizer, prompt_text, memory.tokens, memory.text, min_share, memory.trimmable,
             memory.cache.checkpoints())
    return Turn(agent_id, prompt_text, p, None if p.kind == COLD else memory.cache)


def end(caches: AgentCaches, tokenizer, turn: Turn, finished: Finished) -> AgentMemory:
    """Store the agent's cache after the engine finished (or cancelled) its turn."""
    fed = list(finished.cache_tokens)
    prompt_fed = min(len(fed), len(turn.prompt))
    if prompt_fed < len(turn.prompt):  # cancelled mid-prefill: text of what was fed
        text = tokenizer.decode(fed)
    else:
        text = turn.prompt_text + tokenizer.decode(fed[len(turn.prompt):])
    memory = AgentMemory(turn.agent_id, fed, text, finished.cache)
    if turn.new_prefix and prompt_fed >= (n := len(encode(tokenizer, turn.new_prefix))):
        cache = SequenceCache(finished.cache)
        if not all(c.can_rewind(n) for c in cache):  # shared up to the last point before it the cache can go back to
            n = max((at for at in cache.checkpoints() if at <= n), default=0)
        if n and turn.new_prefix.startswith(shared := tokenizer.decode(fed[:n])):
            caches.share_prefix(shared, fed[:n], cache)
    caches.checkin(memory)
    return memory


def run_turn(
    engine: Engine,
    caches: AgentCaches,
    agent_id: str,
    messages: list[dict],
    sampling: SamplingParams = SamplingParams(),
    use_cache: bool = True,
) -> TurnResult:
    """Run one turn to completion on an otherwise idle engine (its whole reply
    is reserved up front: nothing else runs).  Its times count from the call:
    ``queued_s`` covers rendering the prompt and checking out the agent's cache."""
    start = time.perf_counter()
    tokenizer = engine.tokenizer
    text = render(tokenizer, messages)
    turn = begin(caches, tokenizer, agent_id, text, system_prefix(tokenizer, messages, text), use_cache=use_cache)
    first = finished = None
    try:
        caches.grow(agent_id, len(turn.prompt) + sampling.max_tokens)  # alone: the whole reply up front
        sid = engine.add(turn.prompt, sampling, turn.cache, turn.plan.keep)
        admitted = time.perf_counter()
        while finished is None:
            for d in engine.prefill_step() + engine.step_once():
                if d.seq_id == sid:
                    first = first or time.perf_counter()  # the first token (or an empty reply's end)
                    finished = d.finished
    except BaseException:
        caches.abandon(agent_id)
        raise
    now = time.perf_counter()
    end(caches, tokenizer, turn, finished)
    return TurnResult.measured(finished, finished.reason, arrived=start, admitted=admitted, first_token=first,
                               ended=now)
