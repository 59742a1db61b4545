"""The YAML format: shipped files validate; broken ones fail at the right line."""

import textwrap

import pytest

from semantic.scenarios.cli import LIBRARY, library
from semantic.scenarios.schema import EPHEMERAL, Ref, ScenarioError, load, loads

BASE = textwrap.dedent("""\
    id: gossip
    title: Gossip
    agents:
      alice: {name: Alice, system: You are Alice.}
      bob: {name: Bob, system: You are Bob.}
      eve:
        name: Eve
        system: You are Eve.
        lifecycle: permanent
    phases:
      - name: alice_bob
        agents: [alice, bob]
        rounds: 2
        opening: Alice and Bob talk.
      - name: alice_eve
        agents: [alice, eve]
      - name: reunion
        agents: [alice, bob, eve]
        prompts:
          bob: Remember your talk.
        private:
          - visible_to: [alice]
            text: |
              From Bob:
              ${alice_bob.messages[alice]}
              From Eve:
              ${alice_eve.messages[alice]}
    """)


def line_of(text: str, needle: str, occurrence: int = 1) -> int:
    """The line of the ``occurrence``-th line that contains ``needle``."""
    return [i for i, line in enumerate(text.splitlines(), 1) if needle in line][occurrence - 1]


def error(text: str) -> ScenarioError:
    with pytest.raises(ScenarioError) as e:
        loads(text, "gossip.yaml")
    return e.value


@pytest.mark.parametrize("name", library())
def test_every_shipped_scenario_validates(name):
    s = load(LIBRARY / f"{name}.yaml")
    assert 10 <= s.turns <= 25, f"{name}: {s.turns} turns"
    assert len(s.phases) >= 3


def test_library_has_the_three_scenarios():
    assert {"prisoners_dilemma", "gossip_network", "town_council"} <= set(library())


def test_base_loads_into_frozen_dataclasses():
    s = loads(BASE)
    assert list(s.agents) == ["alice", "bob", "eve"]
    assert [p.name for p in s.phases] == ["alice_bob", "alice_eve", "reunion"]
    p = s.phases[2]
    assert p.order == ("alice", "bob", "eve") and p.rounds == 1 and s.turns == 4 + 2 + 3
    assert p.private[0].visible_to == ("alice",)
    assert p.private[0].text.refs == (Ref("alice_bob", "alice"), Ref("alice_eve", "alice"))
    with pytest.raises(AttributeError):
        p.rounds = 3
    with pytest.raises(TypeError):
        s.agents["mallory"] = None


def test_error_message_names_file_line_and_field():
    text = BASE.replace("agents: [alice, eve]", "agents: [alice, eve2]")
    e = error(text)
    n = line_of(text, "eve2")
    assert str(e) == f"gossip.yaml:{n}: phases[1].agents: unknown agent 'eve2' (known: alice, bob, eve)"
    assert (e.file, e.line, e.field) == ("gossip.yaml", n, "phases[1].agents")


def test_load_names_the_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(BASE.replace("lifecycle: permanent", "lifecycle: immortal"))
    with pytest.raises(ScenarioError) as e:
        load(path)
    assert str(e.value).startswith(f"{path}:9: agents.eve.lifecycle: 'immortal' is not a lifecycle")


