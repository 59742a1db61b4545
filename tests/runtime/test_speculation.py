"""Exact speculative decoding (``runtime.engine.speculation``): drafts verified inside
the batch change no token, no logprob and no cache, for every family, greedy
or seeded with temperature."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from semantic.runtime.engine import decode as decode_module
from semantic.runtime.engine import engine as engine_module
from semantic.runtime.store.cache_file import CacheStore
from semantic.runtime.cache_records import CacheRecord
from semantic.runtime.kv import StateCache
from semantic.runtime.engine.engine import Engine, SamplingParams
from semantic.runtime.engine.row_counts import RowCounts
from semantic.runtime.engine.speculation import NO_INDENTS, TRY, Drafter, Indents, StepCosts, choose_drafts
from tests.runtime.test_engine import ByteTokenizer, drain, measured, prompts
from tests.tiny import TINY_CONFIGS, VOCAB, tiny_model


class Oracle(Drafter):
    """Drafts read from a known continuation, wrong at every ``wrong``-th
    place: runs of drafts that are taken, cut short where one is wrong. It
    claims a high acceptance, so that ``choose_drafts`` verifies its drafts even where
    a slot costs nearly a forward (attention run per slot)."""

    rate = 0.99

    def __init__(self, history, continuation, wrong: int):
        super().__init__(history)
        self.continuation, self.wrong, self.offered = list(continuation), wrong, 0

    def offer(self, limit):
        at = len(self.tokens)
        drafts = self.continuation[at : at + max(limit, 0)]
        self.offered += len(drafts)
        return [(t + 1) % VOCAB if (at + j) % self.wrong == 0 else t for j, t in enumerate(drafts)]


class SteadyCosts(StepCosts):
    """A step costs its forwards, whatever this machine's timings: on a busy
    machine measured times could make ``choose_drafts`` verify no wrong draft, and
    the oracle's runs would not show a draft cut."""

    def __call__(self, widths, contexts, open=False):
        return float(len(self.counts.pack(widths)))


def run(model, tokenizer, prompts, params, counts, speculation=True, oracle=None, monkeypatch=None, act=None):
    """Each prompt's ``Finished``, all added at once (``act(engine, step)`` may add and cancel more)."""
    if oracle is not None:
        monkeypatch.setattr(engine_module, "Drafter", lambda history, _indents: Oracle(history, *oracle[tuple(history)]))
        monkeypatch.setattr(decode_module, "StepCosts", SteadyCosts)
    engine = Engine(model, tokenizer, row_counts=counts, speculation=speculation)
    ids = [engine.add(p, q) for p, q in zip(prompts, params)]
    done = drain(engine, act and (lambda step: act(engine, step)))
    if oracle is not None:
        monkeypatch.setattr(engine_module, "Drafter", Drafter)
        monkeypatch.setattr(decode_module, "StepCosts", StepCosts)
    return [done[i] for i in ids]


def contents(cache) -> list:
    """What a finished sequence's caches hold, up to what they cover."""
    return [c.cache if isinstance(c, StateCache) else c.state for c in cache]


def assert_same(a, b):
    assert a.output_tokens == b.output_tokens and a.text == b.text and a.reason == b.reason
    assert a.cache_tokens == b.cache_tokens
    assert a.logprobs == b.logprobs  # float32 log-softmax of the rows drawn from, bit for bit
    assert len(a.cache) == len(b.cache)
    assert not any(c.trail for c in b.cache if isinstance(c, StateCache))  # a step's states are not kept after it
    x, y = tree_flatten(contents(a.cache)), tree_flatten(contents(b.cache))
    assert [k for k, _ in x] == [k for k, _ in y]
    assert all(mx.array_equal(p, q).item() for (_, p), (_, q) in zip(x, y))


def prompts_for(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 40))] for _ in range(n)]


