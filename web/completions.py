"""OpenAI's legacy completions API (``POST /v1/completions``): request parsing
and validation, the ``text_completion`` JSON, its SSE chunks. Errors are the
chat route's (``web.openai.error_json``).

The model continues ``prompt`` as it is: no chat template, the prompt
tokenized as the tokenizer encodes text, with its BOS where it adds one
(``Agent.complete``). ``prompt`` is one string (or an array of one); token
ids, several prompts, ``suffix`` and a ``best_of`` other than ``n`` are a 400.
``max_tokens`` defaults to 16, as OpenAI's, may be 0 (generate nothing) and
is clamped to the server's cap. ``echo`` puts the prompt before each choice's
text. Unknown fields are ignored, as on the chat route.

``logprobs: n`` (0-5) gives each choice OpenAI's ``logprobs`` object::

    {"tokens": [...], "token_logprobs": [...], "top_logprobs": [...], "text_offset": [...]}

one entry a token: its text (its UTF-8 bytes decoded, a character split
between tokens shown as U+FFFD), its log-probability, a dict of the ``n``
likeliest tokens' texts and log-probabilities with the token's own added
(``n + 1`` entries at most, as OpenAI's), and the character offset in the
choice's ``text`` where it begins (a BOS the prompt does not spell: 0, as
wide as nothing). With ``echo`` the prompt's tokens come first, scored by
the same forwards that prefill them (``SamplingParams.prompt_logprobs``):
the first has ``None`` for its log-probability and its alternatives, each
later one its log-probability given the tokens before it. That is how
evaluation harnesses score a text (``echo: true, logprobs: 1,
max_tokens: 0``); such a request prefills the whole prompt, reusing no cache.

A stream is ``data:`` lines of ``text_completion`` objects, then ``[DONE]``::

    chunk  choices[{index, text: the prompt, logprobs: the prompt's}]    (echo: a choice's first)
    chunk  choices[{index, text: "...", logprobs: its tokens'}] ...
    chunk  choices[{index, text: "", finish_reason: "stop" | "length"}]  (one per choice)
    chunk  choices [], usage                                               (only with stream_options.include_usage)
    [DONE]

As on the chat route: ``: keep-alive`` comments while nothing comes, an
``{"error": ...}`` chunk and ``[DONE]`` for a failure once the stream began,
``usage: null`` in every chunk when usage was asked for.
"""

from __future__ import annotations

import codecs
import logging
import secrets
import time
from collections.abc import AsyncIterable, AsyncIterator, Mapping, Sequence
from typing import TYPE_CHECKING

from semantic.actors import MAX_CHOICES, TokenLogprob

from . import _validate as v
from ._aio import closing
from .openai import error_json, request_fields, usage_json
from .protocols import ProtocolSpec
from .schema import (ChatResult, CompletionRequest, Heartbeat, LogprobsDelta, PromptLogprobs, RequestError, StopReason,
                     StreamItem, cancelled, load_json, stream_text)
from .sse import KEEP_ALIVE, encode

if TYPE_CHECKING:
    from .chat import ChatTurn

__all__ = ["DEFAULT_MAX_TOKENS", "MAX_LOGPROBS", "PROTOCOL", "error_json", "events", "parse_request", "response_json"]

log = logging.getLogger("semantic.web")

DEFAULT_MAX_TOKENS = 16  # OpenAI's
MAX_LOGPROBS = 5  # OpenAI's limit for this API
_FLOOR = -9999.0  # the lowest logprob written (as vLLM: -inf is not JSON)
_FINISH = {StopReason.STOP: "stop", StopReason.STOP_SEQUENCE: "stop", StopReason.LENGTH: "length"}
_DONE = encode("[DONE]")


# --- requests -----------------------------------------------------------------


