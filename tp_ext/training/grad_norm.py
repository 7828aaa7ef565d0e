"""The gradient norm of a tensor-parallel model as if it were unsharded, and clipping by it.

Gradients of sharded parameters live in pieces on the TP ranks; replicated parameters (norms,
row-parallel biases) and replicated rows (KV heads when ``num_kv_heads < tp``) hold the same
gradient on every rank that has them. :func:`grad_norm` counts every element of the unsharded
model exactly once, so it equals ``torch.nn.utils.get_total_norm`` of the unsharded model's
gradients, with one all-reduce over TP.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.dtensors import is_dtensor, local_tensor
from tp_ext.distributed.groups import ResolvedGroup, resolve_group
from tp_ext.layers import ParallelModule, expert_parameters
from tp_ext.sharding import Partition
from tp_ext.validation import is_number

__all__ = ["grad_norm", "clip_grad_norm_", "parallel_grad_norm", "scale_grads_", "model_tp_group"]


def grad_norm(model: nn.Module, tp_group=None, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``model``'s gradients as if it were unsharded: equal to
    ``torch.nn.utils.get_total_norm`` over the unsharded model's gradients, on every TP rank.

    Sharded parameters contribute their local pieces (rows held by several ranks only on the
    first of them), replicated parameters only on TP rank 0; the partial sums travel in one
    all-reduce (a max for ``norm_type=inf``). ``tp_group``: None takes the group of the model's
    parallel layers. A collective: every TP rank must call it. Returns a 0-d float tensor."""
    p = _check_norm_type(norm_type)
    tp = model_tp_group(model, tp_group)
    reduce = "max" if p == math.inf else "sum"
    experts, ep = expert_parameters(model)
    expert_ids = {id(q) for q in experts}
    local = _local_norm_power(model, tp, p, skip=expert_ids)
    whole_experts = None
    if experts:  # each EP rank holds other experts: their part adds up over the EP group first
        sliced = _experts_split_over_tp(model)
        mine = _held_experts_power(model, expert_ids, sliced, tp, p, local.device)
        if ep.size > 1:
            mine = comm.all_reduce(mine, reduce, group=ep)
        if tp.size > 1 and not sliced:
            whole_experts = mine  # the EP group held each expert once: not summed over TP
        else:
            local = _combine(local, mine, p)
    if tp.size > 1:
        local = comm.all_reduce(local, reduce, group=tp)
    if whole_experts is not None:
        local = _combine(local, whole_experts, p)
    return local if p == math.inf else local.pow(1.0 / p)


def _experts_split_over_tp(model: nn.Module) -> bool:
    """Whether the expert-parallel layers also split each expert over a TP group of several."""
    return any(
        m.tp_size > 1
        for m in model.modules()
        if isinstance(m, ParallelModule)
        and any(m.expert_spec(n) is not None for n, _ in m.named_parameters(recurse=False))
    )


def _combine(a: torch.Tensor, b: torch.Tensor, p: float) -> torch.Tensor:
    return torch.maximum(a, b) if p == math.inf else a + b


def parallel_grad_norm(
    model: nn.Module,
    parallel,
    sharded: bool,
    tied_weights=(),
    norm_type: float = 2.0,
) -> torch.Tensor:
    """:func:`grad_norm` of a model built with ``parallel=`` (TP x CP x PP x DP): every stage's
    gradients, TP shards counted once, a tied embedding's two copies (``tied_weights``, the
    model's :meth:`~tp_ext.contract.ParallelModel.tied_weights`) once, each expert once (on the
    first rank of the ranks holding it). The replicas of the dense weights (the DP x CP ranks)
    hold their rows of the gradients when ``sharded`` (FSDP2, ZeRO-2), each counted once, or
    whole ones (DDP, ZeRO-1, the sums), counted on the first replica. One all-reduce over all
    ranks; every rank gets the same norm."""
    p = _check_norm_type(norm_type)
    tp = model_tp_group(model, parallel.tp_group)
    skip = set()
    if tied_weights and model.stage_split.last_stage in model.stage_ids:
        skip = {id(tied_weights[-1])}  # the tied head's copy; the embedding's counts
    experts = {id(q) for q in expert_parameters(model)[0]}
    replicas = resolve_group(parallel.dp_cp_group)
    if not sharded and replicas.rank != 0 and p != math.inf:  # a replica's copy: not counted
        # in the dtype the counting ranks sum in (fp64 for fp64 gradients), for one all-reduce
        wide = any(q.dtype == torch.float64 for q in model.parameters())
        local = torch.zeros((), device=parallel.device, dtype=torch.float64 if wide else None)
    else:
        rows = (replicas.size, replicas.rank) if sharded else None
        local = _local_norm_power(model, tp, p, skip | experts, rows)
    if experts:
        local = _combine(local, _expert_norm_power(model, experts, parallel, tp, p, sharded), p)
    local = comm.all_reduce(
        local.float() if local.dtype != torch.float64 else local,
        "max" if p == math.inf else "sum",
        group=dist.group.WORLD,
    )
    return local if p == math.inf else local.pow(1.0 / p)


