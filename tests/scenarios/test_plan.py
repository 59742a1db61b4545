"""Prompt construction without a backend: transcripts, templates, queues, keys."""

from semantic.scenarios.plan import Line, Prompts, cache_key, cue, render_template, render_transcript, schedule
from semantic.scenarios.schema import Ref, Template, loads

from .test_schema import BASE

NAMES = {"alice": "Alice", "bob": "Bob", "eve": "Eve"}
LINES = [Line("p", "alice", 1, "Hi Bob."), Line("p", "bob", 1, "Hello\n  Alice."), Line("p", "alice", 2, "")]


def test_transcript_from_an_agents_perspective_says_you():
    assert render_transcript(LINES, NAMES, "alice") == "You: Hi Bob.\nBob: Hello Alice.\nYou: (says nothing)"
    assert render_transcript(LINES, NAMES, "bob") == "Alice: Hi Bob.\nYou: Hello Alice.\nAlice: (says nothing)"
    assert render_transcript(LINES, NAMES) == "Alice: Hi Bob.\nBob: Hello Alice.\nAlice: (says nothing)"


def test_template_renders_each_reference():
    t = Template(("From Bob:\n", Ref("p", "bob"), "\nEnd."))
    rendered = render_template(t, {"p": LINES}, NAMES)
    assert rendered == "From Bob:\nAlice: Hi Bob.\nYou: Hello Alice.\nAlice: (says nothing)\nEnd."


def test_schedule_and_cache_keys():
    s = loads(BASE.replace("  eve:\n", "  eve:\n").replace("lifecycle: permanent", "lifecycle: ephemeral"))
    slots = list(schedule(s))
    assert [(x.phase.name, x.round, x.agent) for x in slots] == [
        ("alice_bob", 1, "alice"), ("alice_bob", 1, "bob"), ("alice_bob", 2, "alice"), ("alice_bob", 2, "bob"),
        ("alice_eve", 1, "alice"), ("alice_eve", 1, "eve"),
        ("reunion", 1, "alice"), ("reunion", 1, "bob"), ("reunion", 1, "eve"),
    ]
    assert [x.index for x in slots] == list(range(9))
    assert cache_key(s, "r1", "alice", "alice_bob") == cache_key(s, "r1", "alice", "reunion") == "scn.gossip.r1.alice"
    assert cache_key(s, "r1", "eve", "alice_eve") == "scn.gossip.r1.alice_eve.eve"
    assert cache_key(s, "r1", "eve", "reunion") != cache_key(s, "r1", "eve", "alice_eve")
    assert cache_key(s, "r2", "alice", "reunion") != cache_key(s, "r1", "alice", "reunion")


def test_prompts_queue_what_each_agent_witnessed_in_order():
    s = loads(BASE)
    p = Prompts(s)
    ab, ae, re_ = s.phases
    p.start_phase(ab)
    assert p.take("alice") == f"--- alice_bob ---\nAlice and Bob talk.\n{cue('Alice')}"
    p.said(ab, Line("alice_bob", "alice", 1, "A1"))
    assert p.take("bob") == f"--- alice_bob ---\nAlice and Bob talk.\nAlice: A1\n{cue('Bob')}"
    p.said(ab, Line("alice_bob", "bob", 1, "B1"))
    p.said(ab, Line("alice_bob", "alice", 2, "A2"))
    p.said(ab, Line("alice_bob", "bob", 2, "B2"))  # bob has the last word: alice hears it next time
    p.end_phase(ab)
    p.start_phase(ae)
    assert p.take("alice") == f"Bob: B1\nBob: B2\n--- alice_eve ---\n{cue('Alice')}"
    assert "--- alice_eve ---" not in p.take("bob")  # bob was not there
    p.said(ae, Line("alice_eve", "alice", 1, "A3"))
    p.said(ae, Line("alice_eve", "eve", 1, "E1"))
    p.end_phase(ae)
    p.start_phase(re_)
    alice = p.take("alice")
    assert alice.startswith("Eve: E1\n--- reunion ---\n")
    assert "From Bob:\nYou: A1\nBob: B1\nYou: A2\nBob: B2\nFrom Eve:\nYou: A3\nEve: E1" in alice  # her private block
    bob = p.take("bob")
    assert bob == f"--- reunion ---\nRemember your talk.\n{cue('Bob')}"  # his own prompt, not alice's block


def test_an_ephemeral_agent_forgets_what_it_had_not_heard():
    s = loads(BASE.replace("lifecycle: permanent", "lifecycle: ephemeral"))
    p = Prompts(s)
    ab, ae, re_ = s.phases
    p.start_phase(ab)
    p.end_phase(ab)
    p.start_phase(ae)
    p.take("eve")
    p.said(ae, Line("alice_eve", "alice", 1, "last word"))
    p.end_phase(ae)
    p.start_phase(re_)
    assert "last word" not in p.take("eve")
