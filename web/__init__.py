"""The HTTP layer: Anthropic- and OpenAI-compatible routes over the actor runtime.

Layout (each module one job; routes are thin and speak only ``schema`` to the runtime):

- ``schema``    the protocol-neutral request, stream items, result and ``RequestError``
- ``anthropic`` ``/v1/messages``: body -> ChatRequest; ChatResult -> JSON or SSE events
- ``openai``    ``/v1/chat/completions``: the same for OpenAI's shapes
- ``completions`` ``/v1/completions``: OpenAI's legacy raw-text completions and prompt scoring
- ``responses`` ``/v1/responses``: OpenAI's Responses API; its JSON and SSE events
- ``responses_request`` the Responses API's request: input items, tools -> ``ResponsesRequest``
- ``response_ids`` the Responses API's ids: ``resp_<agent>_<n>_<hash>`` names an agent state
- ``agents``    the agent API (``/v1/agents``): parsing, JSON and SSE bodies
- ``tools``     tool-call formats: parse calls out of generated text, hold them back
                from streamed text, and flatten tool turns for models without tools
- ``tool_grammar`` the grammar of a reply's tool calls, per format (forced or strict)
- ``reasoning`` ``<think>`` tags: reasoning split out of a reply's text
- ``harmony``   GPT-OSS's harmony channels: reasoning, calls and the reply apart
- ``sse``       encoding one event; a response that cancels its body on disconnect
- ``chat``      one turn for a route: request -> runtime conversation -> stream items
- ``prepare``   a request as the model's template takes it: conversation, tools, grammar
- ``identity``  which agent a stateless request continues (longest stored prefix)
- ``protocols`` each protocol's declaration (name, paths, answers, errors) and the app's registry
- ``answer``    a turn answered as JSON or SSE, a ``RequestError`` in its route's shape
- ``chat_routes``  the stateless chat routes (Anthropic, OpenAI chat, Completions, Responses)
- ``agent_routes`` the agent API's routes
- ``ops_routes``   the operator's routes: models, health, metrics, the dashboard
- ``state``     what the routes share: ``ServerConfig`` and ``Server``
- ``guard``     the ASGI middleware before every route: the API key, the body's size and time
- ``metrics``   Prometheus metrics of one server
- ``events``    the event hub: bounded publish/subscribe, recent turns
- ``dashboard`` the dashboard's snapshot JSON, turn observer and sampler (``/v1/events``)
- ``static/``   the dashboard page (HTML, CSS, JS; package data)
- ``app``       the Starlette app: the three route families, the lifespan (opens the
                ``Runtime``), the guard
- ``server``    serving it with hypercorn (trio or asyncio)
- ``_validate`` field checks shared by the parsers (private)
- ``_aio``      closing async iterators, collapsing task groups (private)

The protocol modules (``schema``, ``protocols``, ``anthropic``, ``openai``,
``completions``, ``responses``, ``responses_request``, ``response_ids``,
``tools``, ``tool_grammar``, ``sse``, ``agents``) are pure: no runtime, no model, no I/O.
"""

from .schema import ChatRequest, ChatResult, RequestError, StreamItem, ToolCall, Usage

__all__ = ["ChatRequest", "ChatResult", "RequestError", "StreamItem", "ToolCall", "Usage"]
