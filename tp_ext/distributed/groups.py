"""The one resolver of process groups: anything a caller may pass as a group (a ProcessGroup, its
name, a :class:`ResolvedGroup`, or None for the default) becomes a :class:`ResolvedGroup` here,
once, so forward passes only read plain attributes (no global lookups: torch.compile sees
constants). (A group is any process group: TP, DP, EP, ...; ``ResolvedGroup`` was ``TPGroup``.)"""

from __future__ import annotations

from typing import Optional, Union

import torch.distributed as dist

from tp_ext.distributed.state import PROCESS

__all__ = ["ResolvedGroup", "GroupLike", "resolve_group", "default_group", "device_of"]


class ResolvedGroup:
    """A process group resolved once: ``group`` (None for a group of one or a virtual group),
    ``name`` (its c10d name, what the ops take), ``size`` and this process's ``rank`` in it."""

    def __init__(self, group: Optional[dist.ProcessGroup], name: str, size: int, rank: int) -> None:
        self.group, self.name, self.size, self.rank = group, name, size, rank

    @classmethod
    def of(cls, group: dist.ProcessGroup) -> "ResolvedGroup":
        return cls(group, group.group_name, group.size(), group.rank())

    @classmethod
    def local(cls) -> "ResolvedGroup":
        """A group of one, with no communication: the layers as their unsharded equivalents
        (references, or unsharded parts of a distributed job)."""
        return cls(None, "", 1, 0)

    @classmethod
    def virtual(cls, size: int, rank: int) -> "ResolvedGroup":
        """Rank ``rank`` of ``size`` ranks with no process group behind it: for building one
        rank's shard on the meta device (footprints, shapes, byte counts). Cannot communicate."""
        return cls(None, "<virtual>", size, rank)

    @property
    def can_communicate(self) -> bool:
        return self.group is not None

    def __repr__(self) -> str:
        return f"ResolvedGroup(name={self.name!r}, size={self.size}, rank={self.rank})"


GroupLike = Union[ResolvedGroup, dist.ProcessGroup, str, None]


def device_of(g: ResolvedGroup) -> str:
    """Where tensors for a group's collectives must live: CUDA for NCCL, else the CPU."""
    return "cuda" if dist.get_backend(g.group) == "nccl" else "cpu"


def default_group() -> Optional[dist.ProcessGroup]:
    """The TP group of :func:`tp_ext.init_parallel`, else the world group, else None (no
    torch.distributed at all)."""
    if PROCESS.parallel is not None:
        return PROCESS.parallel.tp_group
    return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None


def resolve_group(group: GroupLike = None) -> ResolvedGroup:
    """``group`` as a :class:`ResolvedGroup`. None is the default TP group (see
    :func:`default_group`); without torch.distributed it is a group of one."""
    if isinstance(group, ResolvedGroup):
        return group
    if group is None:
        group = default_group()
        if group is None:
            return ResolvedGroup.local()
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        try:
            group = _resolve_process_group(group)
        except Exception as e:
            raise ValueError(
                f"group={group!r} is not the name of a live process group; pass a ProcessGroup "
                "or its .group_name after init_process_group / tp_ext.init_parallel"
            ) from e
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"group must be a ProcessGroup, a group name, a ResolvedGroup or None, got "
            f"{type(group).__name__}"
        )
    return ResolvedGroup.of(group)
