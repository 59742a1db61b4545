"""The runner on the fake backend: leakage, growing conversations, cache keys, report."""

import json

import anyio
import pytest

from semantic.runtime.outcome import TurnResult
from semantic.scenarios import report
from semantic.scenarios.cli import LIBRARY, library
from semantic.scenarios.runner import PhaseStarted, TurnFinished, TurnRecord, TurnStarted, TurnText, run
from semantic.scenarios.schema import Ref, Scenario, load, loads

from .fake import MARKER, FakeBackend, Received, marker
from .test_schema import BASE

pytestmark = [pytest.mark.anyio, pytest.mark.both_backends]

SHIPPED = [load(LIBRARY / f"{name}.yaml") for name in library()]


async def play(scenario: Scenario, **kw) -> tuple[FakeBackend, object, list]:
    fake = FakeBackend()
    events = []

    def on_event(event):
        fake.observe(event)
        events.append(event)

    result = await run(scenario, fake, run_id="t", on_event=on_event, **kw)
    return fake, result, events


def allowed_phases(scenario: Scenario, agent: str) -> set[str]:
    """Phases whose words may reach ``agent``: those it took part in, and those
    a private block visible to it names."""
    took_part = {p.name for p in scenario.phases_of(agent)}
    shared = {ref.phase for p in scenario.phases for b in p.private if agent in b.visible_to for ref in b.text.refs}
    return took_part | shared


def leaks(scenario: Scenario, received: list[Received]) -> list[str]:
    """Every marker in a prompt that its agent should not have seen."""
    out = []
    for r in received:
        for phase, speaker, n in MARKER.findall(r.conversation):
            if phase not in allowed_phases(scenario, r.agent):
                out.append(f"{r.agent} saw {marker(phase, speaker, int(n))} from {phase}")
    return out


@pytest.mark.parametrize("scenario", SHIPPED, ids=[s.id for s in SHIPPED])
async def test_no_agent_hears_a_phase_it_was_not_in(scenario):
    fake, result, _ = await play(scenario)
    assert len(fake.received) == scenario.turns == len(result.turns)
    assert leaks(scenario, fake.received) == []
    # The positive side: every earlier line of a phase the agent was in reaches it
    # (ephemeral agents: of the phase of their conversation only).
    for i, r in enumerate(fake.received):
        permanent = scenario.agents[r.agent].permanent
        for t in result.turns[:i]:
            heard = r.agent in scenario.phase(t.phase).agents and (permanent or t.phase == r.phase)
            if heard and t.agent != r.agent:
                assert t.result.text.split()[0] in r.conversation, (i, r.agent, t.result.text)


@pytest.mark.parametrize("scenario", SHIPPED, ids=[s.id for s in SHIPPED])
async def test_private_text_reaches_only_its_audience(scenario):
    fake, _, _ = await play(scenario)
    public = " ".join([p.opening.literal for p in scenario.phases] + [a.system for a in scenario.agents.values()])
    for phase in scenario.phases:
        for block in phase.private:
            for line in block.text.literal.splitlines():
                line = line.strip()
                if len(line) < 12 or line in public:
                    continue
                audience = {a for b in phase.private if line in b.text.literal for a in b.visible_to}
                for r in fake.received:
                    if line in r.prompt:
                        assert r.agent in audience, f"{r.agent} saw private text {line!r}"
                assert any(line in r.prompt for r in fake.received if r.agent in audience), line


async def test_the_leak_check_catches_a_leak():
    """Negative control: a prompt carrying another phase's marker is reported."""
    s = SHIPPED[[x.id for x in SHIPPED].index("gossip-network")]
    fake, _, _ = await play(s)
    bob = fake.of("bob")[-1]
    eve_line = next(r.reply for r in fake.of("eve") if r.phase == "alice_eve")
    tampered = Received(**{**bob.__dict__, "conversation": bob.conversation + eve_line})
    assert leaks(s, [tampered]) == [f"bob saw {eve_line.split()[0]} from alice_eve"]


async def test_visible_to_is_the_only_way_in():
    """bob was not in alice_eve, but a private block visible to him shows it: allowed, and shown."""
    s = loads(BASE.replace("visible_to: [alice]", "visible_to: [bob]"))
    fake, _, _ = await play(s)
    bob_last = fake.of("bob")[-1]
    assert marker("alice_eve", "eve", 1) in bob_last.prompt
    assert "alice_eve" in allowed_phases(s, "bob") and leaks(s, fake.received) == []
    assert marker("alice_eve", "eve", 1) not in fake.of("bob")[0].conversation


