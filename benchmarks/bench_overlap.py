"""Communication hidden behind compute (issue 19): tp_ext's MLP and Qwen2 block, forward + backward
at TP=2, with the fused, overlapped linear ops (tp_ext.comm.set_overlap(True)) against the same
layers with the unfused pairs (set_overlap(False)), in the same processes, steps interleaved.

1. Loopback: both ranks on this host over gloo (the shared-memory channel off, as the overlapped
   transfers go through the process group), and on the default group (channel on) for the
   unfused path's best case.
2. Throttled links, where communication is about as long as compute: each rank in its own
   network namespace, joined by a veth pair limited by tc to each --mbit rate (default 300 and
   600 Mbit/s: the MLP's transfers match its compute near 300, the block's near 600;
   benchmarks/netns.py, needs root), the channel off.
3. The TP MLP against PyTorch's DTensor TP (gate/up ColwiseParallel, down RowwiseParallel) at the
   block benchmark's small and large shapes: on loopback with tp_ext's defaults (on CPU: the
   unfused path and the shared-memory channel), and on the throttled link with the overlap on.

Metric: median step time (ratio = fused / unfused, or tp_ext / DTensor).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH = "overlap"
# hidden, heads, kv_heads, head_dim, intermediate, tokens (batch 1)
MEDIUM = (1024, 8, 4, 128, 2816, 1024)
DTENSOR_SHAPES = {"small": (256, 704, 16), "large": (2048, 5632, 512)}  # hidden, inter, seq


def _layers(kind, sp, group):
    from tp_ext.layers import ParallelMLP, ParallelTransformerBlock

    hidden, heads, kv, hd, inter, _ = MEDIUM
    torch.manual_seed(0)
    if kind == "mlp":
        return ParallelMLP(hidden, inter, sequence_parallel=sp, tp_group=group)
    return ParallelTransformerBlock(
        hidden, heads, kv, inter, hd, sequence_parallel=sp, tp_group=group
    )


def _interleaved(steps, variants):
    """Median seconds per variant; variants alternate within each repeat (noise hits all)."""
    import torch.distributed as dist

    times = {k: [] for k in variants}
    for i in range(steps + 2):
        for key, fn in variants.items():
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            if i >= 2:
                times[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _overlap_steps(steps, shm):
    """{(kind, sp, overlap): median step s} on this rank, over gloo only unless ``shm``."""
    import torch.distributed as dist

    from tp_ext import comm

    torch.set_num_threads(1)
    w, r = dist.get_world_size(), dist.get_rank()
    comm.set_shared_memory(shm)
    group = dist.new_group(list(range(w)))
    comm.all_reduce(torch.ones(1), group=group)  # the group's transport is decided now
    tokens = MEDIUM[-1]
    variants = {}
    for kind in ("mlp", "block"):
        for sp in (False, True):
            layer = _layers(kind, sp, group)
            local = tokens // w if sp else tokens
            x = torch.randn(1, local, MEDIUM[0], generator=torch.Generator().manual_seed(r))
            x.requires_grad_()
            for overlap in (False, True):

                def step(layer=layer, x=x, overlap=overlap, sp=sp):
                    comm.set_overlap(overlap)
                    y = layer(x, seq_len=tokens) if sp else layer(x)
                    y.sum().backward()

                variants[f"{kind}|{sp}|{overlap}"] = step
    out = _interleaved(steps, variants)
    comm.set_overlap(None)
    return out


def _dtensor_mlp_steps(steps, overlap):
    """{(shape, impl): median s}: tp_ext's ParallelMLP (``overlap``: set_overlap's setting) vs
    DTensor TP of a plain MLP."""
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    from tp_ext import comm
    from tp_ext.layers import ParallelMLP

    torch.set_num_threads(1)
    comm.set_overlap(overlap)
    w = dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))

    class MLP(nn.Module):
        def __init__(self, hidden, inter):
            super().__init__()
            self.gate_proj = nn.Linear(hidden, inter, bias=False)
            self.up_proj = nn.Linear(hidden, inter, bias=False)
            self.down_proj = nn.Linear(inter, hidden, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    variants = {}
    for name, (hidden, inter, seq) in DTENSOR_SHAPES.items():
        x = torch.randn(1, seq, hidden, requires_grad=True)
        torch.manual_seed(0)
        ours = ParallelMLP(hidden, inter)
        plan = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                "down_proj": RowwiseParallel()}  # fmt: skip
        theirs = parallelize_module(MLP(hidden, inter), mesh, plan)

        def ours_step(m=ours, x=x):
            m(x).sum().backward()

        def theirs_step(m=theirs, x=x):
            y = m(x)
            (y.to_local() if hasattr(y, "to_local") else y).sum().backward()

        variants[f"{name}|tp_ext"] = ours_step
        variants[f"{name}|dtensor"] = theirs_step
    return _interleaved(steps, variants)


def _slowest(results):
    return {k: max(r[k] for r in results) for k in results[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument(
        "--mbit", type=float, nargs="*", default=[300.0, 600.0], help="throttled link rates"
    )
    args = parser.parse_args()
    from benchmarks import netns

    rows = []
    runs = {"loopback, gloo": _slowest(run_ranks(_overlap_steps, 2, args.steps, False))}
    runs["loopback, shared memory"] = _slowest(run_ranks(_overlap_steps, 2, args.steps, True))
    why = netns.why_not()
    links = {} if why else {f"{m:g} Mbit/s link (tc tbf)": m for m in args.mbit}
    if why:
        print(f"no throttled link here: {why}")
    for link, mbit in links.items():
        runs[link] = _slowest(
            netns.run_throttled(
                "benchmarks.bench_overlap", "_overlap_steps", mbit, args.steps, False
            )
        )
    for where, times in runs.items():
        for kind in ("mlp", "block"):
            for sp in ("False", "True"):
                fused, plain = times[f"{kind}|{sp}|True"], times[f"{kind}|{sp}|False"]
                case = (f"{kind} h={MEDIUM[0]} tokens={MEDIUM[-1]} TP=2"
                        f"{' SP' if sp == 'True' else ''}, {where}")  # fmt: skip
                metric = "step s, overlapped vs unfused"
                rows.append(dict(benchmark=BENCH, case=case, unit="s", value=fused,
                                 metric=metric, baseline=plain))  # fmt: skip
                print(f"{case}: {fused * 1e3:.1f} ms vs {plain * 1e3:.1f} ms "
                      f"({plain / fused:.2f}x faster)")  # fmt: skip
    # as a user runs it: the default (CPU: unfused, the shared-memory channel) on one host, the
    # overlap switched on across a network link
    versus = {"loopback": _slowest(run_ranks(_dtensor_mlp_steps, 2, args.steps, None))}
    for link, mbit in links.items():
        versus[link] = _slowest(
            netns.run_throttled(
                "benchmarks.bench_overlap", "_dtensor_mlp_steps", mbit, args.steps, True
            )
        )
    for where, times in versus.items():
        for name, (hidden, inter, seq) in DTENSOR_SHAPES.items():
            ours, theirs = times[f"{name}|tp_ext"], times[f"{name}|dtensor"]
            case = f"MLP {name} h={hidden} i={inter} s={seq} TP=2, {where}"
            rows.append(dict(benchmark=BENCH, case=case, metric="step s vs DTensor TP",
                             unit="s", value=ours, baseline=theirs))  # fmt: skip
            print(f"{case}: tp_ext {ours * 1e3:.2f} ms vs DTensor {theirs * 1e3:.2f} ms "
                  f"({ours / theirs:.2f}x)")  # fmt: skip
    append_rows(rows)


if __name__ == "__main__":
    main()
