"""``read_json``: the one reader of JSON from outside refuses, with one
``JSONError`` naming the limit, what ``json.loads`` would recurse on, build
without bound or read without end."""

from __future__ import annotations

import json

import pytest

from semantic.runtime.text.json_reader import MAX_DEPTH, JSONError, check_depth, read_json


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_json_within_the_limits_reads_as_json_loads_does():
    doc = {"a": [1, 2.5, None, True], "b": {"c": "x [ { \" ] }"}, "é": "\u2603"}
    for data in (json.dumps(doc), json.dumps(doc).encode(), json.dumps(doc).encode("utf-16")):
        assert read_json(data) == doc
    assert read_json(nested(MAX_DEPTH)) == json.loads(nested(MAX_DEPTH))


@pytest.mark.parametrize("data, needle", [
    (nested(MAX_DEPTH + 1), f"more than {MAX_DEPTH} deep"),
    (nested(100_000), f"more than {MAX_DEPTH} deep"),  # json.loads: RecursionError
    ('{"a": ' * 70 + "1" + "}" * 70, f"more than {MAX_DEPTH} deep"),
    ("[NaN]", "NaN is not a JSON number"),
    ("[-Infinity]", "-Infinity is not a JSON number"),
    ("9" * 5000, "not readable"),  # json.loads: ValueError past Python's integer digit limit
    (b"\xff\x00\xfe", "not UTF-8"),
    ("{nope", "not valid JSON"),
])
def test_json_past_a_limit_is_one_error_naming_it(data, needle):
    with pytest.raises(JSONError, match=needle) as caught:
        read_json(data, "request body")
    assert str(caught.value).startswith("request body ")


def test_brackets_inside_strings_do_not_count_as_nesting():
    text = json.dumps(["[" * 1000, {"k": "{" * 1000 + "\\\"" + "]"}])
    check_depth(text)
    assert read_json(text)[0] == "[" * 1000


def test_keys_are_bounded_across_all_objects():
    text = json.dumps([{"a": 1, "b": 2}] * 6)
    assert len(read_json(text, max_keys=12)) == 6
    with pytest.raises(JSONError, match="more than 11 keys"):
        read_json(text, max_keys=11)
