#!/usr/bin/env bash
# Install the real coding-agent CLIs that tests/clients drives against a local
# `semantic serve`: Claude Code and the Codex CLI, at pinned versions, with
# `npm install --prefix` into the cache home's clients/ folder
# ($SEMANTIC_HOME/clients, else ${XDG_CACHE_HOME:-~/.cache}/semantic/clients).
# Installs Node.js and npm from Debian first when npm is missing.
# Idempotent (a no-op when both are there at these versions); never fatal:
# without them the client tests skip and say why.
#   scripts/setup-clients.sh          install (quietly when there is nothing to do)
#   scripts/setup-clients.sh --dir    print the folder and exit
set -u
CLAUDE_CODE_VERSION=2.1.330
CODEX_VERSION=0.169.0

home=${SEMANTIC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/semantic}
dir=$home/clients
[ "${1:-}" = --dir ] && { echo "$dir"; exit 0; }

installed() {  # installed PACKAGE VERSION BIN: is PACKAGE@VERSION there, and does BIN run?
  local pj="$dir/node_modules/$1/package.json"
  [ -f "$pj" ] && grep -q "\"version\": *\"$2\"" "$pj" && "$dir/node_modules/.bin/$3" --version >/dev/null 2>&1
}

installed @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" claude && installed @openai/codex "$CODEX_VERSION" codex && exit 0

if ! command -v npm >/dev/null; then
  if command -v apt-get >/dev/null; then
    sudo=""
    [ "$(id -u)" = 0 ] || sudo="sudo -n"
    echo "Installing Node.js and npm (Debian packages) for the client tests..."
    { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq nodejs npm >/dev/null; } ||
      echo "note: could not install Node.js; run: sudo apt-get install nodejs npm" >&2
  fi
  command -v npm >/dev/null || {
    echo "note: no npm: the Claude Code and Codex client tests will be skipped (install Node.js and npm)" >&2
    exit 0
  }
fi

echo "Installing Claude Code $CLAUDE_CODE_VERSION and Codex $CODEX_VERSION into $dir ..."
mkdir -p "$dir"
if ! npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
    "@anthropic-ai/claude-code@$CLAUDE_CODE_VERSION" "@openai/codex@$CODEX_VERSION"; then
  echo "note: npm install failed; the client tests will say so" >&2
  exit 0
fi
# Claude Code's postinstall puts its native binary in place of a stub; an npm
# that holds back install scripts leaves the stub, so run it here if needed.
if ! "$dir/node_modules/.bin/claude" --version >/dev/null 2>&1; then
  (cd "$dir/node_modules/@anthropic-ai/claude-code" && node install.cjs) >&2 || true
fi
installed @anthropic-ai/claude-code "$CLAUDE_CODE_VERSION" claude || echo "note: Claude Code did not install" >&2
installed @openai/codex "$CODEX_VERSION" codex || echo "note: Codex did not install" >&2
exit 0
