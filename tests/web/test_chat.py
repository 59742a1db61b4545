"""How a request becomes the runtime's conversation (tools rendered or
flattened), and how the conversation index finds an agent by content."""

from __future__ import annotations

import hashlib
import json

from semantic.actors import Message
from semantic.runtime.outcome import TurnResult
from semantic.web.anthropic import parse_request
from semantic.web.chat import chat_result
from semantic.web.identity import (ConversationIndex, as_generated, forked_conversation_id, new_conversation_id,
                                   route_scope)
from semantic.web.prepare import context_first, prepare
from semantic.web.tools import hermes_calls, tool_prompt

from .test_anthropic import CLAUDE_CODE

HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %} use <tool_call> tags")
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def claude_code():
    return parse_request(json.dumps(CLAUDE_CODE).encode(), max_tokens_cap=64000)


def test_a_template_with_tools_gets_them_and_the_tool_turns_as_they_are():
    p = prepare(claude_code(), HERMES)
    assert p.fmt == "hermes" and p.tool_names == {"Bash", "Read"}
    assert [t["function"]["name"] for t in p.tools] == ["Bash", "Read"]
    assert [m.role for m in p.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert p.messages[2].tool_calls[0]["function"] == {"name": "Bash", "arguments": {"command": "ls"}}
    assert (p.messages[3].tool_call_id, p.messages[3].name) == ("toolu_01A", "Bash")
    assert p.messages[2].as_dict()["tool_calls"] == list(p.messages[2].tool_calls)


def test_a_template_without_tools_is_told_them_and_gets_its_tool_turns_as_text():
    told = prepare(claude_code(), PLAIN)
    assert (told.tools, told.fmt, told.tool_names, told.tools_told) == (None, "hermes", {"Bash", "Read"}, True)
    assert told.messages[0].content.endswith(tool_prompt(claude_code().tools)) and told.holds_calls
    p = prepare(claude_code(), PLAIN, tell_tools=False)  # (tools its context cannot hold: ``ChatCore``)
    assert (p.tools, p.fmt, p.tool_names, p.grammar) == (None, None, frozenset(), None)
    for q in (told, p):
        assert [m.role for m in q.messages] == ["system", "user", "assistant", "user"]
        assert '<tool_call>\n{"name": "Bash", "arguments": {"command": "ls"}}\n</tool_call>' in q.messages[2].content
        assert q.calls_as_text
        assert "[tool result from Read]\nError: no such file" in q.messages[3].content
        assert all(not m.tool_calls and m.tool_call_id is None for m in q.messages)


def test_results_map_the_runtimes_reasons():
    base = dict(text="hi", prompt_tokens=10, reused_tokens=7, prefilled_tokens=3, output_tokens=2,
                queued_s=0, ttft_s=0.1)
    r = chat_result(TurnResult(reason="stop", **base))
    assert (r.stop_reason, r.usage.input_tokens, r.usage.cache_read_input_tokens, r.usage.output_tokens) == \
           ("stop", 3, 7, 2)
    assert chat_result(TurnResult(reason="stop", stop_sequence="END", **base)).stop_sequence == "END"
    assert chat_result(TurnResult(reason="length", **base)).stop_reason == "length"


def test_the_index_finds_the_longest_proper_prefix_and_skips_claimed_agents():
    idx = ConversationIndex("hermes")
    sys, u1 = Message("system", "S"), Message("user", "one")
    a1 = Message("assistant", 'Sure.\n<tool_call>{"name": "ls", "arguments": {"d": "."}}</tool_call>')
    idx.record("short", (sys,))
    idx.record("long", (sys, u1, a1))
    # the client sends the reply back as text plus a call with an id of its own
    sent_back = Message("assistant", "Sure.", ({"id": "call_9", "type": "function",
                                                "function": {"name": "ls", "arguments": {"d": "."}}},))
    request = (sys, u1, sent_back, Message("tool", "a.py", (), "call_9", "ls"))
    assert idx.match(request) == "long"
    assert idx.match((sys, u1, a1)) is None  # never the agent whose conversation *is* the request
    idx.claim("long")
    assert idx.match(request) is None  # a claimed agent is skipped, and a system prompt alone continues nothing
    idx.release("long")
    assert idx.match(request) == "long"
    idx.forget("long")
    assert idx.match((Message("system", "other"), u1)) is None
    # An agent with no reply yet (one the agent API created) is no stranger's conversation to continue.
    assert idx.match((sys, u1)) is None


def test_a_call_sent_back_is_rendered_as_the_model_wrote_it():
    """A template without tools: the client's call, rendered in the Hermes format, reads as the
    stored reply; the turn takes the stored text, whose literals the cache holds as written."""
    sys, u1, result = Message("system", "S"), Message("user", "Price?"), Message("user", "[tool result]\n3")
    raw = '<tool_call>\n{"name": "price", "arguments": {"usd": 12.50, "note": "caf\\u00e9"}}\n</tool_call>'
    history = (sys, u1, Message("assistant", raw))
    call = {"function": {"name": "price", "arguments": {"usd": 12.5, "note": "caf\u00e9"}}}
    sent = (sys, u1, Message("assistant", hermes_calls([call])), result)
    assert sent[2].content == '<tool_call>\n{"name": "price", "arguments": {"usd": 12.5, "note": "caf\u00e9"}}\n</tool_call>'
    assert ConversationIndex("hermes").keys(history) == ConversationIndex("hermes").keys(sent[:3])
    assert as_generated(sent, history, "hermes") == (sys, u1, history[2], result)
    other = {"function": {"name": "price", "arguments": {"usd": 13}}}
    assert as_generated((sys, u1, Message("assistant", hermes_calls([other]))), history, "hermes")[2] != history[2]
    edited = (sys, Message("user", "Cost?"), sent[2])  # (an earlier message differs: nothing is taken)
    assert as_generated(edited, history, "hermes") == edited
    thought = (sys, u1, Message("assistant", "<think>hm</think>" + raw))
    assert as_generated(sent, thought, "hermes") == sent  # a reply that reasoned stays as sent


def test_a_session_hint_lets_an_edited_conversation_keep_its_agent_but_never_another_system_prompts():
    idx = ConversationIndex()
    main, sub, title = Message("system", "main"), Message("system", "sub-agent"), Message("system", "titles")
    u1, a1, u2 = Message("user", "one"), Message("assistant", "ok"), Message("user", "two")
    main_id, sub_id, other_id = (new_conversation_id("s1"), new_conversation_id("s1"), new_conversation_id("s2"))
    assert main_id.startswith("conv-") and main_id != sub_id and main_id[:17] == sub_id[:17] != other_id[:17]
    idx.record(main_id, (main, u1, a1, u2, a1))
    idx.record(sub_id, (sub, u1, a1))
    idx.record(other_id, (main, u1, a1, u2, a1))
    edited = (main, u1, Message("assistant", "ok (trimmed)"), u2)  # e.g. an old tool result cleared
    assert idx.match(edited) is None  # no stored conversation is a prefix of it
    assert idx.match(edited, "s1") == main_id  # its session's agent with the most shared messages
    assert idx.match((sub, u2), "s1") == sub_id
    assert idx.match((title, u1), "s1") is None  # a system prompt of its own: a new agent
    assert idx.match(edited, "s3") is None  # nothing of another session
    idx.claim(main_id)
    assert idx.match(edited, "s1") is None  # a concurrent request never shares a running agent
    assert idx.match((main, u1, a1, u2, a1, u2), "s1") == other_id  # a proper prefix wins, whatever the session


def test_a_fork_is_routed_as_its_source():
    """What a load balancer hashes (scripts/haproxy.cfg): a session's conversations the
    scope of the session hint, other agents that of their id, a conversation without a
    hint nothing (the client's address); a fork (an older response id continued) the
    same as its source, whatever the request's hint, so it stays on its source's server."""
    scope = hashlib.sha256(b"s1").hexdigest()[:12]
    session, anonymous = new_conversation_id("s1"), new_conversation_id()
    assert route_scope(session) == scope and route_scope(anonymous) is None
    assert route_scope("alice") == hashlib.sha256(b"alice").hexdigest()[:12]
    for source in (session, anonymous, "alice"):
        fork = forked_conversation_id(source)
        assert fork.startswith("conv-") and fork != source and route_scope(fork) == route_scope(source)


def test_a_system_message_after_a_user_message_is_rendered_before_it():
    convo = [{"role": "system", "content": "S"}, {"role": "user", "content": "q1"},
             {"role": "system", "content": "env"}, {"role": "assistant", "content": "a1"},
             {"role": "system", "content": "plan mode"}, {"role": "user", "content": "q2"},
             {"role": "system", "content": "reminder"}]
    assert [m["content"] for m in context_first(convo)] == ["S", "env", "q1", "a1", "plan mode", "reminder", "q2"]
    # what a later turn sends extends what an earlier one rendered: the cache stays a prefix
    assert context_first(convo[:3]) == context_first(convo)[:3]
    assert [m["content"] for m in context_first(convo[1:3])] == ["env", "q1"]


def test_every_protocol_module_has_the_shape_the_routes_use():
    from semantic.web import agents, anthropic, openai, responses
    from semantic.web.chat import Answers, ChatProtocol

    assert all(isinstance(m, ChatProtocol) for m in (anthropic, openai, responses))
    assert isinstance(agents, Answers) and not isinstance(agents, ChatProtocol)  # its routes read their own bodies


def test_a_stored_call_matches_the_typed_call_a_client_sends_back():
    """Qwen3-Coder's parser, without the tools' types (a stored reply is read
    without them), gives every value as written: ``"3"``, ``"True"``, JSON text."""
    from semantic.web.identity import message_key

    from .test_tools import library_format, wrapper

    fmt = library_format(wrapper("qwen3_coder"))
    stored = Message("assistant", "<tool_call>\n<function=w>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>"
                                  "\n3\n</parameter>\n<parameter=ok>\nTrue\n</parameter>\n<parameter=o>\n"
                                  '{"a": [1, 2]}\n</parameter>\n</function>\n</tool_call>')
    args = {"city": "Oslo", "days": 3, "ok": True, "o": {"a": [1, 2]}}
    sent = Message("assistant", "", ({"id": "c", "type": "function", "function": {"name": "w", "arguments": args}},))
    assert message_key(stored, fmt) == message_key(sent, fmt)
    other = Message("assistant", "", ({"id": "c", "type": "function", "function": {
        "name": "w", "arguments": {**args, "days": 4}}},))
    assert message_key(stored, fmt) != message_key(other, fmt)
