"""Tool calls in generated text: which format a model uses, parsing the calls
out of its output (whole or streamed), and what to do for models without tools.

Known formats (``ToolFormat``):

- ``"hermes"`` (Hermes, Qwen 2.5/3, and others whose template says ``<tool_call>``):
  one or more ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  possibly after some text.
- ``"llama3"`` (Llama 3.1-3.3): the whole reply is ``{"name": ..., "parameters": {...}}``
  (several may be separated by ``;``), or follows ``<|python_tag|>`` either as
  that JSON or as a built-in call ``brave_search.call(query="...")``.
- ``LibraryFormat``: the other families mlx-lm knows (Qwen3-Coder's XML
  ``<function=...><parameter=...>``, Mistral's ``[TOOL_CALLS]``, GLM, Kimi,
  MiniMax, Gemma ...), as its tokenizer names them (``library_format``):
  each span from the format's start marker to its end marker is read by
  mlx-lm's own parser (``mlx_lm.tool_parsers``), given the request's tools;
  and DeepSeek's (``<｜tool▁calls▁begin｜>``), read here.

A model whose chat template never mentions ``tools`` is told of them by
``tool_prompt``, in the Hermes format, in the system prompt, and its reply
is held to text or a call in that format; ``flatten_tool_messages`` turns a
conversation with tool calls and results into plain user/assistant text
such a template can render. DeepSeek's templates take no tools but write calls and
results: its model is told of the tools as DeepSeek lays them out
(``deepseek_tool_prompt``), and its tool turns stay as they are.

A forced call, or tools that ask for ``strict`` adherence, hold the reply
to the grammar of its calls (``web.tool_grammar``), built from the markers
named here: a format's reading and its grammar share them.

(Long on purpose: every call format we read, side by side.)
"""

from __future__ import annotations

import ast
import importlib
import json
import re
import secrets
from collections.abc import Collection
from dataclasses import dataclass, replace
from typing import Literal

from semantic.runtime.text.json_reader import JSONError, check_depth, read_json

from .schema import ChatResult, StopReason, ToolCall

__all__ = [
    "DEEPSEEK",
    "DS_CALL",
    "DS_CALL_END",
    "DS_SEP",
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "LibraryFormat",
    "ToolCallFilter",
    "ToolFormat",
    "added_tokens",
    "deepseek_tool_prompt",
    "finish_result",
    "flatten_tool_messages",
    "hermes_calls",
    "library_format",
    "new_call_id",
    "parse_tool_calls",
    "reply_format",
    "supports_tools",
    "tool_format",
    "tool_prompt",
]


@dataclass(frozen=True)
class LibraryFormat:
    """A call format read by mlx-lm's parser ``mlx_lm.tool_parsers.<parser>``
    (or, for DeepSeek's, which mlx-lm does not read, by ``_parse_deepseek``):
    calls from ``start`` to ``end`` (``end`` empty: to the end of the reply)."""

    parser: str
    start: str
    end: str

    def parse(self, span: str, tools) -> list[ToolCall]:
        """The calls in one span (mlx-lm's parser raises on what it cannot read)."""
        if self.parser in DEEPSEEK:
            parsed = _parse_deepseek(span, r1=self.parser == "deepseek_r1")
        else:
            parsed = importlib.import_module(f"mlx_lm.tool_parsers.{self.parser}").parse_tool_call(span, tools)
        calls = [_call(c, ("arguments",)) for c in (parsed if isinstance(parsed, list) else [parsed])]
        if not calls or None in calls:
            raise ValueError(f"not a call: {span!r}")
        return calls


ToolFormat = Literal["hermes", "llama3"] | LibraryFormat

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
# DeepSeek's (V3, R1, V3.1): calls, each call, and a call's name from its arguments
_DS_CALLS, _DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK = ("deepseek_v3_1", "deepseek_r1")  # its formats' names: V3.1's, and V3's and R1's
_DS_ONE_CALL = re.compile(f"{DS_CALL}(.*?){DS_SEP}(.*?){DS_CALL_END}", re.S)
_PYTHON_TAG = "<|python_tag|>"
_LLAMA_ENDS = ("<|eom_id|>", "<|eot_id|>")
_MARKERS: dict[str, str] = {"hermes": HERMES_OPEN, "llama3": _PYTHON_TAG}
_TOOLS_VAR = re.compile(r"\btools\b")
_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.S)


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


