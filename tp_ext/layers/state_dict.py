"""Full (unsharded) and sharded state dicts of any module holding tp_ext layers, 1D and 2D.

Each parallel layer records a :class:`tp_ext.sharding.ShardSpec` per sharded parameter (a
:class:`~tp_ext.sharding.Partition` over its TP group, or a :class:`~tp_ext.sharding.GridBlock`
of a P x Q grid) and its place in it (``shard_coord``); see
:class:`tp_ext.layers.base.ParallelModule`. From those alone: this rank's blocks of full tensors
(:func:`local_shards`, :func:`load_full_state_dict`, local), and full tensors gathered from every
rank (:func:`iter_full_tensors`, :func:`full_state_dict`, collectives). Checkpoint code reads
:func:`tensor_specs`.

This module reads layers through the :class:`HoldsShardSpecs` protocol, so the layers' base
class imports it and not the other way round.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional, Protocol, runtime_checkable

import torch
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.dtensors import is_dtensor
from tp_ext.sharding import GridBlock, Partition, ShardSpec

__all__ = [
    "HoldsShardSpecs",
    "load_full_state_dict",
    "full_state_dict",
    "iter_full_tensors",
    "local_shards",
    "tensor_specs",
    "state_entries",
    "full_shapes",
    "expert_rows",
    "check_full_keys",
    "init_from_full_tensors",
    "is_full_transposed",
]


@runtime_checkable
class HoldsShardSpecs(Protocol):
    """A module whose own parameters may be sharded (every tp_ext layer)."""

    def param_spec(self, param_name: str) -> Optional[ShardSpec]:
        """The layout of one of its own parameters; None when every rank holds it whole."""

    @property
    def shard_coord(self):
        """This rank's place in its specs: a TP rank, or ``(row, col)`` on a grid."""

    def expert_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """A second split over the expert-parallel group; None for all but experts."""


def _owned_tensors(module: nn.Module):
    """(name, tensor, owning module, leaf name) for every entry of module.state_dict(). A tensor
    held under several names (a tie, as BERT's masked-LM head holds its decoder's bias) is read
    through the parallel layer that splits it, under each of its names."""
    entries = []
    for name, tensor in module.state_dict(keep_vars=True).items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        entries.append((name, tensor, owner, leaf))
    splitting = {
        id(tensor): (owner, leaf)
        for _, tensor, owner, leaf in entries
        if isinstance(owner, HoldsShardSpecs)
    }
    for name, tensor, owner, leaf in entries:
        if not isinstance(owner, HoldsShardSpecs) and id(tensor) in splitting:
            owner, leaf = splitting[id(tensor)]
        yield name, tensor, owner, leaf


def _spec(owner: nn.Module, leaf: str) -> Optional[ShardSpec]:
    return owner.param_spec(leaf) if isinstance(owner, HoldsShardSpecs) else None


def _expert_spec(owner: nn.Module, leaf: str) -> Optional[Partition]:
    """The split over the expert-parallel group (experts of an MoE layer), or None."""
    expert = owner.expert_spec(leaf) if isinstance(owner, HoldsShardSpecs) else None
    return None if expert is None else expert[1].along(expert[0])


def is_full_transposed(owner: nn.Module, leaf: str) -> bool:
    """Whether the entry's full form is the transpose of what the layer holds (a weight
    converted from Hugging Face's Conv1D): full tensors go in and come out transposed, and
    checkpoint code reads and writes that form."""
    is_transposed = getattr(owner, "full_is_transposed", None)
    return bool(is_transposed and is_transposed(leaf))


def _local(value: torch.Tensor, owner: nn.Module, leaf: str) -> torch.Tensor:
    """This rank's piece of a full tensor: its TP (or grid) block, then its experts."""
    if is_full_transposed(owner, leaf):
        value = value.t()
    spec, expert = _spec(owner, leaf), _expert_spec(owner, leaf)
    if spec is not None:
        value = spec.take_block(value, owner.shard_coord)
    if expert is not None:
        value = expert.take_block(value, owner.ep.rank)
    return value