def _expert_norm_power(
    model, expert_ids: set, parallel, tp: ResolvedGroup, p: float, rows: bool = False
):
    """This rank's share of sum(|g|^p) over the expert gradients, for a sum over every rank:
    the ranks holding the same experts (the expert-DP group) count them on its first rank only,
    or each its own rows of them (``rows``: ZeRO-2's); experts split over TP count each TP slice
    once, whole experts all count."""
    expert_dp = resolve_group(parallel.expert_dp_group)
    if expert_dp.rank != 0 and p != math.inf and not rows:
        return torch.zeros((), device=parallel.device)
    sliced = _experts_split_over_tp(model)
    shards = (expert_dp.size, expert_dp.rank) if rows else None
    return _held_experts_power(model, expert_ids, sliced, tp, p, parallel.device, shards)


def _held_experts_power(model, expert_ids: set, sliced: bool, tp, p: float, device, shards=None):
    """sum(|g|^p) (max for p = inf) over the expert gradients this rank holds: experts ``sliced``
    over TP count each TP slice once, as any TP layer's; whole experts (an EP group across TP
    ranks, or no TP) all count here. ``shards``: (size, rank) of the ranks splitting their
    rows, as for :func:`_local_norm_power`."""
    if sliced:
        dense_ids = {id(q) for q in model.parameters()} - expert_ids
        return _local_norm_power(model, tp, p, skip=dense_ids, dp_shards=shards)
    grads = [
        local_tensor(q.grad)
        for q in model.parameters()
        if id(q) in expert_ids and q.grad is not None
    ]
    return _power_of([_norm_of(g, p) for g in grads], p, device)


def _local_norm_power(model, tp: ResolvedGroup, p: float, skip=frozenset(), dp_shards=None):
    """This rank's share of sum(|g|^p) (or max |g| for p = inf) over the unsharded gradients.
    ``dp_shards``: (size, rank) of the DP ranks when gradients are their rows along dim 0
    (FSDP2's shards, ZeRO-2's rows: DTensors)."""
    terms = []
    for param, spec, where in _grads_with_specs(model, tp, skip):
        g = param.grad
        rows = None
        if is_dtensor(g):
            g = g.to_local()
            rows = _dp_rows(param.shape[0], dp_shards) if dp_shards is not None else None
        if spec is None:
            if tp.rank != 0 and p != math.inf:  # replicated: identical on every rank
                continue
        elif not isinstance(spec, Partition) or p != math.inf:  # (a max needs no de-duplication)
            g = _counted(g, spec, where, rows)
            if g is None:  # another rank's copy of this block counts
                continue
        terms.append(_norm_of(g, p))
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    return _power_of(terms, p, device)


def _counted(g: torch.Tensor, spec, where, rows) -> Optional[torch.Tensor]:
    """The part of this rank's gradient block ``g`` that it alone counts (the spec says which);
    ``rows``: the dim-0 rows [start, end) of its block that FSDP2 left on this DP rank."""
    if rows is None or not isinstance(spec, Partition) or spec.dim != 0 or not spec.replicated:
        return spec.counted(g, where)
    start, end = rows
    keep = [k - start for k in spec.first_owner_positions(where) if start <= k < end]
    if len(keep) == g.size(0):
        return g
    return g.index_select(0, torch.tensor(keep, dtype=torch.long, device=g.device))


