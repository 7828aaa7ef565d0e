"""Collectives and the Megatron communication pairs, as thin wrappers over ``torch.ops.tp_ext``.

Every function takes ``group``: a ``ProcessGroup``, a group name, or ``None`` for the TP group made
by :func:`tp_ext.init_parallel` (the world group if it was not called). The ops themselves take
``(group_name, group_size)``; see ``docs/ops.md`` for each op's schema and forward/backward meaning.

The differentiable pairs (Megatron's mappings)::

    copy_to_tp            identity        / all-reduce       enter a TP region
    reduce_from_tp        all-reduce      / identity         leave a row-parallel layer
    scatter_to_tp         split           / all-gather       take this rank's slice
    gather_from_tp        all-gather      / split            gather a column-parallel output
    gather_from_sp        all-gather      / reduce-scatter   sequence parallel: enter TP region
    reduce_scatter_to_sp  reduce-scatter  / all-gather       sequence parallel: leave TP region

Splits follow :func:`tp_ext.shard_sizes`: a dimension that does not divide evenly gives the first
ranks one extra item. Gathers take ``sizes`` (every rank's size along ``dim``) when pieces differ.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist

from tp_ext import _C  # noqa: F401  (registers the ops)
from tp_ext import _fake  # noqa: F401  (registers their fake kernels)
from tp_ext.sharding import shard_sizes

GroupLike = Union[dist.ProcessGroup, str, None]

__all__ = [
    "all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all",
    "all_reduce_async", "all_gather_async", "reduce_scatter_async", "wait",
    "copy_to_tp", "reduce_from_tp", "scatter_to_tp", "gather_from_tp",
    "gather_from_sp", "reduce_scatter_to_sp",
    "resolve_group", "group_args", "ranked_group_args", "track", "tag", "CommStats", "set_timeout", "set_consistency_checks",
    "set_shared_memory", "shared_memory_active",
]


def _group(group: GroupLike) -> dist.ProcessGroup:
    if group is None:
        from tp_ext.parallel import default_tp_group

        group = default_tp_group()
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
            f"group must be a ProcessGroup, a group name or None, got {type(group).__name__}"
        )
    return group


def resolve_group(group: GroupLike = None) -> dist.ProcessGroup:
    """The ProcessGroup for a group, a group name, or None (the default TP group)."""
    return _group(group)


def group_args(group: GroupLike = None) -> tuple[str, int]:
    """``(group_name, group_size)`` for the ops, from a group, a group name or the default."""
    group = _group(group)
    return group.group_name, group.size()


def ranked_group_args(group: GroupLike = None) -> tuple[str, int, int]:
    """``(group_name, group_size, group_rank)`` for ops whose result is this rank's piece."""
    group = _group(group)
    return group.group_name, group.size(), group.rank()


def _even_or_policy(x: torch.Tensor, dim: int, size: int, sizes):
    """``sizes`` for a split of x's full ``dim``: None when even, else the shard_sizes policy."""
    if sizes is not None:
        return list(sizes)
    n = x.size(dim)
    return None if n % size == 0 else shard_sizes(n, size)


# ---- plain collectives --------------------------------------------------------------------------

def all_reduce(x: torch.Tensor, reduce: str = "sum", group: GroupLike = None) -> torch.Tensor:
    """Reduce ``x`` over the group (``sum``, ``avg``, ``max``, ``min``, ``product``); x is unchanged."""
    return torch.ops.tp_ext.all_reduce(x, reduce, *group_args(group))


def all_gather(x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None,
               group: GroupLike = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim``; ``sizes[r]`` is rank r's size there if uneven."""
    return torch.ops.tp_ext.all_gather(x, dim, None if sizes is None else list(sizes),
                                       *group_args(group))


def reduce_scatter(x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None,
                   reduce: str = "sum", group: GroupLike = None) -> torch.Tensor:
    """Reduce ``x`` over the group and keep this rank's piece along ``dim`` (shard_sizes policy)."""
    name, size, rank = ranked_group_args(group)
    return torch.ops.tp_ext.reduce_scatter(x, dim, _even_or_policy(x, dim, size, sizes), reduce,
                                           name, size, rank)


def broadcast(x: torch.Tensor, src: int = 0, group: GroupLike = None) -> torch.Tensor:
    """Rank ``src``'s ``x`` (``src`` is a rank of the group), on every rank."""
    return torch.ops.tp_ext.broadcast(x, src, *group_args(group))


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               sizes: Optional[Sequence[int]] = None, group: GroupLike = None) -> torch.Tensor:
    """Send piece r of ``x`` (split along ``scatter_dim``) to rank r; concatenate what arrives along
    ``gather_dim``. All ranks pass tensors of the same shape."""
    name, size, rank = ranked_group_args(group)
    return torch.ops.tp_ext.all_to_all(x, scatter_dim, gather_dim,
                                       _even_or_policy(x, scatter_dim, size, sizes), name, size,
                                       rank)


