#!/usr/bin/env bash
# Install a C++ compiler on Linux when it is missing: setup.py builds the CPU
# attention kernels (runtime/model/kernels) with it. Idempotent; never fatal:
# without it the package installs without them (MLX's quantized matmul instead).
set -u
[ "$(uname -s)" = Linux ] || exit 0
command -v c++ >/dev/null && exit 0
command -v apt-get >/dev/null || { echo "note: install a C++ compiler for the CPU attention kernels" >&2; exit 0; }
sudo=""
[ "$(id -u)" = 0 ] || sudo="sudo -n"
echo "Installing a C++ compiler (g++) for the CPU attention kernels..."
if ! { $sudo apt-get update -qq && $sudo apt-get install -y -qq g++ >/dev/null; }; then
  echo "note: could not install g++; run: sudo apt-get install g++" >&2
fi
exit 0