# (old, new, the line to point at, field, words of the message)
BROKEN = {
    "unknown agent in a block list": (
        "agents: [alice, eve]", "agents:\n      - alice\n      - mallory",
        "- mallory", "phases[1].agents", "unknown agent 'mallory'"),
    "template names a missing phase": (
        "${alice_eve.messages[alice]}", "${alice_evil.messages[alice]}",
        "alice_evil", "phases[2].private[0].text", "unknown phase 'alice_evil' (earlier phases: alice_bob, alice_eve)"),
    "template names a later phase": (
        "opening: Alice and Bob talk.", "opening: 'Recall ${reunion.messages[alice]}'",
        "Recall", "phases[0].opening", "phase 'reunion' has not happened yet"),
    "template names its own phase": (
        "Remember your talk.", "Remember ${reunion.messages[bob]}",
        "Remember", "phases[2].prompts.bob", "phase 'reunion' has not happened yet"),
    "template perspective agent not in that phase": (
        "${alice_eve.messages[alice]}", "${alice_eve.messages[bob]}",
        "${alice_eve.messages[bob]}", "phases[2].private[0].text",
        "agent 'bob' did not take part in phase 'alice_eve'"),
    "template perspective agent unknown": (
        "${alice_eve.messages[alice]}", "${alice_eve.messages[zed]}",
        "zed", "phases[2].private[0].text", "unknown agent 'zed'"),
    "own prompt would leak a phase": (
        "Remember your talk.", "Remember ${alice_eve.messages[alice]}",
        "Remember", "phases[2].prompts.bob", "'bob' did not take part in phase 'alice_eve'; to show it"),
    "opening would leak a phase": (
        "    agents: [alice, bob, eve]\n", "    agents: [alice, bob, eve]\n    opening: ${alice_eve.messages}\n",
        "opening: ${alice_eve", "phases[2].opening", "'bob' did not take part in phase 'alice_eve'"),
    "bad reference syntax": (
        "From Bob:", "From ${bob}:",
        "From ${bob}", "phases[2].private[0].text", "bad reference '${bob}'"),
    "bad lifecycle": (
        "lifecycle: permanent", "lifecycle: forever",
        "lifecycle: forever", "agents.eve.lifecycle", "'forever' is not a lifecycle (use permanent or ephemeral)"),
    "unknown top-level key": (
        "title: Gossip", "title: Gossip\ntitel: Gossip",
        "titel", "titel", "unknown key (allowed: id, title,"),
    "unknown agent key": (
        "lifecycle: permanent", "lifecycle: permanent\n    mood: grumpy",
        "mood", "agents.eve.mood", "unknown key"),
    "unknown phase key": (
        "rounds: 2", "rounds: 2\n    turns: 4",
        "turns: 4", "phases[0].turns", "unknown key"),
    "duplicate agent": (
        "  bob: {name: Bob, system: You are Bob.}",
        "  bob: {name: Bob, system: You are Bob.}\n  alice: {name: Al, system: x}",
        "name: Al,", "agents", "duplicate agent 'alice' (first at line 4)"),
    "duplicate display name": (
        "{name: Bob, system: You are Bob.}", "{name: alice, system: You are Bob.}",
        "name: alice", "agents.bob.name", "duplicate name 'alice' (also agents.alice)"),
    "duplicate phase name": (
        "- name: alice_eve", "- name: alice_bob",
        ("- name: alice_bob", 2), "phases[1].name", "duplicate phase name 'alice_bob' (first at line 11)"),
    "duplicate agent in a phase": (
        "agents: [alice, eve]", "agents: [alice, eve, alice]",
        "[alice, eve, alice]", "phases[1].agents", "'alice' is listed twice"),
    "empty phase": (
        "agents: [alice, eve]", "agents: []",
        "agents: []", "phases[1].agents", "needs at least one agent"),
    "no phases": (
        BASE[BASE.index("phases:"):], "phases: []\n",
        "phases: []", "phases", "a scenario needs at least one phase"),
    "order leaves an agent out": (
        "rounds: 2", "rounds: 2\n    order: [bob]",
        "order: [bob]", "phases[0].order", "agent 'alice' never speaks"),
    "visible_to an agent outside the phase": (
        "visible_to: [alice]", "visible_to: [alice, mallory]",
        "visible_to", "phases[2].private[0].visible_to", "'mallory' is not an agent of this phase"),
    "rounds not a positive integer": (
        "rounds: 2", "rounds: zero",
        "rounds: zero", "phases[0].rounds", "expected an integer >= 1"),
    "judge not last": (
        "rounds: 2", "rounds: 1\n    judge: {}",
        "judge: {}", "phases[0].judge", "only the last phase can be the judging phase"),
    "agent in no phase": (
        "phases:", "  zed: {name: Zed, system: z}\nphases:",
        "zed:", "agents.zed", "takes part in no phase"),
    "system prompt with a reference": (
        "system: You are Eve.", "system: You are ${alice_bob.messages}.",
        "You are ${", "agents.eve.system", "cannot hold ${...} references"),
    "invalid YAML": (
        "rounds: 2", "rounds: [2",
        "opening: Alice and Bob", "", "invalid YAML"),
}