@pytest.mark.slow
@pytest.mark.parametrize("arch", TINY_CONFIGS)
def test_greedy_with_drafts_is_bitwise_without(arch, monkeypatch):
    """Three sequences at once, one across a block's end, drafts taken in runs
    and cut where wrong: every token, logprob and cache byte as without drafts
    (alone, and batched at every measured count), and drafts were both taken
    and cut."""
    model, tok = tiny_model(arch), ByteTokenizer()
    counts = measured(model, tok)
    prompts = prompts_for(0, 3)
    prompts[0] = (prompts[0] * 20)[:240]  # decodes across its first block's end
    params = [SamplingParams(max_tokens=m, logprobs=2) for m in (30, 17, 24)]
    want = run(model, tok, prompts, params, counts, speculation=False)
    alone = [run(model, tok, [p], [q], counts, speculation=False)[0] for p, q in zip(prompts, params)]
    oracle = {tuple(p): (list(p) + list(f.output_tokens), w) for p, f, w in zip(prompts, want, (5, 3, 9))}
    got = run(model, tok, prompts, params, counts, oracle=oracle, monkeypatch=monkeypatch)
    for a, b, c in zip(want, got, alone):
        assert_same(a, b)
        assert_same(c, b)
    assert sum(f.accepted_tokens for f in got) > 0
    assert sum(f.drafted_tokens - f.accepted_tokens for f in got) > 0


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "qwen3_next", "deepseek_v3"])
def test_drafts_beside_neighbours_that_come_and_go(arch, monkeypatch):
    """A drafting sequence beside 1-7 others that arrive, finish and are
    cancelled at random steps (some drafting too), in forwards fixed at 8
    slots and at the measured counts: its reply is as alone without drafts."""
    model, tok = tiny_model(arch), ByteTokenizer()
    for counts in (RowCounts.fixed(8), measured(model, tok)):
        rng = random.Random(3)
        probe, params = prompts_for(5, 1)[0], SamplingParams(max_tokens=40, logprobs=1)
        want = run(model, tok, [probe], [params], counts, speculation=False)[0]
        oracle = {tuple(probe): (probe + list(want.output_tokens), 4)}
        live: list[int] = []

        def act(engine, step):
            if live and rng.random() < 0.3:
                engine.cancel(live.pop(rng.randrange(len(live))))
            for _ in range(rng.randrange(0, 3)):
                if len(live) < 7:
                    other = [rng.randrange(1, VOCAB) for _ in range(rng.randrange(3, 30))]
                    oracle[tuple(other)] = (other, 2)  # no continuation known: offers nothing
                    live.append(engine.add(other, SamplingParams(max_tokens=rng.randrange(1, 12))))

        got = run(model, tok, [probe], [params], counts, oracle=oracle, monkeypatch=monkeypatch, act=act)[0]
        assert_same(want, got)
        assert got.accepted_tokens > 0 and got.drafted_tokens > got.accepted_tokens


def test_stop_strings_and_length_cut_where_they_would(monkeypatch):
    """A stop string or ``max_tokens`` inside a run of taken drafts ends the
    reply at the same token, with the same text and cache, as without."""
    model, tok = tiny_model("llama"), ByteTokenizer()
    counts = RowCounts.fixed(8)
    prompt = prompts_for(9, 1)[0]
    free = run(model, tok, [prompt], [SamplingParams(max_tokens=40)], counts, speculation=False)[0]
    text = free.text
    stop = text[11:13] if len(text) > 14 else text[-2:]
    for params in (SamplingParams(max_tokens=40, stop=(stop,)), SamplingParams(max_tokens=13)):
        want = run(model, tok, [prompt], [params], counts, speculation=False)[0]
        oracle = {tuple(prompt): (prompt + list(free.output_tokens), 1000)}  # every draft right
        got = run(model, tok, [prompt], [params], counts, oracle=oracle, monkeypatch=monkeypatch)[0]
        assert_same(want, got)
        assert got.accepted_tokens > 0


class EndlessTokenizer(ByteTokenizer):
    """No end-of-turn token: a reply runs to its length, whatever the model says."""

    eos_token_ids = set()


def drafting(monkeypatch, arch: str, seed: int, max_tokens: int, wrong: int, tok=None):
    """An engine with one sequence added whose drafts come from its reply
    without drafts (``Oracle``): (engine, its id, that reply)."""
    model, tok = tiny_model(arch), tok or ByteTokenizer()
    prompt, params = prompts_for(seed, 1)[0], SamplingParams(max_tokens=max_tokens)
    want = run(model, tok, [prompt], [params], RowCounts.fixed(8), speculation=False)[0]
    monkeypatch.setattr(engine_module, "Drafter", lambda h, _indents: Oracle(h, prompt + list(want.output_tokens), wrong))
    engine = Engine(model, tok, row_counts=RowCounts.fixed(8))
    return engine, engine.add(prompt, params), want