@pytest.mark.parametrize("scenario", SHIPPED, ids=[s.id for s in SHIPPED])
async def test_each_conversation_grows_by_appending(scenario):
    """Each turn's whole prompt starts with the previous turn's prompt + reply on that
    cache key, and the fake engine reused exactly that much."""
    fake, result, _ = await play(scenario)
    by_key: dict[str, list[Received]] = {}
    for r in fake.received:
        by_key.setdefault(r.cache_key, []).append(r)
    for key, turns in by_key.items():
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.conversation.startswith(prev.conversation + prev.reply), key
            assert nxt.reused == len((prev.conversation + prev.reply).split()), key
        assert turns[0].reused == 0
    for t in result.turns:
        assert (t.result.reused_tokens > 0) == (t.agent_turn > 1)


@pytest.mark.parametrize("scenario", SHIPPED, ids=[s.id for s in SHIPPED])
async def test_one_key_per_permanent_agent_and_one_per_phase_for_ephemeral(scenario):
    fake, result, _ = await play(scenario)
    for key, agent in scenario.agents.items():
        keys = [o.cache_key for o in fake.opened if o.agent == key]
        if agent.permanent:
            assert len(keys) == 1, key
        else:
            assert len(keys) == len(scenario.phases_of(key)) == len(set(keys)), key
        assert all(o.system == agent.system for o in fake.opened if o.agent == key)
    assert sorted(fake.closed) == sorted(o.cache_key for o in fake.opened)  # every conversation ended


async def test_ephemeral_agent_is_closed_when_its_phase_ends():
    s = next(x for x in SHIPPED if x.id == "town-council")
    fake = FakeBackend()
    closed_at_vote = []

    def on_event(event):
        fake.observe(event)
        if isinstance(event, PhaseStarted) and event.phase.name == "vote":
            closed_at_vote.extend(fake.closed)

    await run(s, fake, run_id="t", on_event=on_event)
    assert closed_at_vote == ["scn.town-council.t.roads_committee.clerk", "scn.town-council.t.parks_committee.clerk"]
    clerk_vote = [r for r in fake.of("clerk") if r.phase == "vote"][0]
    assert clerk_vote.conversation.count("<|user|>") == 1  # a fresh conversation...
    assert "You: " + marker("roads_committee", "clerk", 1) in clerk_vote.prompt  # ...told its own minutes as "You"


async def test_no_cache_is_passed_through():
    s = SHIPPED[0]
    fake, result, _ = await play(s, use_cache=False)
    assert {o.use_cache for o in fake.opened} == {False}
    assert all(t.result.reused_tokens == 0 and t.result.prefilled_tokens == t.result.prompt_tokens
               for t in result.turns)
    assert result.use_cache is False


async def test_seed_gives_each_turn_its_own_seed():
    s = SHIPPED[0]
    fake, _, _ = await play(s, seed=7)
    assert [r.sampling.seed for r in fake.received] == [7 + i for i in range(s.turns)]
    fake, _, _ = await play(s)
    assert {r.sampling.seed for r in fake.received} == {None}


async def test_events_come_in_order():
    s = loads(BASE)
    _, result, events = await play(s)
    kinds = [type(e).__name__ for e in events]
    assert kinds[0] == "PhaseStarted" and kinds[-1] == "PhaseFinished"
    starts = [e for e in events if isinstance(e, TurnStarted)]
    assert [e.index for e in starts] == list(range(s.turns))
    text = "".join(e.text for e in events[:kinds.index("TurnFinished")] if isinstance(e, TurnText))
    assert text == next(e for e in events if isinstance(e, TurnFinished)).record.result.text
    assert [e.reopened for e in starts][:3] == [True, True, False]


async def test_report_json_has_turns_and_totals():
    s = next(x for x in SHIPPED if x.id == "prisoners-dilemma")
    _, result, _ = await play(s)
    rep = json.loads(json.dumps(report.report(result, model="fake")))
    assert rep["model"] == "fake" and len(rep["turns"]) == s.turns
    for t in rep["turns"]:
        assert {"agent", "phase", "prompt_tokens", "reused_tokens", "prefilled_tokens", "ttft_ms"} <= t.keys()
        assert {"decode_tps", "prefill_ms", "generated_tokens", "reuse", "cache_key", "agent_turn"} <= t.keys()
        assert t["prompt_tokens"] == t["reused_tokens"] + t["prefilled_tokens"]
    totals = rep["totals"]
    assert totals["turns"] == s.turns
    assert totals["prompt_tokens"] == sum(t["prompt_tokens"] for t in rep["turns"])
    assert totals["reused_tokens"] + totals["prefilled_tokens"] == totals["prompt_tokens"]
    assert 0 < totals["reuse"] < 1 and totals["decode_tps"] == 100.0
    assert rep["agents"]["warden"]["turns"] == 8 and rep["agents"]["analyst"]["min_reuse_after_first_turn"] is None
    assert result.verdict is not None and result.verdict == result.turns[-1].result.text