def supports_tools(chat_template: str | None) -> bool:
    """Whether a chat template can show the model a ``tools`` list: it
    mentions ``tools`` at all (a heuristic that errs towards yes). Without
    it, tool definitions never reach the model."""
    return bool(chat_template) and _TOOLS_VAR.search(chat_template) is not None


def library_format(tokenizer) -> LibraryFormat | None:
    """The call format mlx-lm found for ``tokenizer`` (its ``TokenizerWrapper``
    names a parser by the chat template), unless it is Hermes's JSON, which
    this module reads itself; or DeepSeek's, which mlx-lm does not name,
    by the markers in its template."""
    parser = getattr(tokenizer, "tool_parser", None)
    template = getattr(tokenizer, "chat_template", None) or ""
    if parser is None and _DS_CALLS in template:
        name, start, end = ("deepseek_r1" if "```json" in template else "deepseek_v3_1"), _DS_CALLS, _DS_CALLS_END
    elif parser is None or not getattr(tokenizer, "tool_call_start", None):
        return None
    else:
        module = getattr(parser, "__module__", "") or ""
        name = module.rpartition(".")[2]
        if not module.startswith("mlx_lm.tool_parsers.") or name == "json_tools":
            return None
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
    return LibraryFormat(name, start, end)


def added_tokens(tokenizer) -> dict[str, int]:
    """The tokens the tokenizer adds to its vocabulary, by text: its special
    tokens and such markers as Qwen's ``<tool_call>``. llguidance reads every
    one as a special token, never as text, so a grammar names them by id."""
    added = getattr(getattr(tokenizer, "_tokenizer", tokenizer), "added_tokens_decoder", None) or {}
    return {t.content: i for i, t in added.items()}


def tool_format(chat_template: str | None, library: LibraryFormat | None = None) -> ToolFormat | None:
    """The tool-call format a chat template teaches its model (``library``:
    mlx-lm's for its tokenizer, which wins), or ``None`` when it has no tools
    or a format this module cannot parse."""
    if not supports_tools(chat_template):
        return None
    if library is not None:
        return library
    if HERMES_OPEN in chat_template:
        return "hermes"
    if _PYTHON_TAG in chat_template or ("ipython" in chat_template and '"parameters"' in chat_template):
        return "llama3"
    return None


def reply_format(tokenizer) -> ToolFormat | None:
    """The format of the calls in the replies of ``tokenizer``'s model: the
    one its template teaches, DeepSeek's (a template that takes no tools but
    writes calls), or, for any other template without tools, the Hermes
    format its model is told (``tool_prompt``)."""
    library = library_format(tokenizer)
    if library is not None and library.parser in DEEPSEEK:
        return library
    template = getattr(tokenizer, "chat_template", None)
    return tool_format(template, library) if supports_tools(template) else "hermes"


