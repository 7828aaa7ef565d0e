#!/usr/bin/env bash
# The linters `make test` runs, with the same settings locally and in CI (pyproject.toml,
# .clang-format): ruff (lint and format) for Python, clang-format for C++, import-linter's
# layers contract (imports point down; docs/architecture.md), and the structure guard
# (scripts/check_structure.py: sizes of the upper floors, no probing of the parallel state,
# no import cycles).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
$PY -m ruff check tp_ext tests benchmarks examples scripts setup.py
$PY -m ruff format --check tp_ext tests benchmarks examples scripts setup.py
bash scripts/check_format_cpp.sh
# the console script installed next to this Python (import-linter has no `python -m` entry)
"$($PY -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/lint-imports" --no-cache
$PY scripts/check_structure.py
echo "lint: ruff, clang-format, import layers and the structure guard clean"
