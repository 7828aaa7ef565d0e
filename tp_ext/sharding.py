"""How tensors are split across ranks: the one policy every layer, loader and checkpoint uses.

Policy (the same as ``numpy.array_split``): ``n`` items over ``world_size`` ranks give every rank
``n // world_size`` items and the first ``n % world_size`` ranks one extra, in rank order. Sizes never
differ by more than one, no padding is added, and ``n < world_size`` leaves the last ranks empty.
"""

from __future__ import annotations

import torch

__all__ = ["shard_sizes", "shard_offsets", "shard_range", "split_tensor"]


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def shard_sizes(n: int, world_size: int) -> list[int]:
    """Sizes of the ``world_size`` shards of ``n`` items: ``[3, 3, 2, 2]`` for 10 over 4."""
    _check_count("n", n, 0)
    _check_count("world_size", world_size, 1)
    base, extra = divmod(n, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def shard_offsets(n: int, world_size: int) -> list[int]:
    """Start of each shard: ``[0, 3, 6, 8]`` for 10 over 4."""
    offsets, start = [], 0
    for size in shard_sizes(n, world_size):
        offsets.append(start)
        start += size
    return offsets


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(offset, size)`` of ``rank``'s shard of ``n`` items."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    return shard_offsets(n, world_size)[rank], shard_sizes(n, world_size)[rank]


def split_tensor(t: torch.Tensor, dim: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Split ``t`` along ``dim`` into ``world_size`` shards by the policy above.

    Returns views of ``t`` (``narrow``), never copies; shards may have size 0 when
    ``t.size(dim) < world_size``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension, got a 0-d tensor")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"dim={dim} is out of range for a tensor with {t.dim()} dimensions; "
            f"use a value in [{-t.dim()}, {t.dim() - 1}]"
        )
    n = t.size(dim)
    return tuple(
        t.narrow(dim, offset, size)
        for offset, size in zip(shard_offsets(n, world_size), shard_sizes(n, world_size))
    )
