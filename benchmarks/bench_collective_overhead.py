"""Host overhead of one collective call on a tiny tensor (1 element, fp32, gloo on CPU), at world
sizes 1 and 2: tp_ext's ops vs DTensor and functional collectives. Median over many calls of
the wall time per call, microseconds (ratio = tp_ext / baseline). Also one 4 MiB all-reduce
(1M fp32), where bandwidth rather than overhead counts."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH = "collective_overhead"


def _per_call_us(fn, iters, chunks=20):
    """Median over ``chunks`` of the mean time per call in a chunk of iters // chunks calls."""
    for _ in range(20):
        fn()
    n = max(1, iters // chunks)
    samples = []
    for _ in range(chunks):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def _worker(iters):
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from benchmarks.common import load_tp_ext

    load_tp_ext()
    w = dist.get_world_size()
    pg = dist.group.WORLD
    name = pg.group_name
    mesh = init_device_mesh("cpu", (w,))
    x = torch.ones(1)
    xg = torch.ones(1, requires_grad=True)
    partial = DTensor.from_local(x, mesh, [Partial()], run_check=False)
    cases = {
        "tp_ext all_reduce": lambda: torch.ops.tp_ext.all_reduce(x, "sum", name, w),
        "tp_ext reduce_from_tp": lambda: torch.ops.tp_ext.reduce_from_tp(x, name, w),
        "tp_ext copy_to_tp fwd+bwd": lambda: torch.ops.tp_ext.copy_to_tp(xg, name, w).backward(),
        "funcol all_reduce": lambda: funcol.all_reduce(x, "sum", pg).wait(),
        "dist.all_reduce": lambda: dist.all_reduce(x.clone()),
        "DTensor Partial->Replicate": lambda: partial.redistribute(mesh, [Replicate()]).to_local(),
        "torch identity fwd+bwd": lambda: (xg * 1).backward(),
    }
    big = torch.ones(1 << 20)
    big_cases = {
        "tp_ext all_reduce 4 MiB": lambda: torch.ops.tp_ext.all_reduce(big, "sum", name, w),
        "funcol all_reduce 4 MiB": lambda: funcol.all_reduce(big, "sum", pg).wait(),
    }
    out = {}
    for label, fn in list(cases.items()) + list(big_cases.items()):
        dist.barrier()
        out[label] = _per_call_us(fn, iters if label in cases else max(20, iters // 20))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    pairs = {
        "tp_ext all_reduce": "funcol all_reduce",
        "tp_ext reduce_from_tp": "DTensor Partial->Replicate",
        "tp_ext copy_to_tp fwd+bwd": "torch identity fwd+bwd",
        "tp_ext all_reduce 4 MiB": "funcol all_reduce 4 MiB",
    }
    rows = []
    for w in a.world_sizes:
        res = run_ranks(_worker, w, a.iters)[0]
        for label, us in res.items():
            base = None
            if label in pairs:
                base = res[pairs[label]]
            elif label in ("DTensor Partial->Replicate", "dist.all_reduce"):
                base = res["tp_ext all_reduce"]
            rows.append(
                dict(
                    benchmark=BENCH,
                    case=f"{label} ws={w}",
                    metric="time per call",
                    value=us,
                    unit="us",
                    baseline=base,
                )
            )
            print(f"ws={w} {label:30s} {us:9.1f} us" + (f"  (vs {base:.1f} us)" if base else ""))
    if not a.no_save:
        append_rows(rows)


if __name__ == "__main__":
    main()
