"""tp_ext's fused CPU kernels vs the eager PyTorch composites they replace, and its GEMM op
(``tp_ext::linear``: oneDNN for float32 on CPU) vs ``F.linear`` (aten::mm: MKL).

Shapes are one rank's at Qwen2-72B, TP=8 (hidden 8192, MLP 3696 per rank, 8 query heads and 1 KV
head of 128 per rank, vocabulary 19008 per rank), with token counts that fit a 2-core CPU.
Metrics: median time of forward and of forward+backward (ratio = tp_ext / eager, so < 1 is
faster; the two are called alternately), and peak memory of forward+backward.

Peak memory: each variant runs in a child process started with ``MALLOC_MMAP_THRESHOLD_=65536``
(so every tensor buffer is its own mmap and goes back to the OS when freed); before a variant the
child resets the peak resident set (``/proc/self/clear_refs`` <- 5) and afterwards reads VmHWM.
Peak = VmHWM - VmRSS just before the call, i.e. the bytes the variant itself touched on top of its
inputs. Cross-entropy compares the vocab-parallel loss on one rank's shard (a gloo group of one,
so the real op runs) with gathering the full logits (vocab 152064) and calling F.cross_entropy.

Ops that are not registered yet are recorded as ``missing``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.common import append_rows, bench_pair, load_tp_ext  # noqa: E402

HIDDEN, INTER, HEAD_DIM, Q_HEADS, KV_HEADS = 8192, 3696, 128, 8, 1
VOCAB_SHARD, VOCAB, TP = 19008, 152064, 8
EPS = 1e-6
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
BENCH = "kernels"


def _op(name):
    return getattr(torch.ops.tp_ext, name) if hasattr(torch.ops.tp_ext, name) else None


# ---- eager composites (what the layers do without the kernels) ----------------------------------


def eager_rms_norm(x, w, eps=EPS):
    dtype = x.dtype
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


def eager_add_rms_norm(x, res, w, eps=EPS):
    h = x + res
    return eager_rms_norm(h, w, eps), h


def eager_swiglu(gate_up):
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def _rotate_half(x):
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def eager_rotary(q, k, cos, sin):
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


# ---- cases: name -> (make inputs, eager fn, op name, differentiable input indices) -------------


def _inputs(kernel, tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    if kernel == "linear":  # the MLP's down projection on one rank: [tokens, 3696] x [3696, 8192]
        return [r(tokens, INTER), r(HIDDEN, INTER)]
    if kernel == "rms_norm":
        return [r(tokens, HIDDEN), r(HIDDEN), EPS]
    if kernel == "add_rms_norm":
        return [r(tokens, HIDDEN), r(tokens, HIDDEN), r(HIDDEN), EPS]
    if kernel == "swiglu":
        return [r(tokens, 2 * INTER)]
    if kernel == "rotary_embedding":
        batch, seq = 1, tokens
        pos = torch.arange(seq).float()[:, None] / (
            10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM)
        )
        emb = torch.cat((pos, pos), -1)[None]
        return [
            r(batch, Q_HEADS, seq, HEAD_DIM),
            r(batch, KV_HEADS, seq, HEAD_DIM),
            emb.cos().to(dtype),
            emb.sin().to(dtype),
        ]
    raise KeyError(kernel)


EAGER = {
    "linear": F.linear,
    "rms_norm": eager_rms_norm,
    "add_rms_norm": eager_add_rms_norm,
    "swiglu": eager_swiglu,
    "rotary_embedding": eager_rotary,
}
GRAD_ARGS = {
    "linear": (0, 1),
    "rms_norm": (0, 1),
    "add_rms_norm": (0, 1, 2),
    "swiglu": (0,),
    "rotary_embedding": (0, 1),
}


def _step(fn, args, backward):
    """One call; with backward, the grads of the differentiable args for a fixed random upstream
    gradient per output (contiguous, in the output's dtype, as a following matmul hands back)."""
    out = fn(*args)
    if backward:
        outs = out if isinstance(out, (tuple, list)) else (out,)
        torch.autograd.backward(outs, [_upstream_grad(o) for o in outs])
        for a in args:
            if isinstance(a, torch.Tensor):
                a.grad = None
    return out


_UPSTREAM = {}


def _upstream_grad(out):
    """The same random gradient for every call with this shape and dtype (made once, not timed)."""
    key = (tuple(out.shape), out.dtype)
    if key not in _UPSTREAM:
        g = torch.Generator().manual_seed(1)
        _UPSTREAM[key] = torch.randn(out.shape, generator=g).to(out.dtype)
    return _UPSTREAM[key]


def _prepared(kernel, tokens, dtype, backward):
    args = _inputs(kernel, tokens, dtype)
    if backward:
        for i in GRAD_ARGS[kernel]:
            args[i].requires_grad_()
    return args


def time_kernels(tokens_list, dtypes, repeats, kernels=tuple(EAGER)):
    rows = []
    for kernel, eager in EAGER.items():
        if kernel not in kernels:
            continue
        op = _op(kernel)
        for dname in dtypes:
            for tokens in tokens_list:
                case = f"{kernel} {dname} tokens={tokens}"
                if op is None:
                    rows.append(
                        dict(benchmark=BENCH, case=case, metric="status", value="missing", unit="")
                    )
                    print(f"{case}: op missing")
                    continue
                for backward in (False, True):
                    metric = "fwd+bwd time" if backward else "fwd time"
                    args = _prepared(kernel, tokens, DTYPES[dname], backward)
                    try:
                        with torch.no_grad() if not backward else torch.enable_grad():
                            t_op, t_eager = bench_pair(
                                lambda: _step(op, args, backward),
                                lambda: _step(eager, args, backward),
                                2,
                                repeats,
                            )
                    except Exception as e:  # noqa: BLE001 - an op with another signature
                        rows.append(
                            dict(
                                benchmark=BENCH,
                                case=case,
                                metric=metric,
                                value=f"error: {type(e).__name__}",
                                unit="",
                            )
                        )
                        print(f"{case} {metric}: error {e}")
                        continue
                    rows.append(
                        dict(
                            benchmark=BENCH,
                            case=case,
                            metric=metric,
                            value=t_op * 1e3,
                            unit="ms",
                            baseline=t_eager * 1e3,
                        )
                    )
                    print(
                        f"{case:40s} {metric:13s} tp_ext {t_op * 1e3:8.3f} ms  eager "
                        f"{t_eager * 1e3:8.3f} ms  ratio {t_op / t_eager:.3f}"
                    )
    return rows


# ---- peak memory, in a child process ------------------------------------------------------------


def _status_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    raise KeyError(field)


def _peak_of(fn):
    """Bytes of resident memory ``fn`` added at its peak, on top of what existed before."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_kb("VmRSS")
    fn()
    return (_status_kb("VmHWM") - before) * 1024


def _ce_gather(shard, target):
    # all-gather of TP equal shards (cat's backward returns slices, as the gather's split does)
    full = torch.cat([shard] * TP, -1)
    F.cross_entropy(full.float(), target).backward()


def _ce_tp_ext(shard, target):
    import torch.distributed as dist

    # the op under tp_ext.layers.vocab_parallel_cross_entropy, on a TP group of one
    pg = dist.group.WORLD
    loss = torch.ops.tp_ext.vocab_parallel_cross_entropy(
        shard, target, -100, 0.0, pg.group_name, 1, 0
    )
    (loss.sum() / target.numel()).backward()


def memory_worker(spec):
    """Runs in the child: measures every requested case, prints JSON lines."""
    torch.set_num_threads(1)
    for kind, kernel, dname, tokens in spec:
        dtype = DTYPES[dname]
        try:
            if kind == "ce":
                import torch.distributed as dist

                if not dist.is_initialized():
                    import tempfile

                    dist.init_process_group(
                        "gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1
                    )
                    load_tp_ext()
                g = torch.Generator().manual_seed(0)
                shard = torch.randn(tokens, VOCAB_SHARD, generator=g).to(dtype)
                shard.requires_grad_()
                target = torch.randint(0, VOCAB_SHARD, (tokens,), generator=g)
                fn = _ce_tp_ext if kernel == "tp_ext" else _ce_gather
                fn(shard, target)  # warm up (lazy init), then measure
                shard.grad = None
                peak = _peak_of(lambda: fn(shard, target))
            else:
                load_tp_ext()
                fn = EAGER[kernel] if kind == "eager" else _op(kernel)
                if fn is None:
                    print(json.dumps([kind, kernel, dname, tokens, None]), flush=True)
                    continue
                args = _prepared(kernel, tokens, dtype, True)
                _step(fn, args, True)
                peak = _peak_of(lambda: _step(fn, args, True))
            print(json.dumps([kind, kernel, dname, tokens, peak]), flush=True)
        except Exception as e:  # noqa: BLE001
            print(
                json.dumps([kind, kernel, dname, tokens, f"error: {type(e).__name__}: {e}"]),
                flush=True,
            )


def measure_memory(spec):
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    out = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--memory-worker", json.dumps(spec)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode:
        print(out.stderr[-3000:], file=sys.stderr)
    results = {}
    for line in out.stdout.splitlines():
        if line.startswith("["):
            kind, kernel, dname, tokens, peak = json.loads(line)
            results[(kind, kernel, dname, tokens)] = peak
    return results


def memory_rows(tokens, ce_tokens, dtypes, kernels=tuple(EAGER), cross_entropy=True):
    spec = [[kind, k, d, tokens] for k in kernels for d in dtypes for kind in ("op", "eager")]
    if cross_entropy:
        spec += [["ce", v, d, ce_tokens] for d in dtypes for v in ("tp_ext", "gather")]
    res = measure_memory(spec)
    rows = []
    for k in kernels:
        for d in dtypes:
            case = f"{k} {d} tokens={tokens}"
            mine, base = res.get(("op", k, d, tokens)), res.get(("eager", k, d, tokens))
            if not isinstance(mine, int) or not isinstance(base, int):
                rows.append(
                    dict(
                        benchmark=BENCH,
                        case=case,
                        metric="fwd+bwd peak memory",
                        value="missing" if mine is None else str(mine),
                        unit="",
                    )
                )
                continue
            rows.append(
                dict(
                    benchmark=BENCH,
                    case=case,
                    metric="fwd+bwd peak memory",
                    value=mine / 2**20,
                    unit="MiB",
                    baseline=base / 2**20,
                )
            )
    for d in dtypes if cross_entropy else ():
        case = f"cross_entropy {d} tokens={ce_tokens} vocab={VOCAB_SHARD}/{VOCAB}"
        mine, base = (
            res.get(("ce", "tp_ext", d, ce_tokens)),
            res.get(("ce", "gather", d, ce_tokens)),
        )
        if isinstance(mine, int) and isinstance(base, int):
            rows.append(
                dict(
                    benchmark=BENCH,
                    case=case,
                    metric="fwd+bwd peak memory",
                    value=mine / 2**20,
                    unit="MiB",
                    baseline=base / 2**20,
                )
            )
        else:
            rows.append(
                dict(
                    benchmark=BENCH,
                    case=case,
                    metric="fwd+bwd peak memory",
                    value=str(mine if mine is not None else base),
                    unit="",
                )
            )
    for r in rows:
        if r.get("unit") == "MiB":
            print(
                f"{r['case']:48s} peak tp_ext {r['value']:9.1f} MiB  baseline "
                f"{r['baseline']:9.1f} MiB  ratio {r['value'] / max(r['baseline'], 1e-9):.3f}"
            )
        else:
            print(f"{r['case']:48s} peak: {r['value']}")
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument(
        "--kernels",
        nargs="+",
        default=list(EAGER),
        choices=list(EAGER),
        help="time only these kernels",
    )
    p.add_argument("--memory-tokens", type=int, default=1024)
    p.add_argument("--ce-tokens", type=int, default=512)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="intra-op threads (default: torch's, i.e. one per core)",
    )
    p.add_argument(
        "--no-cross-entropy", action="store_true", help="skip the cross-entropy memory comparison"
    )
    p.add_argument("--no-save", action="store_true", help="print only, do not append to the CSV")
    p.add_argument("--memory-worker", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.memory_worker:
        memory_worker(json.loads(a.memory_worker))
        return
    load_tp_ext()
    rows = time_kernels(a.tokens, a.dtypes, a.repeats, a.kernels)
    rows += memory_rows(
        a.memory_tokens, a.ce_tokens, a.dtypes, a.kernels, cross_entropy=not a.no_cross_entropy
    )
    if not a.no_save:
        append_rows(rows)


if __name__ == "__main__":
    main()
