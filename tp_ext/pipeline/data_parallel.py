"""Data parallelism over the replicas of a stage (its DP x CP ranks, which hold the same
weights), with TP (and PP) inside: torch's DDP or FSDP2.

Each pipeline stage module is wrapped on its own (as torchtitan does), so gradients are
synchronised once per step: torch.distributed.pipelining (or tp_ext's local runner) runs DDP's
``no_sync`` / FSDP2's ``set_requires_gradient_sync(False)`` for every micro-batch but the last.

Both *sum* the gradients over the replica group (DDP through a communication hook, FSDP2 with a
gradient divide factor of 1), since every rank's loss is already its share of the global mean
(divided by the global token count): no factor is multiplied in and divided out again, which
rounds at 3 replicas and moves fp16's overflow point. Gradient compression keeps its own
average (its hooks' error feedback works on means).
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tp_ext.compression import CompressionState, PowerSGDCompression, averages, register
from tp_ext.distributed import comm
from tp_ext.sharding import shard_sizes

__all__ = [
    "SyncRow",
    "SYNCS",
    "ZERO_STAGES",
    "choose_sync",
    "Replicas",
    "DATA_PARALLEL",
    "wrap_data_parallel",
    "sum_gradients",
    "ReplicatedStages",
    "replicate_stages",
    "reduce_scatter_in",
]

DATA_PARALLEL = ("ddp", "fsdp")


# the distributed optimizer's stages (tp_ext.training.zero), named as data_parallel names them
ZERO_STAGES = {"zero1": 1, "zero2": 2}


@dataclasses.dataclass(frozen=True)
class SyncRow:
    """One row of :data:`SYNCS`: ``engine`` wraps the stage modules ("ddp", "fsdp"; None:
    unwrapped), ``sync`` finishes the gradients ("engine", "sums", "reduce_scatter", "none"),
    ``zero`` is the optimizer's ZeRO stage (None: the optimizer as given)."""

    engine: Optional[str]
    sync: str
    zero: Optional[int] = None


# (data_parallel, the model has experts) -> row. data_parallel is None when there is one
# replica of the dense weights (experts may still have replicas: over TP ranks, or the CP ranks).
SYNCS = {
    (None, False): SyncRow(None, "none"),
    (None, True): SyncRow(None, "sums"),
    ("ddp", False): SyncRow("ddp", "engine"),
    ("ddp", True): SyncRow(None, "sums"),
    ("fsdp", False): SyncRow("fsdp", "engine"),
    ("fsdp", True): SyncRow("fsdp", "engine"),  # the experts' units on their own replicas
    ("zero1", False): SyncRow("ddp", "engine", zero=1),
    ("zero1", True): SyncRow(None, "sums", zero=1),
    ("zero2", False): SyncRow(None, "reduce_scatter", zero=2),
    ("zero2", True): SyncRow(None, "reduce_scatter", zero=2),
}

# combinations that are not rows, and why
REFUSED: dict = {}


def choose_sync(data_parallel: Optional[str], dp: int, replicas: int, experts: bool) -> SyncRow:
    """The row of :data:`SYNCS` for these settings, or an error naming the argument."""
    known = (None, *DATA_PARALLEL, *ZERO_STAGES)
    if data_parallel not in known:
        raise ValueError(f"data_parallel must be one of {list(known)}, got {data_parallel!r}")
    if data_parallel is None and dp > 1:
        raise ValueError(
            f"data_parallel=None with dp={dp}: the replicas would drift apart; use one of "
            f"{list(known[1:])}"
        )
    if replicas == 1:
        data_parallel = None  # nothing to shard or average over
    elif data_parallel is None:  # cp > 1 at dp = 1: the CP ranks' gradients still add up
        data_parallel = "ddp"
    key = (data_parallel, experts)
    if key in REFUSED:
        raise ValueError(f"data_parallel={data_parallel!r}: {REFUSED[key]}")
    return SYNCS[key]