def tensor_specs(module: nn.Module):
    """``(name, tensor, spec, owner)`` for every entry of ``module.state_dict()``: ``spec`` is
    the :class:`~tp_ext.sharding.ShardSpec` of a sharded tensor (read with
    ``owner.shard_coord``), else None. Checkpoint I/O reads this."""
    for name, tensor, owner, leaf in _owned_tensors(module):
        yield name, tensor, _spec(owner, leaf), owner


def state_entries(module: nn.Module):
    """``(name, tensor, (dim, Partition) or None, owner)``: :func:`tensor_specs` in the 1D
    form older callers read. A module with 2D grid blocks has no such form (read
    :func:`tensor_specs`)."""
    for name, tensor, spec, owner in tensor_specs(module):
        if isinstance(spec, GridBlock):
            raise ValueError(
                f"state_entries: {name!r} is a 2D grid block, which has no (dim, Partition) "
                "form; read tp_ext.layers.tensor_specs (its ShardSpec) instead"
            )
        yield name, tensor, None if spec is None else (spec.dim, spec), owner


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The unsharded shape of every entry of ``module.state_dict()`` (no communication)."""
    return {
        name: _full_shape(tensor, _spec(owner, leaf), _expert_spec(owner, leaf), owner, leaf)
        for name, tensor, owner, leaf in _owned_tensors(module)
    }


def expert_rows(owner: nn.Module, name: str) -> Optional[tuple[int, int]]:
    """(first expert this rank holds, number of experts) of a state-dict entry split by expert
    over an EP group (dim 0); None for any other entry."""
    expert = _expert_spec(owner, name.rpartition(".")[2])
    if expert is None:
        return None
    if expert.dim != 0:
        raise ValueError(
            f"{name}: experts split along dim {expert.dim}; tp_ext splits them along dim 0"
        )
    mine = expert.segments[owner.ep.rank]
    return (mine[0][0] if mine else 0), expert.full


def _full_shape(tensor: torch.Tensor, spec, expert, owner, leaf: str) -> tuple[int, ...]:
    """The shape of the entry's full form."""
    shape = tuple(tensor.shape)
    for split in (spec, expert):
        if split is not None:
            shape = split.full_shape_of(shape)
    return shape[::-1] if is_full_transposed(owner, leaf) else shape


@torch.no_grad()
def init_from_full_tensors(module: nn.Module, draw) -> None:
    """Set every parameter of ``module`` to this rank's block of the full tensor that
    ``draw(name, full_shape, owner)`` returns (``name`` as in ``module.state_dict()``, ``owner``
    the module holding it). When ``draw`` depends only on its arguments, every set of dims (TP
    degree, grid, pipeline stage, expert split) holds blocks of the same full model. A parameter
    held under two names (a tied head) is set once; parameters on the meta device are
    skipped."""
    done = set()
    for name, tensor, owner, leaf in _owned_tensors(module):
        if (
            not isinstance(tensor, nn.Parameter)
            or tensor.device.type == "meta"
            or id(tensor) in done
        ):
            continue
        done.add(id(tensor))
        shape = _full_shape(tensor, _spec(owner, leaf), _expert_spec(owner, leaf), owner, leaf)
        full = draw(name, shape, owner)
        tensor.copy_(_local(full, owner, leaf).to(tensor.device, tensor.dtype))


