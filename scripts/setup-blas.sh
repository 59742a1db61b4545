#!/usr/bin/env bash
# Install Debian's OpenBLAS on Linux when it is missing (MLX's bundled BLAS is
# ~50x slower). Idempotent; never fatal: without it everything still runs, slowly.
set -u
[ "$(uname -s)" = Linux ] || exit 0
ls /usr/lib/*-linux-gnu/openblas-pthread/libblas.so.3 /usr/lib/*-linux-gnu/libopenblas.so.0 >/dev/null 2>&1 && exit 0
command -v apt-get >/dev/null || { echo "note: install OpenBLAS with your package manager for a ~50x faster CPU path" >&2; exit 0; }
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
echo "Installing OpenBLAS (libopenblas0-pthread) for the fast CPU path..."
if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq libopenblas0-pthread >/dev/null; }; then
  echo "note: could not install OpenBLAS; run: sudo apt-get install libopenblas0-pthread" >&2
fi
exit 0