def parse_request(body: bytes, headers: Mapping[str, str] | None = None, *, max_tokens_cap: int) -> CompletionRequest:
    """The ``CompletionRequest`` in a ``/v1/completions`` body. ``headers``
    (lower-case names) may name the agent (``x-agent-id``), as may the body's
    ``session_id``; the two must agree. Raises ``RequestError`` (400) naming
    the first field that breaks a rule."""
    data = load_json(body)
    prompt = _prompt(data)
    common = request_fields(data, headers)
    asked = v.integer(data, "max_tokens", lo=0)
    choices = v.integer(data, "n", lo=1, hi=MAX_CHOICES) or 1
    if (best_of := v.integer(data, "best_of", lo=1)) not in (None, choices):
        raise v.bad("best_of", f"must equal n ({choices}): every reply generated is returned")
    if v.string(data, "suffix"):
        raise v.bad("suffix", "is not supported (this server does not insert text); leave it out")
    return CompletionRequest(
        prompt=prompt,
        max_tokens=min(DEFAULT_MAX_TOKENS if asked is None else asked, max_tokens_cap),
        echo=v.boolean(data, "echo"),
        logprobs=v.integer(data, "logprobs", lo=0, hi=MAX_LOGPROBS),
        **common,
        choices=choices,
    )


def _prompt(data: dict) -> str:
    """The one prompt text: a string, or an array of one string."""
    prompt, where = data.get("prompt"), "prompt"
    if prompt is None:
        raise v.bad(where, "is required")
    if isinstance(prompt, list):
        if any(isinstance(p, (int, list)) and not isinstance(p, bool) for p in prompt):
            raise v.bad(where, "token ids are not supported; send the prompt as text")
        if len(prompt) != 1:
            raise v.bad(where, f"must be one prompt (a string, or an array of one string), not {len(prompt)}; "
                               "send several prompts as several requests")
        prompt, where = prompt[0], "prompt[0]"
    if not isinstance(prompt, str):
        raise v.bad(where, f"must be a string, not {v.jtype(prompt)}")
    if not prompt:
        raise v.bad(where, "must not be empty")
    return prompt


# --- log-probabilities ---------------------------------------------------------


class _Offsets:
    """The character offset of each token in the text its pieces spell, one
    after another from ``start`` (a character split between tokens counts
    at the token that begins it)."""

    def __init__(self, start: int = 0):
        self._at = start
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def __call__(self, piece: bytes) -> int:
        at = self._at
        self._at += len(self._decoder.decode(piece))
        return at


class _ChoiceLogprobs:
    """One choice's tokens as OpenAI's legacy ``logprobs`` object: the prompt's
    (with ``echo``), then the generated ones as they come, offsets into the
    choice's text."""

    def __init__(self, prompt: str, echo: bool):
        self._prompt = prompt
        self._offsets = _Offsets(len(prompt) if echo else 0)  # where the generated text begins

    def prompt_json(self, entries: Sequence[TokenLogprob]) -> dict:
        """The prompt's tokens; those before the text it spells (a BOS) at offset 0."""
        spelled = b"".join(e.piece for e in entries).decode("utf-8", "replace")
        lead = len(spelled) - len(self._prompt) if spelled.endswith(self._prompt) else 0
        offsets = _Offsets(-lead)
        return _logprobs_json(entries, [max(0, offsets(e.piece)) for e in entries])

    def output_json(self, entries: Sequence[TokenLogprob]) -> dict:
        return _logprobs_json(entries, [self._offsets(e.piece) for e in entries])


def _logprobs_json(entries: Sequence[TokenLogprob], offsets: list[int]) -> dict:
    def text(lp: TokenLogprob) -> str:
        return lp.piece.decode("utf-8", "replace")

    def top(lp: TokenLogprob) -> dict[str, float] | None:
        if lp.logprob is None:
            return None
        out: dict[str, float] = {}
        for t in (*lp.top, lp):  # the likeliest first; the token itself when it is not among them
            out.setdefault(text(t), max(t.logprob, _FLOOR))
        return out

    return {"tokens": [text(e) for e in entries],
            "token_logprobs": [None if e.logprob is None else max(e.logprob, _FLOOR) for e in entries],
            "top_logprobs": [top(e) for e in entries],
            "text_offset": offsets}


def _joined(*parts: dict) -> dict:
    return {key: [x for part in parts for x in part[key]] for key in parts[0]}


# --- responses ----------------------------------------------------------------


def new_completion_id() -> str:
    return "cmpl-" + secrets.token_hex(12)


