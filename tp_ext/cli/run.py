"""The main job, ``tp-ext run CONFIG`` under torchrun: the full-size footprint of CONFIG, then a
model of the same family small enough for any machine, taken through everything the full one
needs, laid out TP x PP x DP (``--tp``, ``--pp``, ``--dp`` or the config's ``parallel:``
section; TP takes the ranks PP and DP leave). An application on top of the library: it uses
only public tp_ext names.

1. Print CONFIG's per-rank footprint at this TP degree (built on the meta device, nothing
   allocated).
2. Rank 0 writes a small random checkpoint in Hugging Face format (a sharded index).
3. Every rank loads its shard of its own pipeline stages (slice reads), and checks logits,
   loss and greedy tokens against the single-process model loaded from the same files.
4. A few training steps through the pipeline schedule (AdamW, micro-batches, DDP or FSDP2 over
   the DP replicas, each with its own data, clipping by the norm over every rank): the loss is
   the same on every rank, goes down, and equals a single-process model trained on every
   replica's data.
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
from typing import Optional

import torch.distributed as dist

from tp_ext.cli.auto import auto_overrides
from tp_ext.cli.flags import RUN_FIELDS, add_field_flag, add_override_flags, overrides_of
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.cli.logs import REPORT
from tp_ext.cli.run_hf import HFSelfCheck
from tp_ext.cli.self_check import PROMPT, RunInputs, SelfCheck
from tp_ext.cli.workdir import check_workdir, make_workdir, share_path
from tp_ext.config import (
    PARALLEL_FIELDS,
    JobConfig,
    check_expert_parallel,
    check_pipeline_fields,
    flag_namer,
    job_dims,
)
from tp_ext.distributed import comm, destroy_parallel, init_parallel
from tp_ext.models.hf.config import max_positions
from tp_ext.models.hf.shards import small_config
from tp_ext.models.hf.source import HFModelSource
from tp_ext.validation import ConfigError, as_torch_dtype, check_fields

__all__ = ["run", "add_arguments", "main"]


def run(
    config_path: Optional[str],
    overrides: dict,
    small_path: str | None = None,
    workdir: str | None = None,
    steps: int = 6,
    max_new_tokens: int = 16,
    max_grad_norm: float = 1.0,
    profile_dir: str | None = None,
    model: Optional[str] = None,
) -> int:
    """``overrides``: the config fields the flags set (None: as the config has it), e.g.
    ``{"tp": 2, "pp": 2, "schedule": "1F1B", "micro_batches": 4}``. ``model``: a transformers
    checkpoint directory or config.json (``--model``), run instead of the config's model (no
    config needed then); a job config may name one as its ``model:`` too."""
    # Everything a user gives is read and checked before torch.distributed starts.
    flags = {"steps": steps, "max-new-tokens": max_new_tokens, "max-grad-norm": max_grad_norm}
    check_fields("--", flags, RUN_FIELDS)
    t_start = time.perf_counter()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    from_file = JobConfig.for_command(config_path, model)
    transformers_model = isinstance(from_file.model, HFModelSource)
    if transformers_model and small_path:
        raise ConfigError(
            f"--small {small_path}: a transformers model runs as a small model of its own family "
            "that the job derives from it; drop --small"
        )
    job = _job_config(from_file, overrides)
    if overrides.get("tp"):
        job.model.check_tp(overrides["tp"])
    small_job = JobConfig.from_file(small_path).with_overrides(**overrides) if small_path else job
    dims = job_dims(job.parallel, overrides, world)
    if dims.cp > 1:
        raise ValueError(
            f"{flag_namer(overrides)('cp')} {dims.cp}: tp-ext run does not check context "
            "parallelism yet; train with it (tp-ext train --cp), or use cp=1 here"
        )
    job.model.check_tp(dims.tp)
    check_expert_parallel(job.model, dims, flag_namer(overrides))
    small = _small_model(job, small_job, small_path, dims, overrides)
    positions = max_positions(small) if transformers_model else small.max_position_embeddings
    if PROMPT + max_new_tokens > positions:
        raise ValueError(
            f"--max-new-tokens {max_new_tokens} plus the {PROMPT}-token prompt exceeds the small "
            f"model's max_position_embeddings {positions}"
        )
    if workdir is not None:
        check_workdir(workdir)
    inputs = RunInputs(
        config_path,
        job,
        small_job,
        small,
        as_torch_dtype(overrides.get("dtype") or "float32"),
        dims,
        steps,
        max_new_tokens,
        max_grad_norm,
        profile_dir,
    )
    return _launch(inputs, workdir, world, t_start)


def _job_config(from_file: JobConfig, overrides: dict) -> JobConfig:
    """The config with the flags' overrides, each rule checked under the name the user gave it
    (flag or field): the pipeline fields' rules among themselves, and what run cannot check."""
    fields = {f.name for f in dataclasses.fields(from_file.parallel)}
    given = {k: v for k, v in overrides.items() if k in fields and v is not None}
    merged = dict(dataclasses.asdict(from_file.parallel), **given)
    check_fields("--", {k.replace("_", "-"): v for k, v in given.items()}, _FLAG_FIELDS)
    check_pipeline_fields(merged, flag_namer(overrides))
    job = from_file.with_overrides(**overrides)
    if job.parallel.grad_reduce_dtype is not None:
        raise ValueError(
            f"{flag_namer(overrides)('grad_reduce_dtype')} {job.parallel.grad_reduce_dtype}: "
            "tp-ext run checks its training steps against one process exactly, which a "
            "reduced-precision gradient sum is not; train with it under tp-ext train"
        )
    return job


