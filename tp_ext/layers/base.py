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
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.groups import TPGroup, resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.sharding import Partition, shard_sizes, uneven_sizes

__all__ = [
    "ParallelModule",
    "TPGroup",
    "SEQUENCE_DIM",
    "no_init",
    "check_int",
    "default_linear_init",
]

# Sequence parallelism shards the sequence axis: dim 1 of [batch, seq, hidden], dim 0 of
# [tokens, hidden]; -2 names both.
SEQUENCE_DIM = -2

InitFn = Callable[[torch.Tensor], None]


@contextlib.contextmanager
def no_init():
    """Build layers without initialising their weights (they are about to be loaded): saves the
    time and memory of drawing full tensors, and leaves the default random stream untouched."""
    previous, PROCESS.init_weights = PROCESS.init_weights, False
    try:
        yield
    finally:
        PROCESS.init_weights = previous


def check_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


class ParallelModule(nn.Module):
    """Base of every tp_ext layer."""

    def _setup_tp(self, tp_group) -> TPGroup:
        tp = resolve_group(tp_group)
        # Not a module or tensor: stored without nn.Module's registration.
        object.__setattr__(self, "tp", tp)
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self._shard_specs: dict[str, tuple[int, Partition]] = {}
        self._expert_specs: dict[str, tuple[int, Partition]] = {}
        object.__setattr__(self, "ep", None)
        return tp

    def _set_expert_shard(self, param_name: str, dim: int, partition: Partition, ep) -> None:
        """A second split of a parameter, over the expert-parallel group ``ep`` (a TPGroup):
        each EP rank holds whole experts along ``dim``, on top of any TP split."""
        if partition.world_size != ep.size:
            raise ValueError(
                f"{type(self).__name__}: an expert partition over {partition.world_size} ranks "
                f"does not fit an EP group of {ep.size} ranks"
            )
        object.__setattr__(self, "ep", ep)
        self._expert_specs[param_name] = (dim, partition)

    def _set_shard(self, param_name: str, dim: int, partition: Partition) -> None:
        if partition.world_size != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: a partition over {partition.world_size} ranks does not "
                f"fit a TP group of {self.tp_size} ranks"
            )
        self._shard_specs[param_name] = (dim, partition)

    def shard_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """``(dim, Partition)`` of one of this module's own parameters; None if replicated."""
        return self._shard_specs.get(param_name)

    def expert_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """``(dim, Partition)`` over the EP group (``self.ep``); None unless split by expert."""
        return getattr(self, "_expert_specs", {}).get(param_name)

    def _check_same_group(self, *children: "ParallelModule") -> None:
        for child in children:
            if (child.tp.name, child.tp_size) != (self.tp.name, self.tp_size):
                raise ValueError(
                    f"{type(self).__name__}: sub-layer {type(child).__name__} uses TP group "
                    f"{child.tp} but this layer uses {self.tp}; build both with the same tp_group"
                )

    # -- sequence parallelism: the residual stream split along the sequence ----------------------

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
                f"{sizes[self.tp_rank]} (tp_ext.shard_sizes({seq_len}, {self.tp_size}) = {sizes})"
            )
        return uneven_sizes(sizes)

    def _check_sequence_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(
                f"{type(self).__name__}: sequence-parallel input must be "
                f"[..., seq, features], got shape {tuple(x.shape)}"
            )
        return x

    def _gather_sequence(self, x: torch.Tensor, seq_len: Optional[int]) -> torch.Tensor:
        self._check_sequence_input(x)
        if self.tp_size == 1:
            return x
        return comm.gather_from_sp(x, SEQUENCE_DIM, self._sp_sizes(x, seq_len), self.tp)

    def _scatter_sequence(self, x: torch.Tensor) -> torch.Tensor:
        return comm.reduce_scatter_to_sp(x, SEQUENCE_DIM, group=self.tp)

    # -- initialisation ---------------------------------------------------------------------------

    @torch.no_grad()
    def _init_from_full(self, param_name: str, init: InitFn) -> None:
        """Draw the full tensor with ``init`` and keep this rank's slice (every rank draws the same
        numbers when seeded alike, whatever the TP degree). Skipped on the meta device."""
        param = getattr(self, param_name)
        if param is None or param.device.type == "meta" or not PROCESS.init_weights:
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

    # -- full state dicts --------------------------------------------------------------------------

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's slices of the full (unsharded) tensors in ``full``; see
        :func:`tp_ext.layers.state_dict.load_full_state_dict`."""
        from tp_ext.layers.state_dict import load_full_state_dict

        load_full_state_dict(self, full, strict=strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, gathered on every rank (every rank must call it); see
        :func:`tp_ext.layers.state_dict.full_state_dict`."""
        from tp_ext.layers.state_dict import full_state_dict

        return full_state_dict(self)


def default_linear_init(fan_in: int) -> tuple[InitFn, InitFn]:
    """torch.nn.Linear's initialisation (weight, then bias), applied to full tensors."""

    def weight(t: torch.Tensor) -> None:
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))

    def bias(t: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(t, -bound, bound)

    return weight, bias
