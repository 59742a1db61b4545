"""The grammar of a reply's tool calls, per call format (``web.tools``
names the formats and their markers, and reads the calls back).

A forced call (``tool_choice`` required or naming a tool) is enforced while
decoding: ``call_grammar`` allows exactly one call, in the model's format,
of one of the tools, with arguments its parameters schema accepts (formats
no grammar here holds to a schema: the call markers around the model's
text). Under ``auto``, a request whose tools ask for ``strict`` adherence
gets the grammar of text or calls: text that never starts a call, or text
and then one call or more, each valid; without ``strict`` nothing is
enforced (a grammar costs every step its drafts and its build ahead) and a
call that does not parse stays text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Collection, Mapping

from semantic.actors import grammar

from .tools import DEEPSEEK, DS_CALL, DS_CALL_END, DS_SEP, HERMES_CLOSE, HERMES_OPEN, LibraryFormat, ToolFormat

__all__ = ["arguments_rule", "call_grammar"]

_ARGS = "[ARGS]"  # Mistral's marker between a call's name and its arguments


def call_grammar(fmt: ToolFormat, tools: Collection[dict], forced: bool = True,
                 tokens: Mapping[str, int] | None = None) -> str | None:
    """The grammar of a reply that is one call, in ``fmt``, of one of
    ``tools`` (``{"type": "function", "function": {name, parameters}}``)
    with arguments its parameters schema accepts -- or, not ``forced``, text
    or calls: text that never starts a call, or text that ends where a call
    begins, then one call or more (Llama 3: one). A format whose calls a
    grammar cannot hold to their schemas (mlx-lm's other parsers) gets, when
    forced, a reply that is its call markers around the model's text, and
    under ``auto`` no grammar (None). ``tokens``: the tokenizer's
    ``added_tokens``, which markers are written as. Raises ``GrammarError``."""
    tokens = tokens or {}

    def mark(text: str) -> str:
        return f"<[{tokens[text]}]>" if text in tokens else _literal(text)

    if fmt == "llama3":
        calls = _json_calls_rule(tools, "parameters")
        if forced:
            return grammar.lark(f"start: {calls}")
        return grammar.lark(f"start: TEXT | {calls}\nTEXT: /(?s:.*)/ & ~/[ \\t\\n]*\\{{(?s:.*)/")
    more: str | None = '"\\n"'  # between two calls; None: one span holds every call
    rules = ""  # the call's own rules
    if fmt == "hermes":
        fmt = LibraryFormat("hermes", HERMES_OPEN, HERMES_CLOSE)
        call = f'"\\n" {_json_calls_rule(tools, "arguments")} "\\n" {mark(HERMES_CLOSE)}'
    elif fmt.parser == "qwen3_coder":  # as its template renders a call
        functions = " | ".join(_xml_call(t["function"]) for t in tools)
        call, rules = f'"\\n" ({functions}) "\\n" {mark(fmt.end)}', _XML_TEXT
    elif fmt.parser == "mistral" and _ARGS in tokens:  # v11 tokenizers on: name[ARGS]{...}
        call = " | ".join(f'{_literal(t["function"]["name"])} {mark(_ARGS)} {arguments_rule(t)}' for t in tools)
        more = ""
    elif fmt.parser == "mistral":  # older ones: [{"name": ..., "arguments": {...}}, ...]
        call, more = grammar.json_rule({"type": "array", "minItems": 1, "items": _call_schema(tools, "arguments")}), None
    elif fmt.parser in DEEPSEEK:  # calls chained with nothing between, closed once
        def one_call(t: dict) -> str:
            name = _literal(t["function"]["name"])
            if fmt.parser == "deepseek_r1":
                fenced = f'"\\n```json\\n" {arguments_rule(t)} "\\n```"'
                return f'{mark(DS_CALL)} "function" {mark(DS_SEP)} {name} {fenced} {mark(DS_CALL_END)}'
            return f"{mark(DS_CALL)} {name} {mark(DS_SEP)} {arguments_rule(t)} {mark(DS_CALL_END)}"

        calls = " | ".join(one_call(t) for t in tools)
        call, more = f'({calls}){"" if forced else "+"} {mark(fmt.end)}', None
    elif not forced:
        return None
    else:  # the model's own text between a call's markers
        head, end = f"start: {mark(fmt.start)} body\n", mark(fmt.end) if fmt.end else ""
        if end.startswith('"'):
            return grammar.lark(head + f"body[stop={end}]: /(?s:.+)/")
        return grammar.lark(head + f"body: /(?s:.+)/ {end}")
    start = mark(fmt.start)
    if forced:
        return grammar.lark(f"start: {start} call\ncall: {call}{rules}")
    again = f"({more} {start} call)*" if more is not None else ""
    if fmt.start in tokens:  # one token, which no text holds: text ends where it comes
        return grammar.lark(f"start: TEXT? ({start} call {again})?\ncall: {call}\nTEXT: /(?s:.+)/{rules}")
    return grammar.lark(  # (a lexeme cannot end where the marker begins: ``prose`` stops at it)
        f"start: TEXT | prose call {again}\nprose[stop={start}]: /(?s:.*)/\ncall: {call}\n"
        f"TEXT: /(?s:.*)/ & ~/(?s:.*){_regex(fmt.start)}(?s:.*)/{rules}")


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex(text: str) -> str:
    """``text`` matched literally inside a Lark ``/regex/``."""
    return re.escape(text).replace("/", "\\/")


def arguments_rule(tool: dict) -> str:
    """A Lark rule's body matching the arguments ``tool``'s parameters schema accepts."""
    return grammar.json_rule(tool["function"].get("parameters") or {"type": "object"})


def _call_schema(tools: Collection[dict], key: str) -> dict:
    return {"anyOf": [{
        "type": "object", "additionalProperties": False, "required": ["name", key], "properties": {
            "name": {"const": t["function"]["name"]}, key: t["function"].get("parameters") or {"type": "object"}}}
        for t in tools]}


def _json_calls_rule(tools: Collection[dict], key: str) -> str:
    return grammar.json_rule(_call_schema(tools, key))


# A string parameter's value and what closes it, as Qwen3-Coder's parser reads
# it back: it ends at the first ``</parameter>`` and its call at the first
# ``</tool_call>``, and "null" is None (lazy: the lexeme ends where it can).
_XML_CLOSE = "\\n<\\/parameter>\\n"
_XML_TEXT = (f"\nxml_text[lazy]: XML_TEXT\nXML_TEXT: /(?s:.*){_XML_CLOSE}/ & "
             f"~/(?s:.*)<\\/(parameter|tool_call)>(?s:.*){_XML_CLOSE}/ & ~/(?i:null){_XML_CLOSE}/")
_ANNOTATIONS = {"description", "title", "default", "examples", "$comment"}


def _xml_call(function: dict) -> str:
    """One call of ``function`` as Qwen3-Coder writes it: ``<function=NAME>``,
    then each parameter (the required ones always) as ``<parameter=KEY>``,
    its value on its own lines -- a string as it is, any other type as JSON,
    which is what mlx-lm's parser reads back by the schema's ``type``."""
    name, schema = function["name"], function.get("parameters") or {}
    required = set(schema.get("required") or ())
    parts = [_literal(f"<function={name}>\n")]
    for key, spec in (schema.get("properties") or {}).items():
        block = f'{_literal(f"<parameter={key}>")} "\\n" {_xml_value(spec, f"{name}.{key}")}'
        parts.append(block if key in required else f"({block})?")
    return "(" + " ".join([*parts, '"</function>"']) + ")"


def _xml_value(spec: dict, where: str) -> str:
    """A parameter's value, then its closing tag."""
    kind, rest = spec.get("type"), set(spec) - _ANNOTATIONS - {"type"}
    close = '"\\n</parameter>\\n"'
    if kind == "boolean" and not rest:  # the template writes Python's True, the parser reads either
        return f'("true" | "false" | "True" | "False") {close}'
    if kind in ("integer", "number", "boolean", "object", "array"):
        return f"{grammar.json_rule(spec)} {close}"
    if kind in ("string", None) and rest <= {"enum", "const"} and rest:
        values = spec["enum"] if "enum" in spec else [spec["const"]]
        if all(isinstance(v, str) and v.lower() != "null" for v in values):
            return "(" + " | ".join(_literal(v) for v in values) + f") {close}"
    elif kind == "string" and not rest:
        return "xml_text"
    raise grammar.GrammarError(f"{where}: Qwen3-Coder's calls carry a string as it is and other values by their "
                               f"`type`; this schema cannot be held to that ({json.dumps(spec)[:200]})")
