"""The protocol-neutral request and result: the rules they are built with."""

from __future__ import annotations

import pytest

from semantic.web.schema import ChatRequest, ChatResult, RequestError, ToolCall, Usage, load_json

HI = ({"role": "user", "content": "hi"},)


@pytest.mark.parametrize("body, message", [
    (b"{", "request body is not valid JSON: Expecting property name"),
    (b"null", "request body must be a JSON object"),
    (b'"\xff"', "request body is not"),
])
def test_load_json_refuses_anything_but_an_object(body, message):
    with pytest.raises(RequestError) as e:
        load_json(body)
    assert e.value.status == 400 and e.value.message.startswith(message) and e.value.param is None


def test_load_json():
    assert load_json(b'{"a": [1]}') == {"a": [1]}


def test_request_error():
    err = RequestError(413, "body over 1 MiB", param=None)
    assert (err.status, err.message, str(err)) == (413, "body over 1 MiB", "body over 1 MiB")
    with pytest.raises(ValueError, match="4xx or 5xx, not 200"):
        RequestError(200, "fine")


@pytest.mark.parametrize("fields, rule", [
    ({"messages": ()}, "at least one message"),
    ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ({"messages": ({"role": "robot", "content": "x"},)}, "not 'robot'"),
    ({"stop": ("",)}, "stop strings must not be empty"),
])
def test_request_rules(fields, rule):
    with pytest.raises(ValueError, match=rule):
        ChatRequest(**{"messages": HI, "max_tokens": 5, **fields})


def test_conversation_puts_the_system_prompt_first_and_copies():
    req = ChatRequest(messages=HI, max_tokens=5, system="Be brief.")
    conv = req.conversation()
    assert conv == [{"role": "system", "content": "Be brief."}, *HI]
    conv[1]["content"] = "changed"
    assert req.messages[0]["content"] == "hi"
    assert ChatRequest(messages=HI, max_tokens=5).conversation() == list(HI)


U = Usage(input_tokens=3, cache_read_input_tokens=40, output_tokens=2)
CALL = ToolCall("call_1", "f", {})


def test_usage():
    assert U.prompt_tokens == 43
    with pytest.raises(ValueError):
        Usage(-1)


@pytest.mark.parametrize("fields, rule", [
    ({"stop_reason": "eos"}, "stop_reason must be one of"),
    ({"stop_reason": "stop_sequence"}, "stop_sequence is given exactly when"),
    ({"stop_sequence": "END"}, "stop_sequence is given exactly when"),
    ({"stop_reason": "tool_use"}, "stop_reason 'tool_use' needs tool_calls"),
    ({"tool_calls": (CALL,)}, "tool_calls are given only when"),  # (and with "length": a held call, cut)
])
def test_result_rules(fields, rule):
    with pytest.raises(ValueError, match=rule):
        ChatResult(**{"text": "x", "stop_reason": "stop", "usage": U, **fields})


def test_a_result_keeps_its_calls_as_a_tuple():
    assert ChatResult("", "tool_use", U, tool_calls=[CALL]).tool_calls == (CALL,)