def local_shards(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's piece of each full tensor in ``full`` (views where possible), keyed as
    ``module.state_dict()``; keys the module does not have are ignored."""
    result = {}
    for name, _, owner, leaf in _owned_tensors(module):
        if name in full:
            result[name] = _local(full[name], owner, leaf)
    return result


def check_full_keys(module: nn.Module, names: set, full: Mapping[str, torch.Tensor]) -> None:
    """A strict load's key check: ``full`` must hold exactly ``names``."""
    missing = sorted(names - set(full))
    unexpected = sorted(set(full) - names)
    if missing or unexpected:
        raise KeyError(
            f"load_full_state_dict({type(module).__name__}): missing keys {missing}, unexpected "
            f"keys {unexpected}; expected exactly {sorted(names)} (strict=False loads a subset)"
        )


@torch.no_grad()
def load_full_state_dict(
    module: nn.Module, full: Mapping[str, torch.Tensor], strict: bool = True
) -> None:
    """Copy this rank's block of every full tensor in ``full`` into ``module`` (keys as in
    ``module.state_dict()``; shapes those of the unsharded module). Local, no communication.
    With ``strict``, missing and unexpected keys are errors that list them."""
    entries = list(_owned_tensors(module))
    if strict:
        check_full_keys(module, {name for name, *_ in entries}, full)
    for name, tensor, owner, leaf in entries:
        if name not in full:
            continue
        value = full[name]
        spec, expert = _spec(owner, leaf), _expert_spec(owner, leaf)
        expected = _full_shape(tensor, spec, expert, owner, leaf)
        if tuple(value.shape) != expected:
            hint = (
                ""
                if spec is None and expert is None
                else (
                    f" (this rank holds a slice of {tuple(tensor.shape)}; pass the full "
                    "tensor, not a shard)"
                )
            )
            raise ValueError(
                f"load_full_state_dict: {name!r} has shape {tuple(value.shape)}, "
                f"expected the unsharded shape {expected}{hint}"
            )
        if tensor.device.type == "meta":
            if value.device.type == "meta":
                continue  # a model converted on the meta device: shapes only, nothing to copy
            raise ValueError(
                f"load_full_state_dict: {name!r} is on the meta device; call "
                "module.to_empty(device=...) first"
            )
        tensor.copy_(_local(value, owner, leaf))


def iter_full_tensors(module: nn.Module):
    """``(name, full tensor)`` for every entry of ``module.state_dict()``, gathered one at a time
    (peak memory: one full tensor). A collective per sharded tensor: every rank must iterate."""
    for name, tensor, owner, leaf in _owned_tensors(module):
        full = _gather_full(tensor, _spec(owner, leaf), owner)
        expert = _expert_spec(owner, leaf)
        if expert is not None and owner.ep.size > 1:
            full = comm.all_gather(
                full.contiguous(), expert.dim, expert.local_sizes(), group=owner.ep
            )
        yield name, (full.t().contiguous() if is_full_transposed(owner, leaf) else full)


@torch.no_grad()
def _gather_full(tensor: torch.Tensor, spec, owner) -> torch.Tensor:
    if is_dtensor(tensor):  # sharded over data-parallel ranks too (FSDP2): whole first
        tensor = tensor.full_tensor()
    if isinstance(spec, GridBlock):
        return _gather_grid_block(tensor, spec, owner.grid)
    if spec is None or owner.tp_size == 1:
        return tensor.detach().clone()
    gathered = comm.all_gather(
        tensor.detach().contiguous(), spec.dim, spec.local_sizes(), group=owner.tp
    )
    if not spec.is_contiguous_split():
        order = torch.tensor(spec.gather_order(), device=gathered.device)
        gathered = gathered.index_select(spec.dim, order)
    return gathered


def _gather_grid_block(local: torch.Tensor, block: GridBlock, grid) -> torch.Tensor:
    """A grid block's full tensor: each split dimension gathered over its grid axis."""
    out = local.detach()
    for dim, split in enumerate(block.splits):
        if split is not None:
            axis, sizes = split
            group = grid.col_group if axis == "P" else grid.row_group
            out = comm.all_gather(out.contiguous(), dim, list(sizes), group=group)
    return out.clone() if all(s is None for s in block.splits) else out


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()`` as its full (unsharded) tensor, on every rank.
    A collective over each parallel layer's TP group (or grid): every rank must call it."""
    return dict(iter_full_tensors(module))
