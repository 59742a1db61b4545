"""JSON schemas as llguidance Lark, with two rules of this server's own
(``runtime.text.grammar`` compiles what this module writes):

* **Strict objects** (``strict``): an object schema that lists properties
  (``properties``, ``required`` or ``patternProperties``) and says nothing
  of others gets ``"additionalProperties": false``, as xgrammar's default
  and OpenAI's strict mode have it (JSON Schema's own default allows any
  other key, and a small model copies the schema it was shown into its
  arguments). ``"additionalProperties": true`` (or a schema) opts out. The
  schemas that an object is built from (``allOf`` members, and ``anyOf`` /
  ``oneOf`` members and ``$ref`` targets beside the object's own keywords)
  are left open, and the object they build is closed over all their names.
* **Numbers a float64 holds** (``json_lark``): at most 17 significant
  digits (after at most 16 zeros that lead a fraction: ``0.000123``) and an
  exponent of at most 3 digits; integers at most 19 digits. The schema's own
  bounds intersect these; a number bounded by anything but 0 is written
  without an exponent, as llguidance writes a bounded number. Without it a
  model may write digits that never end.

llguidance compiles a JSON schema itself, but its numbers cannot be bounded
in length (a bounded number's fraction has any length too), so ``json_lark``
writes the schema as Lark: objects, arrays, unions and references become
rules, numbers terminals of bounded length, and what holds no number (a
string's constraints, ``enum``, ``const``) stays ``%json``, compiled by
llguidance. A part it does not write (``allOf``, ``patternProperties``,
``minProperties``, ``multipleOf`` ...) is ``%json`` too, numbers and all.
The caller has llguidance check the whole schema first: what it refuses is
refused, and a keyword it ignores is ignored here.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from decimal import Decimal

__all__ = ["INTEGER", "LAYOUT", "NUMBER", "json_lark", "strict"]

LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}  # Python's json.dumps

# A float64's round trip needs 17 significant digits and a 3-digit exponent; an int64 has 19 digits.
_FRACTION = "|".join(f"[0-9]{{{a}}}\\.[0-9]{{1,{16 - a}}}" for a in range(16))  # 1 + a + (1..16-a) digits
NUMBER = (f"-?(0(\\.(0{{1,16}}|0{{0,16}}[1-9][0-9]{{0,16}}))?|[1-9]([0-9]{{0,16}}|{_FRACTION}))"
          f"([eE][+-]?[0-9]{{1,3}})?")
INTEGER = "-?(0|[1-9][0-9]{0,18})"

_ANNOTATIONS = {"$schema", "$id", "$comment", "$anchor", "$defs", "definitions", "title", "description", "default",
                "examples", "readOnly", "writeOnly", "deprecated", "contentMediaType", "contentEncoding"}
# The keywords llguidance enforces (any other it ignores, or refuses: the caller has it check first).
_ENFORCED = {"anyOf", "oneOf", "allOf", "$ref", "const", "enum", "type", "items", "additionalItems", "prefixItems",
             "minItems", "maxItems", "properties", "additionalProperties", "patternProperties", "required",
             "minProperties", "maxProperties", "minLength", "maxLength", "pattern", "format", "minimum", "maximum",
             "exclusiveMinimum", "exclusiveMaximum", "multipleOf"}
_STRING = {"minLength", "maxLength", "pattern", "format"}
_BOUNDS = {"minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"}
_LISTING = ("properties", "required", "patternProperties")  # an object schema that names its keys
_FOR_LLGUIDANCE = {"allOf", "patternProperties", "minProperties", "maxProperties", "additionalItems", "enum", "const"}
_TYPES = ("null", "boolean", "number", "integer", "string", "array", "object")


# -- strict objects ----------------------------------------------------------------------------------------------


def strict(schema):
    """``schema`` with ``"additionalProperties": false`` wherever an object
    schema lists its properties and says nothing of others (module docstring);
    ``required`` names that ``properties`` lacks join it, allowing any value,
    as they did. The schema given is not changed."""
    defs = _definitions(schema)
    parts = {ref for node in _nodes(schema) for ref in _part_refs(node)}
    return _close(schema, defs, parts, part=False)


def _close(node, defs: dict, parts: set[str], part: bool):
    if isinstance(node, list):
        return [_close(n, defs, parts, part=False) for n in node]
    if not isinstance(node, dict):
        return node
    builds = _builds_object(node)
    out = {}
    for key, value in node.items():
        if key in ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas") \
                and isinstance(value, dict):
            out[key] = {k: _close(v, defs, parts, part=key in ("$defs", "definitions")
                                  and f"#/{key}/{k}" in parts) for k, v in value.items()}
        elif key == "allOf" or (builds and key in ("anyOf", "oneOf")):
            out[key] = [_close(v, defs, parts, part=True) for v in value] if isinstance(value, list) else value
        elif key in ("enum", "const", "required", "type") or key in _ANNOTATIONS:
            out[key] = value
        else:
            out[key] = _close(value, defs, parts, part=False)
    if part or "additionalProperties" in node or not any(k in node for k in _LISTING) and not builds:
        return out
    names = dict.fromkeys(_names(node, defs))
    properties = out.get("properties") if isinstance(out.get("properties"), dict) else {}
    out["properties"] = {**properties, **{k: True for k in names if k not in properties}}
    out["additionalProperties"] = False
    return out


def _builds_object(node: dict) -> bool:
    """Whether ``node`` is one object built from parts (``allOf``; or unions
    and a reference beside its own object keywords)."""
    members = node.get("allOf")
    return (isinstance(members, list) and any(map(_lists, members))) \
        or (any(k in node for k in _LISTING) and any(k in node for k in ("anyOf", "oneOf", "$ref")))


def _lists(node) -> bool:
    """Whether ``node`` (an ``allOf`` member) brings properties of its own."""
    return isinstance(node, dict) and (any(k in node for k in _LISTING) or "$ref" in node
                                       or isinstance(node.get("allOf"), list) and any(map(_lists, node["allOf"])))


def _part_refs(node: dict) -> Iterator[str]:
    """The references whose targets ``node`` builds an object from."""
    members = list(node["allOf"]) if isinstance(node.get("allOf"), list) else []
    if any(k in node for k in _LISTING):
        members += [node] + [m for key in ("anyOf", "oneOf") if isinstance(node.get(key), list) for m in node[key]]
    for m in members:
        if isinstance(m, dict) and isinstance(m.get("$ref"), str):
            yield m["$ref"]


def _names(node, defs: dict, seen: frozenset = frozenset()) -> Iterator[str]:
    """The property names ``node`` and the parts it is built from list (references followed)."""
    if not isinstance(node, dict):
        return
    if isinstance(node.get("properties"), dict):
        yield from node["properties"]
    if isinstance(node.get("required"), list):
        yield from (name for name in node["required"] if isinstance(name, str))
    ref = node.get("$ref")
    if isinstance(ref, str) and ref in defs and ref not in seen:
        yield from _names(defs[ref], defs, seen | {ref})
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list) and (key == "allOf" or _builds_object(node)):
            for m in node[key]:
                yield from _names(m, defs, seen)


def _definitions(schema) -> dict:
    """The schema's definitions by the reference that names them (``#/$defs/NAME``)."""
    return {f"#/{key}/{name}": node for key, nodes in _definition_maps(schema) for name, node in nodes.items()}


