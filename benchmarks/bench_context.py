"""Context parallelism (issue 36): what splitting a long sequence over CP ranks saves. A tiny Qwen2
(2 layers, hidden 64, fp32) runs forward+backward on one sequence of ``--seq`` tokens (16k by
default) at cp = 1, 2, 4, each rank holding its positions (tp_ext's causal load balance):

- activation memory per rank: the peak bytes of live tensors during the step
  (:class:`tp_ext.debug.memory.PeakMemory`) less the parameters and their gradients, against cp=1
  (issue 36's goal: cp=4 at most 0.3x of cp=1);
- the step time of ring attention against all-to-all (Ulysses) attention at the same cp.

    python benchmarks/bench_context.py [--seq 16384] [--cp 1 2 4] [--repeats 3]

torch's own ``context_parallel`` (torch.distributed.tensor.experimental) is not run beside it: it
replaces scaled_dot_product_attention's flash and memory-efficient CUDA kernels and has no CPU
path in torch 2.13.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, bench, run_ranks  # noqa: E402

BENCH = "context_parallel"
CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1 << 17,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
)


def _rank(seq: int, mode: str, repeats: int) -> dict:
    import torch.distributed as dist
    import torch.nn.functional as F

    import tp_ext
    from tp_ext.debug.memory import PeakMemory
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    state = tp_ext.init_parallel(tp=1, cp=dist.get_world_size())
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(CONFIG), parallel=state, cp_mode=mode)
    ids = torch.randint(
        0, CONFIG["vocab_size"], (1, seq), generator=torch.Generator().manual_seed(1)
    )
    mine = tp_ext.cp_positions(seq, parallel=state)
    targets = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)[:, mine]

    def step():
        logits = model(ids, local_logits=True)
        F.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").backward()
        for p in model.parameters():
            p.grad = None

    step()  # warm-up
    with PeakMemory(model.parameters()) as mem:
        step()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    seconds = bench(step, warmup=0, repeats=repeats)
    # peak of live tensors less the parameters and their gradients (which exist at its peak)
    return {"peak": mem.peak, "activations": mem.peak - 2 * params, "step_s": seconds}


def _ring_rank(seq: int, heads: int, head_dim: int, repeats: int) -> dict:
    """On the 2 ranks of a throttled link (benchmarks/netns.py): ring attention alone, forward
    and backward, with and without overlap, called in turn; and the bytes this rank sends per
    call (tp_ext.comm.track(), tag "cp") against the analytic count."""
    import tp_ext
    from tp_ext.layers.context import ring_attention

    g = tp_ext.comm.resolve_group(None)
    mine = tp_ext.cp_positions(seq)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, head_dim)[:, :, mine].contiguous() for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def call(overlap):
        def run():
            out = ring_attention(q, k, v, seq, overlap=overlap)
            out.sum().backward()

        return run

    with tp_ext.comm.track() as stats:
        call(True)()
    sent = stats.bytes(tag="cp", collective="send_recv")
    block = 2 * k.numel() * k.element_size()  # this rank's keys and values
    # forward: C - 1 hops of K/V; backward: C - 1 hops of K/V and C of their fp32 gradients
    analytic = (g.size - 1) * block * 2 + g.size * block
    from benchmarks.common import bench_interleaved

    with_overlap, without = bench_interleaved(call(True), call(False), warmup=1, repeats=repeats)
    return {"sent": sent, "analytic": analytic, "overlap_s": with_overlap, "plain_s": without}


def _bytes_rank(seq: int, mode: str, heads: int, kv_heads: int, head_dim: int) -> int:
    """One attention's forward and backward over the CP group (all ranks of this run), fp32,
    batch 1: the bytes this rank sent, as tp_ext.comm.track() files them under "cp"."""
    import tp_ext
    from tp_ext.layers.context import all_to_all_attention, ring_attention

    local = len(tp_ext.cp_positions(seq))
    torch.manual_seed(0)
    q = torch.randn(1, heads, local, head_dim, requires_grad=True)
    k = torch.randn(1, kv_heads, local, head_dim, requires_grad=True)
    v = torch.randn(1, kv_heads, local, head_dim, requires_grad=True)
    attend = ring_attention if mode == "ring" else all_to_all_attention
    with tp_ext.comm.track() as stats:
        attend(q, k, v, seq).sum().backward()
    return stats.bytes(tag="cp")


def analytic_cp_bytes(seq: int, cp: int, mode: str, heads: int, kv_heads: int, dim: int) -> int:
    """Bytes all CP ranks send for one attention's forward and backward (fp32, batch 1): the
    ring forwards every key/value block cp - 1 times each way and its fp32 gradients cp times;
    the all-to-all moves, each way, every position's heads that another rank attends for and
    every output back to the position's rank."""
    from tp_ext.sharding import cp_chunks, shard_sizes

    local = [sum(n for _, _, n in cp_chunks(seq, cp, r)) for r in range(cp)]
    row = dim * 4
    if mode == "ring":
        return (2 * (cp - 1) + cp) * seq * 2 * kv_heads * row
    kvh = shard_sizes(kv_heads, cp) if kv_heads % cp == 0 else shard_sizes(heads, cp)
    group = heads // kv_heads if kv_heads % cp == 0 else 1
    qh = [h * group for h in kvh]
    every = sum(qh) + 2 * sum(kvh)  # q, k and v heads in all
    scatter = sum(n * (every - qh[r] - 2 * kvh[r]) for r, n in enumerate(local))
    gather = sum(qh[r] * (seq - n) for r, n in enumerate(local))
    return 2 * (scatter + gather) * row


