"""``tp-ext`` (also ``python -m tp_ext``): the command-line applications on top of the library.
Each command lives in its own module (``run``, ``train``, ``demo``); this one parses the arguments.

    torchrun --standalone --nproc-per-node 8 -m tp_ext run configs/qwen2-72b.yaml
    torchrun --standalone --nproc-per-node 4 --max-restarts 3 -m tp_ext train \
        configs/train-tiny.yaml --data tokens.bin --steps 100 --checkpoint-dir ckpt
    tp-ext plan configs/qwen2-72b.yaml --tp 8 --pp 4
    torchrun --standalone --nproc-per-node 4 -m tp_ext demo
"""

from __future__ import annotations

import argparse
import os
import sys

from tp_ext.cli.flags import BETA, RUN_FIELDS, TRAIN_FIELDS, flag_type
from tp_ext.cli.launch import launch_variables_restored
from tp_ext.config import CHECKPOINT_FIELDS, DTYPES, PARALLEL_FIELDS
from tp_ext.planner.hardware import HARDWARE as HARDWARE_NAMES
from tp_ext.sharding import STAGE_ORDERS, divisors
from tp_ext.training.optimizer import OPTIMIZER_FIELDS


def _demo(args) -> int:
    from tp_ext.cli.demo import demo

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is not None and world % args.tp:
        # every rank says it: torchrun stops the others once the first exits
        print(
            f"tp-ext demo: --tp {args.tp} does not divide the {world} ranks; use one of "
            f"{divisors(world)}",
            file=sys.stderr,
        )
        return 2
    return demo(args.tp)


def _check_variables(command: str) -> int:
    """Before a command that starts process groups (demo, run, train): TP_EXT_* variables that
    the first collective would refuse stop it here, with one line per rank rather than a
    traceback. Returns the exit status to stop with, or 0 to go on."""
    from tp_ext import ops

    error = ops._C._env_error()
    if error:  # on every rank: torchrun stops the others once the first exits
        for line in error.splitlines():
            print(f"tp-ext {command}: {line.removeprefix('tp_ext: ')}", file=sys.stderr)
    return 2 if error else 0