def tool_prompt(tools: Collection[dict]) -> str:
    """What a model whose template takes no tools is told of them: the tools
    and the Hermes call format (``tool_grammar.call_grammar`` holds it to
    it). The same whatever the ``tool_choice``, so the prompt's cache serves
    both."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one of these functions. Their signatures are within <tools></tools> "
            f"XML tags:\n<tools>\n{listed}\n</tools>\n\nTo call one, return a JSON object with the function's "
            f'name and arguments within {HERMES_OPEN}{HERMES_CLOSE} XML tags:\n{HERMES_OPEN}\n'
            f'{{"name": <function-name>, "arguments": <args-json-object>}}\n{HERMES_CLOSE}')


def _parse_deepseek(span: str, r1: bool) -> list[dict]:
    """The calls between DeepSeek's markers: ``NAME<sep>{...}`` (V3.1), or
    ``function<sep>NAME`` and the arguments in a fenced JSON block (V3, R1)."""
    calls = []
    for head, body in _DS_ONE_CALL.findall(span):
        if r1:
            head, _, body = body.partition("\n")
            body = body.strip().removeprefix("```json").removesuffix("```")
        calls.append({"name": head.strip(), "arguments": read_json(body.strip())})
    if not calls:
        raise ValueError(f"no call in {span!r}")
    return calls


def deepseek_tool_prompt(tools: Collection[dict], fmt: LibraryFormat) -> str:
    """How a DeepSeek model is told of ``tools`` (its template takes none):
    in the system prompt, as DeepSeek-V3.1's model card lays them out, with
    the call format of ``fmt``."""
    listed = "".join(f"### {t['function']['name']}\nDescription: {t['function'].get('description', '')}\n\n"
                     f"Parameters: {json.dumps(t['function'].get('parameters') or {}, ensure_ascii=False)}\n\n"
                     for t in tools)
    one = (f"{DS_CALL}function{DS_SEP}tool_call_name\n```json\ntool_call_arguments\n```{DS_CALL_END}"
           if fmt.parser == "deepseek_r1" else f"{DS_CALL}tool_call_name{DS_SEP}tool_call_arguments{DS_CALL_END}")
    return (f"## Tools\nYou have access to the following tools:\n\n{listed}IMPORTANT: ALWAYS adhere to this exact "
            f"format for tool use:\n{_DS_CALLS}{one}{{{{additional_tool_calls}}}}{_DS_CALLS_END}\n\nWhere:\n\n"
            "- `tool_call_name` must be an exact match to one of the available tools\n"
            "- `tool_call_arguments` must be valid JSON that strictly follows the tool's Parameters Schema\n"
            "- For multiple tool calls, chain them directly without separators or spaces")


def parse_tool_calls(text: str, fmt: ToolFormat | None, tool_names: Collection[str] | None = None,
                     tools: Collection[dict] | None = None) -> tuple[str, list[ToolCall]]:
    """Split generated ``text`` into (the text without calls, the calls).

    A span that does not parse (bad JSON, no name) stays in the text. The
    untagged Llama form (a bare JSON reply) counts only when every object in
    it names one of ``tool_names`` (when given), since a model may well answer
    with JSON. When calls are found the remaining text loses its trailing
    whitespace. ``fmt=None`` returns ``(text, [])``. ``tools`` (the request's
    definitions) tell mlx-lm's parsers the arguments' types.
    """
    if isinstance(fmt, LibraryFormat):
        return _parse_marked(text, fmt, tools)
    if fmt == "hermes":
        return _parse_hermes(text)
    if fmt == "llama3":
        return _parse_llama3(text, tool_names)
    return text, []


def _call(obj: object, keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from ``{"name": str, <one of keys>: dict | JSON string}``, else None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = read_json(args) if args.strip() else {}
        except JSONError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(new_call_id(), obj["name"], args)


def _parse_hermes(text: str) -> tuple[str, list[ToolCall]]:
    calls, kept, pos = [], [], 0
    for m in _HERMES_CALL.finditer(text):
        try:
            call = _call(read_json(m.group(1)), ("arguments", "parameters"))
        except JSONError:
            call = None
        if call is not None:
            calls.append(call)
            kept.append(text[pos:m.start()])
            pos = m.end()
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).rstrip(), calls


def _parse_marked(text: str, fmt: LibraryFormat, tools) -> tuple[str, list[ToolCall]]:
    calls, kept, pos = [], [], 0
    while (start := text.find(fmt.start, pos)) >= 0:
        begin = start + len(fmt.start)
        end = text.find(fmt.end, begin) if fmt.end else -1
        stop = len(text) if end < 0 else end + len(fmt.end)
        try:
            found = fmt.parse(text[begin: len(text) if end < 0 else end], tools)
        except Exception:  # a parser of model text may raise anything: the span stays text
            kept.append(text[pos:stop])
        else:
            calls += found
            kept.append(text[pos:start])
        pos = stop
    if not calls:
        return text, []
    kept.append(text[pos:])
    return "".join(kept).rstrip(), calls


def _json_calls(payload: str, tool_names: Collection[str] | None) -> list[ToolCall] | None:
    """All of ``payload`` as JSON calls separated by ';' or whitespace, else None."""
    try:
        check_depth(payload)
    except JSONError:
        return None
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(payload) and (payload[i].isspace() or payload[i] == ";"):
            i += 1
        if i == len(payload):
            return calls or None
        try:
            obj, i = decoder.raw_decode(payload, i)
        except json.JSONDecodeError:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None or (tool_names is not None and call.name not in tool_names):
            return None
        calls.append(call)


def _builtin_call(payload: str) -> list[ToolCall] | None:
    """``brave_search.call(query="x")`` (Llama's built-in tools), else None."""
    try:
        node = ast.parse(payload.strip(), mode="eval").body
    except (SyntaxError, RecursionError, MemoryError):  # a model's text may nest anything
        return None
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr == "call" and isinstance(node.func.value, ast.Name) and not node.args):
        return None
    try:
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
    except ValueError:
        return None
    return [ToolCall(new_call_id(), node.func.value.id, args)]