def _definition_maps(schema) -> Iterator[tuple[str, dict]]:
    if isinstance(schema, dict):
        yield from ((k, schema[k]) for k in ("$defs", "definitions") if isinstance(schema.get(k), dict))


def _nodes(node) -> Iterator[dict]:
    """Every object in ``node``, at any depth, but the values it holds as data (``enum``, ``default`` ...)."""
    if isinstance(node, dict):
        yield node
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples"):
                yield from _nodes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _nodes(value)


# -- the schema as Lark ------------------------------------------------------------------------------------------


class _Unwritten(Exception):
    """The schema has references this module does not follow; llguidance holds it whole."""


def json_lark(schema) -> str | None:
    """The Lark grammar (``start``) of the JSON documents ``schema`` allows,
    numbers bounded (module docstring), laid out as Python's ``json.dumps``;
    None where llguidance must hold the schema whole (a ``$ref`` other than
    ``#/$defs/NAME`` or ``#/definitions/NAME``). ``schema`` is one llguidance
    accepts (``strict`` applied, if wanted)."""
    try:
        writer = _Writer(schema)
        start = writer.expr(schema)
    except _Unwritten:
        return None
    return "\n".join([f"start: {start}", *writer.rules])


class _Writer:
    """Lark rules for one schema: ``expr`` writes a node's expression, adding
    the rules it needs (``r<n>``, terminals ``T<n>``) to ``rules``."""

    def __init__(self, schema):
        self.root = schema
        self.defs = _definitions(schema)
        self.rules: list[str] = []
        self.named: dict[str, str] = {}  # a definition's reference (or a shared piece) -> its rule
        for node in _nodes(schema):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in self.defs:
                raise _Unwritten(ref)

    def rule(self, body: str, terminal: bool = False) -> str:
        """A new rule (or terminal) of ``body``; its name."""
        name = f"{'T' if terminal else 'r'}{len(self.rules)}"
        self.rules.append(f"{name}: {body}")
        return name

    def shared(self, name: str, body) -> str:
        """The rule ``name``, written once (``body()``) however often it is used."""
        if name not in self.named:
            self.named[name] = name
            self.rules.append(f"{name}: {body()}")
        return name

    def expr(self, node) -> str:
        if node is True or (isinstance(node, dict) and not (set(node) & _ENFORCED)):
            return self.any_value()
        if not isinstance(node, dict):  # false: nothing (llguidance has refused it wherever it matters)
            return self.json(False)
        keys = set(node) & _ENFORCED
        if keys & _FOR_LLGUIDANCE or isinstance(node.get("items"), list):  # (items as a list: an old draft's tuple)
            return self.json(node)
        applied = keys & {"anyOf", "oneOf", "$ref"}
        if applied:
            if len(applied) > 1 or keys - applied:  # an intersection: llguidance's to make
                return self.json(node)
            if "$ref" in applied:
                return self.ref(node["$ref"])
            members = [self.expr(m) for m in node[applied.pop()] if m is not False]
            return "(" + " | ".join(members) + ")"
        kinds = node.get("type", list(_TYPES))
        kinds = [kinds] if isinstance(kinds, str) else kinds
        if "number" in kinds and "integer" in kinds:
            kinds = [k for k in kinds if k != "integer"]
        return "(" + " | ".join(self.typed(node, kind) for kind in kinds) + ")"

    def typed(self, node: dict, kind: str) -> str:
        if kind == "null":
            return '"null"'
        if kind == "boolean":
            return '("true" | "false")'
        if kind == "string":
            constraints = {k: node[k] for k in _STRING if k in node}
            return self.json({"type": "string", **constraints}) if constraints else self.string()
        if kind in ("number", "integer"):
            return self.number(node, kind == "integer")
        if kind == "array":
            return self.array(node)
        assert kind == "object", f"llguidance accepted a schema of type {kind!r}"
        return self.object(node)

    def json(self, node) -> str:
        """``node`` compiled by llguidance (with the root's definitions, for its references)."""
        if isinstance(node, dict):
            refers = any("$ref" in n for n in _nodes(node))
            defs = {k: v for k, v in _definition_maps(self.root)} if refers else {}
            node = {**defs, **node, "x-guidance": LAYOUT}
        return "%json " + json.dumps(node, ensure_ascii=False)

    def ref(self, ref: str) -> str:
        """The rule of the definition ``ref`` names (which may refer to itself)."""
        if ref not in self.named:
            at = len(self.rules)
            self.named[ref] = name = f"r{at}"
            self.rules.append("")  # its place, filled once its body is written
            self.rules[at] = f"{name}: {self.expr(self.defs[ref])}"
        return self.named[ref]

    # -- values of any kind, strings -------------------------------------------------------------------------

    def any_value(self) -> str:
        """Any JSON value (its numbers bounded, as every number here)."""
        if "json_value" not in self.named:
            self.named["json_value"] = "json_value"
            string, number = self.string(), self.shared("JSON_NUMBER", lambda: f"/{NUMBER}/")
            self.rules += [
                f'json_value: json_object | json_array | {string} | {number} | "true" | "false" | "null"',
                f'json_object: "{{" ({string} ": " json_value (", " {string} ": " json_value)*)? "}}"',
                'json_array: "[" (json_value (", " json_value)*)? "]"']
        return "json_value"

    def string(self) -> str:
        """A JSON string as llguidance writes one: every character as it is but
        the quote, the backslash and the control characters, which are escaped."""
        return self.shared("JSON_STRING", lambda: r'/"([^"\\\x00-\x1F\x7F]|\\[nrbtf\\"]|\\u00[01][0-9a-fA-F]'
                                                  r'|\\u007[fF])*"/')

    # -- numbers -------------------------------------------------------------------------------------------

    def number(self, node: dict, integer: bool) -> str:
        if "multipleOf" in node:
            return self.json({**{k: node[k] for k in (_BOUNDS | {"multipleOf"}) & set(node)},
                              "type": "integer" if integer else "number"})
        shape = f"/{INTEGER if integer else NUMBER}/"
        low, high = _bound(node, "minimum"), _bound(node, "maximum")
        parts = [shape] + [f"({p})" for p in (_at_least(*low) if low else None,
                                              _at_most(*high) if high else None) if p]
        if len(parts) == 1:
            return self.shared("JSON_INTEGER" if integer else "JSON_NUMBER", lambda: shape)
        return self.rule(" & ".join(parts), terminal=True)

    # -- arrays and objects --------------------------------------------------------------------------------

    def array(self, node: dict) -> str:
        prefix = [self.expr(m) for m in node.get("prefixItems") or ()]
        items = node.get("items", True)
        item = None if items is False else self.expr(items)
        low, high = int(node.get("minItems", 0)), node.get("maxItems")
        high = None if high is None else int(high)
        if item is None:
            high = len(prefix) if high is None else min(high, len(prefix))

        def rest(n: int) -> str:  # the elements after the first n, with n written
            sep = '", " ' if n else ""
            if high is not None and n >= high:
                return ""
            if n < len(prefix):
                more = f"{sep}{prefix[n]} {rest(n + 1)}".strip()
                return more if n < low else f"({more})?"
            least, most = max(low - n, 0), None if high is None else high - n
            if n:
                return _repeat(f'(", " {item})', least, most)
            tail = _repeat(f'(", " {item})', max(least - 1, 0), None if most is None else most - 1)
            first = f"{item} {tail}".strip()
            return first if least else f"({first})?"

        body = rest(0)
        return self.rule(f'"[" {body} "]"' if body else '"[" "]"')

    def object(self, node: dict) -> str:
        properties = node.get("properties") or {}
        required = [k for k in node.get("required") or () if isinstance(k, str)]
        others = node.get("additionalProperties", True)
        members = [(k, v) for k, v in properties.items() if v is not False or k in required]
        members += [(k, others if isinstance(others, dict) else True) for k in dict.fromkeys(required)
                    if k not in properties]
        listed = [*properties, *(k for k, _ in members if k not in properties)]  # (a key whose schema is false too)
        pair = None
        if others is not False:
            key = self.string()
            if listed:  # any other key: a string that is none of these
                names = " | ".join(_literal(json.dumps(k, ensure_ascii=False)) for k in listed)
                key = self.rule(f"{key} & ~({names})", terminal=True)
            pair = self.rule(f'{key} ": " {self.expr(others)}')
        # first[i]: members i.. when none is written yet; more[i]: the same after one, each with its ", "
        first = f'({pair} (", " {pair})*)?' if pair else ""
        more = f'(", " {pair})*' if pair else ""
        for i, (key, schema) in reversed(list(enumerate(members))):
            member = f'{_literal(json.dumps(key, ensure_ascii=False))} ": " {self.expr(schema)}'
            with_it_first, with_it_more = f"{member} {more}".strip(), f'", " {member} {more}'.strip()
            if key in required:
                first, more = with_it_first, with_it_more
            else:
                first = f"({with_it_first} | {first})" if first else f"({with_it_first})?"
                more = f"({with_it_more} | {more})" if more else f"({with_it_more})?"
            first, more = self.rule(first), self.rule(more) if i else ""  # (the first member has no more[0])
        return self.rule(f'"{{" {first} "}}"' if first else '"{" "}"')


