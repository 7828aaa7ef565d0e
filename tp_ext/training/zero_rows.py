"""The pieces of :class:`tp_ext.training.zero.ShardedOptimizer` that are plain records: which
rows of a parameter a replica holds, the optimizer state seen per model parameter, the
reduce-scatter buckets and the progress of one announced backward."""

from __future__ import annotations

import math

import torch

__all__ = ["StateView", "Bucket", "Backward", "rows_of", "dim0", "row_numel", "as_rows"]


def rows_of(rows: int, size: int, rank: int) -> tuple[int, int]:
    """``(first row, row count)`` of ``rows`` that DP rank ``rank`` of ``size`` holds: torch.chunk's
    split, as FSDP2 and DTensor's Shard(0) make it."""
    chunk = -(-rows // size) if rows else 0
    start = min(rows, rank * chunk)
    return start, min(rows, start + chunk) - start


class StateView(dict):
    """``optimizer.state`` of a :class:`ShardedOptimizer`: for each model parameter its state with
    every per-element tensor as a DTensor (this rank's rows, Shard(0) on the DP mesh) sharing
    storage with the inner optimizer's (a checkpoint load writes into it)."""

    def __init__(self, owner) -> None:  # a ShardedOptimizer
        super().__init__()
        self.owner = owner

    def _view(self, param):
        owner = self.owner
        inner = owner.inner.state.get(owner._master[param])
        if not inner:
            return None
        return {key: owner._as_param_state(param, value) for key, value in inner.items()}

    def __getitem__(self, param):
        view = self._view(param)
        if view is None:
            raise KeyError(param)
        return view

    def get(self, param, default=None):
        view = self._view(param) if param in self.owner._master else None
        return default if view is None else view

    def __contains__(self, param):
        return param in self.owner._master and self._view(param) is not None

    def keys(self):
        return [p for p in self.owner._master if p in self]

    def __iter__(self):
        return iter(self.keys())

    def __len__(self):
        return len(self.keys())

    def values(self):
        return [self[p] for p in self.keys()]

    def items(self):
        return [(p, self[p]) for p in self.keys()]


class Bucket:
    """Parameters (one replica group, one dtype) whose gradients travel in one reduce-scatter."""

    def __init__(self, dtype: torch.dtype, group):
        self.dtype, self.group, self.params, self.nbytes = dtype, group, [], 0

    @property
    def waited(self) -> int:
        """Its parameters whose last accumulation the backward waits for (not frozen or
        empty ones: no gradient comes for them)."""
        return sum(1 for p in self.params if p.requires_grad and p.numel())


class Backward:
    """One announced backward's progress: accumulations per parameter, gradients final per
    bucket, the next bucket to send, the sends not yet received."""

    def __init__(self, micro_batches: int, divide_by: float, buckets: int):
        self.micro_batches, self.divide_by = micro_batches, divide_by
        self.count: dict = {}
        self.ready = [0] * buckets
        self.next_to_send = 0
        self.in_flight_buckets: list = []
        self.overflow: list = []
        self.in_flight = True


def dim0(param) -> int:
    return param.shape[0] if param.dim() else 1


def row_numel(param) -> int:
    return math.prod(param.shape[1:])  # (a parameter with no rows has rows of this size too)


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a dim 0 (a 0-d tensor as one row)."""
    return t.view(1) if t.dim() == 0 else t


def master_dtype(param) -> torch.dtype:
    return torch.float64 if param.dtype == torch.float64 else torch.float32