def test_preempted_and_resumed_while_drafting(monkeypatch):
    """Taken out between steps of a drafting sequence and put back with its
    cache, a reply goes on as if it had never left."""
    engine, sid, want = drafting(monkeypatch, "qwen3", seed=4, max_tokens=30, wrong=6)
    for _ in range(4):
        engine.prefill_step() or engine.step_once()
    finished = engine.preempt(sid)
    engine.resume(sid, finished.cache, len(finished.cache_tokens))
    got = drain(engine)[sid]
    assert got.output_tokens == want.output_tokens and got.cache_tokens == want.cache_tokens
    assert got.accepted_tokens > 0


@pytest.mark.parametrize("arch", sorted(TINY_CONFIGS))
def test_a_reply_taken_out_while_drafting_goes_on_from_its_file(arch, monkeypatch, tmp_path):
    """Preempted mid-reply while drafting, its cache written to disk and read
    back (what a restart reads), a reply goes on as if it had never left --
    every cache kind's rolled-back drafts included."""
    engine, sid, want = drafting(monkeypatch, arch, seed=4, max_tokens=30, wrong=6, tok=EndlessTokenizer())
    emitted = 0
    while emitted < len(want.output_tokens) // 2:
        emitted += sum(len(d.tokens) for d in engine.prefill_step() or engine.step_once() if d.seq_id == sid)
    out = engine.preempt(sid)
    store = CacheStore(tmp_path)
    store.save(CacheRecord("a", f"tiny/{arch}", "s", list(out.cache_tokens), "", 0.0, 0.0, list(out.cache)))
    back = store.load("a", f"tiny/{arch}", "s")
    engine.resume(sid, back.cache, len(back.tokens))
    got = drain(engine)[sid]
    assert got.output_tokens == want.output_tokens and got.cache_tokens == want.cache_tokens
    assert out.accepted_tokens > 0  # it had drafted, and taken some, before it left


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_seeded_samples_with_drafts_are_bitwise_without(arch, monkeypatch):
    """With temperature, a drafted slot draws with the key decoding one token
    a step would draw with there, and a draft is taken when it is the token
    drawn: seeded replies (tokens, logprobs, caches) are the same with drafts
    and without, while drafts are both taken and refused."""
    model, tok = tiny_model(arch), ByteTokenizer()
    counts = RowCounts.fixed(8)
    prompt = prompts_for(2, 1)[0]
    greedy = run(model, tok, [prompt], [SamplingParams(max_tokens=12)], counts, speculation=False)[0]
    oracle = {tuple(prompt): (prompt + list(greedy.output_tokens), 1000)}
    taken = refused = 0
    for seed in range(12):
        params = SamplingParams(temperature=0.2, top_p=0.95, max_tokens=12, seed=seed, logprobs=1)
        want = run(model, tok, [prompt], [params], counts, speculation=False)[0]
        got = run(model, tok, [prompt], [params], counts, oracle=oracle, monkeypatch=monkeypatch)[0]
        assert_same(want, got)
        taken += got.accepted_tokens
        refused += got.drafted_tokens - got.accepted_tokens
    assert taken > 0 and refused > 0


def test_drafts_from_history():
    """The longest recent n-gram that ends the history and occurred before
    offers what followed it there; nothing when none occurred."""
    d = Drafter([1, 2, 3, 4, 5, 6, 9, 2, 3, 4])
    assert d.offer(3) == [5, 6, 9]
    assert d.offer(10) == [5, 6, 9, 2, 3, 4]
    d.extend(7)
    assert d.offer(4) == []  # (3, 4, 7) and (4, 7) never occurred
    d.extend(2)
    d.extend(3)
    assert d.offer(2) == [4, 7]  # (2, 3) occurred twice: the latest was followed by 4, 7
    assert Drafter([5, 5]).offer(3) == []
    assert d.offer(0) == []
    grown = Drafter([1, 2, 3])
    for t in range(3000):  # more at once than the arrays searched hold, grown by half
        grown.extend(10 + t % 7)
    assert grown.offer(3) == [14, 15, 16]