def response_json(turn: ChatTurn, result: ChatResult) -> dict:
    """The ``text_completion`` object for ``result``; raises ``RequestError``
    (503) for a cancelled turn, which has no completion."""
    if result.stop_reason == StopReason.CANCELLED:
        raise cancelled()
    req: CompletionRequest = turn.request

    def choice(index: int, reply: ChatResult) -> dict:
        logprobs = None
        if req.logprobs is not None:
            record, writer = reply.turn, _ChoiceLogprobs(req.prompt, req.echo)
            generated = writer.output_json(record.logprobs)
            logprobs = _joined(writer.prompt_json(record.prompt_logprobs), generated) if req.echo else generated
        return {"text": (req.prompt if req.echo else "") + reply.text, "index": index, "logprobs": logprobs,
                "finish_reason": _FINISH[reply.stop_reason]}

    return {"id": new_completion_id(), "object": "text_completion", "created": turn.created, "model": turn.model,
            "choices": [choice(i, reply) for i, reply in enumerate(result.every)], "usage": usage_json(result),
            "system_fingerprint": None}


async def events(turn: ChatTurn, items: AsyncIterable[StreamItem]) -> AsyncIterator[bytes]:
    """The SSE stream of one completion, encoded (see the module docstring).

    A choice's text goes out with its tokens' log-probabilities when they
    were asked for (text held back for a possible stop string comes with a
    later token's, or at the end). A ``RequestError`` raised by ``items``
    becomes an error chunk with its message, another exception an error
    chunk saying the server failed (and a log record), a cancelled result a
    503 error chunk; ``[DONE]`` follows each. Cancellation is never caught."""
    req: CompletionRequest = turn.request
    head = {"id": new_completion_id(), "object": "text_completion", "created": turn.created, "model": turn.model}
    asked = req.logprobs is not None
    writers: dict[int, _ChoiceLogprobs] = {}
    held: dict[int, str] = {}  # by choice: text waiting for its tokens' log-probabilities
    echoed: set[int] = set()

    def chunk(index: int, text: str, logprobs: dict | None = None, finish: str | None = None) -> bytes:
        body = {**head, "choices": [{"text": text, "index": index, "logprobs": logprobs, "finish_reason": finish}],
                "system_fingerprint": None}
        return encode(body | {"usage": None} if req.include_usage else body)

    def writer(index: int) -> _ChoiceLogprobs:
        return writers.setdefault(index, _ChoiceLogprobs(req.prompt, req.echo))

    def echo(index: int, entries: Sequence[TokenLogprob]) -> bytes:
        echoed.add(index)
        return chunk(index, req.prompt, writer(index).prompt_json(entries) if asked else None)

    try:
        async with closing(stream_text(items, logprobs=asked)) as pieces:
            async for piece in pieces:
                if isinstance(piece, Heartbeat):
                    yield KEEP_ALIVE
                    continue
                if isinstance(piece, ChatResult):
                    result = piece
                    continue
                index = piece.choice
                if req.echo and index not in echoed:
                    yield echo(index, piece.logprobs if isinstance(piece, PromptLogprobs) else ())
                if isinstance(piece, LogprobsDelta):
                    yield chunk(index, held.pop(index, ""), writer(index).output_json(piece.logprobs))
                elif not isinstance(piece, PromptLogprobs):  # text
                    if asked:
                        held[index] = held.get(index, "") + piece.text
                    else:
                        yield chunk(index, piece.text)
    except RequestError as err:
        yield encode(error_json(err))
        yield _DONE
        return
    except Exception:
        log.exception("a /v1/completions stream failed")
        yield encode(error_json(RequestError(500, "the server failed while generating; see its log")))
        yield _DONE
        return
    for index, reply in enumerate(result.every):
        if req.echo and index not in echoed:
            yield echo(index, reply.turn.prompt_logprobs if reply.turn else ())
        if text := held.pop(index, ""):
            yield chunk(index, text)
        yield chunk(index, "", finish=_FINISH[reply.stop_reason])
    if req.include_usage:
        yield encode({**head, "choices": [], "usage": usage_json(result), "system_fingerprint": None})
    yield _DONE


# its errors are OpenAI's (``error_json``)
PROTOCOL = ProtocolSpec("completions", ("/v1/completions",), response_json, events, error_json)
