"""Field checks shared by the protocol parsers. Each returns None for a field
left out or sent as null (unless required) and raises ``RequestError``
(400) with a message that names the field and the broken rule:

    max_tokens: must be an integer, not a string
    messages[1].content[0].type: 'image' is not supported (this server reads text only)
"""

from __future__ import annotations

import math

from semantic.actors import GrammarError, grammar

from .schema import RequestError

__all__ = ["bad", "boolean", "integer", "jtype", "number", "no_tools_with", "obj", "output_format", "seq", "string",
           "strings"]

_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number",
               list: "an array", dict: "an object", type(None): "null"}


def jtype(value: object) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def bad(where: str, rule: str) -> RequestError:
    return RequestError(400, f"{where}: {rule}", param=where)


def _get(data: dict, key: str, where: str, required: bool):
    """``data[key]``; a field left out or sent as null is None (or missing, if required)."""
    value = data.get(key)
    if value is None and required:
        raise bad(where + key, "is required")
    return value


def string(data: dict, key: str, where: str = "", *, required: bool = False, nonempty: bool = False):
    value = _get(data, key, where, required)
    if value is not None:
        if not isinstance(value, str):
            raise bad(where + key, f"must be a string, not {jtype(value)}")
        if nonempty and not value:
            raise bad(where + key, "must not be empty")
    return value


def boolean(data: dict, key: str, where: str = "", *, default: bool = False) -> bool:
    value = _get(data, key, where, False)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad(where + key, f"must be a boolean, not {jtype(value)}")
    return value


def integer(data: dict, key: str, where: str = "", *, required: bool = False,
            lo: int | None = None, hi: int | None = None, hi_rule: str = ""):
    value = _get(data, key, where, required)
    if value is None:
        return value
    if isinstance(value, float) and value.is_integer():  # some clients send 100.0
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad(where + key, f"must be an integer, not {jtype(value)}")
    if lo is not None and value < lo:
        raise bad(where + key, f"must be at least {lo}, not {value}")
    if hi is not None and value > hi:
        raise bad(where + key, hi_rule or f"must be at most {hi}, not {value}")
    return value


def number(data: dict, key: str, where: str = "", *, lo: float, hi: float, lo_open: bool = False):
    """A finite number in [lo, hi] (or (lo, hi] with ``lo_open``)."""
    value = _get(data, key, where, False)
    if value is None:
        return value
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise bad(where + key, f"must be a number, not {jtype(value)}")
    if value < lo or value > hi or (lo_open and value == lo):
        interval = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
        raise bad(where + key, f"must be in {interval}, not {value:g}")
    return float(value)


def obj(data: dict, key: str, where: str = "", *, required: bool = False):
    value = _get(data, key, where, required)
    if value is not None and not isinstance(value, dict):
        raise bad(where + key, f"must be an object, not {jtype(value)}")
    return value


def seq(data: dict, key: str, where: str = "", *, required: bool = False, nonempty: bool = False):
    value = _get(data, key, where, required)
    if value is None:
        return value
    if not isinstance(value, list):
        raise bad(where + key, f"must be an array, not {jtype(value)}")
    if nonempty and not value:
        raise bad(where + key, "must not be empty")
    return value


def strings(data: dict, key: str, where: str = "", *, allow_one: bool = False) -> tuple[str, ...]:
    """A list of non-empty strings (or one string, with ``allow_one``); () when absent."""
    value = _get(data, key, where, False)
    if value is None:
        return ()
    if allow_one and isinstance(value, str):
        value = [value]
    if not isinstance(value, list):
        kinds = "a string or an array of strings" if allow_one else "an array of strings"
        raise bad(where + key, f"must be {kinds}, not {jtype(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise bad(f"{where}{key}[{i}]", f"must be a string, not {jtype(s)}")
        if not s:
            raise bad(f"{where}{key}[{i}]", "must not be empty")
    return tuple(value)


def output_format(data: dict, key: str, where: str = "", *,
                  kinds: tuple[str, ...] = ("text", "json_object", "json_schema"),
                  schema_in: str | None = None) -> str | None:
    """A structured-output request, ``{"type": "json_schema", "schema": {...}}``
    (the schema one object deeper, under ``schema_in``, for OpenAI chat's
    ``json_schema``) or ``{"type": "json_object"}``, as the grammar the reply
    must follow (``runtime.text.grammar``); None for ``{"type": "text"}`` or none.
    A schema llguidance cannot compile is refused, naming what it lacks."""
    fmt = obj(data, key, where)
    if fmt is None:
        return None
    at = f"{where}{key}."
    kind = string(fmt, "type", at, required=True)
    if kind not in kinds:
        raise bad(at + "type", f"must be {' or '.join(map(repr, kinds))}, not {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar.JSON_OBJECT
    if schema_in is not None:
        fmt, at = obj(fmt, schema_in, at, required=True), f"{at}{schema_in}."
    try:
        return grammar.json_schema(obj(fmt, "schema", at, required=True))
    except GrammarError as e:
        raise bad(at + "schema", f"this server cannot enforce this JSON schema: {e}") from None


def no_tools_with(grammar: str | None, tools, key: str) -> None:
    """Structured output and tools in one request are refused (not yet both at once)."""
    if grammar is not None and tools:
        raise bad(key, "structured output together with tools is not supported; send one or the other")


def strict_tools(data: dict, inner: str | None = None) -> bool:
    """Whether a tool in ``data["tools"]`` asks for ``strict`` adherence (``True``,
    in its ``inner`` object where the protocol nests it: OpenAI chat's ``function``)."""
    tools = data.get("tools")
    return isinstance(tools, list) and any(
        isinstance(t, dict) and isinstance(d := (t.get(inner) if inner else t), dict) and d.get("strict") is True
        for t in tools)