def test_a_turn_that_decoded_nothing_reports_zero_times():
    """No token (or a server that did not say): no TTFT, prefill or decode time; the report shows 0."""
    nothing = TurnResult("cancelled", "", 10, 4, 6, 0, queued_s=None, ttft_s=None)
    t = TurnRecord(0, "p", "alice", "Alice", 1, "permanent", "key.alice", 1, "hi", nothing)
    row = report.turn_row(t)
    assert (row["ttft_ms"], row["prefill_ms"], row["decode_tps"], row["reuse"]) == (0.0, 0.0, 0.0, 0.4)
    assert report.totals([t])["decode_tps"] == 0.0


async def test_transcript_outputs(tmp_path):
    s = next(x for x in SHIPPED if x.id == "prisoners-dilemma")
    _, result, _ = await play(s)
    report.write(result, tmp_path / "out", model="fake")
    t = json.loads((tmp_path / "out" / "transcript.json").read_text())
    assert [p["name"] for p in t["phases"]] == [p.name for p in s.phases]
    assert sum(len(p["lines"]) for p in t["phases"]) == s.turns and t["verdict"] == result.verdict
    md = (tmp_path / "out" / "transcript.md").read_text()
    assert md.startswith("# The Prisoner's Dilemma") and "## Phase 3: The Yard" in md and "## Verdict" in md
    assert "The final reckoning, word for word" not in md  # private context is not speech
    assert json.loads((tmp_path / "out" / "report.json").read_text())["totals"]["turns"] == s.turns


async def test_judge_sees_the_payoff_matrix_and_only_its_private_transcript():
    s = next(x for x in SHIPPED if x.id == "prisoners-dilemma")
    fake, _, _ = await play(s)
    (analyst,) = fake.of("analyst")
    assert "Payoff matrix:\n- both stay silent: 1 year each" in analyst.prompt
    assert {m[0] for m in MARKER.findall(analyst.prompt)} == {"final_reckoning"}
    assert s.phases[-1].private[0].text.refs == (Ref("final_reckoning", None),)


async def test_cancelled_run_closes_every_conversation_and_keeps_none_half_done():
    s = loads(BASE)
    fake = FakeBackend(block=anyio.Event())
    started = anyio.Event()

    def on_event(event):
        fake.observe(event)
        if isinstance(event, TurnText):
            started.set()

    async with anyio.create_task_group() as tg:
        async def go():
            await run(s, fake, run_id="t", on_event=on_event)

        tg.start_soon(go)
        await started.wait()
        tg.cancel_scope.cancel()
    assert fake.received == [] and fake.cache == {}  # the cancelled turn left nothing
    assert fake.closed == [o.cache_key for o in fake.opened] == ["scn.gossip.t.alice"]


async def test_backend_failure_closes_every_conversation_and_propagates():
    s = loads(BASE)

    def reply(phase, agent, n):
        if phase == "alice_eve":
            raise RuntimeError("backend fell over")
        return f"{agent} {n}"

    fake = FakeBackend(reply=reply)
    with pytest.raises(RuntimeError, match="fell over"):
        await run(s, fake, run_id="t", on_event=fake.observe)
    assert sorted(fake.closed) == sorted(o.cache_key for o in fake.opened) and len(fake.opened) == 2


async def projected_run(scenario: Scenario):
    """Run on the fake with every reply as long as its sampling allows (~0.75 words a token)."""
    cap = {(p.name, a): max(1, int(s.max_tokens * 0.75)) for p in scenario.phases for a, s in p.sampling.items()}

    def reply(phase, agent, n):
        return " ".join([marker(phase, agent, n)] + ["w"] * (cap[phase, agent] - 1))

    fake = FakeBackend(reply=reply)
    return await run(scenario, fake, run_id="p", on_event=fake.observe)


@pytest.mark.parametrize("scenario", SHIPPED, ids=[s.id for s in SHIPPED])
async def test_shipped_scenarios_are_shaped_for_90_percent_reuse(scenario):
    """A projection, not a measurement: with whitespace words as tokens and
    full-length replies, every permanent agent reuses >= 92% of each prompt
    from its second turn on.  The shipped scenarios keep each turn's new text
    (others' lines, a phase header, the cue) small next to what the agent
    holds; this test fails if an edit breaks that shape.  The engine's own
    numbers are what the report shows: on SmolLM2 they ran ~1.5 points below
    this projection (chat-template tokens per message), hence 92 for 90."""
    result = await projected_run(scenario)
    for t in result.turns:
        if scenario.agents[t.agent].permanent and t.agent_turn > 1:
            assert t.result.reuse >= 0.92, f"{t.agent} turn {t.agent_turn} ({t.phase}): {t.result.reuse:.1%}"