def test_drafts_across_another_indentation_are_shifted():
    """Where the last tokens occurred only at another indentation, the lookup
    takes every line break's indentation as the same, and the drafts'
    indentations are shifted by the difference; they stop at one with no
    token that wide."""
    indents = Indents({104: ("\n ", 4), 108: ("\n ", 8), 112: ("\n ", 12)})
    block = [7, 8, 108, 9, 112, 10, 108, 11, 104, 12]
    quoted = Drafter([*block, 7, 8, 104], indents)  # 4 less deep
    assert quoted.offer(5) == [9, 108, 10, 104, 11]
    assert quoted.offer(9) == [9, 108, 10, 104, 11]  # (no token for a line break alone: not an indentation)
    assert Drafter([*block, 7, 8, 112], indents).offer(5) == [9]  # 4 deeper: no token for 16 spaces
    wider = Indents({**indents.widths, 116: ("\n ", 16)})
    assert Drafter([*block, 7, 8, 112], wider).offer(5) == [9, 116, 10, 112, 11]
    assert Drafter([*block, 7, 8, 104], NO_INDENTS).offer(5) == []
    # Tokens that occurred as they are draft as they did there, before a later match at another depth:
    assert Drafter([7, 8, 104, 30, 7, 8, 108, 40, 7, 8, 104], indents).offer(4) == [30, 7, 8, 108]


def test_a_method_quoted_at_another_depth_is_drafted_across_its_line_breaks():
    """Code quoted one level less indented than the file it was shown in:
    once the quote's first indented line tells how much less, no draft is
    refused at a later line break (the embedded model's tokenizer); taking
    indentations as they are, every indented one is."""
    import textwrap

    from tests.tiny import embedded_tokenizer

    tok = embedded_tokenizer()
    source = ("class Clock:\n    def tick(self):\n        if self.alarm_armed:\n            self.ring_bell()\n"
              "        self.seconds_counted += 1\n        return self.minute_ended()\n")
    quote = textwrap.dedent(source[source.index("    def") :])
    history = tok.encode(f"```python\n{source}```\n", add_special_tokens=False)
    reply = tok.encode(f"```python\n{quote}", add_special_tokens=False)
    breaks = [i for i, t in enumerate(reply) if "\n" in tok.decode([t])]
    first = next(i for i in breaks if tok.decode([reply[i]]).startswith("\n "))

    def refused(indents: Indents) -> list[bool]:
        """Whether a draft was refused at each line break after the first indented one."""
        drafter, refusals, at = Drafter(history, indents), set(), 0
        while at < len(reply):
            offer, n = drafter.offer(7), 0
            while n < len(offer) and at + n < len(reply) and offer[n] == reply[at + n]:
                n += 1
            if n < len(offer):
                refusals.add(at + n)
            for token in reply[at : at + n + 1]:
                drafter.extend(token)
            at += n + 1
        return [i in refusals for i in breaks if i > first]

    assert refused(Indents.of(tok)) == [False] * 4
    assert refused(NO_INDENTS) == [True, True, True, False]  # (the last, a bare line break, is the same at any depth)


def test_allot_pays_only_for_drafts_worth_their_slots():
    """Drafts are verified where their expected tokens pay for the time they
    add: all of them when slots cost nothing more, none when the chance is
    low against a costly slot, more for the likelier sequence, fewer over a
    long context once its attention is known to cost -- from the first step
    that drafted, which sets what a key costs."""
    free = StepCosts(RowCounts.fixed(8))
    assert choose_drafts([[1, 2, 3]], [0.5], [100], free) == [3]
    assert choose_drafts([[1] * 7] * 8, [0.9] * 8, [100] * 8, free) == [0] * 8  # drafts would add forwards
    costs = StepCosts(RowCounts(tuple(range(1, 9)), ms=(50.0, 60, 70, 75, 80, 85, 95, 100)))
    assert choose_drafts([[1, 2, 3, 4]], [0.05], [100], costs) == [0]
    assert choose_drafts([[1, 2, 3, 4, 5, 6, 7]], [0.95], [100], costs) == [7]
    likely, unlikely = choose_drafts([[1, 2, 3], [1, 2, 3]], [0.9, 0.3], [100, 100], costs)
    assert likely > unlikely
    costs.computed([4], [2000], 75 + 4 * 2000 * 0.01)  # computing it took 0.01 ms more a token a slot attended over
    assert 0.01 < costs.key_ms < 0.02  # the first drafting step's measurement, whole: not a fifth of it from 0
    costs.computed([4], [2000], 75)  # later ones move it a fifth of the way
    assert 0.008 < costs.key_ms < 0.016
    short, long = (choose_drafts([[1, 2, 3, 4, 5, 6, 7]], [0.8], [context], costs)[0] for context in (100, 8000))
    assert short > long


