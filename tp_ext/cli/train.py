"""``tp-ext train CONFIG --data TOKENS.bin --steps N --checkpoint-dir DIR`` under torchrun: train
the config's model on a token file at any TP x PP x DP layout, saving resumable checkpoints.

- The model is built from the config's seed; the data is :class:`tp_ext.data.TokenBatches`
  (``data:`` section: sequence length, global batch, micro-batch size, seed), the optimizer
  AdamW with the ``optimizer:`` section's schedule, the step the Trainer's (pipeline schedule,
  DDP or FSDP2, clipping).
- Every ``save_every`` steps, and after the last, the whole training state goes to
  ``DIR/step-<N>`` (atomic; asynchronous with ``checkpoint.async_save``); the newest
  ``keep_last`` are kept.
- If DIR holds a complete checkpoint, the run continues from the newest one when ``--resume``
  is given or torchrun restarted a run that had started (its agent store remembers); otherwise
  it refuses to start, so nothing is overwritten. Saved at another layout, it is resharded.
  A checkpoint already at ``--steps`` ends the run at once; one beyond it is refused.
- Rank 0 appends ``{"step", "loss", "grad_norm", "lr", "tokens_per_s"}`` per step to
  ``DIR/metrics.jsonl`` (on resume the lines after the checkpoint's step are dropped first, so
  each step appears once) and prints progress to stderr.

An application on top of the library: it uses only public tp_ext names.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import Optional

import torch
import torch.distributed as dist

import tp_ext
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.cli.run import degrees_of, flag_namer
from tp_ext.config import JobConfig, check_pipeline_fields
from tp_ext.data import TokenBatches, TokenFile
from tp_ext.distributed import comm, destroy_parallel, init_parallel, launcher_store
from tp_ext.models import Qwen2ForCausalLM
from tp_ext.training import Trainer, build_lr_scheduler, build_optimizer
from tp_ext.training.checkpoint_dir import keep_newest, newest, remove_unpublished, step_path
from tp_ext.validation import ConfigError

__all__ = ["train", "METRICS"]

METRICS = "metrics.jsonl"


@dataclasses.dataclass
class _Run:
    job: JobConfig
    tokens: TokenFile
    directory: str
    steps: int
    resume: bool
    max_grad_norm: float
    tp: int
    pp: int
    dp: int
    micro_batches: int


def train(
    config_path: str,
    overrides: dict,
    *,
    data: Optional[str] = None,
    steps: int,
    checkpoint_dir: Optional[str] = None,
    save_every: Optional[int] = None,
    keep_last: Optional[int] = None,
    async_save: Optional[bool] = None,
    resume: bool = False,
    max_grad_norm: float = 1.0,
) -> int:
    """``overrides``: the parallel and optimizer fields the flags set (None: as the config has
    them). Everything is checked before torch.distributed starts."""
    checkpoint = {"dir": checkpoint_dir, "save_every": save_every, "keep_last": keep_last}
    checkpoint["async_save"] = async_save
    run = _check(config_path, overrides, data, checkpoint, steps, resume, max_grad_norm)
    one_process_unless_launched("train")
    state = init_parallel(tp=run.tp, pp=run.pp, dp=run.dp)
    try:
        status = _train(state, run)
        # Every rank done before any tears its connections down: a rank still finishing its
        # last collective when a peer destroyed the group was seen to abort at exit (SIGABRT,
        # "terminate called without an active exception"), as `tp-ext run` already avoids.
        comm.barrier(dist.group.WORLD)
        return status
    finally:
        destroy_parallel(destroy_process_group=True)


def _check(config_path, overrides, data, checkpoint, steps, resume, max_grad_norm) -> _Run:
    """The run, from the config and the flags (``checkpoint``: the checkpoint section's flags,
    None where not given), every value and rule checked."""
    job = JobConfig.from_file(config_path).with_overrides(**overrides)
    data_settings = job.data if data is None else dataclasses.replace(job.data, path=data)
    given = {k: v for k, v in checkpoint.items() if v is not None}
    job = dataclasses.replace(
        job, data=data_settings, checkpoint=dataclasses.replace(job.checkpoint, **given)
    )
    if job.data.path is None:
        raise ConfigError("no token file: give --data TOKENS.bin (or data.path in the config)")
    if job.checkpoint.dir is None:
        raise ConfigError(
            "no checkpoint directory: give --checkpoint-dir DIR (or checkpoint.dir in the config)"
        )
    if os.path.exists(job.checkpoint.dir) and not os.path.isdir(job.checkpoint.dir):
        raise ConfigError(f"--checkpoint-dir {job.checkpoint.dir} exists and is not a directory")
    tokens = TokenFile(job.data.path, job.data.dtype)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    tp, pp, dp = degrees_of(job.parallel, overrides, world)
    job.model.check_tp(tp)
    if job.data.seq_len > job.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len {job.data.seq_len} is above the model's max_position_embeddings "
            f"{job.model.max_position_embeddings}: use sequences of at most "
            f"{job.model.max_position_embeddings} tokens"
        )
    name = flag_namer(overrides)
    micro_batches = job.data.micro_batches(dp)
    p = job.parallel
    if p.micro_batches is not None and p.micro_batches != micro_batches:
        raise ConfigError(
            f"{name('micro_batches')} {p.micro_batches} disagrees with the data section: "
            f"data.global_batch {job.data.global_batch} / (dp {dp} x data.micro_batch_size "
            f"{job.data.micro_batch_size}) = {micro_batches} micro-batches per step; leave "
            f"{name('micro_batches')} out"
        )
    fields = dict(dataclasses.asdict(p), pp=pp, micro_batches=micro_batches)
    check_pipeline_fields(
        fields, lambda f: "data.global_batch" if f == "micro_batches" else name(f)
    )
    stages = pp * p.virtual_stages
    if job.model.num_hidden_layers < stages:
        raise ConfigError(
            f"the model's {job.model.num_hidden_layers} decoder layers cannot fill {stages} "
            f"pipeline stages ({name('pp')} {pp} x {name('virtual_stages')} {p.virtual_stages})"
        )
    return _Run(
        job, tokens, job.checkpoint.dir, steps, resume, max_grad_norm, tp, pp, dp, micro_batches
    )


def _build(state, run: _Run):
    job, p = run.job, run.job.parallel
    torch.manual_seed(p.seed)  # the same initial weights at every layout
    tp_ext.random.manual_seed(p.seed)
    model = Qwen2ForCausalLM(
        job.model,
        parallel=state,
        virtual_stages=p.virtual_stages,
        stage_order=p.stage_order,
        dtype=getattr(torch, p.dtype),
    )
    batches = TokenBatches(
        run.tokens,
        seq_len=job.data.seq_len,
        global_batch=job.data.global_batch,
        micro_batch_size=job.data.micro_batch_size,
        dp_rank=state.dp_rank,
        dp_size=state.dp,
        seed=job.data.seed,
        vocab_size=job.model.vocab_size,
    )
    return Trainer(
        model,
        # called after DDP/FSDP2 wrapping, so FSDP2's sharded parameters are the ones stepped
        optimizer=lambda params: build_optimizer(model, job.optimizer),
        parallel=state,
        schedule=p.schedule,
        max_grad_norm=run.max_grad_norm,
        data_parallel=p.data_parallel,
        activation_checkpointing=p.activation_checkpointing,
        lr_scheduler=lambda optimizer: build_lr_scheduler(optimizer, job.optimizer, run.steps),
        data=batches,
    )


_ACCEPTED = "tp_ext/train/accepted"  # in torchrun's agent store: attempt 0 passed the checks


def _start(state, run: _Run, trainer: Trainer) -> Optional[int]:
    """Resume from the newest complete checkpoint in the directory, if there is one and resuming
    is asked for (or torchrun restarted a run that had started). Returns the step resumed from,
    or None for a fresh start."""
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0

    def look():
        if state.rank != 0:
            return ""
        os.makedirs(run.directory, exist_ok=True)
        remove_unpublished(run.directory)
        found = newest(run.directory)
        if found is not None and not (run.resume or _started_before(restarted)):
            raise ConfigError(
                f"{run.directory} holds checkpoints (the newest after step {found[0]}): pass "
                "--resume to continue from it, or give another --checkpoint-dir"
            )
        if found is not None and found[0] > run.steps:
            raise ConfigError(
                f"--steps {run.steps} is below the step of the newest checkpoint in "
                f"{run.directory} ({found[0]}): give --steps {found[0] + 1} or more to train on"
            )
        store = launcher_store()
        if store is not None:
            store.set(_ACCEPTED, "1")  # a restart of this run may resume by itself
        return json.dumps(None if found is None else list(found))

    found = json.loads(
        comm.broadcast_text(
            comm.everywhere(
                dist.group.WORLD, "reading the checkpoint directory", look, ConfigError
            ),
            0,
            dist.group.WORLD,
        )
    )
    if found is None:
        _keep_metrics(state, run.directory, 0)
        return None
    step, path = found
    if step == run.steps:
        return step  # nothing left to train; the caller says so
    wanted = _schedule_of(trainer)
    info = trainer.load_checkpoint(path)  # restores the checkpoint's schedule
    _check_schedule(wanted, _schedule_of(trainer))
    if (info.get("lr_scheduler") or {}).get("lr_lambdas", [None])[0] is None and state.rank == 0:
        print(
            f"tp-ext train: {path} was saved before checkpoints held their LR schedule, so "
            "only its base lr was checked: give the schedule flags it was trained with "
            "(--decay-steps when --steps changed)",
            file=sys.stderr,
        )
    _keep_metrics(state, run.directory, trainer.steps)
    if state.rank == 0:
        saved = info.get("layout", {})
        where = " ".join(f"{k}={saved.get(k)}" for k in ("tp", "pp", "dp"))
        print(
            f"tp-ext train: resumed from {path} (step {trainer.steps}, saved at {where})",
            file=sys.stderr,
        )
    return trainer.steps


def _started_before(restarted: bool) -> bool:
    """Whether this is a torchrun restart of a run that had passed its checks: only then does a
    restart resume without --resume. (A run refused for want of --resume fails, and torchrun
    restarts it: that restart must be refused too.)"""
    if not restarted:
        return False
    store = launcher_store()
    return store is None or store.check([_ACCEPTED])


# the flag that sets each field of LRSchedule.settings()
_SCHEDULE_FLAG = {
    "lr": "--lr",
    "lr_schedule": "--lr-schedule",
    "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr",
    "decay_end": "--decay-steps",
}


def _schedule_of(trainer: Trainer) -> dict:
    # base_lrs: restored from every checkpoint, also those older than the saved settings
    scheduler = trainer.lr_scheduler
    return {**scheduler.lr_lambdas[0].settings(), "lr": scheduler.base_lrs[0]}


def _check_schedule(wanted: dict, saved: dict) -> None:
    """The schedule resumes from the checkpoint (as Megatron-Core does by default): a run asking
    for another one (another LR, shape, warmup, floor, or decay end, which is --steps unless
    --decay-steps is given) is refused rather than silently changed mid-run. Every rank holds
    the same schedule, so every rank raises."""
    # a field one of them lacks (a constant schedule's decay) follows from lr_schedule differing
    both = [k for k in _SCHEDULE_FLAG if k in wanted and k in saved]
    differ = [k for k in both if not _same(wanted[k], saved[k])]
    if not differ:
        return
    said = "; ".join(f"{k} {_show(saved[k])} there, {_show(wanted[k])} here" for k in differ)
    # another shape: every field of the saved one, so that the next try is not refused again
    give = list(saved) if "lr_schedule" in differ else differ
    give = [k for k in _SCHEDULE_FLAG if k in give and not _same(wanted.get(k), saved[k])]
    keep = " ".join(f"{_SCHEDULE_FLAG[k]} {_show(saved[k])}" for k in give)
    why = (
        " (the decay ends at --steps unless --decay-steps is given)"
        if "decay_end" in differ
        else ""
    )
    raise ConfigError(
        f"the checkpoint's LR schedule differs from this run's: {said}{why}. A resumed run keeps "
        f"its schedule: give {keep}, or start a new run in another --checkpoint-dir"
    )


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _keep_metrics(state, directory: str, step: int) -> None:
    """Keep the metrics of steps up to ``step`` (those a resumed run does not repeat); a line
    cut short by a kill is dropped."""
    if state.rank != 0:
        return
    path = os.path.join(directory, METRICS)
    if not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                if entry["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    temp = path + ".tmp"
    with open(temp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def _train(state, run: _Run) -> int:
    trainer = _build(state, run)
    first = _start(state, run, trainer) or 0
    if first == run.steps:
        if state.rank == 0:
            print(
                f"tp-ext train: {run.directory} already holds the checkpoint after step "
                f"{run.steps}; nothing to train (give a larger --steps to go on)",
                file=sys.stderr,
            )
        return 0
    settings = run.job.checkpoint
    tokens_per_step = run.job.data.global_batch * run.job.data.seq_len
    metrics = open(os.path.join(run.directory, METRICS), "a") if state.rank == 0 else None
    started = time.perf_counter()
    try:
        while trainer.steps < run.steps:
            t0 = time.perf_counter()
            lr = trainer.optimizer.param_groups[0]["lr"]
            loss = trainer.step(next(trainer.data))
            seconds = time.perf_counter() - t0
            entry = {
                "step": trainer.steps,
                "loss": loss,
                "grad_norm": trainer.last_grad_norm,
                "lr": float(lr),
                "tokens_per_s": tokens_per_step / seconds,
            }
            if metrics is not None:
                metrics.write(json.dumps(entry) + "\n")
                metrics.flush()
                os.fsync(metrics.fileno())
                _progress(entry, run.steps, first, time.perf_counter() - started)
            if trainer.steps % settings.save_every == 0 or trainer.steps == run.steps:
                _save(state, run, trainer, settings)
        trainer.wait_for_checkpoint()
        if state.rank == 0:
            keep_newest(run.directory, settings.keep_last)
    finally:
        if metrics is not None:
            metrics.close()
    return 0


def _save(state, run: _Run, trainer: Trainer, settings) -> None:
    trainer.wait_for_checkpoint()  # the previous one published: older ones may go
    if state.rank == 0:
        keep_newest(run.directory, settings.keep_last)
    trainer.save_checkpoint(step_path(run.directory, trainer.steps), async_save=settings.async_save)


def _progress(entry: dict, total: int, first: int, elapsed: float) -> None:
    done = entry["step"] - first
    eta = elapsed / done * (total - entry["step"]) if done else 0.0
    norm = entry["grad_norm"]
    print(
        f"step {entry['step']}/{total} loss {entry['loss']:.4f} grad_norm "
        f"{'-' if norm is None else f'{norm:.3g}'} lr {entry['lr']:.3g} tok/s "
        f"{entry['tokens_per_s']:.0f} eta {int(eta // 60)}m{int(eta % 60):02d}s",
        file=sys.stderr,
        flush=True,
    )


# ---- the command line: tp-ext train's flags, and its main ----------------------------------------

HELP = (
    "train the config's model on a token file (launch with torchrun), saving resumable "
    "checkpoints; resumes after a kill, at any layout"
)
_SCHEDULE_FIELDS = ("lr_schedule", "warmup_steps", "min_lr", "decay_steps")


def add_arguments(parser) -> None:
    from tp_ext.cli.flags import RUN_FIELDS, TRAIN_FIELDS, add_field_flag, add_override_flags
    from tp_ext.config import CHECKPOINT_FIELDS
    from tp_ext.training.optimizer import OPTIMIZER_FIELDS

    parser.add_argument(
        "config",
        help="tp_ext YAML/JSON job config (model, parallel, optimizer, data, checkpoint sections)",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="token file (flat uint16/uint32 ids; default: the config's data.path)",
    )
    add_field_flag(parser, "steps", TRAIN_FIELDS["steps"], required=True)
    parser.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoints step-<N> and metrics.jsonl go here (default: the config's "
        "checkpoint.dir)",
    )
    for name, rule in CHECKPOINT_FIELDS.items():
        default = "the config's, else all" if name == "keep_last" else "the config's"
        add_field_flag(parser, name, rule, default)
    parser.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest complete checkpoint in the directory (automatic after a "
        "torchrun restart)",
    )
    add_field_flag(parser, "max_grad_norm", RUN_FIELDS["max-grad-norm"], "1.0", default=1.0)
    add_override_flags(
        parser,
        {
            "tp": "the ranks PP and DP leave",
            "dp": "the ranks TP and PP leave",
            "dtype": "the config's parallel.dtype",
        },
    )
    schedule = parser.add_argument_group("overrides of the config's LR schedule")
    for name in _SCHEDULE_FIELDS:
        add_field_flag(schedule, name, OPTIMIZER_FIELDS[name])


def main(args) -> int:
    from tp_ext.cli.auto import auto_overrides
    from tp_ext.cli.flags import overrides_of

    overrides = {**overrides_of(args), **{f: getattr(args, f) for f in _SCHEDULE_FIELDS}}
    if args.auto:  # the planner's layout for the config's model
        job = JobConfig.from_file(args.config)
        dtype = overrides["dtype"] or job.parallel.dtype
        overrides = auto_overrides(job.model, job.data, overrides, dtype)
    return train(
        args.config,
        overrides,
        data=args.data,
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        keep_last=args.keep_last,
        async_save=args.async_save,
        resume=args.resume,
        max_grad_norm=args.max_grad_norm,
    )
