"""What every tp_ext layer shares: its TP group, how each parameter maps onto the full
(unsharded) tensor, and the conversions between the two.

A parallel module records, for each parameter it owns, a ``(dim, Partition)`` shard spec; a
parameter without one is replicated (every rank holds the whole tensor). From that one record:

- ``load_full_state_dict(full)`` takes this rank's slice of full tensors (as vLLM's weight
  loaders do), so tests, checkpoint converters and users load the same way;
- ``full_state_dict()`` gathers full tensors on every rank (a collective: every rank calls it);
- initialisation draws the *full* tensor from the default generator and keeps this rank's slice,
  so a model built at TP=k equals the one built at TP=1 with the same seed.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Mapping
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tp_ext import comm
from tp_ext.sharding import Partition, shard_sizes

__all__ = ["ParallelModule", "TPGroup", "resolve_tp_group", "load_full_state_dict",
           "full_state_dict", "iter_full_tensors", "local_shards", "state_entries", "SEQUENCE_DIM"]

# Sequence parallelism shards the sequence axis: dim 1 of [batch, seq, hidden], dim 0 of
# [tokens, hidden]; -2 names both.
SEQUENCE_DIM = -2

InitFn = Callable[[torch.Tensor], None]

_skip_init = False


@contextlib.contextmanager
def no_init():
    """Build layers without initialising their weights (they are about to be loaded)."""
    global _skip_init
    previous, _skip_init = _skip_init, True
    try:
        yield
    finally:
        _skip_init = previous


class TPGroup:
    """A TP process group resolved once, at construction: forward only reads plain attributes
    (no global lookups, so torch.compile sees constants). Without torch.distributed and without
    an explicit group, it is a group of one: the layers then run as their torch.nn equivalents."""

    def __init__(self, group=None) -> None:
        if group is None and not dist.is_initialized():
            self.group, self.name, self.size, self.rank = None, "", 1, 0
            return
        self.group = comm.resolve_group(group)
        self.name, self.size, self.rank = (self.group.group_name, self.group.size(),
                                           self.group.rank())

    @classmethod
    def local(cls) -> "TPGroup":
        """A group of one, with no communication: the layers as their unsharded equivalents
        (references, or unsharded parts of a distributed job)."""
        group = cls.__new__(cls)
        group.group, group.name, group.size, group.rank = None, "", 1, 0
        return group

    @classmethod
    def virtual(cls, size: int, rank: int) -> "TPGroup":
        """Rank ``rank`` of ``size`` ranks with no process group behind it: for building one
        rank's shard on the meta device (plans, shapes, byte counts). Forward cannot communicate."""
        group = cls.__new__(cls)
        group.group, group.name, group.size, group.rank = None, "<virtual>", size, rank
        return group

    def __repr__(self) -> str:
        return f"TPGroup(name={self.name!r}, size={self.size}, rank={self.rank})"


