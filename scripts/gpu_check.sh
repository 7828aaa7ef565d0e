#!/usr/bin/env bash
# Issue 20's scripted run on a GPU machine whose python3 already has torch with CUDA (no network):
# build the extension with CUDA, run the CUDA tests (`pytest -m cuda`: kernels against CPU, an NCCL
# group of one, CUDA graphs, torch.compile, the Qwen2-72B TP=8 rank shard), then the GPU benchmarks
# and after them the CPU benchmarks that want a core per rank (rows appended to
# benchmarks/results.csv). Logs and the new CSV rows go to $OUT (8 files: the device tool's limit).
#   OUT=/tmp/gpu bash scripts/gpu_check.sh            build, CUDA tests, benchmarks
#   OUT=/tmp/gpu bash scripts/gpu_check.sh suite N    then the whole suite with N pytest workers
# BUDGET=seconds bounds the whole run (default 1800): each stage gets what is left, so a run cut
# short still returns its logs and the rows measured so far.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:-benchmarks/out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
t0=$(date +%s)
BUDGET=${BUDGET:-1800}
stamp() { echo "[$(($(date +%s) - t0)) s] $*"; }
left() { echo $((BUDGET - ($(date +%s) - t0))); }

if [ "${1:-}" != "suite" ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
  $PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
  stamp "build (sm_90, $(nproc) jobs)"
  if ! TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-9.0} MAX_JOBS=$(nproc) TP_EXT_CUDA=1 \
      $PY setup.py -q build_ext --inplace >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    exit 1
  fi
  stamp "built"
  # the C++ runtime it links (setup.py refuses a static libstdc++: C++ errors would crash)
  readelf -d tp_ext/_C*.so | grep NEEDED | tee -a "$OUT/device.txt"
  stamp "CUDA tests"
  timeout "$(left)" $PY -m pytest -q -m cuda tests -p no:cacheprovider 2>&1 | tee "$OUT/cuda_tests.log" | tail -30
  # On the H200 (2026-11-26 and -28) these crashed (SIGSEGV as the C++ ValueError was raised): that
  # build had a static libstdc++ (setup.py now refuses one). Alone, then after CUDA is initialised.
  errors="tests/test_fused_kernels.py::test_errors tests/test_rotary_kernel.py::test_bad_inputs_raise_clear_errors tests/test_compression.py::test_bad_arguments_are_refused_clearly"
  stamp "C++ errors raise, alone / after CUDA init"
  $PY -X faulthandler -m pytest -q -p no:cacheprovider $errors 2>&1 | tail -3
  $PY -X faulthandler -c "import sys, torch, pytest; torch.zeros(1, device='cuda'); sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', *sys.argv[1:]]))" $errors 2>&1 | tail -3
  stamp "GPU benchmarks"
  before=$(wc -l <benchmarks/results.csv)
  # alone: small kernels behind autograd are timed partly by the CPU, and CPU load beside them
  # slowed them in the 2026-11-28 run
  timeout "$(left)" $PY benchmarks/bench_gpu.py 2>&1 | tee "$OUT/bench_gpu.log" | grep -v "^ *$" | tail -60
  stamp "CPU benchmarks that want a core per rank, side by side on disjoint cores"
  # CPU/gloo benchmarks (the dev VM runs 4 ranks on 2 cores): issue 22's MoE layer at EP=4, the
  # pipeline bubble at pp=4, the overlap benchmark on loopback. Each writes its own CSV (a shared
  # append could interleave), merged below.
  cpu_bench() {  # cores log script args...
    local cores=$1 log=$2
    shift 2
    TP_EXT_RESULTS="$CSVS/$log.csv" timeout "$(left)" taskset -c "$cores" $PY "$@" >"$OUT/$log.log" 2>&1
  }
  CSVS=$(mktemp -d)  # not under $OUT: the device tool brings back at most 8 files
  cpu_bench 0-3 bench_moe benchmarks/bench_moe.py --ep 4 &
  cpu_bench 4-7 bench_3d benchmarks/bench_3d.py --parts bubble --pp 4 &
  cpu_bench 8-9 bench_overlap benchmarks/bench_overlap.py --mbit &
  wait
  for b in bench_moe bench_3d bench_overlap; do
    echo "== $b ($(nproc) cores here, pinned)"
    tail -12 "$OUT/$b.log"
  done
  {
    head -1 benchmarks/results.csv
    tail -n +$((before + 1)) benchmarks/results.csv
    for b in bench_moe bench_3d bench_overlap; do tail -n +2 "$CSVS/$b.csv" 2>/dev/null; done
  } >"$OUT/gpu_rows.csv"
  stamp "done"
else
  stamp "whole suite, ${2:-4} workers"
  # -v: a line per test as it ends, so a run cut short still names what failed
  # and each failure's traceback to failures.log as it happens (tests/conftest.py)
  TP_EXT_FAILURE_LOG="$OUT/failures.log" timeout "$(left)" $PY -m pytest -v tests -n "${2:-4}" \
    -p no:cacheprovider >"$OUT/suite.log" 2>&1
  grep -E "(FAILED|ERROR) |Fatal Python error|node down|passed|failed" "$OUT/suite.log" | tail -60
  stamp "done"
fi
