"""Agents' caches across turns on the real model: prefix reuse, the memory
budget with demotion to disk, shared system prompts, and model swaps."""

from __future__ import annotations

import mlx.core as mx
import pytest

from semantic.runtime.memory.agent_cache import HOT, WARM, AgentCaches, OutOfMemory
from semantic.runtime.memory.block_pool import KVBudget
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.text.prefix import encode
from semantic.runtime.memory.turns import render, run_turn

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=24)
QUESTIONS = [
    "Name a large animal that lives in the sea.",
    "How big can it grow?",
    "What does it eat?",
    "Where does it live in winter?",
    "Give it a friendly name.",
]


def caches_for(smollm2, root, budget_bytes=256 << 20, model_id="smollm2"):
    spec = smollm2.spec
    budget = KVBudget(spec, budget_bytes, sliding_dtype_bytes=smollm2.dtype.size)
    return AgentCaches(CacheStore(root), model_id, spec, budget)


def chat(engine, caches, agent, questions, sampling=GREEDY, use_cache=True, system="You are a concise assistant."):
    """A multi-turn chat; yields (messages, tokens cached before the turn, result) per turn."""
    messages = [{"role": "system", "content": system}]
    for q in questions:
        messages.append({"role": "user", "content": q})
        before = caches.peek(agent)
        r = run_turn(engine, caches, agent, messages, sampling, use_cache=use_cache)
        yield list(messages), [] if before is None else before.tokens, r
        messages.append({"role": "assistant", "content": r.text})


@pytest.mark.slow
def test_follow_up_turns_prefill_only_their_new_tokens(smollm2, tmp_path):
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    caches = caches_for(smollm2, tmp_path)
    previous = None
    report = []
    for n, (messages, cached, f) in enumerate(chat(engine, caches, "alice", QUESTIONS)):
        if previous is not None:
            # What is new this turn: the template's close of the reply, the user's message, the opener.
            new_part = render(tok, messages)[len(previous):]
            assert f.reused_tokens == len(cached), "the prompt extends the cache: every cached token is kept"
            assert f.prefilled_tokens <= len(encode(tok, new_part)) + 8
            assert f.reused_tokens == f.prompt_tokens - f.prefilled_tokens
        report.append((n + 1, f.prompt_tokens, f.reused_tokens, f.prefilled_tokens))
        previous = render(tok, messages) + f.text
    print("\nturn prompt reused prefilled:", report)


@pytest.mark.slow
def test_cached_turns_against_cold_turns(smollm2, tmp_path):
    """Does a cached turn feed the model what a cold turn would?  Measured, printed;
    the assertion is only that every turn's reply is text, unless the model ended it at once."""
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    caches = caches_for(smollm2, tmp_path / "a")
    cached = [(messages, caches.peek("bob").tokens[:f.prompt_tokens], f)  # the prompt as the cache holds it
              for messages, _, f in chat(engine, caches, "bob", QUESTIONS[:3])]
    same_tokens = same_text = 0
    for messages, prompt, f in cached:
        cold_ids = encode(tok, render(tok, messages))
        same_tokens += prompt == cold_ids
        cold = Engine(smollm2.model, tok)
        sid = cold.add(cold_ids, GREEDY)
        while not cold.idle:
            for d in cold.prefill_step() + cold.step_once():
                if d.finished and d.seq_id == sid:
                    same_text += d.finished.text == f.text
        assert f.text.strip() or f.reason == "stop"  # a reply cut at 24 tokens is text (what it says varies)
    print(f"\ncached prompts equal to a cold tokenization: {same_tokens}/{len(cached)}; "
          f"replies identical to a cold run of the same conversation: {same_text}/{len(cached)}")


@pytest.mark.slow
def test_budget_demotes_to_disk_and_outputs_do_not_change(smollm2, tmp_path):
    """A budget for 3 agents, 6 agents round-robin for 3 rounds."""
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    probe = caches_for(smollm2, tmp_path / "probe")
    per_agent = probe.budget.bytes_for(256)  # every conversation here stays under 256 tokens
    tight = caches_for(smollm2, tmp_path / "tight", budget_bytes=3 * per_agent)
    roomy = caches_for(smollm2, tmp_path / "roomy")
    agents = [f"agent-{i}" for i in range(6)]
    sampling = SamplingParams(max_tokens=8)
    histories = {mode: {a: [{"role": "user", "content": f"Say a word about the number {i}."}]
                        for i, a in enumerate(agents)} for mode in ("tight", "roomy")}
    mx.clear_cache()
    baseline = mx.get_active_memory()
    outputs = {"tight": [], "roomy": []}
    for _ in range(3):
        for a in agents:
            for mode, caches in (("tight", tight), ("roomy", roomy)):
                was = caches.tier(a)
                f = run_turn(engine, caches, a, histories[mode][a], sampling)
                histories[mode][a] += [{"role": "assistant", "content": f.text},
                                       {"role": "user", "content": "And one more?"}]
                outputs[mode].append(f.text)
                if mode == "tight":
                    assert caches.budget.used_bytes <= caches.budget.budget_bytes
                    assert len(caches.hot_agents()) <= 3
                    if was == WARM:
                        assert f.reused_tokens > 0, "a demoted agent comes back from disk"
            mx.clear_cache()
    assert tight.demotions >= 9 and roomy.demotions == 0
    assert outputs["tight"] == outputs["roomy"]
    # Hot caches are the only memory that stays; the roomy set holds all 6.
    tight.flush()
    for a in list(roomy.hot_agents()):
        roomy.demote(a)
    mx.clear_cache()
    assert mx.get_active_memory() - baseline <= tight.budget.budget_bytes + (8 << 20)


