"""``tp-ext plan CONFIG``: the footprint of a config per pipeline stage and per (pp, tp) rank
(parameters, bytes, what is replicated, KV cache and communication), on the meta device.
``tp-ext plan CONFIG --auto --gpus N``: the planner ranks the training candidates of N devices by
memory and step time (``--calibrate`` first measures this machine as the "cpu" hardware)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from tp_ext.cli.flags import add_field_flag
from tp_ext.cli.launch import refuse
from tp_ext.cli.logs import LOG
from tp_ext.config import DATA_FIELDS, PARALLEL_FIELDS, JobConfig
from tp_ext.dims import ParallelDims
from tp_ext.models.footprint import format_pipeline_footprint, pipeline_footprint
from tp_ext.models.hf import load_hf_config
from tp_ext.models.hf.footprint import hf_pipeline_footprint
from tp_ext.models.hf.source import HFModelSource
from tp_ext.planner import calibrate, plan, plan_dims
from tp_ext.planner.candidate import ROUTING_IMBALANCE, check_imbalance, usable_memory
from tp_ext.planner.hardware import HARDWARE as HARDWARE_NAMES
from tp_ext.sharding import STAGE_ORDERS
from tp_ext.validation import ArgumentError, Field

__all__ = ["add_arguments", "main", "PLANNER_FIELDS"]

HELP = (
    "per-stage and per-rank parameters and bytes, replicated bytes, KV cache and communication "
    "of a model config over TP x PP (x DP), without allocating it"
)

# The planner's own flags; --seq-len and --global-batch are the data section's fields.
PLANNER_FIELDS = {
    "gpus": Field("int", 1, 2**20, help="devices in all", why="a million devices"),
    "gpus_per_node": Field("int", 1, 2**20, help="devices per node", why="a million devices"),
    "seq_len": DATA_FIELDS["seq_len"],
    "global_batch": DATA_FIELDS["global_batch"],
    "top": Field("int", 1, help="print the best N candidates"),
}


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


def _imbalance(text: str) -> float:
    """``--routing-imbalance``: a number >= 1."""
    try:
        value = float(text)
    except ValueError:
        value = text
    try:
        return check_imbalance(value, "routing_imbalance")
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_arguments(parser) -> None:
    parser.add_argument(
        "config", nargs="?", help="tp_ext YAML/JSON config or a Hugging Face config.json"
    )
    parser.add_argument(
        "--model",
        metavar="DIR_OR_CONFIG",
        help="a Hugging Face model of any architecture parallelize('auto') converts: its "
        "checkpoint directory or config.json (counted as parallelize would shard it)",
    )
    auto = parser.add_argument_group(
        "the planner (--auto): training candidates ranked by memory and step time, with reasons"
    )
    auto.add_argument("--auto", action="store_true", help="rank the TP x PP x DP candidates")
    add_field_flag(auto, "gpus", PLANNER_FIELDS["gpus"])
    add_field_flag(auto, "gpus_per_node", PLANNER_FIELDS["gpus_per_node"], "all in one node")
    auto.add_argument(
        "--gpu-memory", help="memory per device, e.g. 80GiB (default: the hardware's)"
    )
    add_field_flag(auto, "seq_len", PLANNER_FIELDS["seq_len"], "4096", default=4096)
    add_field_flag(auto, "global_batch", PLANNER_FIELDS["global_batch"], "512", default=512)
    auto.add_argument(
        "--hardware",
        default="h100",
        choices=sorted(HARDWARE_NAMES),
        help="device and link speeds (default h100); cpu: this machine once --calibrate ran",
    )
    add_field_flag(auto, "top", PLANNER_FIELDS["top"], "10", default=10)
    auto.add_argument(
        "--routing-imbalance",
        type=_imbalance,
        default=ROUTING_IMBALANCE,
        metavar="F",
        help="with experts (EP): the busiest EP rank's routed rows over its even share, which "
        f"its activations scale with (default {ROUTING_IMBALANCE}, Switch's capacity factor; "
        "exact for MoE layers dropping beyond capacity_factor=F; 1: balanced)",
    )
    auto.add_argument(
        "--calibrate",
        action="store_true",
        help="measure this machine (matmul FLOP/s, gloo all-reduce) as the 'cpu' hardware",
    )
    add_field_flag(parser, "tp", PARALLEL_FIELDS["tp"], "the config's")
    add_field_flag(parser, "pp", PARALLEL_FIELDS["pp"], "the config's")
    add_field_flag(parser, "dp", PARALLEL_FIELDS["dp"], "the config's, else 1")
    add_field_flag(parser, "ep", PARALLEL_FIELDS["ep"], "the config's, else 1")
    add_field_flag(
        parser,
        "cp",
        PARALLEL_FIELDS["cp"],
        "1; without --auto, a cp > 1 prints the memory of a training step at --seq-len beside "
        "cp=1's, and whether it fits",
    )
    add_field_flag(parser, "cp_mode", PARALLEL_FIELDS["cp_mode"], "ring", default="ring")
    add_field_flag(parser, "virtual_stages", PARALLEL_FIELDS["virtual_stages"], default=1)
    parser.add_argument(
        "--pipeline-split",
        type=_layer_counts,
        default=None,
        metavar="N0,N1,...",
        help="decoder layers of each stage (default: split evenly, earlier stages take the "
        "extra layers)",
    )
    parser.add_argument(
        "--stage-order",
        choices=STAGE_ORDERS,
        default="loop",
        help="stages on ranks: loop (stage s on rank s %% pp) or v (virtual_stages=2: stages r "
        "and 2*pp-1-r on rank r) (default loop)",
    )
    add_field_flag(parser, "dtype", PARALLEL_FIELDS["dtype"], "the config's parallel.dtype")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def main(args) -> int:
    if args.auto or args.calibrate:
        return _auto_plan(args)
    if (args.config is None) == (args.model is None):
        return refuse("plan", "argument config: give a config file or --model DIR_OR_CONFIG")
    if (args.cp or 1) > 1:
        return _context_plan(args)
    stages = dict(
        virtual_stages=args.virtual_stages,
        pipeline_split=args.pipeline_split,
        stage_order=args.stage_order,
    )
    try:
        job = JobConfig.from_file(args.config) if args.model is None else None
        hf_config = load_hf_config(args.model) if job is None else None
        if job is not None and isinstance(job.model, HFModelSource):  # a job naming one
            hf_config = job.model.hf_config
        if hf_config is not None:
            fp = hf_pipeline_footprint(
                hf_config,
                tp=args.tp or 1,
                pp=args.pp or 1,
                dp=args.dp or 1,
                ep=args.ep or (job.parallel.ep if job is not None else 1),
                dtype=args.dtype or "bfloat16",
                **stages,
            )
        else:
            par = job.parallel
            fp = pipeline_footprint(
                job.model,
                tp=args.tp if args.tp is not None else par.tp,
                pp=args.pp if args.pp is not None else par.pp,
                dp=args.dp if args.dp is not None else (par.dp or 1),
                dtype=args.dtype or par.dtype,
                **stages,
            )
    except ArgumentError as e:
        return refuse("plan", f"argument --{e.argument.replace('_', '-')}: {e}")
    print(json.dumps(fp, indent=2) if args.json else format_pipeline_footprint(fp))
    return 0


def _auto_plan(args) -> int:
    """``--auto``: the planner's candidates, best first, as a table or JSON on stdout."""
    if args.calibrate:
        hw = calibrate()
        LOG.info(
            f"calibrated: {hw.flops / 1e9:.3g} GFLOP/s per rank, all-reduce "
            f"{hw.intra_node / 1e9:.3g} GB/s, latency {hw.latency * 1e6:.0f} us"
        )
        if not args.auto:
            return 0
    if (args.config is None) == (args.model is None):
        return refuse(
            "plan", "argument config: give a config file or --model DIR_OR_CONFIG with --auto"
        )
    if args.gpus is None:
        return refuse("plan", "argument --gpus: required with --auto (devices to plan for)")
    if args.model is not None:  # any transformers decoder; its config's dtype unless given
        model, dtype = args.model, args.dtype
    else:
        job = JobConfig.from_file(args.config)
        model = getattr(job.model, "hf_config", job.model)  # a transformers model: its config
        dtype = args.dtype or job.parallel.dtype
    ranked = plan(
        model,
        cp=args.cp or 1,
        cp_mode=args.cp_mode,
        gpus=args.gpus,
        gpus_per_node=args.gpus_per_node,
        gpu_memory=args.gpu_memory,
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        hardware=args.hardware,
        dtype=dtype,
        top=args.top,
        routing_imbalance=args.routing_imbalance,
    )
    if args.json:
        print(json.dumps([est.as_dict() for est in ranked], indent=2))
        return 0
    gib = 1024**3
    print(f"{'#':>2} {'candidate':<48} {'fits':>4} {'GiB/rank':>8} {'step s':>8}  reason")
    for i, est in enumerate(ranked, 1):
        print(
            f"{i:>2} {est.candidate.describe():<48} {'yes' if est.fits else 'no':>4} "
            f"{est.memory_bytes['total'] / gib:>8.1f} {est.step_time_s:>8.3g}  {est.reason}"
        )
    return 0