def test_a_plain_step_costs_its_measured_computation_and_drafts_two_builds():
    """A step without drafts costs what steps of its rows took to compute (on
    the evaluator's thread, its build hidden behind the last step), whatever
    the calibration said; one with drafts adds its slots (the line through
    the calibration's times), their attention and two builds in the open --
    its own and the next step's, which waits on its verdict -- of which its
    own is paid either way where the step is built in the open."""
    costs = StepCosts(RowCounts(tuple(range(1, 9)), ms=(50.0, 60, 70, 80, 90, 100, 110, 120)))
    costs.build_ms = 12.0
    contexts = [100] * 4
    assert costs([1] * 4, contexts) == pytest.approx(80.0)
    costs.computed([1] * 4, contexts, 60.0)
    assert costs([1] * 4, contexts) == pytest.approx(60.0)
    assert costs([1] * 4, contexts, open=True) == pytest.approx(72.0)
    assert costs([3, 1, 1, 1], contexts) == costs([3, 1, 1, 1], contexts, open=True) == pytest.approx(60 + 20 + 24)


class CostlyDrafts(StepCosts):
    """No draft ever pays for its slot."""

    def __call__(self, widths, contexts, open=False):
        return 1.0 + 1e9 * (sum(widths) - len(widths))


class Offering(Drafter):
    """Offers drafts at every step while ``on`` (``rate`` as a real history's)."""

    on = True

    def offer(self, limit):
        return [1] * limit if self.on else []


def test_a_fresh_sequence_tries_its_drafts_where_none_pays(monkeypatch):
    """A rate changes only when drafts are verified, so a sequence must try some
    to learn its own: with the forward times measured on an Intel Xeon
    (Cooperlake kernels), a step's build of 24 ms and four agents at 550
    tokens, the rate before any verdict pays no draft, whether the step is
    built in the open anyway or could be built ahead -- one that drafts takes
    its own build and the next one's out of the pipeline -- and a run of
    taken drafts does. So each sequence verifies one draft of its first
    offer (up to ``TRY``) whatever the costs, and no more where none pays."""
    costs = StepCosts(RowCounts(tuple(range(1, 9)), ms=(62.9, 73.1, 80.4, 89.5, 97.4, 104.5, 113.4, 116.2)))
    costs.build_ms, costs.key_ms = 24.0, 0.0092
    offers, contexts = [[1, 2, 3, 4]] * 4, [550] * 4
    prior = Drafter([]).rate
    assert choose_drafts(offers, [prior] * 4, contexts, costs) == choose_drafts(offers, [prior] * 4, contexts, costs, open=True) == [0] * 4
    echo = Drafter([])
    echo.settle(TRY, TRY)
    assert choose_drafts(offers, [echo.rate] * 4, contexts, costs, open=True) != [0] * 4

    monkeypatch.setattr(decode_module, "StepCosts", CostlyDrafts)
    monkeypatch.setattr(engine_module, "Drafter", Offering)
    model, tok = tiny_model("llama"), ByteTokenizer()
    tok.eos_token_ids = set()  # (every reply runs to its length, whatever the kernels make it say)
    engine = Engine(model, tok, row_counts=RowCounts.fixed(8))
    decoder = engine._decoder
    launches, forwards = count_calls(monkeypatch, decoder, "_launch"), count_calls(monkeypatch, decoder, "forward")
    ids = [engine.add(p, SamplingParams(max_tokens=12)) for p in prompts(4, seed=3)]
    monkeypatch.setattr(Offering, "on", False)  # until all four decode: four first offers in one step

    def offer_once_all_decode(step):
        if engine.decoding == 4:
            Offering.on = True

    done = drain(engine, until=offer_once_all_decode)
    assert [done[i].drafted_tokens for i in ids] == [TRY] * 4
    assert len(forwards) == len(launches)  # four tries at once (12 slots) would have split a step in two forwards


