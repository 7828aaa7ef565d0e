#!/usr/bin/env bash
# Checks that every C++/CUDA source under csrc/ is formatted as .clang-format says, with the
# clang-format that pip installs (PyPI package clang-format, pinned below so every machine formats
# alike). Prints the files that differ and exits non-zero if there are any.
#   Fix them: python3 -m pip install clang-format==19.1.7 && clang-format -i <files>
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
PINNED=19.1.7

# The pip package's own `clang-format` console-script entry point, run through $PY, so neither a
# system clang-format earlier on PATH nor another version is used by mistake.
have=$("$PY" -c "import importlib.metadata as m; print(m.version('clang-format'))" 2>/dev/null) || {
  echo "check_format_cpp: the clang-format package is not installed for $PY;" \
       "run: $PY -m pip install clang-format==$PINNED" >&2
  exit 1
}
if [ "$have" != "$PINNED" ]; then
  echo "check_format_cpp: clang-format $have is installed for $PY but $PINNED is pinned (versions" \
       "format differently); run: $PY -m pip install clang-format==$PINNED" >&2
  exit 1
fi
clang_format() {
  "$PY" - "$@" <<'PY'
import sys
from importlib.metadata import entry_points

(ep,) = entry_points(group="console_scripts", name="clang-format")
sys.argv[0] = "clang-format"
ep.load()()
PY
}

mapfile -t sources < <(find csrc -type f \( -name '*.cpp' -o -name '*.cu' -o -name '*.h' \
                         -o -name '*.cuh' \) | sort)
bad=()
for src in "${sources[@]}"; do
  if ! err=$(clang_format --style=file --dry-run --Werror "$src" 2>&1 >/dev/null); then
    if [[ "$err" != *"[-Wclang-format-violations]"* ]]; then
      echo "check_format_cpp: clang-format failed on $src:" >&2
      echo "$err" >&2
      exit 2
    fi
    bad+=("$src")
  fi
done
if [ ${#bad[@]} -gt 0 ]; then
  echo "check_format_cpp: ${#bad[@]} of ${#sources[@]} files are not clang-formatted:" >&2
  printf '  %s\n' "${bad[@]}" >&2
  echo "Fix: clang-format -i ${bad[*]}  (clang-format==$PINNED from pip)" >&2
  exit 1
fi
echo "check_format_cpp: ${#sources[@]} files formatted (clang-format $PINNED)"