def test_a_request_that_can_never_fit_fails_clearly(smollm2, tmp_path):
    engine = Engine(smollm2.model, smollm2.tokenizer)
    probe = caches_for(smollm2, tmp_path / "probe")
    small = caches_for(smollm2, tmp_path, budget_bytes=probe.budget.bytes_for(256))
    with pytest.raises(OutOfMemory, match="MiB"):
        run_turn(engine, small, "big", [{"role": "user", "content": "hi"}], SamplingParams(max_tokens=400))
    assert small.tier("big") is None and small.budget.used_bytes == 0


@pytest.mark.slow
def test_a_shared_system_prompt_is_prefilled_once(smollm2, tmp_path):
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    caches = caches_for(smollm2, tmp_path)
    system = " ".join(["You are one of four analysts reviewing lighthouse logs."] * 90)
    prefix_tokens = len(encode(tok, tok.apply_chat_template(
        [{"role": "system", "content": system}], tokenize=False, add_generation_prompt=False)))
    assert prefix_tokens >= 900
    prefilled = []
    for i in range(4):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"Report {i}?"}]
        f = run_turn(engine, caches, f"analyst-{i}", messages, SamplingParams(max_tokens=4))
        prefilled.append(f.prefilled_tokens)
    assert prefilled[0] >= prefix_tokens
    assert all(p < 20 for p in prefilled[1:]), prefilled
    assert sum(prefilled) < prefix_tokens + 4 * 20


@pytest.mark.slow
def test_shared_prefixes_fill_only_free_room_and_give_it_back(smollm2, tmp_path):
    """Agents with system prompts of their own register shared prefixes in free
    room (left when idle agents go to disk); a turn that needs the room gets it:
    least recently used prefixes are dropped, as idle agents are demoted."""
    engine = Engine(smollm2.model, smollm2.tokenizer)
    probe = caches_for(smollm2, tmp_path / "probe")
    caches = caches_for(smollm2, tmp_path, budget_bytes=3 * probe.budget.bytes_for(256))
    for i in range(4):
        messages = [{"role": "system", "content": f"You are helper {i}."}, {"role": "user", "content": "Hi."}]
        run_turn(engine, caches, f"agent-{i}", messages, SamplingParams(max_tokens=4))
        caches.demote(f"agent-{i}")  # idle and written: the eviction actor's job
    assert len(caches.prefixes()) == 2 and caches.hot_agents() == []  # the budget is 2/3 prefixes
    long = [{"role": "user", "content": "Summarise: " + "the lighthouse log was quiet " * 60}]  # > 256 tokens
    f = run_turn(engine, caches, "reader", long, SamplingParams(max_tokens=4))
    assert f.prompt_tokens > 256 and caches.prefix_drops >= 1
    assert caches.budget.used_bytes <= caches.budget.budget_bytes


def test_caches_survive_a_model_swap(smollm2, tmp_path):
    tok = smollm2.tokenizer
    engine = Engine(smollm2.model, tok)
    first = caches_for(smollm2, tmp_path, model_id="smollm2")
    msgs = [{"role": "user", "content": "Remember the word lantern."}]
    f1 = run_turn(engine, first, "carol", msgs, SamplingParams(max_tokens=6))
    first.flush()
    other = caches_for(smollm2, tmp_path, model_id="another-model")
    assert other.tier("carol") is None  # its cache is tagged by model: nothing to use here
    back = caches_for(smollm2, tmp_path, model_id="smollm2")
    assert back.tier("carol") == WARM
    msgs += [{"role": "assistant", "content": f1.text}, {"role": "user", "content": "Which word?"}]
    f2 = run_turn(engine, back, "carol", msgs, SamplingParams(max_tokens=6))
    assert f2.reused_tokens >= f1.prompt_tokens  # read back from the file
    assert back.tier("carol") == HOT


class _JinjaTokenizer:
    """Just enough tokenizer to render a chat template (as transformers does)."""

    def __init__(self, template: str):
        from jinja2 import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise TemplateError(message)

        self.template = ImmutableSandboxedEnvironment().from_string(template)
        self.raise_exception = raise_exception

    def apply_chat_template(self, messages, tools=None, tokenize=False, add_generation_prompt=True):
        return self.template.render(messages=messages, raise_exception=self.raise_exception)


STRICT = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
          "{{ raise_exception('System role not supported') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}")
LENIENT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def test_a_template_that_refuses_a_later_system_message_gets_it_folded_into_the_user_turn():
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
             {"role": "assistant", "content": "yo"}, {"role": "system", "content": "Be brief."},
             {"role": "user", "content": "go"}]
    assert render(_JinjaTokenizer(LENIENT), convo) == "<system>S<user>hi<assistant>yo<system>Be brief.<user>go"
    assert render(_JinjaTokenizer(STRICT), convo) == "<system>S<user>hi<assistant>yo<user>Be brief.\n\ngo"
    with pytest.raises(Exception, match="System role not supported"):  # nothing to fold: the template's error
        render(_JinjaTokenizer(STRICT.replace("not loop.first", "true")), convo[:2])


def test_a_template_that_writes_arguments_as_text_gets_them_as_json():
    joins = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
             "[{{ c.function.name + ':' + c.function.arguments }}]{% endfor %}{% endfor %}")
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"city": "Zürich"}}}]},
             {"role": "tool", "content": "ok", "tool_call_id": "c1"}]
    assert render(_JinjaTokenizer(joins), convo) == '<user>hi<assistant>[f:{"city": "Zürich"}]<tool>ok'
    assert convo[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Zürich"}  # the caller's, untouched
    with pytest.raises(TypeError):  # no calls to write as text: the template's own error
        render(_JinjaTokenizer("{{ messages[0].content + 1 }}"), convo[:1])
