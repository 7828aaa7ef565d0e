"""GPU benchmarks (needs tp_ext built with CUDA; builds nothing). Appends to benchmarks/results.csv.

1. Kernels in bf16 at Qwen2-72B TP=8 per-rank shapes: tp_ext op vs the eager composite and vs
   torch.compile of it; achieved bytes/s as a fraction of a device-to-device ``copy_`` of the
   same number of bytes, measured in the same run (target >= 0.85 for RMSNorm, SwiGLU, RoPE).
2. The per-rank Qwen2-72B decoder layer at TP=8 (hidden 8192, 8 query heads, 1 KV head, MLP 3696)
   as rank 0 of 8, with communication stubbed by the fake process group: forward+backward time
   and TFLOP/s vs a plain bf16 matmul running at its measured rate on the layer's largest GEMM.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import append_rows, load_tp_ext  # noqa: E402

BENCH = "gpu"
HIDDEN, INTER, HEAD_DIM, Q_HEADS, KV_HEADS, TP = 8192, 3696, 128, 8, 1, 8


def cuda_time(fn, warmup=5, repeats=20):
    """Median seconds per call, by CUDA events."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def copy_seconds(nbytes):
    """Time of a device-to-device copy that reads and writes ``nbytes`` in total."""
    n = nbytes // 2 // 2  # bf16 elements of a tensor copied once (read + write)
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src))


def kernel_cases(tokens):
    from benchmarks.bench_kernels import EAGER

    dt, dev = torch.bfloat16, "cuda"

    def r(*s):
        return torch.randn(*s, dtype=dt, device=dev)

    pos = torch.arange(tokens, device=dev).float()[:, None] / (
        10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)
    )
    emb = torch.cat((pos, pos), -1)[None]
    e = 2  # bytes per element
    T, H, I, D = tokens, HIDDEN, INTER, HEAD_DIM  # noqa: E741 (I: the MLP width)
    return {  # name: (args, bytes read + written by an ideal kernel)
        "rms_norm": ([r(T, H), r(H), 1e-6], (2 * T * H + H) * e),
        "add_rms_norm": ([r(T, H), r(T, H), r(H), 1e-6], (4 * T * H + H) * e),
        "swiglu": ([r(T, 2 * I)], 3 * T * I * e),
        "rotary_embedding": (
            [r(1, Q_HEADS, T, D), r(1, KV_HEADS, T, D), emb.cos().to(dt), emb.sin().to(dt)],
            (2 * (Q_HEADS + KV_HEADS) * T * D + 2 * T * D) * e,
        ),
    }, EAGER


def bench_kernels(tokens, repeats):
    cases, eager = kernel_cases(tokens)
    rows = []
    for name, (args, nbytes) in cases.items():
        case = f"{name} bf16 tokens={tokens}"
        t_copy = copy_seconds(nbytes)
        fns = {"eager": eager[name], "torch.compile": torch.compile(eager[name])}
        if hasattr(torch.ops.tp_ext, name):
            fns["tp_ext"] = getattr(torch.ops.tp_ext, name)
        else:
            rows.append(dict(benchmark=BENCH, case=case, metric="status", value="missing", unit=""))
        t = {}
        for label, fn in fns.items():
            try:
                t[label] = cuda_time(lambda: fn(*args), repeats=repeats)
            except Exception as e:  # noqa: BLE001
                print(f"{case} {label}: error {e}")
                rows.append(
                    dict(
                        benchmark=BENCH,
                        case=case,
                        metric=f"{label} time",
                        value=f"error: {type(e).__name__}",
                        unit="",
                    )
                )
        for label, s in t.items():
            rows.append(
                dict(
                    benchmark=BENCH,
                    case=case,
                    metric=f"{label} bytes/s vs copy",
                    value=nbytes / s / 1e9,
                    unit="GB/s",
                    baseline=nbytes / t_copy / 1e9,
                )
            )
        if "tp_ext" in t:
            for label in ("eager", "torch.compile"):
                if label in t:
                    rows.append(
                        dict(
                            benchmark=BENCH,
                            case=case,
                            metric=f"time vs {label}",
                            value=t["tp_ext"] * 1e6,
                            unit="us",
                            baseline=t[label] * 1e6,
                        )
                    )
        print(
            case,
            {k: f"{v * 1e6:.1f} us" for k, v in t.items()},
            f"copy {t_copy * 1e6:.1f} us, ideal bytes {nbytes}",
        )
    return rows


def layer_flops(tokens):
    T, H, D, I = tokens, HIDDEN, HEAD_DIM, INTER  # noqa: E741 (I: the MLP width)
    fwd = (
        2 * T * H * (Q_HEADS + 2 * KV_HEADS) * D  # qkv
        + 2 * T * Q_HEADS * D * H  # o
        + 2 * T * H * 2 * I
        + 2 * T * I * H  # gate_up, down
        + 2 * T * T * Q_HEADS * D
    )  # causal QK^T and PV (half of the full 4 T^2 h d)
    return 3 * fwd  # forward + backward


def bench_layer(tokens, repeats, device="cuda"):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from tp_ext.layers import ParallelTransformerBlock

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    dt = torch.bfloat16
    rows = []
    for sp in (False, True):
        torch.manual_seed(0)
        blk = ParallelTransformerBlock(
            HIDDEN,
            Q_HEADS * TP,
            KV_HEADS * TP,
            INTER * TP,
            HEAD_DIM,
            sequence_parallel=sp,
            device=device,
            dtype=dt,
        )
        local = tokens // TP if sp else tokens
        x = torch.randn(1, local, HIDDEN, device=device, dtype=dt, requires_grad=True)

        def step():
            y = blk(x, seq_len=tokens) if sp else blk(x)
            y.sum().backward()
            x.grad = None
            blk.zero_grad(set_to_none=True)

        t = cuda_time(step, warmup=3, repeats=repeats)
        flops = layer_flops(tokens)
        a = torch.randn(tokens, HIDDEN, device=device, dtype=dt)
        b = torch.randn(HIDDEN, 2 * INTER, device=device, dtype=dt)
        t_mm = cuda_time(lambda: a @ b, repeats=repeats)
        mm_rate = 2 * tokens * HIDDEN * 2 * INTER / t_mm
        case = f"qwen2-72b layer tp=8 rank0 bf16 tokens={tokens}{' sp' if sp else ''}"
        rows.append(
            dict(
                benchmark=BENCH,
                case=case,
                metric="fwd+bwd time",
                value=t * 1e3,
                unit="ms",
                baseline=flops / mm_rate * 1e3,
            )
        )
        rows.append(
            dict(
                benchmark=BENCH,
                case=case,
                metric="TFLOP/s",
                value=flops / t / 1e12,
                unit="TFLOP/s",
                baseline=mm_rate / 1e12,
            )
        )
        print(
            f"{case}: {t * 1e3:.2f} ms, {flops / t / 1e12:.1f} TFLOP/s vs matmul "
            f"{mm_rate / 1e12:.1f} TFLOP/s"
        )
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens for the kernels")
    p.add_argument("--layer-tokens", type=int, default=4096, help="tokens for the layer")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (and tp_ext built with CUDA)")
    err = load_tp_ext()
    rows = bench_kernels(a.tokens, a.repeats)
    if not a.skip_layer:
        if err:
            print(f"skipping the layer: tp_ext does not import ({err})")
        else:
            rows += bench_layer(a.layer_tokens, a.repeats)
    if not a.no_save:
        append_rows(rows)


if __name__ == "__main__":
    main()
