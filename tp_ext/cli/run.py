"""The main job, ``tp-ext run CONFIG`` under torchrun: the full-size footprint of CONFIG, then a
model of the same family small enough for any machine, taken through everything the full one
needs. An application on top of the library: it uses only public tp_ext names.

1. Print CONFIG's per-rank footprint at this TP degree (built on the meta device, nothing
   allocated).
2. Rank 0 writes a small random checkpoint in Hugging Face format (a sharded index).
3. Every rank loads its shard of it (slice reads), and checks logits, loss and greedy tokens
   against the single-process model loaded from the same files.
4. A few training steps (AdamW, gradient accumulation, TP-aware clipping): the loss goes down.
5. A sharded (DCP) save and reload (bitwise) and a merged Hugging Face export.
6. Greedy generation with the KV cache; tokens per second and memory per rank.

Every check is agreed across ranks; the exit status is 0 only if all passed everywhere. On CPU
the ranks talk over gloo; on CUDA machines the same command runs with NCCL.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_ext import checkpoint
from tp_ext.checkpoint import peak_rss_bytes
from tp_ext.cli.flags import RUN_FIELDS
from tp_ext.cli.workdir import check_workdir, make_workdir, share_path
from tp_ext.config import JobConfig
from tp_ext.distributed import TPGroup, comm, destroy_parallel, init_parallel
from tp_ext.layers import vocab_parallel_cross_entropy
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
from tp_ext.models.footprint import footprint, format_footprint
from tp_ext.training import Trainer, build_optimizer
from tp_ext.validation import check_fields

__all__ = ["run"]


def _memory(device: torch.device) -> dict:
    out = {"peak_rss_mib": peak_rss_bytes() / 2**20}
    if device.type == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _gather_rows(values: list[float], device) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), on every rank."""
    mine = torch.tensor([values], dtype=torch.float64, device=device)
    return comm.all_gather(mine, 0, group=dist.group.WORLD).tolist()