def _repeat(piece: str, least: int, most: int | None) -> str:
    """``piece`` repeated ``least`` to ``most`` (None: any number of) times, in Lark."""
    if most == 0:
        return ""
    if most is None:
        return f"{piece}*" if least == 0 else f"{piece}{{{least},}}"
    return f"{piece}{{{least},{most}}}"


def _literal(text: str) -> str:
    """A Lark string literal matching ``text``."""
    return json.dumps(text, ensure_ascii=False)


# -- bounds as regular expressions ---------------------------------------------------------------------------------
# Each ``_at_least`` / ``_at_most`` is a Lark terminal expression that a
# number's text (``NUMBER`` or ``INTEGER``) must also match. A bound of 0 is
# a sign, and keeps exponents; another compares digits, written out.

_NONNEGATIVE, _POSITIVE = "/[0-9][0-9.eE+-]*/", "/[0.]*[1-9][0-9.eE+-]*/"
_ZERO = "/-?0(\\.0+)?([eE][+-]?[0-9]+)?/"
_ANY_FRACTION = "(\\.[0-9]+)?"


def _bound(node: dict, key: str) -> tuple[Decimal, bool] | None:
    """The schema's lower (``minimum``) or upper bound, and whether it is
    exclusive (the tighter of ``minimum`` and ``exclusiveMinimum``, as
    llguidance takes them)."""
    exclusive_key = "exclusive" + key[0].upper() + key[1:]
    found = [(_decimal(node[k]), k == exclusive_key) for k in (key, exclusive_key) if k in node]
    if not found:
        return None
    lower = key == "minimum"
    return sorted(found, key=lambda b: (b[0], b[1] == lower), reverse=lower)[0]


