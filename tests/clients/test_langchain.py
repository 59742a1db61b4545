"""LangChain's standard chat-model integration tests (``langchain-tests``)
against a real ``semantic serve`` on the embedded model, through three of
LangChain's clients: ``ChatOpenAI`` on chat completions, ``ChatOpenAI`` on
the Responses API, and ``ChatAnthropic``.

Only the tool-calling tests run: every standard test whose name begins with
``test_tool_calling`` (in langchain-tests 1.1.9: ``test_tool_calling``, with
both of its output versions, ``test_tool_calling_async`` and
``test_tool_calling_with_no_arguments``); the rest of the standard suite is
left out of the classes.
Each forces a call (``tool_choice="any"``), which the server holds to a call of
the tool whose arguments its schema accepts (``web/tool_grammar.py``:
``call_grammar``), so the tests pass whatever the 135M model would prefer to write: greedy
output depends on the BLAS kernels, the grammar does not.
"""

from __future__ import annotations

import pytest

pytest.importorskip("langchain_tests")
from langchain_anthropic import ChatAnthropic  # noqa: E402
from langchain_openai import ChatOpenAI  # noqa: E402
from langchain_tests.integration_tests import ChatModelIntegrationTests  # noqa: E402

from .conftest import Server  # noqa: E402

pytestmark = [pytest.mark.model, pytest.mark.slow, pytest.mark.anyio]  # anyio: the async tests

TOOL_TESTS = "test_tool_calling"  # the prefix of the standard tests that run
URL: list[str] = []  # the module's server, once started


@pytest.fixture(scope="module", autouse=True)
def embedded_server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("server")
    s = Server(tmp / "agents", tmp / "server.log")  # the embedded model, max_tokens capped (conftest)
    URL.append(s.url)
    yield s
    URL.clear()
    s.stop()


@pytest.fixture(scope="module")
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="module", autouse=True)
async def one_event_loop(anyio_backend):
    """The module's async tests share one event loop (anyio keeps it while a module-scoped async
    fixture lives): LangChain's clients keep one async HTTP client per base URL for the process,
    and its pooled connections belong to the loop that opened them."""
    yield


class Standard(ChatModelIntegrationTests):
    """The standard class, its client pointed at the module's server (``path``: the client's base URL's)."""

    chat_model_class = ChatOpenAI
    path, extra = "/v1", {}

    @property
    def chat_model_params(self) -> dict:
        return {"model": "smollm2", "api_key": "none", "max_retries": 0, "base_url": URL[0] + self.path,
                **self.extra}


for _name in dir(ChatModelIntegrationTests):  # pytest collects only what is callable
    if _name.startswith("test_") and not _name.startswith(TOOL_TESTS):
        setattr(Standard, _name, None)


class TestChatCompletions(Standard):
    pass


class TestResponses(Standard):
    extra = {"use_responses_api": True}


class TestAnthropic(Standard):
    chat_model_class, path = ChatAnthropic, ""
