"""What the planner ranks: a :class:`Candidate` (the parallel degrees as a
:class:`~tp_ext.ParallelDims` and the run settings that go with them) and its :class:`Estimate`
(memory, communication and time per rank). The cost models (:mod:`.cost`, :mod:`.cost_2d`)
fill Estimates; the search (:mod:`.search`) builds and ranks Candidates."""

from __future__ import annotations

import dataclasses
from typing import Optional

from tp_ext.dims import ParallelDims
from tp_ext.layers.context import CP_MODES
from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.validation import check_dtype_name, check_int

__all__ = [
    "Candidate",
    "Estimate",
    "memory_breakdown",
    "usable_memory",
    "check_imbalance",
    "ROUTING_IMBALANCE",
]

# how DP replicas synchronise: DDP, FSDP2, or ZeRO-1 / ZeRO-2 (tp_ext.training.zero)
DATA_PARALLEL = ("ddp", "fsdp", "zero1", "zero2")
# Of a device's memory, what tensors may take: 5% goes to the caching allocator's fragmentation
# and kernels' workspaces, and 1 GiB to the CUDA context and NCCL's buffers.
USABLE_FRACTION, RESERVED_BYTES = 0.95, 1024**3


# The busiest EP rank's routed rows over its even share that a plan assumes: Switch
# Transformer's training capacity factor, an exact bound when the MoE layers drop beyond it
# (parallelize(capacity_factor=1.25)); dropless routing may exceed it (an untrained router on
# the tests' tiny Mixtral: up to 1.33 over a micro-batch's layers)
ROUTING_IMBALANCE = 1.25


def check_imbalance(value, name: str = "routing_imbalance") -> float:
    """``value`` as a routing imbalance (a real number >= 1), or a ValueError naming it."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not 1 <= value < float("inf"):
        raise ValueError(
            f"{name}={value!r}: must be a number >= 1, the busiest EP rank's routed rows over "
            f"its even share (1: balanced routing; default {ROUTING_IMBALANCE}, Switch's capacity "
            f"factor; with parallelize(capacity_factor=c) c is an exact bound)"
        )
    return float(value)


def usable_memory(device_bytes: int) -> int:
    return int(device_bytes * USABLE_FRACTION) - RESERVED_BYTES


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run training that the planner costs: ``dims`` (resolved: tp, pp, dp and
    virtual stages; ``dims.tp`` a ``(P, Q)`` grid is 2D TP), ``num_micro_batches`` of
    ``micro_batch`` sequences per DP rank and step under ``schedule``, DP replicas synchronised
    by ``data_parallel`` ("ddp", "fsdp", "zero1" or "zero2"), ``activation_checkpointing`` per
    decoder layer (the config's and the CLI's name), and ``dtype``: the parameters' dtype
    (gradients and AdamW state take it too; ZeRO keeps fp32 master rows and state).
    ``routing_imbalance``: with experts (EP), the busiest EP rank's routed rows over its even
    share, which its experts' saved activations scale with (:data:`ROUTING_IMBALANCE`)."""

    dims: ParallelDims
    micro_batch: int
    num_micro_batches: int
    schedule: str = "1F1B"
    activation_checkpointing: bool = False
    data_parallel: str = "ddp"
    dtype: str = "bfloat16"
    cp_mode: str = "ring"  # with dims.cp > 1: "ring" or "all_to_all"
    routing_imbalance: float = ROUTING_IMBALANCE

    def __post_init__(self) -> None:
        if not isinstance(self.dims, ParallelDims) or not self.dims.resolved:
            raise ValueError(
                f"Candidate.dims must be a resolved tp_ext.ParallelDims (tp and dp given, or "
                f"ParallelDims(...).resolve(world_size)), got {self.dims!r}"
            )
        check_int("micro_batch", self.micro_batch)
        check_int("num_micro_batches", self.num_micro_batches)
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {list(SCHEDULES)}, got {self.schedule!r}")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(
                f"activation_checkpointing must be True or False, got "
                f"{self.activation_checkpointing!r}"
            )
        if self.data_parallel not in DATA_PARALLEL:
            raise ValueError(
                f"Candidate.data_parallel must be one of {list(DATA_PARALLEL)}, got "
                f"{self.data_parallel!r}"
            )
        check_dtype_name(self.dtype)
        if self.cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be 'ring' or 'all_to_all', got {self.cp_mode!r}")
        check_imbalance(self.routing_imbalance)

    def describe(self) -> str:
        """``tp=2 pp=2 dp=2 1F1B ddp 4x2 seq`` (virtual stages beside the schedule)."""
        dims = self.dims
        parts = [dims.replace(virtual_stages=1).describe()]
        if dims.pp > 1:
            v = f" v={dims.virtual_stages}" if dims.virtual_stages > 1 else ""
            parts.append(f"{self.schedule}{v}")
        if dims.replicas > 1:  # the DP engine runs over the DP x CP ranks
            parts.append(self.data_parallel)
        if dims.cp > 1:
            parts.append(self.cp_mode)
        parts.append(f"{self.num_micro_batches}x{self.micro_batch} seq")
        if self.activation_checkpointing:
            parts.append("recompute")
        return " ".join(parts)

    def as_dict(self) -> dict:
        """The degrees (:meth:`ParallelDims.as_dict`) and the run settings, flat, for JSON."""
        out = self.dims.as_dict()
        out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(Candidate)[1:]})
        return out


@dataclasses.dataclass
class Estimate:
    """What one :class:`Candidate` costs on the busiest rank."""

    candidate: Candidate
    memory_bytes: dict  # params, grads, optimizer, activations, kv_cache, total (busiest rank)
    # tp, cp, pp, dp: payload bytes per step of the busiest rank, counted as tp_ext.comm.track()
    # does: an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's full
    # input, each pipeline send or receive's tensor on the rank that sends or receives it, and
    # what CP's ring or all-to-all sends
    comm_bytes: dict
    bubble: float
    step_time_s: float
    fits: bool
    memory_limit: Optional[int]
    reason: str = ""
    detail: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        """For JSON, with ``candidate`` as :meth:`Candidate.as_dict` gives it."""
        out = dataclasses.asdict(self)
        out["candidate"] = self.candidate.as_dict()
        return out


def memory_breakdown(params, optimizer, activations, total, fsdp_buffers=0, grads=None) -> dict:
    """An estimate's ``memory_bytes``: gradients as large as the parameters (their dtype) unless
    given (ZeRO-2 keeps this rank's rows); training keeps no KV cache."""
    return {
        "params": int(params),
        "grads": int(params if grads is None else grads),
        "optimizer": int(optimizer),
        "activations": int(activations),
        "kv_cache": 0,
        "fsdp_buffers": int(fsdp_buffers),
        "total": int(total),
    }
