"""The distributed optimizer (issue 38): ZeRO-1 and ZeRO-2 against DDP and FSDP2 in the same run,
and the DP gradient sum in bfloat16 against fp32.

1. A Qwen2 (hidden 512, 4 layers, vocabulary 4096, fp32, AdamW) trained at dp = 2 (gloo, a
   thread per rank) by each engine (ZeRO-2 also with each bucket's parameter all-gather waited
   for by the next forward), steps interleaved: median step time, each rank's optimizer
   state bytes (AdamW's two moments; ZeRO's fp32 master rows beside them) and peak live tensor
   bytes (tp_ext.debug.memory.PeakMemory); every engine's loss checked equal to DDP's.
2. The compression benchmark's byte-level model on the license texts, 2 DP ranks, 200 steps,
   with the gradient sum in fp32 and in bfloat16 (DDP and ZeRO-2), for each of ``--seeds``
   seeds (the initial weights and the sequences drawn): final loss against fp32's of the same
   seed, and the mean over seeds against fp32's mean (goal: within 0.5%). fp32's spread over
   seeds and fp32 under ZeRO-2 (the same sums, rounded in another order) show how far the seed
   and rounding alone move it.

    python benchmarks/bench_zero.py [--steps 200] [--repeats 5] [--seeds 4] [--part all]
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

ENGINES = ("ddp", "fsdp", "zero1", "zero2", "zero2-overlap")


def _engines_rank(repeats: int) -> dict:
    import tp_ext
    from tp_ext.debug.memory import PeakMemory
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=1, dp=torch.distributed.get_world_size())
    config = Qwen2Config.from_dict(
        dict(
            vocab_size=4096, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
            num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256,
            rope_theta=10000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
        )
    )  # fmt: skip
    g = torch.Generator().manual_seed(10 + state.dp_rank)
    batches = [torch.randint(0, 4096, (2, 128), generator=g) for _ in range(2)]
    trainers = {}
    for engine in ENGINES:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(config, parallel=state)
        trainers[engine] = Trainer(
            model,
            optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3),
            parallel=state,
            data_parallel=engine.split("-")[0],
            # the parameters' all-gather waited for by the next forward
            overlap_param_gather=engine.endswith("-overlap"),
        )
    times = {e: [] for e in ENGINES}
    losses = {e: [] for e in ENGINES}
    peaks = {}
    for _ in range(repeats):
        for engine, trainer in trainers.items():
            # two steps in a row, the second timed: it waits for the all-gather the first left
            # in flight (overlap) as the others wait for their own at its end; its own left in
            # flight is waited for untimed, before another engine's collectives queue behind it
            losses[engine].append(trainer.step(batches))
            held = [trainer.model.parameters(), trainer.optimizer]
            if hasattr(trainer.optimizer, "inner"):  # ZeRO's master rows and their state
                held.append(trainer.optimizer.inner)
            with PeakMemory(*held) as peak:
                t0 = time.perf_counter()
                losses[engine].append(trainer.step(batches))
                spent = time.perf_counter() - t0
            if hasattr(trainer.optimizer, "finish_gather"):
                trainer.optimizer.finish_gather()
            times[engine].append(spent)
            peaks[engine] = max(peaks.get(engine, 0), peak.peak)
    state_bytes = {}
    for engine, trainer in trainers.items():
        optimizer = getattr(trainer.optimizer, "inner", trainer.optimizer)
        total = 0
        for per_param in optimizer.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                value = per_param[key]
                value = value.to_local() if hasattr(value, "to_local") else value
                total += value.numel() * value.element_size()
        state_bytes[engine] = total
    return {
        "seconds": {e: statistics.median(t) for e, t in times.items()},
        "state_bytes": state_bytes,
        "peak_bytes": peaks,
        "losses": losses,
    }


def _engines(repeats: int) -> list:
    rows = []
    out = run_ranks(_engines_rank, 2, repeats)
    r = out[0]
    for engine in ENGINES:
        torch.testing.assert_close(r["losses"][engine], r["losses"]["ddp"], rtol=1e-4, atol=0)
    print({k: v for k, v in r.items() if k != "losses"})
    for engine in ENGINES[1:]:
        case = f"{engine} vs ddp, dp=2"
        rows.append(dict(benchmark="zero", case=case, metric="step_s",
                         value=max(o["seconds"][engine] for o in out), unit="s",
                         baseline=max(o["seconds"]["ddp"] for o in out)))  # fmt: skip
        rows.append(dict(benchmark="zero", case=case, metric="optimizer_state_bytes_rank0",
                         value=r["state_bytes"][engine], unit="B",
                         baseline=r["state_bytes"]["ddp"]))  # fmt: skip
        rows.append(dict(benchmark="zero", case=case, metric="peak_bytes_rank0",
                         value=r["peak_bytes"][engine], unit="B",
                         baseline=r["peak_bytes"]["ddp"]))  # fmt: skip
    return rows


def _bf16_sum(steps: int, seeds: int) -> list:
    from benchmarks import bench_compression

    runs = (
        ("fp32", None, "ddp"),
        # the same sums in another order: how far rounding alone moves the final loss
        ("fp32 zero2", None, "zero2"),
        ("bf16 ddp", torch.bfloat16, "ddp"),
        ("bf16 zero2", torch.bfloat16, "zero2"),
    )
    final = {name: [] for name, _, _ in runs}  # per seed: mean of the last 20 steps' losses
    for seed in range(seeds):
        for name, dtype, engine in runs:
            losses = run_ranks(bench_compression._train, 2, None, steps, dtype, engine, seed)
            final[name].append(statistics.mean(losses[0][0][-20:]))
            print(f"seed {seed} {name}: final {final[name][-1]:.4f}", flush=True)
    metric = f"final loss (mean of last 20 of {steps} steps) vs fp32"
    rows = []
    for seed in range(seeds):
        for name in ("fp32 zero2", "bf16 ddp", "bf16 zero2"):
            rows.append(dict(benchmark="zero_bf16_gradient_sum",
                             case=f"{name}, 2 DP ranks, seed {seed}", metric=metric,
                             value=final[name][seed], unit="nats",
                             baseline=final["fp32"][seed]))  # fmt: skip
    for name in ("fp32 zero2", "bf16 ddp", "bf16 zero2"):
        rows.append(dict(benchmark="zero_bf16_gradient_sum",
                         case=f"{name}, 2 DP ranks, mean of {seeds} seeds", metric=metric,
                         value=statistics.mean(final[name]), unit="nats",
                         baseline=statistics.mean(final["fp32"])))  # fmt: skip
    if seeds > 1:  # how far the seed alone moves fp32's final loss
        spread = statistics.stdev(final["fp32"]) / statistics.mean(final["fp32"])
        print(f"fp32 final loss over {seeds} seeds: relative standard deviation {spread:.4f}")
        rows.append(dict(benchmark="zero_bf16_gradient_sum",
                         case=f"fp32, 2 DP ranks, {seeds} seeds",
                         metric="relative standard deviation of the final loss over seeds",
                         value=spread, unit="ratio", baseline=1.0))  # fmt: skip
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seeds", type=int, default=4)
    p.add_argument("--part", choices=("all", "engines", "bf16"), default="all")
    a = p.parse_args()
    rows = []
    if a.part in ("all", "engines"):
        rows += _engines(a.repeats)
    if a.part in ("all", "bf16"):
        rows += _bf16_sum(a.steps, a.seeds)
    append_rows(rows)


if __name__ == "__main__":
    main()