@dataclasses.dataclass(frozen=True)
class Replicas:
    """The ranks holding the same weights as this one, which data parallelism synchronises:
    ``group`` (a process group), ``mesh`` (the same ranks as a 1-d DeviceMesh, for FSDP2 and
    DTensors) and the ``device`` tensors live on."""

    group: dist.ProcessGroup
    mesh: object  # a 1-d DeviceMesh
    device: torch.device
    # expert parameters, whose replicas are the ranks holding the same experts instead
    experts: tuple = ()
    expert_mesh: object = None  # those ranks as a 1-d DeviceMesh (None: no other rank)

    @property
    def size(self) -> int:
        return self.group.size()

    @classmethod
    def of(cls, parallel, experts=()) -> "Replicas":
        """A :class:`~tp_ext.ParallelState`'s replicas of the dense weights: its DP ranks, and
        the CP ranks beside them under context parallelism; ``experts``' replicas: the
        expert-DP ranks."""
        expert_mesh = None
        if experts and comm.resolve_group(parallel.expert_dp_group).size > 1:
            expert_mesh = _mesh_of(parallel.expert_dp_group, parallel)
        if not parallel.dims.cp_enabled:
            group, mesh = parallel.dp_group, parallel.mesh["dp"]
        else:
            group, mesh = parallel.dp_cp_group, _mesh_of(parallel.dp_cp_group, parallel)
        return cls(group, mesh, parallel.device, tuple(experts), expert_mesh)


def _mesh_of(group, parallel):
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, parallel.device.type)


