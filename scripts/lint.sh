#!/usr/bin/env bash
# The linters `make test` runs, with the same settings locally and in CI (pyproject.toml,
# .clang-format): ruff (lint and format) for Python, clang-format for C++, and import-linter's
# layers contract (imports point down; docs/architecture.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
$PY -m ruff check tp_ext tests benchmarks examples setup.py
$PY -m ruff format --check tp_ext tests benchmarks examples setup.py
bash scripts/check_format_cpp.sh
# the console script installed next to this Python (import-linter has no `python -m` entry)
"$($PY -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/lint-imports" --no-cache
echo "lint: ruff, clang-format and import layers clean"