def _decimal(value) -> Decimal:
    return Decimal(repr(value)) if isinstance(value, float) else Decimal(value)


def _at_least(bound: Decimal, exclusive: bool) -> str:
    if bound == 0:
        return _POSITIVE if exclusive else _NONNEGATIVE
    if bound > 0:
        return f"/{_magnitude_at_least(bound, exclusive)}/"
    return f'{_NONNEGATIVE} | "-" /{_magnitude_at_most(-bound, exclusive)}/'


def _at_most(bound: Decimal, exclusive: bool) -> str:
    if bound == 0:
        negative = f'"-" {_POSITIVE}'
        return negative if exclusive else f"{negative} | {_ZERO}"
    if bound < 0:
        return f'"-" /{_magnitude_at_least(-bound, exclusive)}/'
    return f'"-" /[0-9.eE+-]+/ | /{_magnitude_at_most(bound, exclusive)}/'


def _digits(bound: Decimal) -> tuple[str, str]:
    """A positive bound's integer digits and fraction digits (no trailing zeros)."""
    whole, _, fraction = format(bound, "f").partition(".")
    return whole, fraction.rstrip("0")


def _magnitude_at_least(bound: Decimal, exclusive: bool) -> str:
    """Digits without sign or exponent whose value is at least (over) ``bound`` > 0."""
    whole, fraction = _digits(bound)
    n = len(whole)
    parts = [f"[1-9][0-9]*{_ANY_FRACTION}" if whole == "0" else f"[1-9][0-9]{{{n},}}{_ANY_FRACTION}"]
    if whole != "0":  # as many digits, larger
        parts += [f"{whole[:k]}[{int(d) + 1}-9][0-9]{{{n - k - 1}}}{_ANY_FRACTION}"
                  for k, d in enumerate(whole) if d != "9"]
    if not fraction:  # the same integer part
        parts.append(f"{whole}(\\.[0-9]*[1-9][0-9]*)" if exclusive else f"{whole}{_ANY_FRACTION}")
    else:
        larger = [f"{fraction[:k]}[{int(d) + 1}-9][0-9]*" for k, d in enumerate(fraction) if d != "9"]
        equal = f"{fraction}[0-9]*[1-9][0-9]*" if exclusive else f"{fraction}[0-9]*"
        parts.append(f"{whole}\\.({'|'.join([*larger, equal])})")
    return "(" + "|".join(parts) + ")"


def _magnitude_at_most(bound: Decimal, exclusive: bool) -> str:
    """Digits without sign or exponent whose value is at most (under) ``bound`` > 0."""
    whole, fraction = _digits(bound)
    n = len(whole)
    parts = [f"(0|[1-9][0-9]{{0,{n - 2}}}){_ANY_FRACTION}"] if n > 1 else []  # fewer digits
    for k, d in enumerate(whole):  # as many digits, smaller
        lowest = 1 if k == 0 and n > 1 else 0
        if int(d) > lowest:
            parts.append(f"{whole[:k]}[{lowest}-{int(d) - 1}][0-9]{{{n - k - 1}}}{_ANY_FRACTION}")
    if not fraction:  # the same integer part
        if not exclusive:
            parts.append(f"{whole}(\\.0+)?")
    else:
        smaller = [f"{fraction[:k]}[0-{int(d) - 1}][0-9]*" for k, d in enumerate(fraction) if d != "0"]
        smaller += [f"{fraction[:k]}0*" for k in range(1, len(fraction))]
        if not exclusive:
            smaller.append(f"{fraction}0*")
        parts.append(f"{whole}(\\.({'|'.join(smaller)}))?")
    return "(" + "|".join(parts) + ")"