def _data(config, batch: int, seq: int, seed: int) -> torch.Tensor:
    """A learnable toy language: each sequence counts up from a random start by a random stride
    (mod the vocabulary), so next-token loss can fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % config.vocab_size


_PROMPT = 8  # prompt tokens of the generation step


@dataclasses.dataclass
class _Job:
    config_path: str
    job: JobConfig
    small_job: JobConfig
    small: Qwen2Config
    dtype: torch.dtype  # of the small model: --dtype, else float32 (parity exact to 1e-4)
    steps: int
    micro_batches: int
    max_new_tokens: int
    max_grad_norm: float


def run(
    config_path: str,
    overrides: dict,
    small_path: str | None = None,
    workdir: str | None = None,
    steps: int = 6,
    micro_batches: int = 2,
    max_new_tokens: int = 16,
    max_grad_norm: float = 1.0,
) -> int:
    # Everything a user gives is read and checked before torch.distributed starts.
    flags = {"steps": steps, "micro-batches": micro_batches, "max-new-tokens": max_new_tokens}
    check_fields("--", dict(flags, **{"max-grad-norm": max_grad_norm}), RUN_FIELDS)
    t_start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    job = JobConfig.from_file(config_path).with_overrides(**overrides)
    tp = overrides.get("tp") or world
    job.model.check_tp(tp)
    small_job = JobConfig.from_file(small_path).with_overrides(**overrides) if small_path else job
    small = small_job.model if small_path else job.model.tiny()
    small.check_tp(tp)
    if _PROMPT + max_new_tokens > small.max_position_embeddings:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} plus the {_PROMPT}-token prompt exceeds the small "
            f"model's max_position_embeddings {small.max_position_embeddings}"
        )
    if workdir is not None:
        check_workdir(workdir)
    inputs = _Job(
        config_path,
        job,
        small_job,
        small,
        getattr(torch, overrides.get("dtype") or "float32"),
        steps,
        micro_batches,
        max_new_tokens,
        max_grad_norm,
    )
    state = init_parallel(
        tp=tp, pp=job.parallel.pp, dp=job.parallel.dp if overrides.get("dp") else None
    )
    path = None
    try:
        made = comm.everywhere(
            dist.group.WORLD,
            "creating the work directory",
            lambda: make_workdir(workdir) if state.rank == 0 else None,
            OSError,
        )
        path = share_path(made, dist.group.WORLD)
        status = _job(state, inputs, path, keep=workdir is not None, world=world, t_start=t_start)
        comm.barrier(dist.group.WORLD)  # every rank is done with the files
        return status
    finally:  # also after an error: no temporary checkpoints are left behind
        if state.rank == 0 and workdir is None and path is not None:
            shutil.rmtree(path, ignore_errors=True)
        destroy_parallel(destroy_process_group=True)


def _job(state, inputs: _Job, workdir: str, keep: bool, world: int, t_start: float) -> int:
    job, small_job, small, dtype = inputs.job, inputs.small_job, inputs.small, inputs.dtype
    steps, micro_batches = inputs.steps, inputs.micro_batches
    max_new_tokens, max_grad_norm = inputs.max_new_tokens, inputs.max_grad_norm
    full, config_path = job.model, inputs.config_path
    device = state.device
    is_main = state.rank == 0
    say = print if is_main else (lambda *a, **k: None)
    checks: list[tuple[str, bool]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, bool(ok)))
        say(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    say(
        f"tp-ext run: {world} ranks (tp={state.tp}, dp={state.dp}), backend {state.backend}, "
        f"torch {torch.__version__}, device {device}"
    )
    say(
        f"\n[1] footprint of {os.path.basename(config_path)} ({full.architecture}) at "
        f"TP={state.tp}, on the meta device:"
    )
    say(format_footprint(footprint(full, state.tp, job.parallel.dtype)))

    # -- 2. a small random checkpoint of the same family, in Hugging Face format -----------------
    tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
    hf_dir = os.path.join(workdir, "hf")
    torch.manual_seed(small_job.parallel.seed)
    if is_main:
        source = Qwen2ForCausalLM(small, tp_group=TPGroup.local(), dtype=dtype)
        source.save_pretrained(hf_dir, max_shard_bytes=200_000)
        del source
    comm.barrier(dist.group.WORLD)
    files = sorted(os.listdir(hf_dir))
    say(
        f"\n[2] small {small.architecture} model (vocab {small.vocab_size}, hidden "
        f"{small.hidden_size}, {small.num_attention_heads} heads / {small.num_key_value_heads} "
        f"KV heads, {small.num_hidden_layers} layers, {dtype}) written to {hf_dir}: "
        f"{len([f for f in files if f.endswith('.safetensors')])} safetensors files + index"
    )

    # -- 3. sharded load, parity with the single-process model -----------------------------------
    t0 = time.perf_counter()
    model = Qwen2ForCausalLM.from_pretrained(hf_dir, tp_group=state.tp_group, device=device)
    load_s = time.perf_counter() - t0
    report = model.load_report
    reference = Qwen2ForCausalLM.from_pretrained(
        hf_dir, tp_group=TPGroup.local(), device=device, progress=False
    )
    say(
        f"\n[3] loaded across {state.tp} ranks in {load_s:.2f} s; rank 0 read "
        f"{report['read_bytes']:,} of {report['checkpoint_bytes']:,} bytes (its shard: "
        f"{report['shard_bytes']:,})"
    )
    ids = _data(small, 4, 24, seed=small_job.parallel.seed + 1).to(device)
    with torch.no_grad():
        logits, expected = model(ids), reference(ids)
    scale = expected.abs().max().item()
    diff = (logits - expected).abs().max().item()
    check(
        "logits equal the single-process model",
        diff <= tolerance * scale,
        f"max |diff| {diff:.2e} (logit scale {scale:.2f})",
    )
    with torch.no_grad():
        loss_tp = vocab_parallel_cross_entropy(
            model(ids[:, :-1], local_logits=True), ids[:, 1:], tp_group=state.tp_group
        )
        loss_ref = F.cross_entropy(
            expected[:, :-1].reshape(-1, small.vocab_size).float(), ids[:, 1:].reshape(-1)
        )
    check(
        "vocab-parallel loss equals F.cross_entropy",
        abs(loss_tp.item() - loss_ref.item()) <= tolerance * max(1.0, loss_ref.item()),
        f"{loss_tp.item():.6f} vs {loss_ref.item():.6f}",
    )
    prompt = ids[:, :6]
    same = torch.equal(model.generate(prompt, 8), reference.generate(prompt, 8))
    check("greedy tokens equal the single-process model", same)
    del reference

    # -- 4. training ---------------------------------------------------------------------------
    trainer = Trainer(
        model,
        build_optimizer(model, small_job.optimizer),
        max_grad_norm=max_grad_norm,
        dp_group=state.dp_group if state.dp > 1 else None,
    )
    batch = _data(small, 4 * micro_batches * state.dp, 32, seed=small_job.parallel.seed + 2)
    mine = batch.chunk(state.dp)[state.dp_rank].to(device)  # this DP rank's part
    chunks = list(mine.chunk(micro_batches))
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        losses.append(trainer.step(chunks))
    train_s = time.perf_counter() - t0
    train_tokens = batch.numel() * steps
    say(
        f"\n[4] {steps} training steps (AdamW lr {small_job.optimizer.lr:g}, {micro_batches} "
        f"micro-batches per step, clip {max_grad_norm}): loss "
        + " -> ".join(f"{x:.3f}" for x in losses)
    )
    check(
        "training loss goes down at every step",
        all(b < a for a, b in zip(losses, losses[1:])),
        f"{losses[0]:.3f} -> {losses[-1]:.3f}",
    )

    # -- 5. sharded save/reload, merged export ---------------------------------------------------
    sharded = os.path.join(workdir, "sharded")
    checkpoint.save_sharded(model, sharded, step=steps)
    fresh = Qwen2ForCausalLM(small, tp_group=state.tp_group, device=device, dtype=dtype)
    info = checkpoint.load_sharded(fresh, sharded)
    bitwise = all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values())
    )
    check("sharded DCP checkpoint reloads bitwise", bitwise and info["step"] == steps)
    del fresh
    model.save_pretrained(os.path.join(workdir, "export"))
    say(
        f"\n[5] saved {sharded} (DCP, one file per rank) and a merged Hugging Face export in "
        f"{os.path.join(workdir, 'export')}"
        + ("" if keep else " (temporary; --workdir keeps them)")
    )

    # -- 6. generation, throughput, memory -------------------------------------------------------
    prompt = ids[:, :_PROMPT]
    t0 = time.perf_counter()
    tokens = model.generate(prompt, max_new_tokens)
    gen_s = time.perf_counter() - t0
    generated = tokens.numel() - prompt.numel()
    check(
        "generation produced every token",
        tokens.shape == (prompt.size(0), _PROMPT + max_new_tokens),
    )
    say(
        f"\n[6] generated {max_new_tokens} tokens x {prompt.size(0)} sequences with the KV "
        f"cache; first sequence: {tokens[0, _PROMPT:].tolist()}"
    )
    memory = _memory(device)
    rows = _gather_rows(
        [
            memory["peak_rss_mib"],
            memory.get("peak_gpu_mib", 0.0),
            report["shard_bytes"] / 2**20,
            report["peak_rss_increase_bytes"] / 2**20,
        ],
        device,
    )
    say(
        f"    training {train_tokens / train_s:,.0f} tokens/s; generation "
        f"{generated / gen_s:,.1f} tokens/s ({gen_s / max_new_tokens * 1e3:.1f} ms per step)"
    )
    say(
        "    rank  peak host MiB"
        + ("  peak GPU MiB" if device.type == "cuda" else "")
        + "  shard MiB  host MiB added while loading"
    )
    for r, (rss, gpu, shard, load) in enumerate(rows):
        say(
            f"    {r:>4}  {rss:>13.1f}"
            + (f"  {gpu:>12.1f}" if device.type == "cuda" else "")
            + f"  {shard:>9.3f}  {load:>10.1f}"
        )
    say(
        "    (peak host memory is mostly the Python and torch runtime; the load adds the shard "
        "plus at most one 16 MiB read piece, see docs/checkpoints.md)"
    )

    flags = torch.tensor(
        [min((ok for _, ok in checks), default=True)], dtype=torch.float32, device=device
    )
    passed = comm.all_reduce(flags, "min", group=dist.group.WORLD).item() == 1.0
    say(
        f"\n{'all checks passed' if passed else 'SOME CHECKS FAILED'} on {world} ranks in "
        f"{time.perf_counter() - t_start:.1f} s"
    )
    return 0 if passed else 1
