#!/usr/bin/env bash
# `make test`'s checks after the install: the linters, then pytest with the CUDA compile check
# running beside it. The check is a nvcc compile per .cu file (minutes of CPU) that needs no
# GPU and shares nothing with the tests, so it runs at the lowest CPU priority in the cores'
# idle time (the tests wait on processes starting and on timeouts) instead of before them.
# Either failing fails the whole command; the check's output is printed when it ends.
# Arguments go to pytest (`make test-all` passes --full-matrix).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

PY=$PY bash scripts/lint.sh || exit 1

log=$(mktemp)
PY=$PY nice -n 19 bash scripts/check_cuda_compile.sh >"$log" 2>&1 &
check=$!
trap 'kill "$check" 2>/dev/null; rm -f "$log"' EXIT

$PY -m pytest -q tests "$@"
tests=$?

wait "$check"
compiled=$?
cat "$log"
if [ "$compiled" -ne 0 ]; then
  echo "make test: the CUDA compile check failed (its output is above)" >&2
fi
[ "$tests" -eq 0 ] && [ "$compiled" -eq 0 ]
