"""How a request becomes the runtime's conversation (tools rendered or
flattened), and how the conversation index finds an agent by content."""

from __future__ import annotations

import json

from actors import Message, TurnResult
from web.anthropic import parse_request
from web.chat import chat_result, prepare
from web.identity import ConversationIndex

from .test_anthropic import CLAUDE_CODE

HERMES = ("{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
          "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %} use <tool_call> tags")
PLAIN = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def claude_code():
    return parse_request(json.dumps(CLAUDE_CODE).encode(), max_tokens_limit=64000)


def test_a_template_with_tools_gets_them_and_the_tool_turns_as_they_are():
    p = prepare(claude_code(), HERMES)
    assert p.fmt == "hermes" and p.tool_names == {"Bash", "Read"}
    assert [t["function"]["name"] for t in p.tools] == ["Bash", "Read"]
    assert [m.role for m in p.messages] == ["system", "user", "assistant", "tool", "tool", "user"]
    assert p.messages[2].tool_calls[0]["function"] == {"name": "Bash", "arguments": {"command": "ls"}}
    assert (p.messages[3].tool_call_id, p.messages[3].name) == ("toolu_01A", "Bash")
    assert p.messages[2].as_dict()["tool_calls"] == list(p.messages[2].tool_calls)


def test_a_template_without_tools_gets_plain_text_and_never_a_tool_call():
    p = prepare(claude_code(), PLAIN)
    assert (p.tools, p.fmt, p.tool_names) == (None, None, frozenset())
    assert [m.role for m in p.messages] == ["system", "user", "assistant", "user"]
    assert '[tool call: Bash({"command": "ls"})]' in p.messages[2].content
    assert "[tool result from Read]\nError: no such file" in p.messages[3].content
    assert all(not m.tool_calls and m.tool_call_id is None for m in p.messages)


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
    assert idx.match((sys, u1, a1)) == "short"  # never the agent whose conversation *is* the request
    idx.claim("long")
    assert idx.match(request) == "short"
    idx.release("long")
    assert idx.match(request) == "long"
    idx.forget("long")
    assert idx.match((Message("system", "other"), u1)) is None
