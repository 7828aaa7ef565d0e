"""GPU benchmarks (needs tp_ext built with CUDA; builds nothing). Appends to benchmarks/results.csv.

1. Kernels at Qwen2-72B TP=8 per-rank shapes (hidden 8192, MLP 3696, 8 query heads and 1 KV head
   of 128, vocabulary shard 19008), in bf16 and fp32, forward and forward+backward: RMSNorm,
   RMSNorm with the residual add, SwiGLU, RoPE and the local cross-entropy (one rank's vocabulary
   shard through ``vocab_parallel_cross_entropy`` on a fake TP=8 group: the real local kernels,
   collectives that move nothing). Each against the eager composite and torch.compile of it,
   and its ideal bytes (each input read once, each output written once) as a fraction of a
   device-to-device ``copy_`` of the same bytes, measured in the same run (target >= 0.85): per
   wall time (what a caller waits, launch gaps included) and per GPU busy time (the kernels alone,
   from torch.profiler; small kernels behind autograd are otherwise timed by the CPU).
2. Vocab-parallel cross-entropy peak memory (vocabulary 152,064 over 8 ranks, 8k tokens, bf16,
   forward+backward) against gathering the logits and calling ``F.cross_entropy`` (target <= 0.25).
3. The per-rank Qwen2-72B decoder layer at TP=8 (hidden 8192, 8 query heads, 1 KV head, MLP 3696)
   as rank 0 of 8, with communication stubbed by the fake process group: forward+backward time
   and TFLOP/s vs a plain bf16 matmul running at its measured rate on the layer's largest GEMM.
4. Mixture of experts at Mixtral-8x7B shapes (hidden 4096, expert MLP 14336, top-2 of 8), bf16:
   the permutation ops (moe_route + moe_permute + moe_unpermute, forward+backward) against the
   eager way (stable argsort, index gather, index_copy, weighted sum), and ``ExpertParallelMoE``
   at EP=1 (one GPU holds every expert) against the same layer built from eager pieces (the
   torchtitan recipe with its all-to-alls at EP=1 being no-ops), same router and weights.
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import append_rows, bench, load_tp_ext  # noqa: E402

BENCH = "gpu"
HIDDEN, INTER, HEAD_DIM, Q_HEADS, KV_HEADS, TP = 8192, 3696, 128, 8, 1, 8
VOCAB = 152064
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


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


def device_seconds(fn, repeats=10):
    """GPU time per call: the summed durations of the kernels (and device copies or fills) ``fn``
    launches, from torch.profiler. Unlike the wall time of ``cuda_time`` it leaves out the gaps
    while the GPU waits for the CPU (dispatch, autograd), so it is the kernels' own bandwidth."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeats):
            fn()
        torch.cuda.synchronize()
    busy = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == DeviceType.CUDA)
    return busy / 1e6 / repeats


def copy_seconds(nbytes):
    """Time of a device-to-device copy that reads and writes ``nbytes`` in total."""
    n = nbytes // 2 // 2  # bf16 elements of a tensor copied once (read + write)
    src = torch.empty(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src))


