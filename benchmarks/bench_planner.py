"""The planner's estimates against measured Trainer steps of a small Qwen2 on this machine.

First ``tp_ext.planner.calibrate()`` measures this machine as the planner's "cpu" hardware (two
1-thread ranks at once: tp_ext's decoder FLOP/s and per-operator cost, gloo all-reduce and
reduce-scatter latency and bandwidth, AdamW, the pipelining and FSDP2 runtimes). Then every
layout of 2 ranks (one intra-op thread each) trains a Qwen2 (hidden 256, 4 layers, vocab 4096)
on the same global batch of 8 sequences of 128 tokens: the median step time of 9 timed steps
(median again over 3 rounds through all layouts) and the peak tensor memory per rank of one
step, against ``tp_ext.planner.estimate``. Reported: each layout's measured and estimated step
time (benchmark ``planner_step_time``) and peak (``planner_memory``), and the Spearman rank
correlation of the step times (the issue's target: >= 0.8).
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

MODEL = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SEQ, GLOBAL_BATCH = 128, 8


def _layouts():
    from tp_ext.planner import Layout

    def lay(tp, pp, dp, mb, schedule="1F1B", v=1, recompute=False, engine="ddp"):
        m = GLOBAL_BATCH // (dp * mb)
        return Layout(tp, pp, dp, mb, m, schedule, v, recompute, engine, "float32")

    # all on 2 ranks (the calibration measures a rank while the other one runs too), spread
    # over what the model weighs: micro-batch sizes (operator overhead against FLOPs), the
    # bubble (2 micro-batches against 8), recompute, TP / PP / DP communication
    return [
        lay(2, 1, 1, 8),
        lay(2, 1, 1, 1),
        lay(2, 1, 1, 4, recompute=True),
        lay(1, 2, 1, 4),
        lay(1, 2, 1, 1),
        lay(1, 2, 1, 2, "GPipe"),
        lay(1, 2, 1, 2, "Interleaved1F1B", 2),
        lay(1, 1, 2, 4),
        lay(1, 1, 2, 1),
        lay(1, 1, 2, 2, engine="fsdp"),
        lay((1, 2), 1, 1, 4),  # 2D TP (SUMMA) on the grids 2 ranks make
        lay((2, 1), 1, 1, 4),
    ]


def _worker(layout, steps: int):
    torch.set_num_threads(1)
    import tp_ext
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
    from tp_ext.training import Trainer

    sys.path.insert(0, ROOT)
    from tests.memory_peak import PeakMemory

    state = tp_ext.init_parallel(tp=layout.tp, pp=layout.pp, dp=layout.dp)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(
        Qwen2Config.from_dict(MODEL), parallel=state, virtual_stages=layout.virtual_stages
    )
    trainer = Trainer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        parallel=state,
        schedule=layout.schedule,
        data_parallel=layout.data_parallel,
        activation_checkpointing=layout.recompute,
    )
    g = torch.Generator().manual_seed(1)
    shape = (layout.micro_batch, SEQ)
    batches = [torch.randint(0, 4096, shape, generator=g) for _ in range(layout.num_micro_batches)]
    trainer.step(batches)
    with PeakMemory(model.parameters(), trainer.optimizer) as memory:
        trainer.step(batches)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        trainer.step(batches)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), memory.peak


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(xs):
        order = sorted(range(len(xs)), key=lambda i: xs[i])
        r = [0.0] * len(xs)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    d2 = sum((x - y) ** 2 for x, y in zip(ra, rb))
    return 1 - 6 * d2 / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=9, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=3, help="runs of every layout, in turn")
    args = parser.parse_args()
    from tp_ext.models import Qwen2Config
    from tp_ext.planner import calibrate, estimate

    hw = calibrate()
    print(
        f"calibrated: {hw.flops / 1e9:.3g} GFLOP/s, all-reduce {hw.intra_node / 1e9:.3g} GB/s, "
        f"latency {hw.latency * 1e6:.0f} us"
    )
    config = Qwen2Config.from_dict(MODEL)
    layouts = _layouts()
    # rounds over every layout in turn, so a slow spell of this shared machine falls on all of
    # them alike rather than on one; each layout's step time is its median over the rounds
    steps = {layout: [] for layout in layouts}
    peaks = {}
    for _ in range(args.rounds):
        for layout in layouts:
            out = run_ranks(_worker, layout.world_size, layout, args.steps)
            steps[layout].append(max(t for t, _ in out))
            peaks[layout] = max(p for _, p in out)
    rows, measured, estimated = [], [], []
    for layout in layouts:
        step, peak = statistics.median(steps[layout]), peaks[layout]
        est = estimate(config, layout, seq_len=SEQ, hardware=hw)
        measured.append(step)
        estimated.append(est.step_time_s)
        print(
            f"{layout.describe():<44} step {step:.3f} s (est {est.step_time_s:.3f}), peak "
            f"{peak / 2**20:.1f} MiB (est {est.memory_bytes['total'] / 2**20:.1f})"
        )
        rows.append(
            dict(
                benchmark="planner_step_time",
                case=layout.describe(),
                metric="step_s (estimated vs measured)",
                value=est.step_time_s,
                unit="s",
                baseline=step,
            )  # fmt: skip
        )
        rows.append(
            dict(
                benchmark="planner_memory",
                case=layout.describe(),
                metric="peak bytes per rank (estimated vs measured)",
                value=float(est.memory_bytes["total"]),
                unit="B",
                baseline=float(peak),
            )
        )
    rho = spearman(measured, estimated)
    print(f"Spearman rank correlation of the step times: {rho:.3f}")
    rows.append(
        dict(
            benchmark="planner_step_time",
            case=f"{len(measured)} layouts",
            metric="Spearman rank correlation (target >= 0.8)",
            value=rho,
            unit="rho",
            baseline=0.8,
        )  # fmt: skip
    )
    append_rows(rows)


if __name__ == "__main__":
    main()
