"""The HTTP layer: Anthropic- and OpenAI-compatible routes over the actor runtime.

Layout (each module one job; routes are thin and speak only ``schema`` to the runtime):

- ``schema``    the protocol-neutral request, stream items, result and ``RequestError``
- ``anthropic`` ``/v1/messages``: body -> ChatRequest; ChatResult -> JSON or SSE events
- ``openai``    ``/v1/chat/completions``: the same for OpenAI's shapes
- ``tools``     tool-call formats: parse calls out of generated text, hold them back
                from streamed text, and flatten tool turns for models without tools
- ``sse``       encoding one event; a response that cancels its body on disconnect
- ``_validate`` field checks shared by the parsers (private)
- ``_aio``      closing async iterators, collapsing task groups (private)

The protocol modules are pure: no runtime, no model, no I/O.
"""

from .schema import ChatRequest, ChatResult, RequestError, StreamItem, TextDelta, ToolCall, Usage

__all__ = ["ChatRequest", "ChatResult", "RequestError", "StreamItem", "TextDelta", "ToolCall", "Usage"]
