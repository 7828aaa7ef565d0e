"""Training checkpoints on CPU: tp_ext's ``Trainer.save_checkpoint`` / ``load_checkpoint`` against
torch.distributed.checkpoint (DCP) used directly, and what an asynchronous save costs a training
loop against a synchronous one.

Part ``io`` (benchmark ``checkpoint_io``): a Qwen2 of ~14M parameters (fp32 model + AdamW state,
~170 MB) at (tp, pp) = (1, 1), (2, 1) and (1, 2). tp_ext writes every tensor under its unsharded
name with this rank's offsets (resharding on load), hashes every file (sha256, after fsync) into
the manifest and publishes by one symlink swap. The baselines write the same tensors (the model's
and the optimizer's state on each rank, keyed per rank: no resharding) with
``dcp.save``/``dcp.load`` through DCP's safetensors storage (``HuggingFaceStorageWriter``) and
through its default ``FileSystemWriter``. MB/s = bytes on disk / wall time (median of 3, all
ranks, barrier to barrier). The page cache cannot be dropped here: loads read from memory, saves
include fsync only where the writer does it. ``hash_s`` is the time of tp_ext's hashing alone.

Part ``async`` (benchmark ``checkpoint_async``): the same model at tp=2 training (AdamW, 4
micro-batches of 2 x 256 tokens). The step time without saving; the time a synchronous save
blocks the loop; the time an asynchronous save blocks it (the copy to CPU memory), the extra time
of the steps that overlap its background write until it is published, and the total extra time
per checkpoint of each kind.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH_IO = "checkpoint_io"
BENCH_ASYNC = "checkpoint_async"
MODEL = dict(
    vocab_size=8192,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SEQ, MICRO, MICRO_BATCHES = 256, 2, 4
REPEATS = 3


def _trainer(tp: int, pp: int):
    import tp_ext
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
    from tp_ext.training import Trainer

    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=1)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config.from_dict(MODEL), parallel=state)
    return Trainer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        parallel=state,
        max_grad_norm=1.0,
    )


def _batches():
    g = torch.Generator().manual_seed(1)
    return [
        torch.randint(0, MODEL["vocab_size"], (MICRO, SEQ), generator=g)
        for _ in range(MICRO_BATCHES)
    ]


def _bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(os.path.realpath(path)):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _plain_state(trainer) -> dict:
    """The tensors DCP used directly saves: this rank's model and optimizer state, keyed per
    rank (what a user without tp_ext's names would do; it cannot reshard)."""
    import torch.distributed as dist

    rank = dist.get_rank()
    state = {f"r{rank}.model.{k}": v.detach() for k, v in trainer.model.state_dict().items()}
    names = {p: n for n, p in trainer.model.named_parameters()}
    for param, values in trainer.optimizer.state.items():
        for key, value in values.items():
            state[f"r{rank}.optim.{names[param]}.{key}"] = value
    return state


def _io(tp: int, pp: int, directory: str) -> dict:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import (
        FileSystemReader,
        FileSystemWriter,
        HuggingFaceStorageReader,
        HuggingFaceStorageWriter,
    )

    from tp_ext.checkpoint import complete_checkpoint
    from tp_ext.checkpoint.manifest import hash_files

    trainer = _trainer(tp, pp)
    trainer.step(_batches())  # the optimizer's state exists
    plain = _plain_state(trainer)
    rank = dist.get_rank()
    times = {k: [] for k in ("tp_ext_save", "tp_ext_load", "hf_save", "hf_load", "fs_save")}
    times["fs_load"], times["hash"] = [], []
    sizes = {}
    for i in range(REPEATS):
        ours = os.path.join(directory, f"tp_ext-{i}")
        hf = os.path.join(directory, f"dcp-hf-{i}")
        fs = os.path.join(directory, f"dcp-fs-{i}")
        times["tp_ext_save"].append(_timed(lambda: trainer.save_checkpoint(ours)))
        times["hf_save"].append(
            _timed(
                lambda: dcp.save(
                    plain, storage_writer=HuggingFaceStorageWriter(hf, save_distributed=True)
                )
            )
        )
        times["fs_save"].append(
            _timed(lambda: dcp.save(plain, storage_writer=FileSystemWriter(fs)))
        )
        times["tp_ext_load"].append(_timed(lambda: trainer.load_checkpoint(ours)))
        times["hf_load"].append(
            _timed(lambda: dcp.load(plain, storage_reader=HuggingFaceStorageReader(hf)))
        )
        times["fs_load"].append(
            _timed(lambda: dcp.load(plain, storage_reader=FileSystemReader(fs)))
        )
        version = complete_checkpoint(ours)
        times["hash"].append(_timed(lambda: hash_files(version, dist.group.WORLD)))
        if rank == 0:
            sizes = {"tp_ext": _bytes(ours), "hf": _bytes(hf), "fs": _bytes(fs)}
        dist.barrier()
        if rank == 0:
            for p in (ours, ours + ".versions", hf, fs):
                shutil.rmtree(p, ignore_errors=True) if os.path.isdir(p) else None
            if os.path.islink(ours):
                os.unlink(ours)
        dist.barrier()
    return {"times": {k: statistics.median(v) for k, v in times.items()}, "sizes": sizes}


def _async(tp: int, directory: str) -> dict:
    trainer = _trainer(tp, 1)
    batches = _batches()
    for _ in range(2):  # warm up
        trainer.step(batches)
    plain = []
    for _ in range(6):
        plain.append(_timed(lambda: trainer.step(batches)))
    step = statistics.median(plain)
    sync, blocking, overlapped, published_after = [], [], [], []
    for i in range(REPEATS):
        sync.append(_timed(lambda: trainer.save_checkpoint(os.path.join(directory, f"s{i}"))))
        blocking.append(
            _timed(
                lambda: trainer.save_checkpoint(os.path.join(directory, f"a{i}"), async_save=True)
            )
        )
        extra, steps = 0.0, 0
        while trainer._pending_save is not None and steps < 20:
            extra += _timed(lambda: trainer.step(batches)) - step
            steps += 1
        extra += _timed(trainer.wait_for_checkpoint)  # nothing left, unless 20 steps did not do
        overlapped.append(extra)
        published_after.append(steps)
    return {
        "step": step,
        "sync": statistics.median(sync),
        "async_blocking": statistics.median(blocking),
        "async_overlap": statistics.median(overlapped),
        "published_after_steps": statistics.median(published_after),
    }


def _io_rows(name: str, result: dict) -> list[dict]:
    t, sizes = result["times"], result["sizes"]
    mb = {k: v / 2**20 for k, v in sizes.items()}
    rows = []
    for op in ("save", "load"):
        ours = mb["tp_ext"] / t[f"tp_ext_{op}"]
        for base in ("hf", "fs"):
            rows.append(
                dict(
                    benchmark=BENCH_IO,
                    case=f"{name}-{op}-vs-dcp-{'safetensors' if base == 'hf' else 'filesystem'}",
                    metric="MB/s",
                    value=ours,
                    unit="MB/s",
                    baseline=mb[base] / t[f"{base}_{op}"],
                )
            )
    rows.append(
        dict(
            benchmark=BENCH_IO,
            case=f"{name}-hash",
            metric="hash_s",
            value=t["hash"],
            unit="s",
            baseline=t["tp_ext_save"],
        )
    )
    rows.append(
        dict(benchmark=BENCH_IO, case=f"{name}-size", metric="MB", value=mb["tp_ext"], unit="MB")
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("io", "async", "all"), default="all")
    parser.add_argument("--quick", action="store_true", help="a small model, nothing recorded")
    args = parser.parse_args()
    if args.quick:
        MODEL.update(vocab_size=1024, hidden_size=128, intermediate_size=256)
    rows = []
    base = tempfile.mkdtemp(prefix="tp_ext_bench_ckpt_", dir=os.environ.get("TMPDIR", "/tmp"))
    try:
        if args.part in ("io", "all"):
            for name, (world, tp, pp) in {
                "ws1": (1, 1, 1),
                "tp2": (2, 2, 1),
                "pp2": (2, 1, 2),
            }.items():
                directory = os.path.join(base, name)
                os.makedirs(directory)
                result = run_ranks(_io, world, tp, pp, directory)[0]
                rows += _io_rows(name, result)
                for row in rows[-6:]:
                    print(f"{row['case']:<40} {row['value']:>10.3g} vs {row.get('baseline', '-')}")
        if args.part in ("async", "all"):
            directory = os.path.join(base, "async")
            os.makedirs(directory)
            r = run_ranks(_async, 2, 2, directory)[0]
            print(r)
            step = r["step"]
            rows += [
                dict(benchmark=BENCH_ASYNC, case="tp2", metric="step_s", value=step, unit="s"),
                dict(
                    benchmark=BENCH_ASYNC,
                    case="tp2",
                    metric="blocking_s (async vs sync)",
                    value=r["async_blocking"],
                    unit="s",
                    baseline=r["sync"],
                ),
                dict(
                    benchmark=BENCH_ASYNC,
                    case="tp2",
                    metric="extra_s per checkpoint (async vs sync)",
                    value=r["async_blocking"] + r["async_overlap"],
                    unit="s",
                    baseline=r["sync"],
                ),
                dict(
                    benchmark=BENCH_ASYNC,
                    case="tp2",
                    metric="overlapped steps' extra_s",
                    value=r["async_overlap"],
                    unit="s",
                    baseline=step,
                ),
                dict(
                    benchmark=BENCH_ASYNC,
                    case="tp2",
                    metric="steps until published",
                    value=float(r["published_after_steps"]),
                    unit="steps",
                ),
            ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if not args.quick:
        append_rows(rows)


if __name__ == "__main__":
    main()
