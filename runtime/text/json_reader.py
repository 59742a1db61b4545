"""The one reader for JSON that comes from outside: request bodies, JSON
inside their string fields, archive members, files on disk, a model's tool
calls.

``json.loads`` recurses once per level of nesting (a 100,000-deep ``[[[``
in a 200 KB body is a ``RecursionError``, and a structure just under that
depth breaks whatever walks it next), builds as many objects as it is
given, and reads integers of any length. ``read_json`` refuses all of that
before building anything: nesting past ``MAX_DEPTH``, more than
``MAX_KEYS`` keys in all, integers past Python's digit limit, ``NaN`` and
``Infinity`` (not JSON), text that is not UTF-8. Every refusal is one
``JSONError`` (a ``ValueError``) whose message names the limit.
"""

from __future__ import annotations

import json
import re

__all__ = ["MAX_DEPTH", "MAX_KEYS", "JSONError", "check_depth", "read_json"]

MAX_DEPTH = 64  # arrays and objects within each other; agent protocols need about 10
MAX_KEYS = 1_000_000  # keys of all objects together: ~100 MB of dicts at most

_STRING_OR_BRACKET = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"|[\[\]{}]')


class JSONError(ValueError):
    """Not JSON, or JSON past one of this module's limits (the message says which)."""


def read_json(data: bytes | str, what: str = "JSON", *, max_depth: int = MAX_DEPTH, max_keys: int = MAX_KEYS):
    """``data`` parsed, within the limits; ``what`` names it in the error
    (``"request body"``). Bytes may be UTF-8, -16 or -32, as JSON allows.
    Raises ``JSONError``."""
    if isinstance(data, (bytes, bytearray)):
        try:
            data = data.decode(json.detect_encoding(data))
        except UnicodeDecodeError:
            raise JSONError(f"{what} is not UTF-8 text") from None
    check_depth(data, max_depth, what)
    keys = 0

    def counted(pairs: list) -> dict:
        nonlocal keys
        keys += len(pairs)
        if keys > max_keys:
            raise JSONError(f"{what} has more than {max_keys} keys")
        return dict(pairs)

    def constant(name: str):
        raise JSONError(f"{what} is not valid JSON: {name} is not a JSON number")

    try:
        return json.loads(data, object_pairs_hook=counted, parse_constant=constant)
    except json.JSONDecodeError as e:
        raise JSONError(f"{what} is not valid JSON: {e}") from None
    except JSONError:
        raise
    except ValueError as e:  # an integer past sys.get_int_max_str_digits()
        raise JSONError(f"{what} is not readable: {e}") from None


def check_depth(text: str, limit: int = MAX_DEPTH, what: str = "JSON") -> None:
    """Raise ``JSONError`` if ``text`` nests arrays and objects deeper than
    ``limit`` (for callers that decode with ``json.JSONDecoder.raw_decode``)."""
    if text.count("[") + text.count("{") <= limit:
        return  # cannot nest deeper than it has brackets
    depth = 0
    for m in _STRING_OR_BRACKET.finditer(text):
        c = text[m.start()]
        if c in "[{":
            depth += 1
            if depth > limit:
                raise JSONError(f"{what} nests arrays and objects more than {limit} deep")
        elif c in "]}":
            depth -= 1
