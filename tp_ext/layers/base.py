"""What every tp_ext layer shares, 1D and 2D: its TP group (or P x Q grid), how each parameter
maps onto the full (unsharded) tensor, and the conversions between the two.

A parallel module records, for each parameter it owns, a :class:`tp_ext.sharding.ShardSpec`
(a ``Partition`` along one dim over the TP group, or a ``GridBlock`` of the grid); a parameter
without one is replicated (every rank holds the whole tensor). From that one record:

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
from tp_ext.distributed.grid import TPGrid
from tp_ext.distributed.groups import ResolvedGroup, resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.layers.state_dict import full_state_dict as _full_state_dict
from tp_ext.layers.state_dict import load_full_state_dict as _load_full_state_dict
from tp_ext.sharding import GridBlock, Partition, ShardSpec, shard_sizes, uneven_sizes
from tp_ext.validation import check_int

__all__ = [
    "ParallelModule",
    "ResolvedGroup",
    "SEQUENCE_DIM",
    "no_init",
    "check_int",
    "default_linear_init",
    "default_grid",
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


class ParallelModule(nn.Module):
    """Base of every tp_ext layer, 1D (over a TP group: :meth:`_setup_tp`) and 2D (over a P x Q
    grid: :meth:`_setup_grid`). Each sharded parameter has a :class:`~tp_ext.sharding.ShardSpec`
    (:meth:`param_spec`) and this rank's place in it (:attr:`shard_coord`); the state-dict
    functions (:mod:`tp_ext.layers.state_dict`) and initialisation read only those."""

    # set by _setup_tp / _setup_grid (and _set_expert_shard): its TP group (a ResolvedGroup),
    # its grid (2D layers), its EP group (expert layers); None until then
    tp: Optional[ResolvedGroup] = None
    grid: Optional[TPGrid] = None
    ep: Optional[ResolvedGroup] = None

    def _setup_tp(self, tp_group) -> ResolvedGroup:
        tp = resolve_group(tp_group)
        # Not a module or tensor: stored without nn.Module's registration.
        object.__setattr__(self, "tp", tp)
        object.__setattr__(self, "grid", None)
        self.tp_size, self.tp_rank = tp.size, tp.rank
        self._init_specs()
        return tp

    def _setup_grid(self, grid: Optional[TPGrid]) -> TPGrid:
        """A 2D layer on ``grid`` (None: the grid of ``tp_ext.init_parallel(tp=(P, Q))``); its
        TP group is the grid's P x Q ranks."""
        grid = default_grid() if grid is None else grid
        if not isinstance(grid, TPGrid):
            raise TypeError(f"grid must be a tp_ext TPGrid, got {type(grid).__name__}")
        object.__setattr__(self, "grid", grid)  # not a module: no registration
        object.__setattr__(self, "tp", grid.tp_group)
        self.tp_size, self.tp_rank = grid.tp_group.size, grid.tp_group.rank
        self._init_specs()
        return grid

    def _init_specs(self) -> None:
        self._specs: dict[str, ShardSpec] = {}
        self._expert_specs: dict[str, Partition] = {}
        object.__setattr__(self, "ep", None)

    @property
    def shard_coord(self):
        """This rank's place in its parameters' specs: ``(row, col)`` on a grid, else its TP
        rank."""
        grid = self.grid
        return (grid.row, grid.col) if grid is not None else self.tp_rank

    def param_spec(self, param_name: str) -> Optional[ShardSpec]:
        """The :class:`~tp_ext.sharding.ShardSpec` of one of this module's own parameters
        (a Partition along one dim, or a GridBlock); None if every rank holds it whole."""
        return getattr(self, "_specs", {}).get(param_name)

    def full_is_transposed(self, param_name: str) -> bool:
        """True when the parameter's full (unsharded) form, the one full and loaded state dicts
        hold, is the transpose of the tensor this layer computes with: a linear layer converted
        from Hugging Face's Conv1D (GPT-2) keeps that module's [in, out] weight there, so an
        export is a checkpoint transformers reads, while it computes with nn.Linear's [out, in]."""
        return param_name in getattr(self, "_full_transposed", ())

    def keep_full_transposed(self, param_name: str) -> None:
        """From now on, the full form of ``param_name`` is its transpose (see
        :meth:`full_is_transposed`)."""
        self._full_transposed = frozenset(getattr(self, "_full_transposed", ())) | {param_name}

    def _set_expert_shard(self, param_name: str, dim: int, partition: Partition, ep) -> None:
        """A second split of a parameter, over the expert-parallel group ``ep`` (a ResolvedGroup):
        each EP rank holds whole experts along ``dim``, on top of any TP split."""
        if partition.world_size != ep.size:
            raise ValueError(
                f"{type(self).__name__}: an expert partition over {partition.world_size} ranks "
                f"does not fit an EP group of {ep.size} ranks"
            )
        object.__setattr__(self, "ep", ep)
        self._expert_specs[param_name] = partition.along(dim)

    def _set_shard(self, param_name: str, dim: int, partition: Partition) -> None:
        if partition.world_size != self.tp_size:
            raise ValueError(
                f"{type(self).__name__}: a partition over {partition.world_size} ranks does not "
                f"fit a TP group of {self.tp_size} ranks"
            )
        self._specs[param_name] = partition.along(dim)

    def _set_block(self, param_name: str, block: GridBlock) -> None:
        self._specs[param_name] = block

    def _new_param(self, name: str, block: GridBlock, device, dtype) -> nn.Parameter:
        """Register parameter ``name`` as this rank's block of a grid-split tensor."""
        shape = block.shape(*self.shard_coord)
        param = nn.Parameter(torch.empty(shape, device=device, dtype=dtype))
        self.register_parameter(name, param)
        self._set_block(name, block)
        return param

    def shard_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """``(dim, Partition)`` of a 1D-sharded parameter; None if replicated (or a grid
        block: read :meth:`param_spec`)."""
        spec = self.param_spec(param_name)
        return (spec.dim, spec) if isinstance(spec, Partition) else None

    def grid_block(self, param_name: str) -> Optional[GridBlock]:
        """The :class:`GridBlock` of a 2D layer's parameter; None: whole on every rank."""
        spec = self.param_spec(param_name)
        return spec if isinstance(spec, GridBlock) else None

    def expert_spec(self, param_name: str) -> Optional[tuple[int, Partition]]:
        """``(dim, Partition)`` over the EP group (``self.ep``); None unless split by expert."""
        spec = getattr(self, "_expert_specs", {}).get(param_name)
        return None if spec is None else (spec.dim, spec)

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
        """Draw the full tensor with ``init`` and keep this rank's block (every rank draws the
        same numbers when seeded alike, whatever the TP degree or grid). Skipped on the meta
        device."""
        param = getattr(self, param_name)
        if param is None or param.device.type == "meta" or not PROCESS.init_weights:
            return
        spec = self.param_spec(param_name)
        if spec is None:
            init(param)
            return
        full_shape = spec.full_shape_of(param.shape)
        full = torch.empty(full_shape, dtype=param.dtype, device=param.device)
        init(full)
        param.copy_(spec.take_block(full, self.shard_coord))

    # -- full state dicts --------------------------------------------------------------------------

    def load_full_state_dict(self, full: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load this rank's blocks of the full (unsharded) tensors in ``full``; see
        :func:`tp_ext.layers.state_dict.load_full_state_dict`."""
        _load_full_state_dict(self, full, strict=strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full tensors, gathered on every rank (every rank must call it); see
        :func:`tp_ext.layers.state_dict.full_state_dict`."""
        return _full_state_dict(self)


def default_grid() -> TPGrid:
    """The grid of :func:`tp_ext.init_parallel` (``tp=(P, Q)``)."""
    state = PROCESS.parallel
    if state is None or state.tp_grid is None:
        raise ValueError(
            "no 2D grid: pass grid= (tp_ext.init_parallel(tp=(P, Q)).tp_grid, or "
            "tp_ext.distributed.grid.make_tp_grid(P, Q, group)), or call "
            "tp_ext.init_parallel(tp=(P, Q)) first"
        )
    return state.tp_grid


def default_linear_init(fan_in: int) -> tuple[InitFn, InitFn]:
    """torch.nn.Linear's initialisation (weight, then bias), applied to full tensors."""

    def weight(t: torch.Tensor) -> None:
        nn.init.kaiming_uniform_(t, a=math.sqrt(5))

    def bias(t: torch.Tensor) -> None:
        bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
        nn.init.uniform_(t, -bound, bound)

    return weight, bias
