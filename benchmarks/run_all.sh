#!/usr/bin/env bash
# Every CPU benchmark (rows appended to benchmarks/results.csv), then the plots.
# About 10-15 minutes on 2 cores. Usage: bash benchmarks/run_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
$PY -c "import matplotlib, accelerate" 2>/dev/null || $PY -m pip install -q -r benchmarks/requirements.txt
echo "load before: $(cat /proc/loadavg)"
$PY benchmarks/bench_kernels.py
$PY benchmarks/bench_collective_overhead.py
$PY benchmarks/bench_block_vs_dtensor.py
$PY benchmarks/bench_3d.py
$PY benchmarks/bench_checkpoint.py
$PY benchmarks/bench_summa.py
$PY benchmarks/bench_planner.py
$PY benchmarks/bench_moe.py
$PY benchmarks/bench_vs_transformers.py --tp 2 4 --shapes small
$PY benchmarks/bench_vs_transformers.py --tp 2 --shapes large --repeats 6
$PY benchmarks/bench_vs_transformers.py --pp 2
$PY benchmarks/plot.py
$PY benchmarks/report.py --update BENCHMARKS.md
echo "load after: $(cat /proc/loadavg)"
