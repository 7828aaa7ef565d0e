#!/usr/bin/env bash
# Installs everything tp_ext needs and builds its extension against the installed torch.
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}

if ! $PY -c "import torch" 2>/dev/null; then
  # The CPU build (a local file on the project machines); a looser pin would download CUDA.
  $PY -m pip install -q torch==2.13.0
fi
$PY -m pip install -q -r requirements-dev.txt
if $PY -c "import tp_ext" 2>/dev/null && command -v tp-ext >/dev/null 2>&1; then
  MAX_JOBS=${MAX_JOBS:-2} $PY setup.py -q build_ext --inplace   # incremental (ninja)
else
  MAX_JOBS=${MAX_JOBS:-2} $PY -m pip install -q --no-build-isolation --no-deps -e .
fi
$PY -c "import tp_ext, torch; print('tp_ext ready: torch', torch.__version__)"
