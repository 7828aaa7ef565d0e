#!/usr/bin/env bash
# Compiles every CUDA source of tp_ext with nvcc against the installed torch's headers (compile
# only: nothing CUDA runs on a machine without a GPU). Fails if a .cu file no longer compiles.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mapfile -t sources < <(find csrc -name '*.cu' | sort)
if [ ${#sources[@]} -eq 0 ]; then
  echo "check_cuda_compile: no CUDA sources in csrc/"
  exit 0
fi
if ! command -v nvcc >/dev/null 2>&1; then
  echo "check_cuda_compile: nvcc not found; cannot check ${#sources[@]} CUDA sources" >&2
  exit 1
fi
includes=$($PY - <<'PY'
import sysconfig
from torch.utils.cpp_extension import include_paths
print(" ".join(f"-I{p}" for p in include_paths() + [sysconfig.get_paths()["include"]]))
PY
)
abi=$($PY -c "import torch; print(int(torch._C._GLIBCXX_USE_CXX11_ABI))")
out=$(mktemp -d)
# A CPU-only torch ships c10/cuda headers without the build-generated cuda_cmake_macros.h; supply
# the one line it holds so c10/cuda/*.h (streams, guards) can be included.
if ! $PY -c "import torch.utils.cpp_extension as c, os, sys; sys.exit(not any(os.path.exists(os.path.join(p, 'c10/cuda/impl/cuda_cmake_macros.h')) for p in c.include_paths()))"; then
  mkdir -p "$out/stub/c10/cuda/impl"
  echo '#define C10_CUDA_BUILD_SHARED_LIBS' > "$out/stub/c10/cuda/impl/cuda_cmake_macros.h"
  includes="$includes -I$out/stub"
fi
for src in "${sources[@]}"; do
  echo "nvcc -c $src"
  nvcc -std=c++17 -O1 --expt-relaxed-constexpr -arch=sm_90 -DTP_EXT_WITH_CUDA \
    -D_GLIBCXX_USE_CXX11_ABI="$abi" -DTORCH_EXTENSION_NAME=_C $includes -Icsrc \
    -c "$src" -o "$out/$(basename "$src").o"
done
# The CUDA halves of the C++ files (registration, launches under TP_EXT_WITH_CUDA): g++ syntax
# check against the CUDA toolkit's headers (where nvcc itself looks; nvcc may be a wrapper).
cuda_include=$(nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 |
               sed -n 's/.*INCLUDES="-I\([^"]*\)".*/\1/p' | head -1)
mapfile -t guarded < <(grep -rl --include='*.cpp' TP_EXT_WITH_CUDA csrc | sort)
for src in "${guarded[@]}"; do
  echo "g++ -fsyntax-only -DTP_EXT_WITH_CUDA $src"
  g++ -std=c++17 -fsyntax-only -DTP_EXT_WITH_CUDA -D_GLIBCXX_USE_CXX11_ABI="$abi" \
    -DTORCH_EXTENSION_NAME=_C $includes -I"$cuda_include" -Icsrc "$src"
done
rm -rf "$out"
echo "check_cuda_compile: ${#sources[@]} CUDA sources compile, ${#guarded[@]} C++ files compile with CUDA on"