@pytest.mark.parametrize("case", BROKEN, ids=list(BROKEN))
def test_broken_yaml_points_at_the_line(case):
    old, new, at, field, words = BROKEN[case]
    assert old in BASE, case
    text = BASE.replace(old, new, 1)
    e = error(text)
    expected = line_of(text, *at) if isinstance(at, tuple) else line_of(text, at)
    assert e.line == expected, str(e)
    assert e.field == field, str(e)
    assert words in e.message, str(e)
    assert str(e).startswith(f"gossip.yaml:{e.line}: ")


def test_private_block_may_share_a_phase_the_audience_missed():
    """The declared exception: visible_to shows bob a phase he was not in."""
    text = BASE.replace("visible_to: [alice]", "visible_to: [bob]")
    s = loads(text)
    assert s.phases[2].private[0].visible_to == ("bob",)


def test_defaults_and_overrides():
    text = BASE.replace("title: Gossip", "title: Gossip\nsampling: {max_tokens: 20, stop: [\"\\n\\n\"]}")
    text = text.replace("rounds: 2", "rounds: 2\n    sampling: {temperature: 0.7}")
    text = text.replace("{name: Bob, system: You are Bob.}", "{name: Bob, system: You are Bob., lifecycle: ephemeral}")
    text = text.replace("name: Eve\n", "name: Eve\n    sampling: {max_tokens: 64, temperature: 0.2}\n")
    s = loads(text)
    ab, ae, re_ = (p.sampling for p in s.phases)
    assert ab["alice"].max_tokens == 20 and ab["alice"].temperature == 0.7 and ab["alice"].stop == ("\n\n",)
    assert ae["alice"].temperature == 0.0
    assert ae["eve"].max_tokens == 64 and ae["eve"].temperature == 0.2 and ae["eve"].stop == ("\n\n",)
    assert re_.keys() == {"alice", "bob", "eve"}
    # scenario < phase < agent: eve's own settings win over the phase's, the rest comes from the phase
    s = loads(text.replace("phases:\n  - name: alice_bob\n    agents: [alice, bob]",
                           "phases:\n  - name: alice_bob\n    agents: [alice, eve]"))
    ab = s.phases[0].sampling
    assert ab["eve"].temperature == 0.2 and ab["eve"].max_tokens == 64 and ab["alice"].temperature == 0.7
    assert s.agents["bob"].lifecycle == EPHEMERAL and s.phases[0].label == "alice_bob"


def test_judge_phase_with_payoff_matrix():
    text = BASE + textwrap.indent(textwrap.dedent("""\
        - name: verdict
          agents: [eve]
          judge:
            payoff_matrix:
              both silent: 1 year each
              both confess: 5 years
        """), "  ")
    s = loads(text)
    assert s.phases[-1].judge.payoff_matrix == (("both silent", "1 year each"), ("both confess", "5 years"))
    e = error(text.replace("agents: [eve]\n    judge", "agents: [eve, bob]\n    judge"))
    assert "one agent and one round" in e.message


def test_yaml_nested_past_what_the_parser_can_take_is_a_scenario_error():
    with pytest.raises(ScenarioError, match="invalid YAML: nested too deeply"):
        loads("[" * 50_000 + "]" * 50_000, "deep.yaml")