def resolve_tp_group(tp_group) -> TPGroup:
    return tp_group if isinstance(tp_group, TPGroup) else TPGroup(tp_group)


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ParallelModule(nn.Module):
    """Base of every tp_ext layer."""

    def _setup_tp(self, tp_group) -> TPGroup:
        tp = resolve_tp_group(tp_group)
        # Not a module or tensor: stored without nn.Module's registration.
        object.__setattr__(self, "tp", tp)
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self._shard_specs: dict[str, tuple[int, Partition]] = {}
        return tp

    def _set_shard(self, param_name: str, dim: int, partition: Partition) -> None:
        if partition.world_size != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: a partition over {partition.world_size} ranks does not "
                f"fit a TP group of {self.tp_size} ranks")
        self._shard_specs[param_name] = (dim, partition)

    def shard_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """``(dim, Partition)`` of one of this module's own parameters; None if replicated."""
        return self._shard_specs.get(param_name)

    def _check_same_group(self, *children: "ParallelModule") -> None:
        for child in children:
            if (child.tp.name, child.tp_size) != (self.tp.name, self.tp_size):
                raise ValueError(
                    f"{type(self).__name__}: sub-layer {type(child).__name__} uses TP group "
                    f"{child.tp} but this layer uses {self.tp}; build both with the same tp_group")

    # -- collectives used by forward (skipped on a group of one) ---------------------------------

    def _copy_to_tp(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        return torch.ops.tp_ext.copy_to_tp(x, self.tp.name, self.tp_size)

    def _sp_sizes(self, x: torch.Tensor, seq_len: Optional[int]) -> Optional[list[int]]:
        """Every rank's sequence-shard length (None when even), checking x holds this rank's."""
        local = x.size(SEQUENCE_DIM)
        if seq_len is None:
            return None  # even split: every rank holds `local`
        sizes = shard_sizes(seq_len, self.tp_size)
        if local != sizes[self.tp_rank]:
            raise ValueError(
                f"{type(self).__name__}: sequence-parallel input has {local} positions on rank "
                f"{self.tp_rank}, but seq_len={seq_len} over {self.tp_size} ranks gives this rank "
                f"{sizes[self.tp_rank]} (tp_ext.shard_sizes({seq_len}, {self.tp_size}) = {sizes})")
        return None if seq_len % self.tp_size == 0 else sizes

    def _gather_sequence(self, x: torch.Tensor, seq_len: Optional[int]) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"{type(self).__name__}: sequence-parallel input must be "
                             f"[..., seq, features], got shape {tuple(x.shape)}")
        if self.tp_size == 1:
            return x
        return torch.ops.tp_ext.gather_from_sp(x, SEQUENCE_DIM, self._sp_sizes(x, seq_len),
                                               self.tp.name, self.tp_size, self.tp_rank)

    def _scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return x
        n = x.size(SEQUENCE_DIM)
        sizes = None if n % self.tp_size == 0 else shard_sizes(n, self.tp_size)
        return torch.ops.tp_ext.reduce_scatter_to_sp(x, SEQUENCE_DIM, sizes, self.tp.name,
                                                     self.tp_size, self.tp_rank)

    # -- initialisation ---------------------------------------------------------------------------

    @torch.no_grad()
    def _init_from_full(self, param_name: str, init: InitFn) -> None:
        """Draw the full tensor with ``init`` and keep this rank's slice (every rank draws the same
        numbers when seeded alike, whatever the TP degree). Skipped on the meta device."""
        param = getattr(self, param_name)
        if param is None or param.device.type == "meta" or _skip_init:
            return
        spec = self.shard_spec(param_name)
        if spec is None:
            init(param)
            return
        dim, partition = spec
        shape = list(param.shape)
        shape[dim] = partition.full
        full = torch.empty(shape, dtype=param.dtype, device=param.device)
        init(full)
        param.copy_(partition.local(full, dim, self.tp_rank))

    # -- full state dicts ---------------------------------------------------------------------------

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's slices of the full (unsharded) tensors in ``full``; see
        :func:`load_full_state_dict`."""
        load_full_state_dict(self, full, strict=strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, gathered on every rank (every rank must call it); see
        :func:`full_state_dict`."""
        return full_state_dict(self)