def _parse_llama3(text: str, tool_names: Collection[str] | None) -> tuple[str, list[ToolCall]]:
    before, tag, payload = text.partition(_PYTHON_TAG)
    if not tag:
        before, payload = "", text
        if not text.lstrip().startswith("{"):
            return text, []
    for end in _LLAMA_ENDS:
        payload = payload.split(end, 1)[0]
    calls = _json_calls(payload, None if tag else tool_names) or (_builtin_call(payload) if tag else None)
    return (before.rstrip(), calls) if calls else (text, [])


class ToolCallFilter:
    """Holds back streamed text that may be the start of a tool call.

    ``feed`` returns the part of the text so far that is safe to show: never
    a tool-call marker, nor a tail that could grow into one, nor trailing
    whitespace (``parse_tool_calls`` strips it before calls). Once a marker
    has appeared (or a Llama reply opens with ``{``) nothing more is released;
    the rest arrives with the final result. So the released text is always a
    prefix of ``parse_tool_calls(whole_text)[0]``.
    """

    def __init__(self, fmt: ToolFormat):
        self._marker = fmt.start if isinstance(fmt, LibraryFormat) else _MARKERS[fmt]
        self._bare_json = fmt == "llama3"
        self._text = ""
        self._sent = 0
        self._held = False

    def feed(self, text: str) -> str:
        self._text += text
        if self._held:
            return ""
        buf = self._text
        end = buf.find(self._marker, max(0, self._sent - len(self._marker)))
        if end >= 0 or (self._bare_json and self._sent == 0 and buf.lstrip().startswith("{")):
            self._held = True
            end = max(end, 0)
        else:  # keep back a tail that could still become the marker
            end = len(buf) - next((k for k in range(len(self._marker) - 1, 0, -1)
                                   if buf.endswith(self._marker[:k])), 0)
        end = max(len(buf[:end].rstrip()), self._sent)
        out, self._sent = buf[self._sent:end], end
        return out


def finish_result(result: ChatResult, fmt: ToolFormat | None, tool_names: Collection[str] | None = None,
                  tools: Collection[dict] | None = None, held: bool = False) -> ChatResult:
    """``result`` with tool calls parsed out of its text; a turn that ended
    normally with calls ends with ``"tool_use"``. A turn cut by ``max_tokens``
    keeps its reason: its calls are read too where a grammar ``held`` them
    (it closes a call within the limit: ``runtime.text.grammar``), else they stay
    in the text (they may be cut), as after a stop string."""
    if fmt is None or result.tool_calls or result.stop_reason not in (
            StopReason.STOP, StopReason.LENGTH if held else StopReason.STOP):
        return result
    text, calls = parse_tool_calls(result.text, fmt, tool_names, tools)
    if not calls:
        return result
    reason = StopReason.TOOL_USE if result.stop_reason == StopReason.STOP else result.stop_reason
    return replace(result, text=text, stop_reason=reason, tool_calls=tuple(calls))


def hermes_calls(calls: Collection[dict]) -> str:
    """``calls`` (``{"function": {"name", "arguments"}}``) as a model told of
    them by ``tool_prompt`` writes them, held to the Hermes grammar
    (``tool_grammar.call_grammar``): a call a line, its JSON laid out as the
    grammar lays it."""
    return "\n".join(f"{HERMES_OPEN}\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']}, ensure_ascii=False)}\n{HERMES_CLOSE}"
                     for c in calls)


def flatten_tool_messages(messages: list[dict]) -> list[dict]:
    """``messages`` for a template without tools: assistant calls become the
    text the model wrote for them (``hermes_calls``: the turn renders as it
    was generated, so its agent's cache serves the next turn), tool results
    become user text, and neighbours of one role merge (such templates often
    insist that roles alternate)."""
    out: list[dict] = []
    for m in messages:
        role, content = m["role"], m["content"]
        if role == "assistant" and m.get("tool_calls"):
            content = "\n".join(([content] if content else []) + [hermes_calls(m["tool_calls"])])
        elif role == "tool":
            role = "user"
            content = f"[tool result{' from ' + m['name'] if m.get('name') else ''}]\n{content}"
        if out and out[-1]["role"] == role and role != "system":
            out[-1]["content"] += "\n\n" + content
        else:
            out.append({"role": role, "content": content})
    return out
