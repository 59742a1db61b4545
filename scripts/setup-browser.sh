#!/usr/bin/env bash
# Install a headless browser for the dashboard's browser test (tests/web/test_dashboard.py):
# Debian's chromium and chromium-driver. The test drives it with selenium (a dev
# extra). Idempotent (a no-op when both are there); never fatal: without them the
# browser test skips and says why.
set -u
have() { command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; }
have && exit 0
command -v apt-get >/dev/null || {
  echo "note: no apt-get: install chromium and its chromedriver for the dashboard's browser test" >&2
  exit 0
}
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
echo "Installing chromium and chromium-driver (Debian packages) for the dashboard's browser test..."
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    --no-install-recommends chromium chromium-driver fonts-dejavu-core >/dev/null; }; then
  echo "note: could not install chromium; run: sudo apt-get install chromium chromium-driver" >&2
fi
have || echo "note: no chromium/chromedriver: the dashboard's browser test will be skipped" >&2
exit 0
