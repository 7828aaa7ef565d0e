#!/usr/bin/env bash
# `make test` after the install: the linters, then the test suite with the CUDA compile check
# beside it. Arguments go to pytest (`make test PYTEST_ARGS=...`; `make test-all` passes
# --full-matrix).
#
# Why beside it: the check is ~70 s of nvcc on 2 cores, and the suite leaves a fifth of the CPU
# idle (distributed tests wait on each other, on torchrun starts and on timeouts). At the lowest
# priority (nice 19) nvcc takes that idle time and little else, so it no longer adds its minute
# before the first test. Both must pass: the check's output is printed after the suite, and
# either failing fails the command.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PY=$PY bash scripts/lint.sh || exit 1
log=$(mktemp)
PY=$PY nice -n 19 bash scripts/check_cuda_compile.sh >"$log" 2>&1 &
cuda=$!
trap 'kill $cuda 2>/dev/null; rm -f "$log"' EXIT
$PY -m pytest -q tests "$@"
tests=$?
wait $cuda
checked=$?
cat "$log"
if [ $checked -ne 0 ]; then
  echo "test: the CUDA compile check failed (its output is above)" >&2
fi
[ $tests -eq 0 ] && [ $checked -eq 0 ]
