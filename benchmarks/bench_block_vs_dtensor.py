"""A Qwen2 decoder block, forward + backward on CPU/gloo: tp_ext's ParallelTransformerBlock vs
PyTorch's own tensor parallelism (DTensor ``parallelize_module``) with the same weights, in the
same processes, at TP=2 and TP=4; with and without sequence parallelism.

The DTensor block is the torchtitan layout: separate q/k/v and gate/up projections
(ColwiseParallel), o/down RowwiseParallel, norms SequenceParallel in the SP variant, local heads
by ``view(b, s, -1, head_dim)``. Its weights are the reference's fused tensors split apart.

tp_ext runs twice: on the default group, whose small collectives take tp_ext's shared-memory
channel (ranks on one host), and on a group with that channel off, over gloo like DTensor.

Metrics per case: median step time (ratio = tp_ext / DTensor), the bytes each sends per rank
(ring bus bytes: all-reduce 2(w-1)/w of its tensor, all-gather / reduce-scatter (w-1)/w of the
full tensor) vs Megatron's minimum, 4 all-reduces of tokens x hidden per block (2 forward, 2
backward), and the relative error of each output vs the unsharded reference (tests/reference.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH = "block_vs_dtensor"
SHAPES = {  # name: hidden, heads, kv_heads, head_dim, intermediate, batch, seq
    "small": (256, 8, 4, 32, 704, 1, 16),
    "large": (2048, 16, 4, 128, 5632, 1, 512),
}


class DTBlock(nn.Module):
    """The reference block with unfused projections, so DTensor's even column splits keep whole
    heads (and gate/up units) on each rank."""

    def __init__(self, hidden, heads, kv_heads, head_dim, inter, eps=1e-6, theta=10000.0):
        super().__init__()
        from tests.reference import RefRMSNorm

        self.head_dim, self.theta = head_dim, theta
        self.rep = heads // kv_heads
        self.input_layernorm = RefRMSNorm(hidden, eps)
        self.post_attention_layernorm = RefRMSNorm(hidden, eps)
        self.q_proj = nn.Linear(hidden, heads * head_dim)
        self.k_proj = nn.Linear(hidden, kv_heads * head_dim)
        self.v_proj = nn.Linear(hidden, kv_heads * head_dim)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def load_ref(self, sd, heads, kv_heads):
        d = self.head_dim
        q, k, v = sd["self_attn.qkv_proj.weight"].split([heads * d, kv_heads * d, kv_heads * d])
        qb, kb, vb = sd["self_attn.qkv_proj.bias"].split([heads * d, kv_heads * d, kv_heads * d])
        gate, up = sd["mlp.gate_up_proj.weight"].chunk(2)
        self.load_state_dict(
            {
                "input_layernorm.weight": sd["input_layernorm.weight"],
                "post_attention_layernorm.weight": sd["post_attention_layernorm.weight"],
                "q_proj.weight": q,
                "q_proj.bias": qb,
                "k_proj.weight": k,
                "k_proj.bias": kb,
                "v_proj.weight": v,
                "v_proj.bias": vb,
                "o_proj.weight": sd["self_attn.o_proj.weight"],
                "gate_proj.weight": gate,
                "up_proj.weight": up,
                "down_proj.weight": sd["mlp.down_proj.weight"],
            }
        )

    def _rope(self, x, cos, sin):
        x1, x2 = x.chunk(2, -1)
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def attention(self, x):
        b, s, _ = x.shape
        d = self.head_dim
        q = self.q_proj(x).view(b, s, -1, d).transpose(1, 2)
        k = self.k_proj(x).view(b, s, -1, d).transpose(1, 2)
        v = self.v_proj(x).view(b, s, -1, d).transpose(1, 2)
        inv = 1.0 / (self.theta ** (torch.arange(0, d, 2, dtype=torch.float) / d))
        ang = torch.arange(s).float()[:, None] * inv
        emb = torch.cat((ang, ang), -1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        k, v = k.repeat_interleave(self.rep, 1), v.repeat_interleave(self.rep, 1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, s, -1))

    def mlp(self, y):
        return self.down_proj(F.silu(self.gate_proj(y)) * self.up_proj(y))

    def forward(self, x):
        attn = getattr(self, "attn_in", None) or self.attention
        mlp = getattr(self, "mlp_in", None) or self.mlp
        h = x + attn(self.input_layernorm(x))
        return h + mlp(self.post_attention_layernorm(h))


class _Sub(nn.Module):  # a module around the attention / MLP, for PrepareModuleInput
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def parallelize_dtensor(block: DTBlock, sp: bool, mesh):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {
        name: ColwiseParallel() for name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    }
    out = Shard(1) if sp else Replicate()
    plan["o_proj"] = RowwiseParallel(output_layouts=out)
    plan["down_proj"] = RowwiseParallel(output_layouts=out)
    if sp:
        plan["input_layernorm"] = SequenceParallel()
        plan["post_attention_layernorm"] = SequenceParallel()
    parallelize_module(block, mesh, plan)
    if sp:
        # one input feeds 3 (q/k/v) or 2 (gate/up) projections: gather it once, as torchtitan does
        for name, fn in (("attn_in", block.attention), ("mlp_in", block.mlp)):
            sub = _Sub(fn)
            parallelize_module(
                sub,
                mesh,
                PrepareModuleInput(
                    input_layouts=(Shard(1),),
                    desired_input_layouts=(Replicate(),),
                    use_local_output=True,
                ),
            )
            object.__setattr__(block, name, sub)  # not a submodule: no parameters twice
    return block


# ---- communication accounting for DTensor (the functional collectives it dispatches) -----------


def dtensor_comm_recorder():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.records = []  # (collective, bytes in tp_ext's CommStats convention)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
            if func.namespace in ("_c10d_functional", "c10d_functional"):
                t = args[0] if isinstance(args[0], torch.Tensor) else args[0][0]
                nbytes = t.numel() * t.element_size()
                if name.startswith("all_reduce"):
                    self.records.append(("all_reduce", nbytes))
                elif name.startswith("all_gather"):
                    self.records.append(("all_gather", out.numel() * out.element_size()))
                elif name.startswith("reduce_scatter"):
                    self.records.append(("reduce_scatter", nbytes))
                elif name.startswith("all_to_all"):
                    self.records.append(("all_to_all", nbytes))
                elif name.startswith("broadcast"):
                    self.records.append(("broadcast", nbytes))
            return out

        def bus_bytes(self, w):
            share = (w - 1) / w
            return sum(b * (2.0 if c == "all_reduce" else 1.0) * share for c, b in self.records)

        def counts(self):
            out = {}
            for c, _ in self.records:
                out[c] = out.get(c, 0) + 1
            return out

    return Recorder()


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _worker(shape_name, repeats, dtype_name):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    import tp_ext
    from tests.reference import RefBlock, random_state
    from tp_ext import comm
    from tp_ext.layers import ParallelTransformerBlock

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    hidden, heads, kv, hd, inter, batch, seq = SHAPES[shape_name]
    r, w = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (w,))

    ref = RefBlock(hidden, heads, kv, inter, hd)
    state = random_state(ref, 0)
    state = {k: v * (0.1 if v.dim() == 2 else 1.0) for k, v in state.items()}  # keep it tame
    ref.load_state_dict(state)
    ref.to(dtype)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(batch, seq, hidden, generator=g).to(dtype)
    x_ref = X.clone().requires_grad_()
    ref(x_ref).float().sum().backward()
    Y_ref_grad = x_ref.grad

    # tp_ext twice: on the default group, whose small collectives go through tp_ext's shared-memory
    # channel (all ranks on this host), and on a group made with the channel off, over gloo only
    # (the transport DTensor uses), so the table shows what each part is worth.
    comm.set_shared_memory(False)
    gloo_only = dist.new_group(list(range(w)))
    comm.all_reduce(torch.ones(1), group=gloo_only)  # the group decides now: gloo
    comm.set_shared_memory(True)
    variants = {}
    for sp in (False, True):
        for impl, group in (("tp_ext", None), ("tp_ext_gloo", gloo_only)):
            blk = ParallelTransformerBlock(
                hidden, heads, kv, inter, hd, sequence_parallel=sp, tp_group=group, dtype=dtype
            )
            blk.load_full_state_dict({k: v.to(dtype) for k, v in ref.state_dict().items()})
            variants[(impl, sp)] = blk
        d = DTBlock(hidden, heads, kv, hd, inter).to(dtype)
        d.load_ref(ref.state_dict(), heads, kv)
        variants[("dtensor", sp)] = parallelize_dtensor(d, sp, mesh)

    def make_input(sp):
        x = tp_ext.split_tensor(X, 1, w)[r].contiguous() if sp else X.clone()
        return x.requires_grad_()

    def step(key, x):
        impl, sp = key
        blk = variants[key]
        if impl.startswith("tp_ext"):
            y = blk(x, seq_len=seq) if sp else blk(x)
        else:
            y = blk(x)
            if hasattr(y, "to_local"):
                y = y.to_local()
        y.float().sum().backward()
        blk.zero_grad(set_to_none=True)
        return y

    results = {}
    for key in variants:
        impl, sp = key
        x = make_input(sp)
        # correctness vs the reference (output and the input's gradient)
        if impl.startswith("tp_ext"):
            with comm.track() as stats:
                y = step(key, x)
            bus = stats.bus_bytes(w)
            counts = {
                c: stats.count(collective=c)
                for c in ("all_reduce", "all_gather", "reduce_scatter")
                if stats.count(collective=c)
            }
        else:
            rec = dtensor_comm_recorder()
            with rec:
                y = step(key, x)
            bus, counts = rec.bus_bytes(w), rec.counts()
        with torch.no_grad():
            Y = ref(X)
        if sp:
            y = torch.cat([t for t in _all_gather(y.detach().contiguous())], 1)
            gx = torch.cat([t for t in _all_gather(x.grad.contiguous())], 1)
        else:
            y, gx = y.detach(), x.grad
        results[key] = {
            "bus_bytes": bus,
            "counts": counts,
            "out_err": _rel(y, Y),
            "dx_err": _rel(gx, Y_ref_grad),
        }
    # timing: variants interleaved per repeat so machine noise hits all alike
    times = {k: [] for k in variants}
    inputs = {k: make_input(k[1]) for k in variants}
    for k in variants:
        step(k, inputs[k])  # warm-up
    for _ in range(repeats):
        for k in variants:
            dist.barrier()
            t0 = time.perf_counter()
            step(k, inputs[k])
            inputs[k].grad = None
            dist.barrier()
            times[k].append(time.perf_counter() - t0)
    for k in variants:
        results[k]["time"] = statistics.median(times[k])
    return results


def _all_gather(t):
    import torch.distributed as dist

    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed steps per variant (default: 30 small, 7 large)",
    )
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    targets = {"small": 0.5, "large": 1.0}
    rows = []
    for shape in a.shapes:
        hidden, heads, kv, hd, inter, batch, seq = SHAPES[shape]
        esize = 4 if a.dtype == "fp32" else 2
        for w in a.world_sizes:
            repeats = a.repeats or (30 if shape == "small" else 7)
            res = run_ranks(_worker, w, shape, repeats, a.dtype)[0]
            minimum = 4 * batch * seq * hidden * esize * 2 * (w - 1) / w
            for sp in (False, True):
                case = f"{shape} h={hidden} s={seq} {a.dtype} tp={w}{' sp' if sp else ''}"
                mine, theirs = res[("tp_ext", sp)], res[("dtensor", sp)]
                gloo = res[("tp_ext_gloo", sp)]
                rows.append(
                    dict(
                        benchmark=BENCH,
                        case=case,
                        metric="step time",
                        value=mine["time"] * 1e3,
                        unit="ms",
                        baseline=theirs["time"] * 1e3,
                    )
                )
                rows.append(
                    dict(
                        benchmark=BENCH,
                        case=case,
                        metric="step time, tp_ext over gloo",
                        value=gloo["time"] * 1e3,
                        unit="ms",
                        baseline=theirs["time"] * 1e3,
                    )
                )
                for impl, r in (("tp_ext", mine), ("dtensor", theirs)):
                    rows.append(
                        dict(
                            benchmark=BENCH,
                            case=case,
                            metric=f"{impl} bus bytes",
                            value=float(r["bus_bytes"]),
                            unit="B",
                            baseline=minimum,
                        )
                    )
                    rows.append(
                        dict(
                            benchmark=BENCH,
                            case=case,
                            metric=f"{impl} collectives",
                            value=" ".join(f"{c}={n}" for c, n in sorted(r["counts"].items())),
                            unit="",
                        )
                    )
                    rows.append(
                        dict(
                            benchmark=BENCH,
                            case=case,
                            metric=f"{impl} output rel err",
                            value=max(r["out_err"], r["dx_err"]),
                            unit="",
                        )
                    )
                ratio = mine["time"] / theirs["time"]
                print(
                    f"{case:36s} tp_ext {mine['time'] * 1e3:9.2f} ms  DTensor "
                    f"{theirs['time'] * 1e3:9.2f} ms  ratio {ratio:.3f} (target <= "
                    f"{targets[shape]}; over gloo only {gloo['time'] * 1e3:.2f} ms, ratio "
                    f"{gloo['time'] / theirs['time']:.3f})  "
                    f"bus bytes tp_ext {mine['bus_bytes']:.0f} DTensor "
                    f"{theirs['bus_bytes']:.0f} min {minimum:.0f}  collectives "
                    f"{mine['counts']} vs {theirs['counts']}  err tp_ext "
                    f"{mine['out_err']:.1e}/{mine['dx_err']:.1e} DTensor "
                    f"{theirs['out_err']:.1e}/{theirs['dx_err']:.1e}",
                    flush=True,
                )
    if not a.no_save:
        append_rows(rows)


if __name__ == "__main__":
    main()