# ---- async collectives --------------------------------------------------------------------------

def all_reduce_async(x: torch.Tensor, reduce: str = "sum", group: GroupLike = None) -> torch.Tensor:
    """Start an all-reduce and return its output at once; read it only after :func:`wait`."""
    return torch.ops.tp_ext.all_reduce_async(x, reduce, *group_args(group))


def all_gather_async(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Start an all-gather along dim 0 (equal sizes); read the output only after :func:`wait`."""
    return torch.ops.tp_ext.all_gather_async(x, *group_args(group))


def reduce_scatter_async(x: torch.Tensor, reduce: str = "sum",
                         group: GroupLike = None) -> torch.Tensor:
    """Start a reduce-scatter along dim 0 (even split); read the output only after :func:`wait`."""
    return torch.ops.tp_ext.reduce_scatter_async(x, reduce, *group_args(group))


def wait(t: torch.Tensor) -> torch.Tensor:
    """Complete an async collective; returns its output."""
    return torch.ops._c10d_functional.wait_tensor(t)


# ---- differentiable Megatron pairs --------------------------------------------------------------

def copy_to_tp(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward."""
    return torch.ops.tp_ext.copy_to_tp(x, *group_args(group))


def reduce_from_tp(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    return torch.ops.tp_ext.reduce_from_tp(x, *group_args(group))


def scatter_to_tp(x: torch.Tensor, dim: int = -1, sizes: Optional[Sequence[int]] = None,
                  group: GroupLike = None) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` forward, all-gather of the gradient backward."""
    name, size, rank = ranked_group_args(group)
    return torch.ops.tp_ext.scatter_to_tp(x, dim, _even_or_policy(x, dim, size, sizes), name, size,
                                          rank)


def gather_from_tp(x: torch.Tensor, dim: int = -1, sizes: Optional[Sequence[int]] = None,
                   group: GroupLike = None) -> torch.Tensor:
    """All-gather along ``dim`` forward, this rank's slice of the gradient backward."""
    return torch.ops.tp_ext.gather_from_tp(x, dim, None if sizes is None else list(sizes),
                                           *ranked_group_args(group))


def gather_from_sp(x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None,
                   group: GroupLike = None) -> torch.Tensor:
    """All-gather of sequence shards forward, reduce-scatter of the gradient backward."""
    return torch.ops.tp_ext.gather_from_sp(x, dim, None if sizes is None else list(sizes),
                                           *ranked_group_args(group))


def reduce_scatter_to_sp(x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None,
                         group: GroupLike = None) -> torch.Tensor:
    """Reduce-scatter into sequence shards forward, all-gather of the gradient backward."""
    name, size, rank = ranked_group_args(group)
    return torch.ops.tp_ext.reduce_scatter_to_sp(x, dim, _even_or_policy(x, dim, size, sizes),
                                                 name, size, rank)


# ---- accounting, tags, timeouts -----------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class CommRecord:
    tag: str
    op: str  # the tp_ext op that communicated (e.g. "copy_to_tp", "all_reduce")
    collective: str  # all_reduce | all_gather | reduce_scatter | broadcast | all_to_all
    count: int
    bytes: int
    seconds: float


class CommStats:
    """What tp_ext collectives did while :func:`track` was active.

    Bytes per call: all_reduce and broadcast count the tensor, all_gather its gathered output,
    reduce_scatter its full input, all_to_all its input; :meth:`bus_bytes` converts them to the
    traffic each rank actually sends. Seconds are wall time from issue to completion
    (issue only, for async ops).
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def _filter(self, tag=None, op=None, collective=None):
        return [r for r in self.records
                if (tag is None or r.tag == tag) and (op is None or r.op == op)
                and (collective is None or r.collective == collective)]

    def bytes(self, tag=None, op=None, collective=None) -> int:
        return sum(r.bytes for r in self._filter(tag, op, collective))

    def count(self, tag=None, op=None, collective=None) -> int:
        return sum(r.count for r in self._filter(tag, op, collective))

    def bus_bytes(self, world_size: int, tag=None, op=None, collective=None) -> float:
        """Bytes each rank sends under ring algorithms (nccl-tests' bus-bandwidth convention):
        all-reduce moves 2(w-1)/w of its tensor, all-gather and reduce-scatter (w-1)/w of the full
        tensor, broadcast and all-to-all (w-1)/w. So an all-gather plus a reduce-scatter of a
        tensor moves exactly what one all-reduce of it does (sequence parallelism's claim)."""
        factor = {"all_reduce": 2.0}
        share = (world_size - 1) / world_size
        return sum(r.bytes * factor.get(r.collective, 1.0) * share
                   for r in self._filter(tag, op, collective))

    def seconds(self, tag=None, op=None, collective=None) -> float:
        return sum(r.seconds for r in self._filter(tag, op, collective))

    def table(self) -> str:
        lines = [f"{'tag':<16} {'op':<22} {'collective':<15} {'count':>7} {'bytes':>14} {'ms':>10}"]
        for r in self.records:
            lines.append(f"{r.tag:<16} {r.op:<22} {r.collective:<15} {r.count:>7} "
                         f"{r.bytes:>14,} {r.seconds * 1e3:>10.3f}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"CommStats(count={self.count()}, bytes={self.bytes()})"


@contextlib.contextmanager
def track() -> Iterator[CommStats]:
    """Record every tp_ext collective of this process inside the block::

        with tp_ext.comm.track() as stats:
            loss = model(x).sum(); loss.backward()
        print(stats.table()); stats.bytes(collective="all_reduce")
    """
    if _C._tracking():
        raise RuntimeError("tp_ext.comm.track() blocks cannot be nested")
    stats = CommStats()
    _C._reset_stats()
    _C._set_tracking(True)
    try:
        yield stats
    finally:
        _C._set_tracking(False)
        stats.records = [CommRecord(*row) for row in _C._stats()]


@contextlib.contextmanager
def tag(name: str) -> Iterator[None]:
    """Attribute the collectives inside the block to ``name`` in :func:`track`'s records.
    Set it outside compiled regions (it is process-wide state)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"tag name must be a non-empty string, got {name!r}")
    previous = _C._get_tag()
    _C._set_tag(name)
    try:
        yield
    finally:
        _C._set_tag(previous)


def set_timeout(seconds: float) -> None:
    """Time limit for every tp_ext collective (0: the process group's own timeout)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
    _C._set_timeout_ms(int(seconds * 1000))


def set_consistency_checks(enabled: bool) -> None:
    """Before every collective, check that all ranks agree on op, dtype and shape, and raise the
    same clear error on each rank if not (one extra small blocking all-gather per call, so async
    ops then wait for their peers to arrive). Also enabled by ``TP_EXT_CHECK_COLLECTIVES=1``."""
    _C._set_consistency_checks(bool(enabled))


def set_shared_memory(enabled: bool) -> None:
    """Whether process groups set up from now on carry the synchronous CPU collectives
    (all_reduce, all_gather, reduce_scatter and the Megatron pairs built on them) through shared
    memory when all their ranks are on one host and use gloo: passes through memory instead of
    gloo's TCP rounds (in rounds of ``TP_EXT_SHM_SLOT_BYTES``, 1 MiB, per rank). On by default; ``TP_EXT_SHM=0`` turns it off. A group decides once, at
    its first such collective, and all its ranks decide alike (off if off on any of them)."""
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True or False, got {enabled!r}")
    _C._set_shm_enabled(enabled)


def shared_memory_active(group: GroupLike = None) -> bool:
    """Whether ``group``'s collectives use the shared-memory channel (False before its first
    synchronous CPU collective, and for groups that cannot use it)."""
    return bool(_C._shm_active(_group(group).group_name))