def _norm_of(g: torch.Tensor, p: float) -> torch.Tensor:
    acc = torch.float64 if g.dtype == torch.float64 else torch.float32
    return torch.linalg.vector_norm(g, p, dtype=acc)


def _power_of(norms: list, p: float, device) -> torch.Tensor:
    """sum(norm^p) of the norms (their max for p = inf); 0 for none."""
    if not norms:
        return torch.zeros((), device=device)
    dtype = torch.float64 if any(t.dtype == torch.float64 for t in norms) else torch.float32
    stacked = torch.stack([t.to(dtype) for t in norms])
    return stacked.max() if p == math.inf else stacked.pow(p).sum()


def _dp_rows(rows: int, shards: tuple[int, int]) -> tuple[int, int]:
    """Rows [start, end) of dim 0 that FSDP2 (or ZeRO-2) gives DP rank ``shards[1]`` of
    ``shards[0]`` (torch.chunk's split)."""
    size, rank = shards
    chunk = -(-rows // size)
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk)


def clip_grad_norm_(
    model: nn.Module, max_norm: float, tp_group=None, norm_type: float = 2.0
) -> torch.Tensor:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when that is below 1, with the norm
    from :func:`grad_norm` (so all TP ranks scale alike, as torch.nn.utils.clip_grad_norm_ would
    on the unsharded model). Returns the norm before clipping."""
    if not is_number(max_norm) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    total = grad_norm(model, tp_group, norm_type)
    scale_grads_(model, max_norm, total)
    return total


@torch.no_grad()
def scale_grads_(model: nn.Module, max_norm: float, total: torch.Tensor) -> None:
    """Multiply every gradient by ``min(1, max_norm / (total + 1e-6))`` (torch's clip rule),
    data-parallel shards (DTensor gradients) included."""
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in model.parameters():
        g = param.grad
        if g is not None:
            g = local_tensor(g)
            g.mul_(coef.to(g.dtype))


def _check_norm_type(norm_type) -> float:
    if not is_number(norm_type) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got {norm_type!r}")
    return float(norm_type)


def model_tp_group(model: nn.Module, tp_group) -> ResolvedGroup:
    """The explicit group, else the one group of the model's parallel layers (a group of one
    for a model without any)."""
    if tp_group is not None:
        return resolve_group(tp_group)
    groups = {}
    for module in model.modules():
        # a 2D layer's group is its grid's P x Q ranks
        tp = module.tp if isinstance(module, ParallelModule) else None
        if tp is not None and tp.size > 1:
            groups[tp.name] = tp
    if len(groups) > 1:
        raise ValueError(
            f"{type(model).__name__} has layers on several TP groups "
            f"({sorted(groups)}); pass tp_group= to say which one to reduce over"
        )
    return next(iter(groups.values()), ResolvedGroup.local())


def _grads_with_specs(model: nn.Module, tp: ResolvedGroup, skip=frozenset()):
    """(parameter, ShardSpec or None, this rank's place in it) for each distinct parameter with
    a gradient, but those in ``skip`` (ids). A parameter that a parallel layer shares with
    another module (BERT's head bias, held by the head and its split decoder) has the layer's
    spec, whichever module holds it first."""
    split = {
        id(param): (module, name)
        for module in model.modules()
        if isinstance(module, ParallelModule)
        for name, param in module.named_parameters(recurse=False)
    }
    seen = set(skip)
    for holder in model.modules():
        for name, param in holder.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights: counted once
                continue
            seen.add(id(param))
            if param.grad is None:
                continue
            if id(param) not in split:
                yield param, None, None
                continue
            module, name = split[id(param)]
            spec = module.param_spec(name)
            if isinstance(spec, Partition) and spec.world_size != tp.size:
                raise ValueError(
                    f"{type(module).__name__}.{name} is sharded over {spec.world_size} ranks "
                    f"but tp_group has {tp.size}; pass the group the model was built with"
                )
            yield param, spec, None if spec is None else module.shard_coord
