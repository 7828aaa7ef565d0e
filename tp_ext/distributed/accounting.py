"""What tp_ext's collectives did, and the settings of the C++ communication layer: accounting per
tag (:func:`track`, :func:`tag`), the collective timeout, the opt-in cross-rank consistency check
and the shared-memory transport. All of it lives in C++ (csrc/comm/), process-wide; these are its
Python controls."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Optional

import torch

from tp_ext.distributed.groups import GroupLike, resolve_group
from tp_ext.ops import _C

__all__ = [
    "CommRecord",
    "CommStats",
    "track",
    "tag",
    "record_transfer",
    "set_timeout",
    "set_consistency_checks",
    "set_shared_memory",
    "shared_memory_active",
]


@dataclasses.dataclass(frozen=True)
class CommRecord:
    tag: str
    op: str  # the tp_ext op that communicated (e.g. "copy_to_tp", "all_reduce")
    # all_reduce | all_gather | reduce_scatter | broadcast | all_to_all | all_to_all_v | reduce
    collective: str
    count: int
    bytes: int
    seconds: float


class CommStats:
    """What tp_ext collectives did while :func:`track` was active.

    Bytes per call: all_reduce, broadcast and reduce (summa_linear's panels) count the tensor,
    all_gather its gathered output, reduce_scatter its full input, all_to_all its input,
    all_to_all_v (all_to_all_single: uneven, expert parallelism and all-to-all attention) the
    bytes it sends to other ranks, send_recv (ring attention's hops to the next rank) the bytes it
    sends; :meth:`bus_bytes` converts them to the traffic each rank actually sends. Seconds are the
    host's wall time inside the op: on CPU (gloo, shared memory) that includes the transfer; on
    CUDA (NCCL) the op returns once the collective is enqueued on the stream, so it is enqueue
    time, not transfer time (use torch.profiler for device time). For the asynchronous
    collectives of summa_linear they are the time spent starting and waiting, not the part
    overlapped with its GEMMs.
    """

    def __init__(self) -> None:
        self.records: list[CommRecord] = []

    def _filter(self, tag=None, op=None, collective=None):
        return [
            r
            for r in self.records
            if (tag is None or r.tag == tag)
            and (op is None or r.op == op)
            and (collective is None or r.collective == collective)
        ]

    def bytes(self, tag=None, op=None, collective=None) -> int:
        return sum(r.bytes for r in self._filter(tag, op, collective))

    def count(self, tag=None, op=None, collective=None) -> int:
        return sum(r.count for r in self._filter(tag, op, collective))

    def bus_bytes(self, world_size: int, tag=None, op=None, collective=None) -> float:
        """Bytes each rank sends under ring algorithms (nccl-tests' bus-bandwidth convention):
        all-reduce moves 2(w-1)/w of its tensor, all-gather and reduce-scatter (w-1)/w of the full
        tensor, broadcast and all-to-all (w-1)/w. So an all-gather plus a reduce-scatter of a
        tensor moves exactly what one all-reduce of it does (sequence parallelism's claim)."""
        share = (world_size - 1) / world_size
        # all_to_all_v (uneven) and send_recv (point to point) record the bytes they send
        factor = {"all_reduce": 2.0 * share, "all_to_all_v": 1.0, "send_recv": 1.0}
        return sum(
            r.bytes * factor.get(r.collective, share) for r in self._filter(tag, op, collective)
        )

    def seconds(self, tag=None, op=None, collective=None) -> float:
        return sum(r.seconds for r in self._filter(tag, op, collective))

    def table(self) -> str:
        lines = [f"{'tag':<16} {'op':<22} {'collective':<15} {'count':>7} {'bytes':>14} {'ms':>10}"]
        for r in self.records:
            lines.append(
                f"{r.tag:<16} {r.op:<22} {r.collective:<15} {r.count:>7} "
                f"{r.bytes:>14,} {r.seconds * 1e3:>10.3f}"
            )
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
        # a range in torch.profiler traces (tp_ext.debug.trace), beside the ops it covers
        with torch.profiler.record_function(f"tp_ext.tag:{name}"):
            yield
    finally:
        _C._set_tag(previous)


def record_transfer(op: str, collective: str, nbytes: int, seconds: float) -> None:
    """Count one transfer tp_ext made outside its C++ collectives (ring attention's
    ``batch_isend_irecv`` hops, collective "send_recv": ``nbytes`` sent) in :func:`track`'s
    records, under the current :func:`tag`."""
    _C._record(op, collective, int(nbytes), float(seconds))


def set_timeout(seconds: float) -> None:
    """Time limit for every tp_ext collective (0: the process group's own timeout)."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or seconds < 0:
        raise ValueError(f"seconds must be a number >= 0, got {seconds!r}")
    _C._set_timeout_ms(int(seconds * 1000))


def set_consistency_checks(enabled: Optional[bool]) -> None:
    """Before every collective, check that all ranks agree on op, dtype, shape, ``sizes`` and the
    other arguments (dim, reduce, src), and raise the same clear error on each rank if not (one
    extra small blocking all-gather per call, so async ops then wait for their peers to arrive).
    Also enabled by ``TP_EXT_CHECK_COLLECTIVES=1``; ``None`` follows that variable again.
    Groups with the shared-memory channel compare a signature of every call even without it."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _C._set_consistency_checks(enabled)


def set_shared_memory(enabled: Optional[bool]) -> None:
    """Whether process groups set up from now on carry the synchronous CPU collectives
    (all_reduce, all_gather, reduce_scatter and the Megatron pairs built on them) through shared
    memory when all their ranks are on one host and use gloo: passes through memory instead of
    gloo's TCP rounds (in rounds of ``TP_EXT_SHM_SLOT_BYTES``, 1 MiB, per rank). On by default;
    ``TP_EXT_SHM=0`` turns it off, and ``None`` follows that variable again. A group decides once,
    at its first collective, and all its ranks decide alike (off if off on any of them)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"enabled must be True, False or None, got {enabled!r}")
    _C._set_shm_enabled(enabled)


def shared_memory_active(group: GroupLike = None) -> bool:
    """Whether ``group``'s collectives use the shared-memory channel (False before its first
    synchronous CPU collective, and for groups that cannot use it)."""
    return bool(_C._shm_active(resolve_group(group).name))