def _bytes(args) -> None:
    """``--bytes``: each mode's transfers for one attention (the tiny model's heads) at every
    cp given, summed over the ranks, against :func:`analytic_cp_bytes`."""
    heads, kv_heads, dim = 4, 2, 16
    rows = []
    for cp in [c for c in args.cp if c > 1]:
        for mode in ("ring", "all_to_all"):
            sent = sum(run_ranks(_bytes_rank, cp, args.seq, mode, heads, kv_heads, dim))
            want = analytic_cp_bytes(args.seq, cp, mode, heads, kv_heads, dim)
            print(f"cp={cp} {mode}: sent {sent:,} B, analytic {want:,} B", flush=True)
            case = f"attention-seq{args.seq}-h{heads}/{kv_heads}x{dim}-cp{cp}-{mode}"
            rows.append(dict(
                benchmark=BENCH, case=case, metric="cp_bytes_all_ranks_vs_analytic", value=sent,
                unit="B", baseline=want,
            ))  # fmt: skip
    append_rows(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=16384)
    parser.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--mbit",
        type=float,
        help="instead: ring attention alone at cp=2 across a link throttled to this many "
        "Mbit/s (network namespaces, root), with and without overlap, and its bytes",
    )
    parser.add_argument(
        "--bytes",
        action="store_true",
        help="instead: each mode's bytes for one attention (tracked under 'cp', all ranks) at "
        "every --cp against the analytic count",
    )
    args = parser.parse_args()
    if args.bytes:
        _bytes(args)
        return
    if args.mbit:
        _throttled(args)
        return
    results = {}
    for cp in args.cp:
        for mode in ["ring", "all_to_all"] if cp > 1 else ["ring"]:
            r = run_ranks(_rank, cp, args.seq, mode, args.repeats)
            # the busiest rank's memory and the slowest rank's time
            results[cp, mode] = {
                "activations": max(x["activations"] for x in r),
                "peak": max(x["peak"] for x in r),
                "step_s": max(x["step_s"] for x in r),
            }
            print(f"cp={cp} {mode}: {results[cp, mode]}", flush=True)
    base = results.get((1, "ring"))
    rows = []
    for (cp, mode), r in results.items():
        case = f"qwen2-tiny-seq{args.seq}-cp{cp}-{mode}"

        def row(metric, value, unit, baseline=""):
            return dict(
                benchmark=BENCH, case=case, metric=metric, value=value, unit=unit,
                baseline=baseline,
            )  # fmt: skip

        rows.append(row("activation_bytes_per_rank", r["activations"], "B",
                        base["activations"] if base else ""))  # fmt: skip
        rows.append(row("peak_bytes_per_rank", r["peak"], "B", base["peak"] if base else ""))
        ring = results.get((cp, "ring"))
        rows.append(row("step_s", r["step_s"], "s", ring["step_s"] if mode != "ring" else ""))
    append_rows(rows)


def _throttled(args) -> None:
    from benchmarks import netns

    why = netns.why_not()
    if why:
        raise SystemExit(f"--mbit: no throttled link here: {why}")
    seq, heads, head_dim = args.seq, 8, 64
    r = netns.run_throttled(
        "benchmarks.bench_context", "_ring_rank", args.mbit, seq, heads, head_dim, args.repeats
    )
    print(f"ring at cp=2 over {args.mbit:g} Mbit/s: {r}", flush=True)
    case = f"ring-seq{seq}-h{heads}x{head_dim}-cp2-{args.mbit:g}mbit"
    slow = max(r, key=lambda x: x["overlap_s"])
    rows = [
        dict(benchmark=BENCH, case=case, metric="step_s_overlap_vs_not", unit="s",
             value=slow["overlap_s"], baseline=slow["plain_s"]),
        dict(benchmark=BENCH, case=case, metric="bytes_sent_vs_analytic", unit="B",
             value=r[0]["sent"], baseline=r[0]["analytic"]),
    ]  # fmt: skip
    append_rows(rows)


if __name__ == "__main__":
    main()
