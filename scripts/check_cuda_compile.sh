#!/usr/bin/env bash
# Compiles every CUDA source of tp_ext with nvcc against the installed torch's headers (compile
# only: nothing CUDA runs on a machine without a GPU). Fails if a .cu file no longer compiles, or
# if a .cpp file has CUDA-only code (csrc/README.md: CUDA kernels and their registration live in
# .cu files, which are compiled only when CUDA is built; no .cpp uses TP_EXT_WITH_CUDA).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
mapfile -t guarded < <(grep -rl --include='*.cpp' --include='*.h' TP_EXT_WITH_CUDA csrc | sort)
if [ ${#guarded[@]} -gt 0 ]; then
  echo "check_cuda_compile: CUDA-only code in C++ files (move it to the op's .cu):" >&2
  printf '  %s\n' "${guarded[@]}" >&2
  exit 1
fi
mapfile -t sources < <(find csrc -name '*.cu' | sort)
# torch's build names each object after its source's stem: a.cpp and a.cu would both be a.o, and
# the CUDA build stops with "multiple rules generate" (CUDA kernels live in <op>_cuda.cu)
clashes=$(find csrc \( -name '*.cpp' -o -name '*.cu' \) | sed 's/\.[^.]*$//' | sort | uniq -d)
if [ -n "$clashes" ]; then
  echo "check_cuda_compile: sources that would compile to the same object (rename the .cu):" >&2
  echo "$clashes" | sed 's/^/  /' >&2
  exit 1
fi
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
# One nvcc per core (each is single-threaded), each compiling a unity file that includes its
# share of the sources: torch's and CUDA's headers (~250k preprocessed lines, most of the ~55 s a
# .cu takes) are then parsed once per core instead of once per source (6 sources on 2 cores:
# 150 s -> 60 s). So the sources must not define the same name in their anonymous namespaces
# (shared helpers live in csrc/common/cuda_vec.cuh). A unity file checks only its first source
# for includes it forgot: the CUDA build (scripts/gpu_check.sh) compiles every source alone.
# A unity file that fails prints its whole log, which names the source and line.
jobs=$(nproc)
[ "$jobs" -gt ${#sources[@]} ] && jobs=${#sources[@]}
units=()
for ((j = 0; j < jobs; j++)); do
  unit="$out/unity$j.cu"
  : >"$unit"
  for ((i = j; i < ${#sources[@]}; i += jobs)); do
    echo "#include \"$PWD/${sources[i]}\"" >>"$unit"
  done
  units+=("$unit")
done
export NVCC_FLAGS="-std=c++17 -O1 --expt-relaxed-constexpr -arch=sm_90 -DTP_EXT_WITH_CUDA \
  -D_GLIBCXX_USE_CXX11_ABI=$abi -DTORCH_EXTENSION_NAME=_C $includes -Icsrc"
if ! printf '%s\0' "${units[@]}" | xargs -0 -n 1 -P "$jobs" bash -c '
    names=$(sed "s|.*/||; s|\"||" "$0" | paste -sd " ")
    if nvcc $NVCC_FLAGS -c "$0" -o "${0%.cu}.o" >"$0.log" 2>&1; then echo "nvcc -c $names: ok"
    else echo "nvcc -c $names: FAILED" >&2; cat "$0.log" >&2; exit 1; fi'; then
  echo "check_cuda_compile: a CUDA source does not compile (its nvcc output is above)" >&2
  rm -rf "$out"
  exit 1
fi
# A .cu calls the shared setup its op's .cpp defines (csrc/README.md); without a GPU build nothing
# links them, so check that every tp_ext symbol the CUDA objects need is defined (not in an
# anonymous namespace) in the CPU build of the extension, when one is there.
linked="not checked (no tp_ext/_C*.so built)"
so=$(ls tp_ext/_C*.so 2>/dev/null | head -1 || true)
if [ -n "$so" ]; then
  missing=$(comm -23 \
    <(nm -C --undefined-only "$out"/*.o | sed -n 's/^ *U \(tp_ext::.*\)$/\1/p' | sort -u) \
    <(nm -C --defined-only "$so" | sed -n 's/^[0-9a-f]* [TWV] \(tp_ext::.*\)$/\1/p' | sort -u))
  if [ -n "$missing" ]; then
    echo "check_cuda_compile: CUDA objects use tp_ext symbols that $so does not define:" >&2
    echo "$missing" | sed 's/^/  /' >&2
    rm -rf "$out"
    exit 1
  fi
  linked="their tp_ext symbols are all defined in $so"
fi
rm -rf "$out"
echo "check_cuda_compile: ${#sources[@]} CUDA sources compile, $linked; no C++ file has CUDA-only code"
