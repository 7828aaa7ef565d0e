"""Shared helpers for the benchmarks: a long-format results CSV, timing and a gloo launcher.

Each row is one measurement: ``benchmark`` (the script), ``case`` (shape/dtype/variant),
``metric`` and ``value`` with its ``unit``, the ``baseline`` value it is compared to and
``ratio`` = value / baseline. Machine, date and versions are filled in by :func:`append_rows`.
"""

from __future__ import annotations

import csv
import datetime
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# TP_EXT_RESULTS: another CSV (benchmarks run side by side each write their own)
RESULTS = os.environ.get("TP_EXT_RESULTS") or os.path.join(ROOT, "benchmarks", "results.csv")
COLUMNS = [
    "date",
    "machine",
    "torch",
    "commit",
    "benchmark",
    "case",
    "metric",
    "value",
    "unit",
    "baseline",
    "ratio",
    "command",
    "load",
]


def machine() -> str:
    cpu = platform.processor() or "unknown cpu"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f" + {torch.cuda.get_device_name()}"
    except Exception:  # noqa: BLE001
        pass
    cores = len(os.sched_getaffinity(0))  # the cores this run may use (taskset) of the host's
    used = f"x{cores} of {os.cpu_count()}" if cores < (os.cpu_count() or 0) else f"x{cores}"
    return f"{platform.node()} / {cpu} {used}{gpu}"


def git_commit() -> str:
    """HEAD's short hash (-dirty with uncommitted changes other than the benchmarks' own
    outputs: results.csv and the plots); TP_EXT_COMMIT overrides it, for a copied tree whose
    git state is not the code's (the GPU machine's copy)."""
    if os.environ.get("TP_EXT_COMMIT"):
        return os.environ["TP_EXT_COMMIT"]
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                ":!benchmarks/results.csv",
                ":!benchmarks/plots",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out + ("-dirty" if dirty else "")
    except Exception:  # noqa: BLE001 - no git
        return "unknown"


def command_line() -> str:
    return "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:]
    )


def load_average() -> str:
    try:
        return "%.2f" % os.getloadavg()[0]
    except OSError:
        return ""


def append_rows(rows: Iterable[dict], path: str = RESULTS) -> None:
    """Append result rows (dicts with benchmark, case, metric, value, unit and optionally
    baseline); the rest of the columns are filled in here."""
    import torch

    common = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "torch": torch.__version__,
        "commit": git_commit(),
        "command": command_line(),
        "load": load_average(),
    }
    new = not os.path.exists(path)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        if new:
            writer.writeheader()
        for row in rows:
            row = {**common, **row}
            base = row.get("baseline")
            if (
                row.get("ratio") in (None, "")
                and isinstance(base, (int, float))
                and base
                and isinstance(row.get("value"), (int, float))
            ):
                row["ratio"] = row["value"] / base
            for k in ("value", "baseline", "ratio"):
                if isinstance(row.get(k), float):
                    row[k] = f"{row[k]:.6g}"
            writer.writerow({k: row.get(k, "") for k in COLUMNS})


def read_rows(path: str = RESULTS, latest: bool = True) -> list[dict]:
    """Rows of the CSV; with ``latest``, only the newest row per (benchmark, case, metric)."""
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not latest:
        return rows
    newest: dict = {}
    for row in rows:  # the file is in time order
        newest[(row["benchmark"], row["case"], row["metric"])] = row
    return list(newest.values())


def bench(
    fn: Callable[[], object], warmup: int = 3, repeats: int = 10, min_time: float = 0.0
) -> float:
    """Median wall time of ``fn()`` in seconds, after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    times = []
    start = time.perf_counter()
    while len(times) < repeats or time.perf_counter() - start < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_pair(
    f: Callable[[], object], g: Callable[[], object], warmup: int = 3, repeats: int = 10
) -> tuple[float, float]:
    """Median wall times of ``f()`` and ``g()``, called alternately so that load changes on a
    shared machine hit both alike."""
    return bench_interleaved(f, g, warmup=warmup, repeats=repeats)


def bench_interleaved(*fns: Callable[[], object], warmup: int = 3, repeats: int = 10) -> tuple:
    """Median wall time of each of ``fns``, called in turn every round (see bench_pair)."""
    for _ in range(warmup):
        for fn in fns:
            fn()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, spent in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - t0)
    return tuple(statistics.median(t) for t in times)


def run_ranks(fn, world_size: int, *args):
    """Run module-level ``fn(*args)`` on ``world_size`` spawned gloo ranks; returns rank results.
    A rank that fails takes the others down (their queues time out) and the error is raised."""
    import multiprocessing as mp
    import tempfile

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as d:
        init = os.path.join(d, "rendezvous")
        procs = [
            ctx.Process(target=_rank_main, args=(fn, r, world_size, init, results, args))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        out = {}
        try:
            for _ in range(world_size):
                r, ok, payload = results.get(timeout=900)
                if not ok:
                    raise RuntimeError(f"rank {r} failed:\n{payload}")
                out[r] = payload
        finally:
            for p in procs:
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
    return [out[r] for r in range(world_size)]


def _rank_main(fn, rank, world_size, init, results, args):
    import traceback

    import torch
    import torch.distributed as dist

    # the cores this process may use (taskset), shared out: a core per rank when there are enough
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init}", rank=rank, world_size=world_size
        )
        import tp_ext  # noqa: F401

        results.put((rank, True, fn(*args)))
    except BaseException:  # noqa: BLE001
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def load_tp_ext() -> str:
    """Import tp_ext (registers its ops). If the package does not import (for example while an op
    is half-added), load the built library alone so the ops that exist can still be measured.
    Returns "" or the import error."""
    import glob

    import torch

    try:
        import tp_ext  # noqa: F401

        return ""
    except Exception as e:  # noqa: BLE001
        libs = glob.glob(os.path.join(ROOT, "tp_ext", "_C*.so"))
        if libs:
            torch.ops.load_library(libs[0])
        print(
            f"warning: import tp_ext failed ({type(e).__name__}: {e}); loaded {libs}",
            file=sys.stderr,
        )
        return f"{type(e).__name__}: {e}"