def wrap_data_parallel(
    module: nn.Module,
    kind: str,
    replicas: Replicas,
    compression: Optional[tuple] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> nn.Module:
    """``module`` under DDP (``"ddp"``) or FSDP2 (``"fsdp"``, each decoder layer and then the
    stage as one unit, parameters sharded along dim 0 over the replicas), on the ``replicas``'
    group. Without replicas (one rank) the module is returned as it is.
    ``compression``: (method, named parameters) of a :mod:`tp_ext.compression` hook for DDP
    to send its gradients with (its state is left in ``module.compression_state``)."""
    if kind not in DATA_PARALLEL:
        raise ValueError(f"data_parallel must be one of {DATA_PARALLEL} or None, got {kind!r}")
    if replicas.size == 1:
        return module
    group = replicas.group
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = replicas.device
        device_ids = None if device.type == "cpu" else [device.index]
        # buffers (rotary tables) are equal on every rank: no broadcast before each forward
        # (torch >= 2.13 names the switch forward_sync_buffers; older ones broadcast_buffers)
        params = inspect.signature(DistributedDataParallel).parameters
        no_sync = (
            {"forward_sync_buffers": False}
            if "forward_sync_buffers" in params
            else {"broadcast_buffers": False}
        )
        ddp = DistributedDataParallel(module, device_ids=device_ids, process_group=group, **no_sync)
        if compression is not None:
            method, named = compression
            ddp.compression_state = register(ddp, method, group, named)
        elif reduce_dtype is not None:
            ddp.register_comm_hook(group, _sum_in(reduce_dtype))
        elif replicas.size > 2:
            ddp.register_comm_hook(group, _reproducible_sum)
        else:
            ddp.register_comm_hook(group, _sum)
        return ddp

    return _fully_shard(module, replicas)


def _fully_shard(module: nn.Module, replicas: Replicas) -> nn.Module:
    """FSDP2 units: each module holding expert parameters on the experts' own replicas (or left
    out of FSDP2 where no other rank holds them), each decoder layer, then the stage."""
    from torch.distributed.fsdp import fully_shard

    expert_ids = {id(p) for p in replicas.experts}
    owners = [m for m in module.modules() if any(id(p) in expert_ids for p in m.parameters(False))]
    units, ignored = [], set()
    if replicas.expert_mesh is not None:
        units = [fully_shard(m, mesh=replicas.expert_mesh) for m in owners]
    else:  # each rank's own experts: nothing to reduce or shard
        ignored = {p for m in owners for p in m.parameters(False) if id(p) in expert_ids}
    mesh, options = replicas.mesh, {"ignored_params": ignored} if ignored else {}
    layers = getattr(module, "layers", {}).values()
    units += [fully_shard(layer, mesh=mesh, **options) for layer in layers]
    units.append(fully_shard(module, mesh=mesh, **options))
    for unit in units:  # a sum, not a mean (see the module's doc); SUM is what gloo has
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return module


def reduce_scatter_in(
    flat: torch.Tensor, sizes: list, dtype: torch.dtype, group, *, async_op: bool = False
):
    """This rank's piece (``sizes[rank]`` elements of ``flat``, split by ``sizes``) of the sum of
    every rank's ``flat``, with the pieces sent in ``dtype`` (bf16: half fp32's bytes) and added
    in ``flat``'s own dtype: one all-to-all, then a local sum of the rounded terms in rank order
    (this rank's own rounded too, so an element's sum does not depend on which rank adds it: a
    resumed run whose buckets differ rounds alike). A reduce-scatter in bf16 would add in bf16.
    ``async_op=True``: a handle whose ``wait()`` returns the piece."""
    g = comm.resolve_group(group)
    if g.size == 1:
        piece = flat.to(dtype).to(flat.dtype)
        return _Summed(None, piece, 1, 0) if async_op else piece
    if async_op:
        pending = comm.all_to_all(flat.to(dtype), 0, 0, sizes, group=g, async_op=True)
        return _Summed(pending, flat.dtype, g.size, sizes[g.rank])
    pieces = comm.all_to_all(flat.to(dtype), 0, 0, sizes, group=g)
    return pieces.view(g.size, sizes[g.rank]).to(flat.dtype).sum(dim=0)


class _Summed:
    """:func:`reduce_scatter_in` in flight: ``wait()`` sums the arrived pieces in rank order."""

    def __init__(self, pending, dtype_or_result, ranks: int, mine: int):
        self._pending, self._ranks, self._mine = pending, ranks, mine
        self._result = None if pending is not None else dtype_or_result
        self._dtype = dtype_or_result

    def wait(self) -> torch.Tensor:
        if self._result is None:
            pieces = self._pending.wait()
            self._result = pieces.view(self._ranks, self._mine).to(self._dtype).sum(dim=0)
        return self._result


def _sum_in(dtype: torch.dtype):
    """A DDP comm hook summing each bucket with its pieces on the wire in ``dtype`` (bf16: half
    the bytes of fp32) and added in fp32 (:func:`reduce_scatter_in`), the sums then all-gathered
    in ``dtype``, so every replica gets the same gradients; through tp_ext's collectives (their
    bytes tracked under "train.dp_sync")."""

    def hook(group, bucket):  # -> Future[Tensor]
        buffer = bucket.buffer()
        sizes = shard_sizes(buffer.numel(), group.size())
        with comm.tag("train.dp_sync"):
            mine = reduce_scatter_in(buffer, sizes, dtype, group)
            everyone = comm.all_gather(mine.to(dtype), 0, sizes, group=group)
        buffer.copy_(everyone)
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    return hook


def _sum(group, bucket):  # -> Future[Tensor]
    """DDP's all-reduce of a bucket, summed (DDP's own divides by the group's size)."""
    buffer = bucket.buffer()
    return dist.all_reduce(buffer, group=group, async_op=True).get_future().then(lambda _: buffer)


def _reproducible_sum(group, bucket):  # -> Future[Tensor] (DDP checks no string)
    """The sum over the replicas, one all-reduce per parameter instead of per bucket.

    Why: DDP re-buckets the parameters after the first step, by the order their gradients were
    ready. A ring all-reduce over 3 or more ranks adds each element's terms in an order that
    depends on its offset in the buffer, so a run resumed from a checkpoint (its first step on
    the initial buckets) would round differently from the run it continues. Per parameter, an
    element's offset is fixed: resumed runs are bitwise the same. (Two ranks add a + b, which
    is the same either way: they keep one all-reduce per bucket.)"""
    works = [dist.all_reduce(grad, group=group, async_op=True) for grad in bucket.gradients()]
    done = torch.futures.collect_all([work.get_future() for work in works])
    return done.then(lambda _: bucket.buffer())


@torch.no_grad()
def sum_gradients(
    params,
    group,
    compression: Optional[CompressionState] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> None:
    """Sum the gradients of ``params`` over ``group`` in one flat all-reduce (or, sent
    compressed by ``compression``'s method with its error feedback, average them: as the
    compression hooks do).

    For the zero-bubble schedules only: their split backward computes weight gradients with
    ``torch.autograd.grad`` and writes ``.grad`` directly, so DDP's gradient hooks never fire
    and its all-reduce would not happen; this is DDP's sum, done once after the step."""
    params = [p for p in params if p.requires_grad]
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    if compression is not None:  # each parameter its own chunks, as the DDP hooks
        for p, avg in zip(params, averages(compression, grads, params)):
            p.grad = avg.to(p.dtype)
        return
    dtype = torch.float64 if any(g.dtype == torch.float64 for g in grads) else torch.float32
    flat = torch.cat([g.flatten().to(dtype) for g in grads])
    size = comm.resolve_group(group).size
    if reduce_dtype is None:
        flat = comm.all_reduce(flat, "sum", group=group)
    else:  # as the DDP hook: pieces in reduce_dtype, added in fp32, the sums gathered
        sizes = shard_sizes(flat.numel(), size)
        mine = reduce_scatter_in(flat, sizes, reduce_dtype, group)
        flat = comm.all_gather(mine.to(reduce_dtype), 0, sizes, group=group)
        flat = flat.to(dtype)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad = flat[offset : offset + n].view_as(p).to(p.dtype)
        offset += n


@dataclasses.dataclass
class ReplicatedStages:
    """A pipeline rank's stage modules as data parallelism runs them: what a
    :class:`~tp_ext.pipeline.PipelineRunner` needs from the DP side.

    - ``modules``: one module per stage this rank holds (DDP- or FSDP2-wrapped, or as they are);
    - ``sync_after_step``: tp_ext sums the gradients after the schedule's step (schedules
      that write weight gradients outside autograd, where DDP's hooks never fire);
    - ``compression_states``: the gradient-compression states (int8 / 1-bit residuals, PowerSGD's
      errors), whose ``state_dict()`` the checkpoints hold; empty without compression."""

    modules: list
    sync_after_step: bool = False
    compression_states: list = dataclasses.field(default_factory=list)
    reduce_dtype: Optional[torch.dtype] = None  # the DP sum's dtype on the wire (None: own)

    def synchronise(self, params, group) -> None:
        """The replicas' sum after the step (only with ``sync_after_step``; compressed: their
        average)."""
        state = self.compression_states[0] if self.compression_states else None
        sum_gradients(params, group, state, self.reduce_dtype)


def replicate_stages(
    model: nn.Module,
    replicas: Optional[Replicas],
    data_parallel: Optional[str],
    *,
    sync_after_step: bool = False,
    compression: Optional[str] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> ReplicatedStages:
    """``model.stage_modules()`` set up for data parallelism over ``replicas``: wrapped by
    :func:`wrap_data_parallel` (``data_parallel`` "ddp" / "fsdp"; None: as they are), or left
    unwrapped with ``sync_after_step``; with ``compression`` (a method of
    :mod:`tp_ext.compression`, already checked against the schedule) its DDP hooks, or its state
    for the sum after the step. Every int8 / 1-bit residual exists (and is saved) from the
    start."""
    several = replicas is not None and replicas.size > 1
    compression = compression if several else None
    # residuals named as the model names its parameters (the checkpoint's keys)
    named = list(model.named_parameters())
    modules = model.stage_modules()
    if data_parallel is not None and several and not sync_after_step:
        hook = (compression, named) if compression else None
        modules = [
            wrap_data_parallel(m, data_parallel, replicas, hook, reduce_dtype) for m in modules
        ]
    states = [
        m.compression_state
        for m in modules
        if isinstance(
            getattr(m, "compression_state", None), (CompressionState, PowerSGDCompression)
        )
    ]
    if compression and sync_after_step:
        states = [CompressionState(replicas.group, compression, named)]
    owners = [m.module for m in modules if hasattr(m, "compression_state")] or [model]
    for state, owner in zip(states, owners):
        if not isinstance(state, CompressionState):
            continue  # PowerSGD's state_dict has every parameter from the start
        for param in owner.parameters():
            if param.requires_grad:
                state.residual_of(param)
    return ReplicatedStages(modules, sync_after_step, states, reduce_dtype)