def count_calls(monkeypatch, obj, name: str) -> list:
    """A list that grows by one at each call of ``obj.name``."""
    calls, method = [], getattr(obj, name)

    def counted(*args, **kwargs):
        calls.append(None)
        return method(*args, **kwargs)

    monkeypatch.setattr(obj, name, counted)
    return calls


def test_drafts_never_move_a_sequence_into_another_forward():
    """A step whose drafts regroup the sequences into other forwards rebuilds
    every working copy, and the next step again: ``choose_drafts`` keeps each
    sequence in the forward it runs in without drafts, for the drafts that
    pay and for a fresh sequence's try alike (the first in line get theirs)."""
    free = StepCosts(RowCounts(tuple(range(1, 9)), ms=(50.0,) * 8))  # slots cost nothing: all drafts would pay

    def groups(taken):
        return [n for n, _ in free.counts.pack([1 + t for t in taken])]

    offers = [[1] * 7] * 4
    taken = choose_drafts(offers, [0.99] * 4, [100] * 4, free)
    assert sum(taken) == 4 and groups(taken) == [4]
    assert choose_drafts(offers, [0.0] * 4, [100] * 4, free, least=[TRY] * 4) == [TRY, TRY, 0, 0]
    ten = choose_drafts([[1] * 7] * 10, [0.99] * 10, [100] * 10, free)  # forwards of 8 and 2 sequences
    assert ten[:8] == [0] * 8 and sum(ten[8:]) == 6 and groups(ten) == [8, 2]


def test_a_miss_between_runs_costs_little_and_a_failed_rate_returns():
    """Echoed text fails where the model changes a little (the embedded model
    re-indents code it quotes) and then echoes on. At the Intel Xeon's step
    costs for an agent at 500 tokens: one miss after a run of taken drafts
    leaves the rate where a step verifies most of its 7 drafts, and the rate
    of a sequence whose drafts failed three times is back at the rate before
    any verdict within some 50 steps without drafts (weights 0.7 and 0.95
    took 4 drafts and 18 steps, and multi-turn decoded 10% slower:
    docs/benchmarks.md)."""
    costs = StepCosts(RowCounts(tuple(range(1, 9)), ms=(62.9, 73.1, 80.4, 89.5, 97.4, 104.5, 113.4, 116.2)))
    costs.build_ms, costs.key_ms = 15.0, 0.03
    echo = Drafter([])
    for _ in range(5):
        echo.settle(3, 3)
    echo.settle(3, 1)
    assert choose_drafts([[1] * 7], [echo.rate], [500], costs)[0] >= 5
    failed = Drafter([])
    for _ in range(3):
        failed.settle(2, 0)
    prior = Drafter([]).rate
    for pause in range(100):  # (bounded: a rate that never returns fails, not hangs)
        if failed.rate > prior - 0.01:
            break
        failed.settle(0, 0)
    assert 40 <= pause <= 60


def test_drafts_after_the_first_refused_are_not_counted():
    """Drafts are judged in order and the first refused ends the verdict: those
    after it say nothing of the chance a draft is taken once its
    predecessors were (``rate``, as ``choose_drafts`` uses it). Counted as refused,
    one early miss of seven drafts set a rate near 1/5 that kept an
    echoing agent from drafting for some 25 steps (``bench speculation``'s
    edit)."""
    missed_first, missed_one = Drafter([]), Drafter([])
    missed_first.settle(7, 0)
    missed_one.settle(1, 0)
    assert missed_first.rate == missed_one.rate == 0.25
    taken, four_of_seven = Drafter([]), Drafter([])
    taken.settle(4, 4)
    four_of_seven.settle(7, 4)  # the fifth refused: five judged
    assert taken.rate == (4 + 0.5) / (4 + 1)
    assert four_of_seven.rate == (4 + 0.5) / (5 + 1)


