"""Expert parallelism (issue 22) on CPU/gloo, in one run:

1. The token permutation: tp_ext's moe_route + moe_permute + moe_unpermute (forward and
   backward) against the eager PyTorch way (a stable argsort, index gather, index scatter, a
   weighted sum over the top-k rows), single process.
2. The MoE layer, forward + backward, at EP = 2 and 4 (one rank per EP rank, dp = ep):
   tp_ext.layers.ExpertParallelMoE against a plain-PyTorch expert parallel built the torchtitan
   way (argsort permutation, counts exchanged with all_to_all_single, tokens with torch's
   all_to_all_single_autograd, received rows regrouped per local expert by another argsort),
   with the same router, experts and weights, steps interleaved.

Metric: median seconds per step; ratio = tp_ext / baseline (goals: layer <= 0.8x, ops <= 0.5x).
The layer runs also time the local experts' GEMMs alone on the same rows (no routing or
communication), which both layers share, and report what each layer spends beyond them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, bench_interleaved, bench_pair, run_ranks  # noqa: E402

BENCH = "moe"
EXPERTS, TOP_K = 8, 2


# ---- 1. the permutation ops ------------------------------------------------------------------


def _routing(tokens, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, EXPERTS, generator=g)
    w, ids = torch.topk(torch.softmax(logits, -1), TOP_K, -1)
    return w, ids


def _ops_step(x, w, ids, fn_rows):
    """Permute, a per-row function, unpermute with weights; backward through all of it."""
    from tp_ext import ops

    row_map, _ = ops.moe_route(ids, EXPERTS)
    rows = ops.moe_permute(x, row_map, None, ids.numel())
    out = ops.moe_unpermute(fn_rows(rows), row_map, w)
    out.sum().backward()


def _eager_step(x, w, ids, fn_rows):
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    rows = x[order // TOP_K]
    y = fn_rows(rows)
    back = torch.empty_like(y).index_copy(0, order, y)  # index scatter (differentiable)
    out = (back.view(ids.shape[0], TOP_K, -1) * w.unsqueeze(-1)).sum(1)
    out.sum().backward()


def bench_ops(tokens, hidden, repeats):
    torch.manual_seed(0)
    rows = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
        w, ids = _routing(tokens)
        w = w.requires_grad_()
        scale = torch.tensor(1.5, dtype=dtype)

        def rows_fn(r):
            return r * scale  # stands in for the experts: the permutation is what is timed

        ours, eager = bench_pair(
            lambda: _ops_step(x, w, ids, rows_fn),
            lambda: _eager_step(x, w, ids, rows_fn),
            warmup=3,
            repeats=repeats,
        )
        case = f"permute ops T={tokens} H={hidden} k={TOP_K} {str(dtype).split('.')[-1]}"
        print(f"{case}: tp_ext {ours * 1e3:.2f} ms, eager {eager * 1e3:.2f} ms "
              f"({ours / eager:.2f}x)")  # fmt: skip
        rows.append(
            {"benchmark": BENCH, "case": case, "metric": "fwd+bwd seconds", "value": ours,
             "unit": "s", "baseline": eager, "ratio": ours / eager,
             "notes": "baseline: argsort + index gather + index_copy + weighted sum (eager)"}
        )  # fmt: skip
    return rows


# ---- 2. the layer ------------------------------------------------------------------------------


class _Router(torch.nn.Module):
    def __init__(self, hidden):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(EXPERTS, hidden) * 0.02)

    def forward(self, x):
        logits = torch.nn.functional.linear(x, self.weight)
        w, ids = torch.topk(torch.softmax(logits.float(), -1), TOP_K, -1)
        return logits, w, ids


class _TorchtitanStyleMoE(torch.nn.Module):
    """Expert parallelism from torch pieces only, as torchtitan builds it."""

    def __init__(self, router, gate_up, down, group):
        super().__init__()
        self.router, self.group = router, group
        self.gate_up, self.down = torch.nn.Parameter(gate_up), torch.nn.Parameter(down)

    def forward(self, x):
        import torch.distributed as dist
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        ep, local = dist.get_world_size(self.group), self.gate_up.shape[0]
        _, w, ids = self.router(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        rows = x[order // TOP_K]
        counts = torch.bincount(flat, minlength=EXPERTS)
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=self.group)
        send = counts.view(ep, local).sum(1).tolist()
        recv = received_counts.view(ep, local).sum(1).tolist()
        got = all_to_all_single_autograd(rows, recv, send, self.group)
        local_ids = torch.arange(local).repeat(ep).repeat_interleave(received_counts)
        regroup = torch.argsort(local_ids, stable=True)
        grouped = got[regroup]
        sizes = received_counts.view(ep, local).sum(0).tolist()
        outs, start = [], 0
        for e, n in enumerate(sizes):
            h = torch.nn.functional.linear(grouped[start : start + n], self.gate_up[e])
            gate, up = h.chunk(2, -1)
            outs.append(
                torch.nn.functional.linear(torch.nn.functional.silu(gate) * up, self.down[e])
            )
            start += n
        y = torch.empty_like(grouped).index_copy(0, regroup, torch.cat(outs))
        back = all_to_all_single_autograd(y, send, recv, self.group)
        back = torch.empty_like(back).index_copy(0, order, back)
        return (back.view(x.shape[0], TOP_K, -1) * w.unsqueeze(-1).to(back.dtype)).sum(1)


def _layer_rank(tokens, hidden, inter, repeats):
    import torch.distributed as dist

    import tp_ext
    from tp_ext.layers import ExpertParallelMoE, ParallelExperts

    ws = dist.get_world_size()
    state = tp_ext.init_parallel(tp=1, dp=ws, ep=ws)
    torch.manual_seed(0)
    router = _Router(hidden)
    experts = ParallelExperts(EXPERTS, hidden, inter, torch.nn.SiLU(), ep=state.ep_group)
    ours = ExpertParallelMoE(router, experts, state.ep_group)
    theirs = _TorchtitanStyleMoE(
        router, experts.gate_up_proj.detach().clone(), experts.down_proj.detach().clone(),
        state.ep_group,
    )  # fmt: skip
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(dist.get_rank()))
    seen = []  # the rows and group sizes the local experts get
    hook = experts.register_forward_pre_hook(lambda _, args: seen.append(args))
    torch.testing.assert_close(ours(x), theirs(x), rtol=1e-4, atol=1e-5)  # the same layer
    hook.remove()
    received, group_sizes = seen[0][0].detach().clone(), list(seen[0][1])

    def step(layer):
        def run():
            dist.barrier()
            layer(x.requires_grad_()).sum().backward()

        return run

    def gemms_only():  # the same expert GEMMs on the same rows, no routing or communication
        dist.barrier()
        experts(received.requires_grad_(), group_sizes).sum().backward()

    return bench_interleaved(step(ours), step(theirs), gemms_only, warmup=2, repeats=repeats)


def bench_layer(eps, tokens, hidden, inter, repeats):
    rows = []
    for ep in eps:
        results = run_ranks(_layer_rank, ep, tokens, hidden, inter, repeats)
        # the step ends with the slowest rank
        ours, theirs, gemms = (max(r[i] for r in results) for i in range(3))
        case = f"MoE layer EP={ep} T={tokens}/rank H={hidden} I={inter} E={EXPERTS} k={TOP_K}"
        print(f"{case}: tp_ext {ours * 1e3:.1f} ms, torchtitan-style {theirs * 1e3:.1f} ms "
              f"({ours / theirs:.2f}x); expert GEMMs alone {gemms * 1e3:.1f} ms, the rest "
              f"{(ours - gemms) * 1e3:.1f} vs {(theirs - gemms) * 1e3:.1f} ms "
              f"({(ours - gemms) / (theirs - gemms):.2f}x)")  # fmt: skip
        rows.append(
            {"benchmark": BENCH, "case": case, "metric": "fwd+bwd seconds", "value": ours,
             "unit": "s", "baseline": theirs, "ratio": ours / theirs,
             "notes": "baseline: argsort permutation + all_to_all_single_autograd (torchtitan)"}
        )  # fmt: skip
        rows.append(
            {"benchmark": BENCH, "case": case, "metric": "fwd+bwd seconds beyond the expert GEMMs",
             "value": ours - gemms, "unit": "s", "baseline": theirs - gemms,
             "ratio": (ours - gemms) / (theirs - gemms),
             "notes": f"both minus the local experts' GEMMs alone on the same rows "
                      f"({gemms:.4f} s, same run): routing, permutation and communication"}
        )  # fmt: skip
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--inter", type=int, default=512)
    parser.add_argument("--ep", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--no-csv", action="store_true", help="print only (smoke runs)")
    args = parser.parse_args()
    t0 = time.time()
    rows = bench_ops(args.tokens, args.hidden, args.repeats)
    rows += bench_layer(args.ep, args.tokens // 4, args.hidden, args.inter, args.repeats)
    print(f"({time.time() - t0:.0f} s)")
    if not args.no_csv:
        append_rows(rows)


if __name__ == "__main__":
    main()