def _auto_plan(args) -> int:
    """``tp-ext plan CONFIG --auto``: the planner's layouts, best first (``--calibrate`` first
    measures this machine as the "cpu" hardware)."""
    import json

    from tp_ext.config import JobConfig
    from tp_ext.planner import calibrate, plan

    if args.calibrate:
        hw = calibrate()
        print(
            f"calibrated: {hw.flops / 1e9:.3g} GFLOP/s per rank, all-reduce "
            f"{hw.intra_node / 1e9:.3g} GB/s, latency {hw.latency * 1e6:.0f} us",
            file=sys.stderr,
        )
        if not args.auto:
            return 0
    if args.config is None:
        print("tp-ext plan: argument config: required with --auto", file=sys.stderr)
        return 2
    if args.gpus is None:
        print("tp-ext plan: argument --gpus: required with --auto (devices to plan for)",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        job = JobConfig.from_file(args.config)
        ranked = plan(
            job.model,
            gpus=args.gpus,
            gpus_per_node=args.gpus_per_node,
            gpu_memory=args.gpu_memory,
            seq_len=args.seq_len,
            global_batch=args.global_batch,
            hardware=args.hardware,
            dtype=args.dtype or job.parallel.dtype,
            top=args.top,
        )
    except ValueError as e:
        print(f"tp-ext plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([est.as_dict() for est in ranked], indent=2))
        return 0
    gib = 1024**3
    print(
        f"{'#':>2} {'layout':<48} {'fits':>4} {'GiB/rank':>8} {'step s':>8}  reason",
    )
    for i, est in enumerate(ranked, 1):
        print(
            f"{i:>2} {est.layout.describe():<48} {'yes' if est.fits else 'no':>4} "
            f"{est.memory_bytes['total'] / gib:>8.1f} {est.step_time_s:>8.3g}  {est.reason}"
        )
    return 0


def _plan(args) -> int:
    """The footprint of a config per pipeline stage and per (pp, tp) rank: parameters, bytes,
    what is replicated, KV cache and communication, on the meta device."""
    import json

    if args.auto or args.calibrate:
        return _auto_plan(args)
    if args.config is None:
        print("tp-ext plan: argument config: required", file=sys.stderr)
        return 2

    from tp_ext.config import JobConfig
    from tp_ext.models.footprint import PlanError, format_pipeline_footprint, pipeline_footprint

    try:
        job = JobConfig.from_file(args.config)
        par = job.parallel
        fp = pipeline_footprint(
            job.model,
            tp=args.tp if args.tp is not None else par.tp,
            pp=args.pp if args.pp is not None else par.pp,
            dp=args.dp if args.dp is not None else (par.dp or 1),
            virtual_stages=args.virtual_stages,
            pipeline_split=args.pipeline_split,
            stage_order=args.stage_order,
            dtype=args.dtype or par.dtype,
        )
    except PlanError as e:
        flag = "--" + e.argument.replace("_", "-")
        print(f"tp-ext plan: argument {flag}: {e}", file=sys.stderr)
        return 2
    except ValueError as e:  # ConfigError included
        print(f"tp-ext plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(fp, indent=2) if args.json else format_pipeline_footprint(fp))
    return 0


def _layer_counts(text: str) -> list[int]:
    """``--pipeline-split``: decoder layers per stage, comma-separated."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = None
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(
            f"must be the decoder layers of each stage, comma-separated ints >= 1 (e.g. "
            f"27,27,26), got {text!r}"
        )
    return counts


def _run(args) -> int:
    """The main job: see tp_ext/cli/run.py."""
    from tp_ext.cli.run import run

    try:
        overrides = _auto(args, _overrides(args), "run")
        return run(
            args.config,
            overrides,
            small_path=args.small,
            workdir=args.workdir,
            steps=args.steps,
            max_new_tokens=args.max_new_tokens,
            max_grad_norm=args.max_grad_norm,
            profile_dir=args.profile,
        )
    except ValueError as e:  # ConfigError included
        print(f"tp-ext run: {e}", file=sys.stderr)
        return 2


def _doctor(args) -> int:
    """Exit 1 when a check fails."""
    import dataclasses
    import json

    from tp_ext.debug import doctor

    checks = doctor()
    if args.json:
        print(json.dumps([dataclasses.asdict(c) for c in checks], indent=2))
    else:
        for c in checks:
            print(f"[{c.status:>4}] {c.name:<18} {c.detail}")
    return 1 if any(c.status == "fail" for c in checks) else 0


def _auto(args, overrides: dict, command: str) -> dict:
    """With ``--auto``, the planner's layout for the model the command trains (train: the
    config's; run: its small model) on the config's batches."""
    if not args.auto:
        return overrides
    from tp_ext.cli.auto import auto_overrides
    from tp_ext.config import JobConfig

    job = JobConfig.from_file(args.config)
    model = job.model
    if command == "run":
        model = JobConfig.from_file(args.small).model if args.small else model.tiny()
    dtype = overrides.get("dtype") or job.parallel.dtype
    return auto_overrides(model, job.data, overrides, dtype)


def _overrides(args) -> dict:
    """The parallel and optimizer fields the flags set (None: as the config has them)."""
    return {
        "tp": args.tp,
        "pp": args.pp,
        "dp": args.dp,
        "schedule": args.schedule,
        "virtual_stages": args.virtual_stages,
        "data_parallel": args.data_parallel,
        "micro_batches": args.micro_batches,
        "activation_checkpointing": args.activation_checkpointing,
        "dtype": args.dtype,
        "seed": args.seed,
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "betas": args.betas,
    }


def _train(args) -> int:
    """Training on a token file with resumable checkpoints: see tp_ext/cli/train.py."""
    from tp_ext.cli.train import train

    try:
        schedule = {f: getattr(args, f) for f in _SCHEDULE_FLAGS}
        return train(
            args.config,
            _auto(args, {**_overrides(args), **schedule}, "train"),
            data=args.data,
            steps=args.steps,
            checkpoint_dir=args.checkpoint_dir,
            save_every=args.save_every,
            keep_last=args.keep_last,
            async_save=args.async_save,
            resume=args.resume,
            max_grad_norm=args.max_grad_norm,
        )
    except (ValueError, FileNotFoundError) as e:  # ConfigError included
        print(f"tp-ext train: {e}", file=sys.stderr)
        return 2


_SCHEDULE_FLAGS = ("lr_schedule", "warmup_steps", "min_lr", "decay_steps")


def _parallel_flags(parser, tp_help: str, dtype_help: str) -> None:
    """The flags that override the config's parallel and optimizer sections (run and train)."""
    group = parser.add_argument_group("overrides of the config's parallel and optimizer settings")
    group.add_argument("--tp", type=flag_type(PARALLEL_FIELDS["tp"]), help=tp_help)
    group.add_argument(
        "--pp", type=flag_type(PARALLEL_FIELDS["pp"]), help="pipeline-parallel degree (stages)"
    )
    group.add_argument(
        "--dp",
        type=flag_type(PARALLEL_FIELDS["dp"]),
        help="data-parallel degree (default: the ranks TP and PP leave)",
    )
    group.add_argument(
        "--schedule",
        choices=PARALLEL_FIELDS["schedule"].choices,
        help="pipeline schedule (default 1F1B); ZBVZeroBubble and DualPipeV need "
        "--virtual-stages 2",
    )
    group.add_argument(
        "--virtual-stages",
        type=flag_type(PARALLEL_FIELDS["virtual_stages"]),
        help="pipeline stages per rank (default 1; >1 needs an interleaved or V schedule)",
    )
    group.add_argument(
        "--data-parallel",
        choices=PARALLEL_FIELDS["data_parallel"].choices,
        help="how DP replicas synchronise: ddp (default) or fsdp (FSDP2, parameters sharded)",
    )
    group.add_argument(
        "--micro-batches",
        type=flag_type(PARALLEL_FIELDS["micro_batches"]),
        help="micro-batches per step (pipeline micro-batches and gradient accumulation; "
        "default max(2, pp x virtual stages))",
    )
    group.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute each decoder layer in backward (default: the config's, else off)",
    )
    group.add_argument(
        "--auto",
        action="store_true",
        help="take the planner's best layout that fits these ranks and devices (tp-ext plan "
        "--auto ranks them all); no other layout flag with it",
    )
    group.add_argument("--dtype", choices=DTYPES, help=dtype_help)
    group.add_argument("--seed", type=flag_type(PARALLEL_FIELDS["seed"]))
    group.add_argument("--lr", type=flag_type(OPTIMIZER_FIELDS["lr"]))
    group.add_argument("--weight-decay", type=flag_type(OPTIMIZER_FIELDS["weight_decay"]))
    group.add_argument("--betas", type=flag_type(BETA), nargs=2)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tp-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run every collective and pair across ranks and check them (launch with torchrun)",
    )
    demo.add_argument(
        "--tp",
        type=flag_type(PARALLEL_FIELDS["tp"]),
        default=None,
        help="TP degree (default: world size)",
    )
    demo.set_defaults(func=_demo)
    plan = sub.add_parser(
        "plan",
        help="per-stage and per-rank parameters and bytes, replicated bytes, KV cache and "
        "communication of a model config over TP x PP (x DP), without allocating it",
    )
    plan.add_argument(
        "config", nargs="?", help="tp_ext YAML/JSON config or a Hugging Face config.json"
    )
    auto = plan.add_argument_group(
        "the planner (--auto): training layouts ranked by memory and step time, with reasons"
    )
    auto.add_argument("--auto", action="store_true", help="rank the TP x PP x DP layouts")
    auto.add_argument("--gpus", type=flag_type(PARALLEL_FIELDS["tp"]), help="devices in all")
    auto.add_argument(
        "--gpus-per-node",
        type=flag_type(PARALLEL_FIELDS["tp"]),
        help="devices per node (default: all in one node)",
    )
    auto.add_argument(
        "--gpu-memory", help="memory per device, e.g. 80GiB (default: the hardware's)"
    )
    auto.add_argument(
        "--seq-len", type=flag_type(PARALLEL_FIELDS["tp"]), default=4096, help="default 4096"
    )
    auto.add_argument(
        "--global-batch",
        type=flag_type(PARALLEL_FIELDS["tp"]),
        default=512,
        help="sequences per step over all DP replicas (default 512)",
    )
    auto.add_argument(
        "--hardware",
        default="h100",
        choices=sorted(HARDWARE_NAMES),
        help="device and link speeds (default h100); cpu: this machine once --calibrate ran",
    )
    auto.add_argument("--top", type=flag_type(PARALLEL_FIELDS["tp"]), default=10)
    auto.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul FLOP/s, gloo all-reduce) as the 'cpu' hardware",
    )
    plan.add_argument(
        "--tp",
        type=flag_type(PARALLEL_FIELDS["tp"]),
        default=None,
        help="TP degree (default: the config's)",
    )
    plan.add_argument(
        "--pp",
        type=flag_type(PARALLEL_FIELDS["pp"]),
        default=None,
        help="pipeline ranks (default: the config's)",
    )
    plan.add_argument(
        "--dp",
        type=flag_type(PARALLEL_FIELDS["dp"]),
        default=None,
        help="data-parallel replicas, for the rank numbers and totals (default: the config's, "
        "else 1)",
    )
    plan.add_argument(
        "--virtual-stages",
        type=flag_type(PARALLEL_FIELDS["pp"]),
        default=1,
        help="pipeline stages per pipeline rank (default 1)",
    )
    plan.add_argument(
        "--pipeline-split",
        type=_layer_counts,
        default=None,
        metavar="N0,N1,...",
        help="decoder layers of each stage (default: split evenly, earlier stages take the "
        "extra layers)",
    )
    plan.add_argument(
        "--stage-order",
        choices=STAGE_ORDERS,
        default="loop",
        help="stages on ranks: loop (stage s on rank s %% pp) or v (virtual_stages=2: stages r "
        "and 2*pp-1-r on rank r) (default loop)",
    )
    plan.add_argument(
        "--dtype",
        default=None,
        choices=DTYPES,
        help="dtype of the parameters (default: the config's parallel.dtype)",
    )
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=_plan)
    run = sub.add_parser(
        "run",
        help="the main job (launch with torchrun): full-size plan, then a "
        "small model of the family loaded sharded, checked, "
        "trained, saved and sampled",
    )
    run.add_argument("config", help="tp_ext YAML/JSON config or a Hugging Face config.json")
    run.add_argument(
        "--small",
        default=None,
        help="config of the model actually run (default: a tiny model of CONFIG's family)",
    )
    run.add_argument(
        "--workdir",
        default=None,
        help="keep the checkpoints in this directory (created if absent). An existing one must "
        "be empty or one an earlier tp-ext run wrote: anything else is refused, never written "
        "into. Default: a fresh private temporary directory (mode 0700), removed at the end",
    )
    _parallel_flags(
        run,
        tp_help="TP degree (default: the ranks PP and DP leave; the config's tp is the plan's)",
        dtype_help="dtype of the small model (default float32)",
    )
    run.add_argument(
        "--steps", type=flag_type(RUN_FIELDS["steps"]), default=6, help="training steps (default 6)"
    )
    run.add_argument("--max-new-tokens", type=flag_type(RUN_FIELDS["max-new-tokens"]), default=16)
    run.add_argument("--max-grad-norm", type=flag_type(RUN_FIELDS["max-grad-norm"]), default=1.0)
    run.add_argument(
        "--profile",
        metavar="DIR",
        default=None,
        help="write a torch.profiler trace of the training steps to DIR/trace_rank<r>.json "
        "(chrome://tracing or ui.perfetto.dev; tp_ext's tags show as ranges)",
    )
    run.set_defaults(func=_run)
    doctor = sub.add_parser(
        "doctor",
        help="the environment: torch against the one tp_ext was built with, CUDA, NCCL, "
        "backends, shared memory, launcher variables, and what would fail",
    )
    doctor.add_argument("--json", action="store_true", help="print JSON instead of a table")
    doctor.set_defaults(func=_doctor)
    train = sub.add_parser(
        "train",
        help="train the config's model on a token file (launch with torchrun), saving "
        "resumable checkpoints; resumes after a kill, at any layout",
    )
    train.add_argument(
        "config",
        help="tp_ext YAML/JSON job config (model, parallel, optimizer, data, checkpoint sections)",
    )
    train.add_argument(
        "--data",
        default=None,
        help="token file (flat uint16/uint32 ids; default: the config's data.path)",
    )
    train.add_argument(
        "--steps",
        type=flag_type(TRAIN_FIELDS["steps"]),
        required=True,
        help="train up to this step",
    )
    train.add_argument(
        "--checkpoint-dir",
        default=None,
        help="checkpoints step-<N> and "
        "metrics.jsonl go here (default: the config's checkpoint.dir)",
    )
    train.add_argument(
        "--save-every",
        type=flag_type(CHECKPOINT_FIELDS["save_every"]),
        help="save every K steps, and after the last (default: the config's)",
    )
    train.add_argument(
        "--keep-last",
        type=flag_type(CHECKPOINT_FIELDS["keep_last"]),
        help="keep the newest M checkpoints (default: the config's, else all)",
    )
    train.add_argument(
        "--async-save",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="write checkpoints while training goes on (default: the config's)",
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest "
        "complete checkpoint in the directory (automatic after a torchrun restart)",
    )
    train.add_argument(
        "--max-grad-norm",
        type=flag_type(RUN_FIELDS["max-grad-norm"]),
        default=1.0,
        help="clip gradients to this norm (default 1.0)",
    )
    _parallel_flags(
        train,
        tp_help="TP degree (default: the ranks PP and DP leave)",
        dtype_help="dtype of the parameters (default: the config's parallel.dtype)",
    )
    schedule = train.add_argument_group("overrides of the config's LR schedule")
    schedule.add_argument(
        "--lr-schedule",
        choices=OPTIMIZER_FIELDS["lr_schedule"].choices,
        help="after warmup, how the LR goes from --lr to --min-lr (default: the config's)",
    )
    schedule.add_argument(
        "--warmup-steps",
        type=flag_type(OPTIMIZER_FIELDS["warmup_steps"]),
        help="steps of linear warmup",
    )
    schedule.add_argument(
        "--min-lr", type=flag_type(OPTIMIZER_FIELDS["min_lr"]), help="the LR the decay ends at"
    )
    schedule.add_argument(
        "--decay-steps",
        type=flag_type(OPTIMIZER_FIELDS["decay_steps"]),
        help="the step the decay ends at (default: --steps; set it when a run will be resumed "
        "with a larger --steps, so that the schedule stays the same)",
    )
    train.set_defaults(func=_train)
    args = parser.parse_args(argv)
    if args.command in ("demo", "run", "train"):
        status = _check_variables(args.command)
        if status:
            return status
    with launch_variables_restored():  # in-process callers (tests, notebooks) get theirs back
        return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