def test_pack_keeps_a_sequences_slots_in_one_forward():
    counts = RowCounts((1, 2, 4, 8))
    assert counts.pack([1] * 11) == counts.forwards(11) == [(8, 8), (3, 4)]
    assert counts.pack([3, 4, 2]) == [(2, 8), (1, 2)]
    assert counts.pack([8, 1]) == [(1, 8), (1, 1)]
    with pytest.raises(ValueError, match="9 token slots"):
        counts.pack([9])


def test_held_drafts_wait_a_step(monkeypatch):
    """A sequence whose owner has no room for drafts (``hold_drafts``) verifies
    none in the next step, and drafts again after; ``decode_lengths`` says
    what a step needs and may add."""
    engine, sid, want = drafting(monkeypatch, "llama", seed=6, max_tokens=24, wrong=1000)
    while engine.prefilling:
        engine.prefill_step()
    (tokens, room), = engine.decode_lengths().values()
    assert (tokens, room) == (len(prompts_for(6, 1)[0]) + 2, 7)  # its next input, and the one after
    engine.hold_drafts(sid)
    (delta,) = engine.step_once()
    assert len(delta.tokens) == 1  # no drafts verified
    (delta,) = engine.step_once()
    assert len(delta.tokens) > 1  # drafts again, every one right
    got = drain(engine)[sid]
    assert got.output_tokens == want.output_tokens


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_sequences_under_a_grammar_draft_what_it_allows_and_say_what_they_say_without(arch, monkeypatch):
    """Drafts of a constrained sequence are cut where its grammar forbids one
    (``Constraint.allows``), and each slot draws under the mask of its own
    place (``Constraint.masks``): every token, logprob and cache byte as
    without drafts, beside a free sequence."""
    from semantic.runtime.text.grammar import json_schema
    from tests.runtime.test_grammar import COLOUR, SCHEMA
    from tests.tiny import tiny_model_with_tokenizer

    model, tok = tiny_model_with_tokenizer(arch)
    counts = measured(model, tok)
    prompts = [tok.encode(text) for text in ("Describe a shirt as JSON.", "Colour?", "Hello there")]
    params = [SamplingParams(max_tokens=80, logprobs=2, grammar=json_schema(SCHEMA)),
              SamplingParams(max_tokens=20, grammar=json_schema(COLOUR)), SamplingParams(max_tokens=15)]
    want = run(model, tok, prompts, params, counts, speculation=False)
    oracle = {tuple(p): (list(p) + list(f.output_tokens), w) for p, f, w in zip(prompts, want, (5, 3, 4))}
    got = run(model, tok, prompts, params, counts, oracle=oracle, monkeypatch=monkeypatch)
    for a, b in zip(want, got):
        assert_same(a, b)
    assert got[0].accepted_tokens > 0  # the constrained sequence took drafts


def test_a_constraint_allows_drafts_as_far_as_its_grammar_goes_and_masks_each_place():
    from semantic.runtime.text.grammar import Grammars, json_schema
    from tests.tiny import embedded_tokenizer

    tok = embedded_tokenizer()
    grammars = Grammars(tok, tok.eos_token_ids)
    c = grammars.constraint(json_schema({"enum": ["red", "green"]}))
    size = len(tok.get_vocab())
    green = tok.encode('"green"', add_special_tokens=False)
    eos = min(tok.eos_token_ids)
    assert c.allows(green) == len(green)
    assert c.allows(green[:-1] + tok.encode("x", add_special_tokens=False)) == len(green) - 1
    assert c.allows(green + [eos]) == len(green)  # an end of turn is never a draft
    masks = c.masks(green, size)
    fresh = grammars.constraint(json_schema({"enum": ["red", "green"]}))
    for token, mask in zip([*green, None], masks):  # each as the matcher would give it there
        assert mx.array_equal(mask, fresh.allowed(size)).item()
        if token is not None:
            fresh.advance(token)
    assert mx.array_equal(c.allowed(size), masks[0]).item()  # and it is where it was
