"""What one training candidate (:class:`~tp_ext.planner.candidate.Candidate`) of tp_ext's Qwen2
(1D or on a 2D grid, or a transformers decoder) costs per rank: memory (parameters, gradients,
optimizer state, activations), bytes communicated per step over TP, CP, PP and DP, the pipeline
bubble and the step time on a :class:`~tp_ext.planner.hardware.Hardware`.

:func:`estimate` checks the candidate and puts together the parts: its step (:mod:`.step`; a 2D
grid's: :class:`~tp_ext.planner.cost_2d.GridStep`, the model's part its own) and that step's
memory (:mod:`.memory`), bytes (:mod:`.traffic`) and time (:mod:`.timing`), the same for both
as the Trainer's one core is. The tests hold them to the measured numbers of a Trainer step."""

from __future__ import annotations

from typing import Optional

from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.pipeline.data_parallel import ZERO_STAGES
from tp_ext.planner.candidate import Candidate, Estimate, usable_memory
from tp_ext.planner.cost_2d import GridStep, grid_problem
from tp_ext.planner.counts import ZERO2_BUCKET_BYTES
from tp_ext.planner.hardware import Hardware
from tp_ext.planner.memory import memory_on
from tp_ext.planner.step import Step
from tp_ext.planner.timing import bubble_fraction, step_timing
from tp_ext.planner.traffic import cp_bytes_on, dp_bytes_on, pp_bytes_on, tied_bytes_on
from tp_ext.validation import DTYPE_BYTES

__all__ = [
    "Candidate",
    "Estimate",
    "estimate",
    "bubble_fraction",
    "DTYPE_BYTES",
    "usable_memory",
    "ZERO_STAGES",
    "ZERO2_BUCKET_BYTES",
]


def _check_candidate(config: Qwen2Config, candidate: Candidate) -> None:
    """What the Trainer refuses, refused by name (everything else it runs is costed)."""
    if not isinstance(candidate, Candidate):
        raise TypeError(
            f"estimate: candidate must be a tp_ext.planner.Candidate, got "
            f"{type(candidate).__name__}"
        )
    dims = candidate.dims
    if dims.grid is None:
        config.check_tp(dims.tp)
    elif grid_problem(config, candidate):
        raise ValueError(grid_problem(config, candidate))
    if dims.stages > config.num_hidden_layers:
        raise ValueError(
            f"pp={dims.pp} x virtual_stages={dims.virtual_stages} = {dims.stages} stages, more "
            f"than the model's {config.num_hidden_layers} decoder layers"
        )


def estimate(
    config: Qwen2Config,
    candidate: Candidate,
    *,
    seq_len: int,
    hardware: Hardware,
    gpu_memory: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
) -> Estimate:
    """The cost of training ``config`` with ``candidate`` on ``hardware`` (a step of
    ``dp x num_micro_batches x micro_batch`` sequences of ``seq_len`` tokens)."""
    _check_candidate(config, candidate)
    kind = Step if candidate.dims.grid is None else GridStep
    step = kind(config, candidate, seq_len, hardware, gpus_per_node)
    pp_ranks = range(step.pp)
    ranks = [memory_on(step, r) for r in pp_ranks]
    busiest = max(pp_ranks, key=lambda r: ranks[r][0]["total"])
    memory = ranks[busiest][0]
    numel = max(n for _, n in ranks)
    dp_traffic = max((dp_bytes_on(step, r) for r in pp_ranks), key=lambda t: t[0])
    comm = {
        "tp": max(step.tp_bytes_on(r) for r in pp_ranks),
        "cp": max(cp_bytes_on(step, r) for r in pp_ranks),
        "pp": max(pp_bytes_on(step, r) for r in pp_ranks),
        "dp": dp_traffic[0],
        "tied": max(tied_bytes_on(step, r) for r in pp_ranks),
    }
    detail = step_timing(step, comm, dp_traffic, memory, numel)
    detail.update(
        parameters_per_rank=numel,
        parameters_by_pp_rank=[n for _, n in ranks],
        busiest_pp_rank=busiest,
    )
    bubble = bubble_fraction(candidate.schedule, step.pp, step.m, step.v)
    fits = gpu_memory is None or memory["total"] <= usable_memory(gpu_memory)
    step_time = detail.pop("step_s")
    return Estimate(candidate, memory, comm, bubble, step_time, fits, gpu_memory, "", detail)
