#!/usr/bin/env bash
# Install HAProxy (Debian's package) for the many-servers test (tests/test_scaling.py),
# which runs scripts/haproxy.cfg in front of two `semantic serve`. Only the binary
# is used: the test starts its own haproxy (the package's service, where systemd
# starts it, runs Debian's default configuration, which listens on nothing).
# Idempotent (a no-op when haproxy is there); never fatal: without it the test
# skips and says why.
set -u
have() { command -v haproxy >/dev/null 2>&1 || [ -x /usr/sbin/haproxy ]; }
have && exit 0
command -v apt-get >/dev/null || {
  echo "note: no apt-get: install haproxy (2.6 or later) for the many-servers test" >&2
  exit 0
}
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
echo "Installing haproxy (Debian package) for the many-servers test..."
if ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq \
    --no-install-recommends haproxy >/dev/null; }; then
  echo "note: could not install haproxy; run: sudo apt-get install haproxy" >&2
fi
have || echo "note: no haproxy: the many-servers test will be skipped" >&2
exit 0