def _small_model(job: JobConfig, small_job: JobConfig, small_path, dims, overrides):
    """The model the job runs: --small's, a narrow copy of a transformers model, or a tiny one
    of the config's family; a layer or more per pipeline stage."""
    transformers_model = isinstance(job.model, HFModelSource)
    if transformers_model:  # the narrow copy's widths and counts, a layer or more per stage
        small = small_config(job.model.hf_config, max(2, dims.stages))
    else:
        small = small_job.model if small_path else job.model.tiny()
        small.check_tp(dims.tp)
    if small.num_hidden_layers < dims.stages:
        if small_path:
            name = flag_namer(overrides)
            raise ValueError(
                f"--small {small_path}: its {small.num_hidden_layers} decoder layers cannot fill "
                f"{name('pp')} {dims.pp} x {name('virtual_stages')} {dims.virtual_stages} = "
                f"{dims.stages} pipeline stages (each needs a layer); give a model of at least "
                f"{dims.stages} layers"
            )
        small = small.replace(num_hidden_layers=dims.stages)  # the tiny model: a layer per stage
    return small


def _launch(inputs: RunInputs, workdir: str | None, world: int, t_start: float) -> int:
    """Start the process groups, run the job in its work directory, and take them down."""
    one_process_unless_launched("run")
    state = init_parallel(inputs.dims)
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


# The parallel fields a flag can set, checked under the flag's name when run() is called from
# Python (argparse checks them on the command line).
_FLAG_FIELDS = {k.replace("_", "-"): rule for k, rule in PARALLEL_FIELDS.items()}


def _job(state, inputs: RunInputs, workdir: str, keep: bool, world: int, t_start: float) -> int:
    """The stages in order; 0 if every check passed on every rank, else 1."""
    if isinstance(inputs.job.model, HFModelSource):
        job = HFSelfCheck(state, inputs, workdir, keep, world)
    else:
        job = SelfCheck(state, inputs, workdir, keep, world)
    job.show_footprint()
    hf_dir = job.write_small_checkpoint()
    model, ids = job.load_and_compare(hf_dir)
    trainer, losses, batch, tokens_per_s = job.train(model)
    reference, trained, scale = job.compare_training(hf_dir, trainer, model, losses, batch, ids)
    job.save_and_reload(trainer, model, ids, trained, scale)
    generated, gen_s = job.generate(trainer, model, reference, ids)
    del reference
    job.throughput_and_memory(model, tokens_per_s, generated, gen_s)
    passed = job.passed_everywhere()
    REPORT.info(
        f"\n{'all checks passed' if passed else 'SOME CHECKS FAILED'} on {world} ranks "
        f"({inputs.job.parallel.describe(inputs.dims)}) in {time.perf_counter() - t_start:.1f} s"
    )
    return 0 if passed else 1


HELP = (
    "the main job (launch with torchrun): full-size plan, then a small model of the family "
    "loaded sharded, checked, trained, saved and sampled"
)


def add_arguments(parser) -> None:
    parser.add_argument(
        "config",
        nargs="?",
        default=None,
        help="tp_ext YAML/JSON config or a Hugging Face config.json (optional with --model)",
    )
    parser.add_argument(
        "--model",
        default=None,
        metavar="DIR_OR_CONFIG",
        help="a transformers model (checkpoint directory or config.json) of any architecture "
        "parallelize(model, 'auto') converts: the job runs a small model of its family against "
        "transformers itself",
    )
    parser.add_argument(
        "--small",
        default=None,
        help="config of the model actually run (default: a tiny model of CONFIG's family)",
    )
    parser.add_argument(
        "--workdir",
        default=None,
        help="keep the checkpoints in this directory (created if absent). An existing one must "
        "be empty or one an earlier tp-ext run wrote: anything else is refused, never written "
        "into. Default: a fresh private temporary directory (mode 0700), removed at the end",
    )
    add_override_flags(
        parser,
        {
            "tp": "the ranks PP and DP leave; the config's tp is the plan's",
            "dp": "the ranks TP and PP leave",
            "dtype": "float32",
        },
    )
    add_field_flag(parser, "steps", RUN_FIELDS["steps"], "6", default=6)
    add_field_flag(parser, "max_new_tokens", RUN_FIELDS["max-new-tokens"], "16", default=16)
    add_field_flag(parser, "max_grad_norm", RUN_FIELDS["max-grad-norm"], "1.0", default=1.0)
    parser.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="write a torch.profiler trace of the training steps to DIR/trace_rank<r>.json "
        "(chrome://tracing or ui.perfetto.dev; tp_ext's tags show as ranges)",
    )


def main(args) -> int:
    overrides = overrides_of(args)
    if args.auto:  # the planner's dims for the model this job runs: --small's, else a tiny one
        job = JobConfig.for_command(args.config, args.model)
        if isinstance(job.model, HFModelSource):
            model = small_config(job.model.hf_config, 2)
        else:
            model = JobConfig.from_file(args.small).model if args.small else job.model.tiny()
        dtype = overrides["dtype"] or job.parallel.dtype
        overrides = auto_overrides(model, job.data, overrides, dtype, job.parallel)
    return run(
        args.config,
        overrides,
        small_path=args.small,
        workdir=args.workdir,
        steps=args.steps,
        max_new_tokens=args.max_new_tokens,
        max_grad_norm=args.max_grad_norm,
        profile_dir=args.profile,
        model=args.model,
    )
