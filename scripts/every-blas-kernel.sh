#!/usr/bin/env bash
# Tests under every OpenBLAS kernel set this CPU can run, as on other machines of
# the same kind: each OPENBLAS_CORETYPE in turn runs the invariance tests, or
# what the arguments name. `-m model` runs the tests on the embedded model,
# which must pass whatever it writes under each kernel set's rounding (about
# 15 minutes a set on 2 cores). A developer's check (CI leaves the BLAS as the
# machine sets it).
#
#   scripts/every-blas-kernel.sh [pytest args]   (default: the invariance tests)
set -u
cd "$(dirname "$0")/.."
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/runtime/test_invariance.py
  tests/runtime/test_batch_cache.py::test_fixed_shape_matmul_rows_do_not_depend_on_their_neighbours
  tests/runtime/test_batch_cache.py::test_each_sequence_in_a_forward_computes_as_alone)
corename='import ctypes, numpy, semantic.runtime, mlx.core as mx; from semantic.runtime.model import blas
mx.eval(mx.ones((64, 64)) @ mx.ones((64, 64))); numpy.ones((64, 64)) @ numpy.ones((64, 64))  # (both BLAS run)
f = ctypes.CDLL(blas.status().library).openblas_get_corename; f.restype = ctypes.c_char_p; print(f().decode())'
status=0
for core in Prescott Core2 Nehalem Sandybridge Haswell Zen SkylakeX Cooperlake SapphireRapids; do
  if ! ran=$(OPENBLAS_CORETYPE=$core .venv/bin/python -c "$corename" 2>/dev/null); then
    printf '%-15s this CPU cannot run its kernels\n' "$core"  # (an illegal instruction: AVX-512 kernels without it)
    continue
  fi
  result=$(OPENBLAS_CORETYPE=$core .venv/bin/pytest -q -p no:cacheprovider "${tests[@]}" 2>&1 | tail -1)
  printf '%-15s kernel %-12s %s\n' "$core" "$ran" "$result"
  case $result in *failed*|*error*|"") status=1 ;; *passed*) ;; *) status=1 ;; esac  # (a crash: no summary)
done
exit $status
