"""How long one step of a candidate (:class:`~tp_ext.planner.step.Step`) takes on a
:class:`~tp_ext.planner.hardware.Hardware`: each micro-batch's compute (FLOPs at the device's
rate and a fixed cost per dispatched operator), its TP, CP and PP communication, the pipeline
bubble, the DP traffic not hidden behind compute and the optimizer step (:func:`step_timing`)."""

from __future__ import annotations

import math

from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.counts import ZERO2_BUCKET_BYTES
from tp_ext.planner.step import Step

__all__ = ["bubble_fraction", "step_timing"]


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The idle share of a pipeline step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1)
    interleaved; the zero-bubble schedules fill most of it with deferred weight gradients
    (modelled as a third of 1F1B's, what their papers report at these sizes)."""
    if pp == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (3 * v * m + pp - 1)


def crosses_nodes(step: Step) -> tuple[bool, bool, bool]:
    """Whether the TP, PP and DP groups span nodes (ranks (pp, dp, cp, tp) row-major; the DP
    group here is the one gradients are summed over: DP x CP)."""
    tp, pp, dp = step.tp, step.pp, step.dp
    inner = tp * step.cp
    span = step.gpus_per_node or inner * pp * dp
    sync = step.replicas > 1
    return tp > span, pp > 1 and inner * dp * pp > span, sync and tp * step.replicas > span


def cp_crosses_nodes(step: Step) -> bool:
    return step.cp > 1 and step.tp * step.cp > (step.gpus_per_node or step.tp * step.cp)


def compute_on(step: Step, r: int) -> float:
    """Seconds of one micro-batch's forward + backward on pipeline rank r: its FLOPs at the
    device's rate, and its operators' fixed cost (dispatch, launch: what dominates small
    shapes)."""
    ops, recompute = step.op_counts(), 1 if step.recompute else 0
    n_ops = step.layers_on(r) * (ops["layer"] + recompute * ops["layer_forward"])
    if step.last_on(r):
        n_ops += ops["head"]
    if step.first_on(r):
        n_ops += ops["embedding"]
    return step.flops_on(r) / step.hardware.flops + n_ops * step.hardware.op_overhead


def cp_seconds(step: Step, comm: dict, layers_max: int, compute: float) -> float:
    """CP seconds of one micro-batch not hidden: the bytes at the link's rate and a latency
    per hop (the ring: cp - 1 forward, 2 cp - 1 backward; the all-to-all: 4 each way per
    layer); the ring's hops travel while blocks are computed where collectives run beside
    compute (a GPU), so only what outlasts the compute shows."""
    if step.cp == 1:
        return 0.0
    hw, cp = step.hardware, step.cp
    hops = (3 * cp - 2) if step.candidate.cp_mode == "ring" else 8
    seconds = (comm["cp"] / step.m) / hw.link(cp_crosses_nodes(step))
    seconds += layers_max * hops * hw.latency
    if step.candidate.cp_mode == "ring" and hw.overlap:
        return max(0.0, seconds - compute)
    return seconds


def micro_batch_seconds(step: Step, comm: dict, layers_max: int) -> tuple:
    """(TP seconds, PP seconds) of one micro-batch: the model's TP collectives
    (:meth:`~tp_ext.planner.step.Step.tp_seconds`); each stage boundary a rank crosses: a send
    and a receive forward, the same backward."""
    hw, pp, m = step.hardware, step.pp, step.m
    tp_cross, pp_cross, _ = crosses_nodes(step)
    tp_time = step.tp_seconds(comm["tp"] / m, layers_max, tp_cross)
    if pp == 1:
        return tp_time, 0.0
    boundaries = 2 * step.v
    pp_time = (comm["pp"] / m) / hw.link(pp_cross) + 2 * boundaries * hw.latency
    return tp_time, pp_time


def dp_seconds(step: Step, dp_traffic: tuple, numel: int, tensors: int, compute: float) -> tuple:
    """(DP seconds, the part not hidden behind compute). Where collectives cannot run beside
    compute (CPU ranks over gloo share their cores), nothing is hidden."""
    hw, m, e = step.hardware, step.m, step.e
    n = step.replicas  # the ranks whose gradients are summed
    dp_bytes, gathered, scattered = dp_traffic
    link = hw.link(crosses_nodes(step)[2])
    hide = 1.0 if hw.overlap else 0.0
    if step.sync is None:
        return 0.0, 0.0
    if step.sync == "sums" and not step.zero:
        # tp_ext's flat all-reduces after the backward: nothing to hide behind
        dp_time = 2 * (n - 1) / n * dp_bytes / link + hw.latency
        return dp_time, dp_time
    if step.zero:
        # the gradients' sum goes in the last micro-batch's backward (ZeRO-1: DDP's
        # all-reduce, or the experts' flat sums after it; ZeRO-2: a reduce-scatter per 25 MiB
        # bucket), after the schedule under the weight-split ones; the rows' all-gather after
        # the optimizer step: neither of those has compute to hide behind
        after_step = SCHEDULES[step.candidate.schedule].weight_split or step.sync == "sums"
        gather = (n - 1) / n * gathered / link + hw.latency
        if step.zero == 1:
            reduce, _ = all_reduce_seconds(step, dp_bytes - gathered, numel, tensors, 0.0)
        else:
            buckets = math.ceil(numel * e / ZERO2_BUCKET_BYTES)
            rate = hw.reduce_scatter or link
            reduce = (n - 1) / n * scattered / rate + buckets * hw.latency
        hidden = 0.0 if after_step else min(reduce, hide * compute * 2 / 3)
        return reduce + gather, reduce + gather - hidden
    if step.shard == 1:
        return all_reduce_seconds(step, dp_bytes, numel, tensors, hide * compute)
    # all-gathers and the reduce-scatter move (n-1)/n of their payload (the reduce-scatter
    # at its own rate where measured: gloo's is slower than its gathers); the gathers come
    # in every micro-batch, prefetching hides each behind its micro-batch's compute, up to
    # it; each unit (a decoder layer, and the stage's root) costs FSDP2's own work (hooks,
    # copies in and out of the flat buffers, the calls) in every micro-batch on top
    units = max(step.layers_on(r) for r in range(step.pp)) + 1
    dp_time = (n - 1) / n * (gathered / link + scattered / (hw.reduce_scatter or link))
    overhead = m * units * hw.fsdp_unit_overhead
    return dp_time, max(0.0, dp_time - hide * m * compute) + overhead


def all_reduce_seconds(step: Step, nbytes: int, numel: int, tensors: int, hide: float) -> tuple:
    """(seconds, the part not hidden) of DDP's gradient all-reduce: a ring, overlapped only
    with the last micro-batch's backward (``hide``: its compute, where collectives run beside
    it); one call per 25 MB bucket (DDP's default), per parameter above 2 replicas (the
    reproducible hook)."""
    hw, n = step.hardware, step.replicas
    link = hw.link(crosses_nodes(step)[2])
    calls = tensors if n > 2 else math.ceil(numel * step.e / (25 * 2**20))
    dp_time = 2 * (n - 1) / n * nbytes / link + calls * hw.latency
    return dp_time, max(0.0, dp_time - hide * 2 / 3)


def runtime_seconds(step: Step, memory: dict) -> tuple[float, float]:
    """(torch's pipelining runtime, the optimizer step): per schedule action (a stage's
    forward or backward of a micro-batch; the zero-bubble schedules split the backward in
    two; none in the local loop at one stage); a fused AdamW reads and writes parameters,
    gradients and moments about twice, where not measured."""
    hw = step.hardware
    split_backward = SCHEDULES[step.candidate.schedule].weight_split
    pipelined = step.pp * step.v > 1
    actions = step.m * step.v * (3 if split_backward else 2) if pipelined else 0
    if hw.optimizer_seconds_per_param is not None:
        stepped = memory["params"] / step.e
        if step.zero:  # ZeRO steps this replica's rows only
            stepped = max(step.zero_rows_on(r) for r in range(step.pp))
        optimizer = stepped * hw.optimizer_seconds_per_param
    else:
        moved = memory["params"] + memory["grads"] + memory["optimizer"]
        optimizer = 4 * moved / hw.memory_bandwidth
    return actions * hw.pp_action_overhead, optimizer


def step_timing(step: Step, comm: dict, dp_traffic: tuple, memory: dict, numel: int) -> dict:
    """The estimate's ``detail`` on time (and ``step_s``, the step's seconds): the pipeline's
    micro-batches stretched by its bubble, then torch's pipelining runtime, the DP traffic not
    hidden and the optimizer step."""
    pp, m = step.pp, step.m
    compute = max(compute_on(step, r) for r in range(pp))
    layers_max = max(step.layers_on(r) for r in range(pp))
    tp_time, pp_time = micro_batch_seconds(step, comm, layers_max)
    cp_time = cp_seconds(step, comm, layers_max, compute)
    bubble = bubble_fraction(step.candidate.schedule, pp, m, step.v)
    pipeline = m * (compute + tp_time + cp_time + pp_time) / (1 - bubble)
    tensors = max(step.params_on(r)[1] for r in range(pp))
    dp_time, dp_exposed = dp_seconds(step, dp_traffic, numel, tensors, compute)
    pp_runtime, optimizer_time = runtime_seconds(step, memory)
    tp_cross, pp_cross, dp_cross = crosses_nodes(step)
    # the tied embedding's gradient sum runs after the pipeline, before the optimizer
    tied_time = comm["tied"] / step.hardware.link(pp_cross) if comm["tied"] else 0.0
    return {
        "step_s": pipeline + pp_runtime + dp_exposed + tied_time + optimizer_time,
        "layers_per_rank": layers_max,
        "in_flight_micro_batches": step.in_flight(0),
        "compute_s": m * compute,
        "tp_s": m * tp_time,
        "cp_s": m * cp_time,
        "pp_s": m * pp_time,
        "dp_s": dp_time,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer_time,
        "pp_runtime_s": pp_runtime,
        "tp_crosses_nodes": tp_cross,
        "pp_crosses_nodes": pp_cross,
        "dp_crosses_nodes": dp_cross,
    }