def default_linear_init(fan_in: int) -> tuple[InitFn, InitFn]:
    """torch.nn.Linear's initialisation (weight, then bias), applied to full tensors."""

    def weight(t: torch.Tensor) -> None:
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))

    def bias(t: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(t, -bound, bound)

    return weight, bias


def sum_over_replicas(local: torch.Tensor, dim: int, tp: TPGroup,
                      replica_rows: tuple[torch.Tensor, torch.Tensor, int]) -> torch.Tensor:
    """Identity forward; backward sums the gradient of rows held by several ranks (replicated KV
    heads) over those ranks, so replicas get the full gradient and stay equal. Only the replicated
    rows travel: they are packed into a tensor indexed by replicated full row, which is
    all-reduced (copy_to_tp's backward)."""
    local_pos, packed_pos, packed_len = replica_rows
    rows = local.index_select(dim, local_pos)
    shape = list(local.shape)
    shape[dim] = packed_len
    packed = local.new_zeros(shape).index_copy(dim, packed_pos, rows)
    packed = torch.ops.tp_ext.copy_to_tp(packed, tp.name, tp.size)
    return local.index_copy(dim, local_pos, packed.index_select(dim, packed_pos))


def replica_rows(partition: Partition, rank: int) -> Optional[tuple[list[int], list[int], int]]:
    """(local positions, packed positions, packed length) of ``rank``'s replicated rows; None when
    no row of the partition is replicated."""
    if not partition.replicated:
        return None
    packed = {i: n for n, i in enumerate(partition.replicated_indices())}
    mine = partition.local_indices(rank)
    local_pos = [p for p, i in enumerate(mine) if i in packed]
    return local_pos, [packed[mine[p]] for p in local_pos], len(packed)


# ---- full <-> sharded state dicts -----------------------------------------------------------------

def _owned_tensors(module: nn.Module):
    """(name, tensor, owning module, leaf name) for every entry of module.state_dict()."""
    for name, tensor in module.state_dict(keep_vars=True).items():
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        yield name, tensor, owner, leaf


def _spec(owner: nn.Module, leaf: str):
    return owner.shard_spec(leaf) if isinstance(owner, ParallelModule) else None


def state_entries(module: nn.Module):
    """``(name, tensor, spec, owner)`` for every entry of ``module.state_dict()``: ``spec`` is
    the owner's ``(dim, Partition)`` for sharded tensors, else None. Checkpoint I/O reads this."""
    for name, tensor, owner, leaf in _owned_tensors(module):
        yield name, tensor, _spec(owner, leaf), owner


def _full_shape(tensor: torch.Tensor, spec) -> tuple[int, ...]:
    shape = list(tensor.shape)
    if spec is not None:
        shape[spec[0]] = spec[1].full
    return tuple(shape)


def local_shards(module: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's piece of each full tensor in ``full`` (views where possible), keyed as
    ``module.state_dict()``; keys the module does not have are ignored."""
    result = {}
    for name, _, owner, leaf in _owned_tensors(module):
        if name in full:
            spec = _spec(owner, leaf)
            value = full[name]
            result[name] = value if spec is None else spec[1].local(value, spec[0], owner.tp_rank)
    return result


@torch.no_grad()
def load_full_state_dict(module: nn.Module, full: Mapping[str, torch.Tensor],
                         strict: bool = True) -> None:
    """Copy this rank's slice of every full tensor in ``full`` into ``module`` (keys as in
    ``module.state_dict()``; shapes those of the unsharded module). Local, no communication.
    With ``strict``, missing and unexpected keys are errors that list them."""
    entries = list(_owned_tensors(module))
    names = {name for name, *_ in entries}
    missing = sorted(names - set(full))
    unexpected = sorted(set(full) - names)
    if strict and (missing or unexpected):
        raise KeyError(
            f"load_full_state_dict({type(module).__name__}): missing keys {missing}, unexpected "
            f"keys {unexpected}; expected exactly {sorted(names)}")
    for name, tensor, owner, leaf in entries:
        if name not in full:
            continue
        value = full[name]
        spec = _spec(owner, leaf)
        expected = _full_shape(tensor, spec)
        if tuple(value.shape) != expected:
            hint = "" if spec is None else (
                f" (this rank holds a slice of {tuple(tensor.shape)}; pass the full tensor, not "
                "a shard)")
            raise ValueError(f"load_full_state_dict: {name!r} has shape {tuple(value.shape)}, "
                             f"expected the unsharded shape {expected}{hint}")
        if tensor.device.type == "meta":
            raise ValueError(f"load_full_state_dict: {name!r} is on the meta device; call "
                             "module.to_empty(device=...) first")
        piece = value if spec is None else spec[1].local(value, spec[0], owner.tp_rank)
        tensor.copy_(piece)


def iter_full_tensors(module: nn.Module):
    """``(name, full tensor)`` for every entry of ``module.state_dict()``, gathered one at a time
    (peak memory: one full tensor). A collective per sharded tensor: every rank must iterate."""
    for name, tensor, owner, leaf in _owned_tensors(module):
        yield name, _gather_full(tensor, _spec(owner, leaf), owner)


@torch.no_grad()
def _gather_full(tensor: torch.Tensor, spec, owner) -> torch.Tensor:
    if spec is None or owner.tp_size == 1:
        return tensor.detach().clone()
    dim, partition = spec
    gathered = comm.all_gather(tensor.detach().contiguous(), dim, partition.local_sizes(),
                               group=owner.tp.group)
    if not partition.is_contiguous_split():
        order = torch.tensor(partition.gather_order(), device=gathered.device)
        gathered = gathered.index_select(dim, order)
    return gathered


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every entry of ``module.state_dict()`` as its full (unsharded) tensor, on every rank.
    A collective over each parallel layer's TP group: every rank must call it."""
    return dict(iter_full_tensors(module))
