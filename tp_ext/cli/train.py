"""``tp-ext train CONFIG --data TOKENS.bin --steps N --checkpoint-dir DIR`` under torchrun: train
the config's model on a token file at any TP x PP x DP dims, saving resumable checkpoints.

- ``--model DIR_OR_CONFIG`` (or a job config whose ``model:`` is such a path) trains any
  transformers decoder ``parallelize(model, "auto")`` converts instead of tp_ext's Qwen2: from a
  checkpoint directory its weights (each rank reading its slices), from a config.json random
  weights drawn from the seed (equal at any dims); after the last step the trained model is
  written merged to ``DIR/export`` (config.json + safetensors: ``from_pretrained`` loads it).
- The model is built from the config's seed; the data is :class:`tp_ext.data.TokenBatches`
  (``data:`` section: sequence length, global batch, micro-batch size, seed), the optimizer
  AdamW with the ``optimizer:`` section's schedule, the step the Trainer's (pipeline schedule,
  DDP or FSDP2, clipping).
- Every ``save_every`` steps, and after the last, the whole training state goes to
  ``DIR/step-<N>`` (atomic; asynchronous with ``checkpoint.async_save``); the newest
  ``keep_last`` are kept.
- If DIR holds a complete checkpoint, the run continues from the newest one when ``--resume``
  is given or torchrun restarted a run that had started (its agent store remembers); otherwise
  it refuses to start, so nothing is overwritten. Saved at other dims, it is resharded.
  A checkpoint already at ``--steps`` ends the run at once; one beyond it is refused.
- Rank 0 appends ``{"step", "loss", "grad_norm", "lr", "tokens_per_s"}`` per step to
  ``DIR/metrics.jsonl`` (on resume the lines after the checkpoint's step are dropped first, so
  each step appears once) and prints progress to stderr.

An application on top of the library: it uses only public tp_ext names.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Optional

import torch
import torch.distributed as dist

import tp_ext
from tp_ext.checkpoint import save_hf_checkpoint
from tp_ext.cli.auto import auto_overrides
from tp_ext.cli.flags import (
    RUN_FIELDS,
    TRAIN_FIELDS,
    add_field_flag,
    add_override_flags,
    overrides_of,
)
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.cli.logs import LOG
from tp_ext.config import (
    CHECKPOINT_FIELDS,
    DATA_FIELDS,
    JobConfig,
    check_expert_parallel,
    check_pipeline_fields,
    flag_namer,
    job_dims,
)
from tp_ext.data import TokenBatches, TokenFile
from tp_ext.distributed import comm, destroy_parallel, init_parallel, launcher_store
from tp_ext.models import Qwen2ForCausalLM
from tp_ext.models.hf.source import HFModelSource
from tp_ext.parallelize.context import CP_ARCHITECTURES
from tp_ext.training import Trainer
from tp_ext.training.loop import Wording
from tp_ext.training.optimizer import OPTIMIZER_FIELDS
from tp_ext.validation import ConfigError, as_torch_dtype

__all__ = ["train", "METRICS"]

METRICS = "metrics.jsonl"
EXPORT = "export"  # a transformers model's trained weights, merged (config.json + safetensors)


@dataclasses.dataclass
class _Run:
    job: JobConfig
    tokens: TokenFile
    directory: str
    steps: int
    resume: bool
    max_grad_norm: float
    dims: tp_ext.ParallelDims  # resolved: every degree filled
    micro_batches: int


def train(
    config_path: Optional[str],
    overrides: dict,
    *,
    model: Optional[str] = None,
    data: Optional[str] = None,
    seq_len: Optional[int] = None,
    steps: int,
    checkpoint_dir: Optional[str] = None,
    save_every: Optional[int] = None,
    keep_last: Optional[int] = None,
    async_save: Optional[bool] = None,
    resume: bool = False,
    max_grad_norm: float = 1.0,
) -> int:
    """``overrides``: the parallel and optimizer fields the flags set (None: as the config has
    them). ``model``: a transformers checkpoint directory or config.json to train instead of
    the config's model (no config needed then: the other sections take their defaults).
    Everything is checked before torch.distributed starts."""
    checkpoint = {"dir": checkpoint_dir, "save_every": save_every, "keep_last": keep_last}
    checkpoint["async_save"] = async_save
    job = JobConfig.for_command(config_path, model)
    if seq_len is not None:  # --seq-len: the data section's, as the flag says
        job = dataclasses.replace(job, data=dataclasses.replace(job.data, seq_len=seq_len))
    run = _check(job, overrides, data, checkpoint, steps, resume, max_grad_norm)
    one_process_unless_launched("train")
    state = init_parallel(run.dims)
    try:
        status = _train(state, run)
        # Every rank done before any tears its connections down: a rank still finishing its
        # last collective when a peer destroyed the group was seen to abort at exit (SIGABRT,
        # "terminate called without an active exception"), as `tp-ext run` already avoids.
        comm.barrier(dist.group.WORLD)
        return status
    finally:
        destroy_parallel(destroy_process_group=True)


def _check_vocabulary(tokens: TokenFile, vocab_size: int) -> None:
    """A token file whose sidecar names a vocabulary larger than the model's is refused before
    anything runs (its ids could index past the embedding)."""
    if tokens.meta is None or tokens.meta.get("vocab_size", 0) <= vocab_size:
        return
    raise ConfigError(
        f"--data {tokens.path}: tokenized with a vocabulary of {tokens.meta['vocab_size']} ids "
        f"({tokens.meta.get('tokenizer')}), more than the model's vocab_size {vocab_size}: "
        "tokenize with the model's own tokenizer"
    )


def _check(job, overrides, data, checkpoint, steps, resume, max_grad_norm) -> _Run:
    """The run, from the config and the flags (``checkpoint``: the checkpoint section's flags,
    None where not given), every value and rule checked."""
    job = job.with_overrides(**overrides)
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
    _check_vocabulary(tokens, job.model.vocab_size)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    dims = job_dims(job.parallel, overrides, world)
    job.model.check_tp(dims.tp)
    check_expert_parallel(job.model, dims, flag_namer(overrides))
    kind = getattr(getattr(job.model, "hf_config", None), "model_type", None)
    if dims.cp > 1 and isinstance(job.model, HFModelSource) and kind not in CP_ARCHITECTURES:
        raise ConfigError(
            f"{flag_namer(overrides)('cp')} {dims.cp}: context parallelism runs transformers' "
            f"{', '.join(CP_ARCHITECTURES)} decoders (and tp_ext's Qwen2); this model is "
            f"{kind!r}: use cp=1 with it"
        )
    if job.data.seq_len > job.model.max_position_embeddings:
        raise ConfigError(
            f"data.seq_len {job.data.seq_len} is above the model's max_position_embeddings "
            f"{job.model.max_position_embeddings}: use sequences of at most "
            f"{job.model.max_position_embeddings} tokens"
        )
    name = flag_namer(overrides)
    micro_batches = job.data.micro_batches(dims.dp)
    p = job.parallel
    if p.micro_batches is not None and p.micro_batches != micro_batches:
        raise ConfigError(
            f"{name('micro_batches')} {p.micro_batches} disagrees with the data section: "
            f"data.global_batch {job.data.global_batch} / (dp {dims.dp} x data.micro_batch_size "
            f"{job.data.micro_batch_size}) = {micro_batches} micro-batches per step; leave "
            f"{name('micro_batches')} out"
        )
    fields = dict(dataclasses.asdict(p), pp=dims.pp, micro_batches=micro_batches)
    check_pipeline_fields(
        fields, lambda f: "data.global_batch" if f == "micro_batches" else name(f)
    )
    if job.model.num_hidden_layers < dims.stages:
        raise ConfigError(
            f"the model's {job.model.num_hidden_layers} decoder layers cannot fill {dims.stages} "
            f"pipeline stages ({name('pp')} {dims.pp} x {name('virtual_stages')} "
            f"{dims.virtual_stages})"
        )
    return _Run(job, tokens, job.checkpoint.dir, steps, resume, max_grad_norm, dims, micro_batches)


def _build(state, run: _Run):
    job, p = run.job, run.job.parallel
    torch.manual_seed(p.seed)  # the same initial weights at any dims
    tp_ext.random.manual_seed(p.seed)
    options = dict(virtual_stages=p.virtual_stages, stage_order=p.stage_order)
    if isinstance(job.model, HFModelSource):  # parallelize("auto") of the transformers model
        options["cp_mode"] = p.cp_mode
        model = job.model.build(state, dtype=as_torch_dtype(p.dtype), seed=p.seed, **options)
    else:
        dtype = as_torch_dtype(p.dtype)
        model = Qwen2ForCausalLM(
            job.model, parallel=state, dtype=dtype, cp_mode=p.cp_mode, **options
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
    return Trainer.from_config(
        job, model, state, steps=run.steps, max_grad_norm=run.max_grad_norm, data=batches
    )


_ACCEPTED = "tp_ext/train/accepted"  # in torchrun's agent store: attempt 0 passed the checks


def _started_before(restarted: bool) -> bool:
    """Whether this is a torchrun restart of a run that had passed its checks: only then does a
    restart resume without --resume. (A run refused for want of --resume fails, and torchrun
    restarts it: that restart must be refused too.)"""
    if not restarted:
        return False
    store = launcher_store()
    return store is None or store.check([_ACCEPTED])


def _accept() -> None:
    """The run passed its checks: a torchrun restart of it may resume by itself."""
    store = launcher_store()
    if store is not None:
        store.set(_ACCEPTED, "1")


# the flag that sets each field of LRSchedule.settings(), and fit's arguments
_FLAG = {
    "lr": "--lr",
    "lr_schedule": "--lr-schedule",
    "warmup_steps": "--warmup-steps",
    "min_lr": "--min-lr",
    "decay_end": "--decay-steps",
    "steps": "--steps",
    "resume": "--resume",
    "checkpoint_dir": "--checkpoint-dir",
}


class _Flags(Wording):
    """fit's errors in this command's words: its flags."""

    def arg(self, name: str, value=None) -> str:
        flag = _FLAG.get(name, "--" + name.replace("_", "-"))
        return flag if value is None or value is True else f"{flag} {self.show(value)}"

    def schedule(self, field: str, value=None) -> str:
        return self.arg(field, value)

    def decay_note(self) -> str:
        return "(the decay ends at --steps unless --decay-steps is given)"

    def schedule_hint(self) -> str:
        return "give the schedule flags it was trained with"


def _train(state, run: _Run) -> int:
    trainer = _build(state, run)
    settings = run.job.checkpoint
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    # only rank 0 reads the directory (and the launcher's store)
    resume = run.resume or (state.rank == 0 and _started_before(restarted))
    checkpoints = trainer.checkpoints(
        run.directory,
        every=settings.save_every,
        keep_last=settings.keep_last,
        async_save=settings.async_save,
        on_accept=_accept,
    )
    trainer.fit(
        trainer.data,
        run.steps,
        checkpoint_dir=checkpoints,
        resume=resume,
        metrics=[os.path.join(run.directory, METRICS), _progress(state, run.steps)],
        wording=_Flags(),
    )
    if isinstance(run.job.model, HFModelSource):  # a checkpoint transformers loads
        export = os.path.join(run.directory, EXPORT)
        save_hf_checkpoint(trainer.model, export)
        if state.rank == 0:
            LOG.info(f"tp-ext train: the trained model written to {export} (from_pretrained)")
    return 0


def _progress(state, total: int):
    """Rank 0's progress line per step (the tp_ext logger: stderr at --log-level info). fit's own
    notes (resumed from ..., nothing to train) come through the same logger."""
    started = time.perf_counter()
    first: list[int] = []

    def show(entry: dict) -> None:
        if state.rank != 0:
            return
        if not first:
            first.append(entry["step"] - 1)
        done = entry["step"] - first[0]
        elapsed = time.perf_counter() - started
        eta = elapsed / done * (total - entry["step"]) if done else 0.0
        norm = entry["grad_norm"]
        LOG.info(
            f"step {entry['step']}/{total} loss {entry['loss']:.4f} grad_norm "
            f"{'-' if norm is None else f'{norm:.3g}'} lr {entry['lr']:.3g} tok/s "
            f"{entry['tokens_per_s']:.0f} eta {int(eta // 60)}m{int(eta % 60):02d}s"
        )

    return show


# ---- the command line: tp-ext train's flags, and its main ----------------------------------------

HELP = (
    "train the config's model on a token file (launch with torchrun), saving resumable "
    "checkpoints; resumes after a kill, at any dims"
)
_SCHEDULE_FIELDS = ("lr_schedule", "warmup_steps", "min_lr", "decay_steps")


def add_arguments(parser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        help="tp_ext YAML/JSON job config (model, parallel, optimizer, data, checkpoint "
        "sections); optional with --model",
    )
    parser.add_argument(
        "--model",
        metavar="DIR_OR_CONFIG",
        help="train this transformers model (any architecture parallelize('auto') converts): a "
        "checkpoint directory (its weights, each rank reading its slices) or a config.json "
        "(random weights, equal at any dims); the trained model goes to "
        "CHECKPOINT_DIR/export",
    )
    parser.add_argument(
        "--data",
        default=None,
        help="token file (flat uint16/uint32 ids; default: the config's data.path)",
    )
    add_field_flag(parser, "steps", TRAIN_FIELDS["steps"], required=True)
    add_field_flag(parser, "seq_len", DATA_FIELDS["seq_len"], "the config's data.seq_len")
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
    overrides = {**overrides_of(args), **{f: getattr(args, f) for f in _SCHEDULE_FIELDS}}
    if args.auto:  # the planner's dims for the config's model
        job = JobConfig.for_command(args.config, args.model)
        dtype = overrides["dtype"] or job.parallel.dtype
        model = getattr(job.model, "hf_config", job.model)
        overrides = auto_overrides(model, job.data, overrides, dtype, job.parallel)
    return train(
        args.config,
        overrides,
        model=args.model,
        data=args.data,
        seq_len=args.seq_len,
        steps=args.steps,
        checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every,
        keep_last=args.keep_last,
        async_save=args.async_save,
        resume=args.resume,
        max_grad_norm=args.max_grad_norm,
    )