def init_fake_tp():
    """Rank 0 of a fake TP=8 process group: tp_ext's ops run their real local kernels and the
    collectives move nothing, so one GPU times one rank's share of the work."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=TP)
    return dist.group.WORLD


def eager_local_cross_entropy(logits, target):
    """The local shard's loss terms the eager way: F.cross_entropy over the shard (the same
    logsumexp and target pick; its reads and writes are what a local kernel must do)."""
    return F.cross_entropy(logits.float(), target, reduction="none")


def kernel_cases(tokens, ce_tokens, dtype):
    """name: (fn, eager fn, args, differentiable arg indices, ideal bytes fwd, ideal bytes bwd)."""
    from benchmarks.bench_kernels import EAGER
    from tp_ext.layers import vocab_parallel_cross_entropy

    group = init_fake_tp()
    e = torch.finfo(dtype).bits // 8
    dev = "cuda"

    def r(*s):
        return torch.randn(*s, dtype=dtype, device=dev)

    pos = torch.arange(tokens, device=dev).float()[:, None] / (
        10000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM)
    )
    emb = torch.cat((pos, pos), -1)[None]
    T, H, I, D = tokens, HIDDEN, INTER, HEAD_DIM  # noqa: E741 (I: the MLP width)
    V = VOCAB // TP
    qk = (Q_HEADS + KV_HEADS) * T * D
    ops = torch.ops.tp_ext
    # ids inside this shard: on the fake group the vocabulary is the shard (sizes are all-reduced)
    target = torch.randint(0, V, (ce_tokens,), device=dev)
    return {
        # rms_norm: read x, write y | read dy, x, write dx (dw: one row per block, negligible)
        "rms_norm": (
            ops.rms_norm,
            EAGER["rms_norm"],
            [r(T, H), r(H), 1e-6],
            (0, 1),
            2 * T * H * e,
            3 * T * H * e,
        ),
        # add_rms_norm: read x, res, write y, h | read dy, dh, h, write dx (= dres)
        "add_rms_norm": (
            ops.add_rms_norm,
            EAGER["add_rms_norm"],
            [r(T, H), r(T, H), r(H), 1e-6],
            (0, 1, 2),
            4 * T * H * e,
            4 * T * H * e,
        ),
        # swiglu: read gate|up, write y | read dy, gate|up, write d(gate|up)
        "swiglu": (ops.swiglu, EAGER["swiglu"], [r(T, 2 * I)], (0,), 3 * T * I * e, 5 * T * I * e),
        # rotary: read q, k, cos, sin, write q, k | the same for the gradients
        "rotary_embedding": (
            ops.rotary_embedding,
            EAGER["rotary_embedding"],
            [r(1, Q_HEADS, T, D), r(1, KV_HEADS, T, D), emb.cos().to(dtype), emb.sin().to(dtype)],
            (0, 1),
            (2 * qk + 2 * T * D) * e,
            (2 * qk + 2 * T * D) * e,
        ),
        # local cross-entropy: read the logits shard | read it again, write its gradient
        "cross_entropy_local": (
            lambda x, t: vocab_parallel_cross_entropy(x, t, group, reduction="none"),
            eager_local_cross_entropy,
            [r(ce_tokens, V), target],
            (0,),
            ce_tokens * V * e,
            2 * ce_tokens * V * e,
        ),
    }


def _step(fn, args, grads, backward):
    out = fn(*args)
    if backward:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        torch.autograd.backward(outs, grads)
        for a in args:  # a fresh .grad each step: accumulating would add a pass over it
            if isinstance(a, torch.Tensor):
                a.grad = None
    return out


def bench_kernels(tokens, ce_tokens, repeats, dtypes):
    rows = []
    for dname in dtypes:
        dtype = DTYPES[dname]
        for name, (op, eager, args, diff, fwd_bytes, bwd_bytes) in kernel_cases(
            tokens, ce_tokens, dtype
        ).items():
            case = f"{name} {dname} tokens={ce_tokens if 'cross' in name else tokens}"
            fns = {"tp_ext": op, "eager": eager, "torch.compile": torch.compile(eager)}
            for backward in (False, True):
                nbytes = fwd_bytes + (bwd_bytes if backward else 0)
                t_copy = copy_seconds(nbytes)
                x = [
                    a.detach().requires_grad_(backward) if i in diff else a
                    for i, a in enumerate(args)
                ]
                with torch.enable_grad() if backward else torch.no_grad():
                    outs = op(*x)
                outs = outs if isinstance(outs, (tuple, list)) else (outs,)
                grads = [torch.randn_like(o) for o in outs]
                t = {}
                for label, fn in fns.items():
                    try:
                        with torch.enable_grad() if backward else torch.no_grad():
                            t[label] = cuda_time(
                                lambda: _step(fn, x, grads, backward), repeats=repeats
                            )
                    except Exception as err:  # noqa: BLE001 - record it, keep measuring
                        print(f"{case} {label}: error {type(err).__name__}: {err}")
                        rows.append(
                            dict(
                                benchmark=BENCH,
                                case=case,
                                metric=f"{label} error",
                                value=type(err).__name__,
                                unit="",
                            )
                        )
                what = "fwd+bwd" if backward else "fwd"
                busy = {}  # GPU time alone: the kernels' bandwidth, without launch gaps
                for label, fn in fns.items():
                    if label in t:
                        with torch.enable_grad() if backward else torch.no_grad():
                            busy[label] = device_seconds(lambda: _step(fn, x, grads, backward))
                # bandwidth per wall time, and per GPU busy time ("kernel")
                for kind, seconds in (("", t), (" kernel", busy)):
                    for label, s in seconds.items():
                        rows.append(
                            dict(
                                benchmark=BENCH,
                                case=case,
                                metric=f"{what} {label}{kind} bytes/s vs copy",
                                value=nbytes / s / 1e9,
                                unit="GB/s",
                                baseline=nbytes / t_copy / 1e9,
                            )
                        )
                for label in ("eager", "torch.compile"):
                    if "tp_ext" in t and label in t:
                        rows.append(
                            dict(
                                benchmark=BENCH,
                                case=case,
                                metric=f"{what} time vs {label}",
                                value=t["tp_ext"] * 1e6,
                                unit="us",
                                baseline=t[label] * 1e6,
                            )
                        )
                print(
                    f"{case} {what}:",
                    {k: f"{v * 1e6:.1f} us ({nbytes / v / 1e9:.0f} GB/s)" for k, v in t.items()},
                    f"copy {nbytes / t_copy / 1e9:.0f} GB/s; GPU busy",
                    {k: f"{v * 1e6:.1f} us ({nbytes / v / 1e9:.0f} GB/s)" for k, v in busy.items()},
                    flush=True,
                )
    return rows


def bench_cross_entropy_memory(tokens):
    """Peak bytes allocated by forward+backward on top of the inputs: one rank's vocab-parallel
    loss on its bf16 shard against gathering the full logits and calling F.cross_entropy."""
    from tp_ext.layers import vocab_parallel_cross_entropy

    group = init_fake_tp()
    shard = torch.randn(tokens, VOCAB // TP, device="cuda", dtype=torch.bfloat16)
    # on the fake group the vocabulary the op sees is the shard's (it all-reduces shard sizes)
    local_target = torch.randint(0, VOCAB // TP, (tokens,), device="cuda")
    target = torch.randint(0, VOCAB, (tokens,), device="cuda")

    def ours(x):
        return vocab_parallel_cross_entropy(x, local_target, group)

    def gathered(x):
        # what all_gather hands back: every rank's shard side by side (autograd slices it back)
        full_logits = torch.cat([x] * TP, dim=-1)
        return F.cross_entropy(full_logits, target)

    peaks = {}
    for label, fn in (("tp_ext", ours), ("gather + F.cross_entropy", gathered)):
        x = shard.detach().clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn(x).backward()
        torch.cuda.synchronize()
        peaks[label] = torch.cuda.max_memory_allocated() - base
        del x
    case = f"vocab-parallel cross-entropy bf16 vocab={VOCAB} tp={TP} tokens={tokens}"
    print(case, {k: f"{v / 2**20:.0f} MiB" for k, v in peaks.items()})
    return [
        dict(
            benchmark=BENCH,
            case=case,
            metric="fwd+bwd peak memory vs gather + F.cross_entropy",
            value=peaks["tp_ext"] / 2**20,
            unit="MiB",
            baseline=peaks["gather + F.cross_entropy"] / 2**20,
        )
    ]


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
    from tp_ext.layers import ParallelTransformerBlock

    init_fake_tp()
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


# ---- 4. mixture of experts -------------------------------------------------------------------

MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K = 4096, 14336, 8, 2


def _moe_routing(tokens, device):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(tokens, MOE_EXPERTS, generator=g), -1)
    w, ids = torch.topk(probs, MOE_TOP_K, -1)
    return w.to(device), ids.to(device)


def _eager_unpermute(y, order, w):
    back = torch.empty_like(y).index_copy(0, order, y)  # index scatter (differentiable)
    return (back.view(w.shape[0], MOE_TOP_K, -1) * w.unsqueeze(-1).to(y.dtype)).sum(1)


class _Router(torch.nn.Module):
    def __init__(self, hidden, device, dtype):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.randn(MOE_EXPERTS, hidden, device=device, dtype=dtype) * 0.02
        )

    def forward(self, x):
        logits = F.linear(x, self.weight)
        w, ids = torch.topk(torch.softmax(logits.float(), -1), MOE_TOP_K, -1)
        return logits, w, ids


def _eager_moe(x, router, experts):
    """The MoE layer from eager pieces on one device (torchtitan's recipe at EP=1): argsort
    permutation, a GEMM pair per expert on its contiguous rows, index scatter, weighted sum."""
    _, w, ids = router(x)
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows = x[order // MOE_TOP_K]
    sizes = torch.bincount(flat, minlength=MOE_EXPERTS).tolist()
    outs = []
    for e, r in enumerate(rows.split(sizes)):
        gate, up = F.linear(r, experts.gate_up_proj[e]).chunk(2, -1)
        outs.append(F.linear(F.silu(gate) * up, experts.down_proj[e]))
    return _eager_unpermute(torch.cat(outs), order, w)


def bench_moe(tokens, repeats, device="cuda", hidden=MOE_HIDDEN, inter=MOE_INTER):
    from tp_ext import ops
    from tp_ext.layers import ExpertParallelMoE, ParallelExperts

    timer = cuda_time if device == "cuda" else functools.partial(bench, warmup=1)
    dt = torch.bfloat16
    rows = []
    torch.manual_seed(0)
    x = torch.randn(tokens, hidden, device=device, dtype=dt, requires_grad=True)
    w, ids = _moe_routing(tokens, device)
    w.requires_grad_()

    def ours_ops():
        row_map, _ = ops.moe_route(ids, MOE_EXPERTS)
        out = ops.moe_unpermute(ops.moe_permute(x, row_map, None, ids.numel()) * 1.5, row_map, w)
        out.sum().backward()
        x.grad = w.grad = None

    def eager_ops():
        order = torch.argsort(ids.flatten(), stable=True)
        _eager_unpermute(x[order // MOE_TOP_K] * 1.5, order, w).sum().backward()
        x.grad = w.grad = None

    t_ours, t_eager = timer(ours_ops, repeats=repeats), timer(eager_ops, repeats=repeats)
    case = f"moe permute ops T={tokens} H={hidden} top{MOE_TOP_K} of {MOE_EXPERTS} bf16"
    rows.append(_versus_eager(case, t_ours, t_eager))

    router = _Router(hidden, device, dt)
    experts = ParallelExperts(MOE_EXPERTS, hidden, inter, torch.nn.SiLU(), device=device, dtype=dt)
    layer = ExpertParallelMoE(router, experts)  # no EP group made: a group of one
    with torch.no_grad():
        torch.testing.assert_close(
            layer(x), _eager_moe(x, router, experts), rtol=2e-2, atol=2e-2
        )  # the same layer

    def step(fn):
        def run():
            fn(x).sum().backward()
            x.grad = None
            layer.zero_grad(set_to_none=True)

        return run

    t_ours = timer(step(layer), repeats=repeats)
    t_eager = timer(step(lambda t: _eager_moe(t, router, experts)), repeats=repeats)
    case = (f"ExpertParallelMoE ep=1 T={tokens} H={hidden} I={inter} top{MOE_TOP_K} of "
            f"{MOE_EXPERTS} bf16")  # fmt: skip
    rows.append(_versus_eager(case, t_ours, t_eager))
    return rows


def _versus_eager(case: str, ours: float, eager: float) -> dict:
    """The printed line and the CSV row of a fwd+bwd time against its eager baseline."""
    print(f"{case}: tp_ext {ours * 1e3:.3f} ms, eager {eager * 1e3:.3f} ms ({ours / eager:.2f}x)")
    return dict(benchmark=BENCH, case=case, metric="fwd+bwd time", value=ours * 1e3, unit="ms",
                baseline=eager * 1e3)  # fmt: skip


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=16384, help="tokens for the kernels")
    p.add_argument("--ce-tokens", type=int, default=8192, help="tokens for the cross-entropy")
    p.add_argument("--layer-tokens", type=int, nargs="+", default=[4096, 16384])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--skip-layer", action="store_true")
    p.add_argument("--moe-tokens", type=int, default=8192, help="tokens for the MoE part")
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu.py needs a CUDA device (and tp_ext built with CUDA)")
    err = load_tp_ext()
    if err:
        sys.exit(f"tp_ext does not import: {err}")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    save = (lambda rows: None) if a.no_save else append_rows
    # each part saved as it ends (a run cut short keeps what it measured); the quick parts first
    save(bench_cross_entropy_memory(a.ce_tokens))
    if not a.skip_layer:
        for tokens in a.layer_tokens:
            save(bench_layer(tokens, a.repeats))
    for dtype in a.dtypes:
        save(bench_kernels(a.tokens, a.ce_tokens, a.repeats, [dtype]))
    save(bench_moe(a.moe_tokens, a.repeats))


if __name__ == "__main__":
    main()