def _context_plan(args) -> int:
    """``--cp C`` without ``--auto``: what a training step of ``--seq-len`` sequences (one per
    micro-batch; as many micro-batches as pipeline stages need, at least one) per DP rank needs
    per rank at the dims given (flags, else the config's tp, pp, dp and ep) with cp = C and
    with cp = 1, with and without activation checkpointing, against the device's memory."""
    degrees = {"tp": 1, "pp": 1, "dp": 1, "ep": 1}
    if args.model is not None:
        model, dtype = args.model, args.dtype
    else:
        job = JobConfig.from_file(args.config)
        model = getattr(job.model, "hf_config", job.model)
        dtype = args.dtype or job.parallel.dtype
        settings = dataclasses.asdict(job.parallel)
        degrees.update({k: settings[k] or 1 for k in degrees})
    degrees.update({k: getattr(args, k) for k in degrees if getattr(args, k) is not None})
    rows = []
    try:
        for cp in (1, args.cp):
            dims = ParallelDims(cp=cp, **degrees)
            rows += plan_dims(
                model,
                dims,
                args.seq_len,
                hardware=args.hardware,
                gpu_memory=args.gpu_memory,
                dtype=dtype,
                cp_mode=args.cp_mode,
                micro_batches=degrees["pp"],  # torch's schedules need one per stage at least
                routing_imbalance=args.routing_imbalance,
            )
    except ValueError as e:
        return refuse("plan", str(e))
    if args.json:
        print(json.dumps([est.as_dict() for est in rows], indent=2))
        return 0
    gib = 1024**3
    limit = rows[0].memory_limit
    sequences = "one" if degrees["pp"] == 1 else str(degrees["pp"])
    print(
        f"{sequences} {args.seq_len}-token sequence(s) per DP rank, a training step's peak per "
        f"rank (device: {limit / gib:.0f} GiB, {usable_memory(limit) / gib:.1f} usable)"
    )
    print(f"{'dims':<48} {'activations':>12} {'total':>9} {'fits':>5} {'step s':>8}")
    for est in rows:
        mem = est.memory_bytes
        print(
            f"{est.candidate.describe():<48} {mem['activations'] / gib:>10.1f}Gi "
            f"{mem['total'] / gib:>7.1f}Gi {'yes' if est.fits else 'no':>5} "
            f"{est.step_time_s:>8.3g}"
        )
    return 0
