"""Full (unsharded) and sharded state dicts of any module holding tp_ext layers.

Each parallel layer records a ``(dim, Partition)`` shard spec per sharded parameter (see
:class:`tp_ext.layers.base.ParallelModule`). From it: this rank's slices of full tensors
(:func:`local_shards`, :func:`load_full_state_dict`, local), and full tensors gathered from every
rank (:func:`iter_full_tensors`, :func:`full_state_dict`, collectives). Checkpoint code reads
:func:`state_entries`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from tp_ext.distributed import comm
from tp_ext.layers.base import ParallelModule

__all__ = [
    "load_full_state_dict",
    "full_state_dict",
    "iter_full_tensors",
    "local_shards",
    "state_entries",
    "full_shapes",
    "expert_rows",
]


def _owned_tensors(module: nn.Module):
    """(name, tensor, owning module, leaf name) for every entry of module.state_dict()."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        yield name, tensor, owner, leaf


def _spec(owner: nn.Module, leaf: str):
    return owner.shard_spec(leaf) if isinstance(owner, ParallelModule) else None


def _expert_spec(owner: nn.Module, leaf: str):
    """The split over the expert-parallel group (experts of an MoE layer), or None."""
    return owner.expert_spec(leaf) if isinstance(owner, ParallelModule) else None


def _local(value: torch.Tensor, owner: nn.Module, leaf: str) -> torch.Tensor:
    """This rank's piece of a full tensor: its TP slice, then its experts."""
    spec, expert = _spec(owner, leaf), _expert_spec(owner, leaf)
    if spec is not None:
        value = spec[1].local(value, spec[0], owner.tp_rank)
    if expert is not None:
        value = expert[1].local(value, expert[0], owner.ep.rank)
    return value


def state_entries(module: nn.Module):
    """``(name, tensor, spec, owner)`` for every entry of ``module.state_dict()``: ``spec`` is
    the owner's ``(dim, Partition)`` for sharded tensors, else None. Checkpoint I/O reads this."""
    for name, tensor, owner, leaf in _owned_tensors(module):
        yield name, tensor, _spec(owner, leaf), owner


def full_shapes(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """The unsharded shape of every entry of ``module.state_dict()`` (no communication)."""
    return {
        name: _full_shape(tensor, _spec(owner, leaf), _expert_spec(owner, leaf))
        for name, tensor, owner, leaf in _owned_tensors(module)
    }


def expert_rows(owner: nn.Module, name: str) -> Optional[tuple[int, int]]:
    """(first expert this rank holds, number of experts) of a state-dict entry split by expert
    over an EP group (dim 0); None for any other entry."""
    expert = _expert_spec(owner, name.rpartition(".")[2])
    if expert is None:
        return None
    dim, partition = expert
    if dim != 0:
        raise ValueError(f"{name}: experts split along dim {dim}; tp_ext splits them along dim 0")
    mine = partition.segments[owner.ep.rank]
    return (mine[0][0] if mine else 0), partition.full


def _full_shape(tensor: torch.Tensor, spec, expert=None) -> tuple[int, ...]:
    shape = list(tensor.shape)
    for split in (spec, expert):
        if split is not None:
            shape[split[0]] = split[1].full
    return tuple(shape)


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
    """Copy this rank's slice of every full tensor in ``full`` into ``module`` (keys as in
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
        expected = _full_shape(tensor, spec, expert)
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
            dim, partition = expert
            full = comm.all_gather(full.contiguous(), dim, partition.local_sizes(), group=owner.ep)
        yield name, full


@torch.no_grad()
def _gather_full(tensor: torch.Tensor, spec, owner) -> torch.Tensor:
    if isinstance(tensor, DTensor):  # sharded over data-parallel ranks too (FSDP2): whole first
        tensor = tensor.full_tensor()
    if spec is None or owner.tp_size == 1:
        return tensor.detach().clone()
    dim, partition = spec
    gathered = comm.all_gather(
        tensor.detach().contiguous(), dim, partition.local_sizes(), group=owner.tp
    )
    if not partition.is_contiguous_split():
        order = torch.tensor(partition.gather_order(), device=gathered.device)
        gathered = gathered.index_select(dim, order)
    return gathered


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()`` as its full (unsharded) tensor, on every rank.
    A collective over each parallel layer's TP group: every rank must call it."""
    return dict(iter_full_tensors(module))
