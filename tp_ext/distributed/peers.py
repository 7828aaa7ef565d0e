"""Which rank died: gloo reports a dead peer by its address ("Connection reset by peer"), which
does not say which rank it was. Each rank's host and pid are exchanged once per group (a small
all-gather, at :func:`tp_ext.init_parallel` or a group's first checkpoint operation), so that an
error can name the ranks on this host that have exited."""

from __future__ import annotations

import os
import socket
import time

import torch
import torch.distributed as dist

from tp_ext.distributed.groups import GroupLike, device_of, resolve_group
from tp_ext.distributed.state import PROCESS

__all__ = ["record", "exited", "explain"]

_WIDTH = 64  # bytes per rank: "<pid> <hostname>"


def record(group: GroupLike = None) -> None:
    """Exchange (pid, host) with every rank of ``group`` (a collective; once per group)."""
    g = resolve_group(group)
    if g.group is None or g.size == 1 or g.name in PROCESS.peers:
        return
    mine = f"{os.getpid()} {socket.gethostname()}".encode()[:_WIDTH].ljust(_WIDTH, b"\0")
    device = device_of(g)
    row = torch.frombuffer(bytearray(mine), dtype=torch.uint8).to(device)
    rows = [torch.empty_like(row) for _ in range(g.size)]
    dist.all_gather(rows, row, group=g.group)
    peers = []
    for r in rows:
        pid, _, host = bytes(r.cpu().tolist()).rstrip(b"\0").decode(errors="replace").partition(" ")
        peers.append((int(pid), host))
    PROCESS.peers[g.name] = peers


def exited(group: GroupLike = None) -> list[tuple[int, int]]:
    """``(rank, pid)`` of the ranks of ``group`` on this host whose process is gone (empty if the
    group was never recorded)."""
    g = resolve_group(group)
    here = socket.gethostname()
    return [
        (rank, pid)
        for rank, (pid, host) in enumerate(PROCESS.peers.get(g.name, ()))
        if host == here and rank != g.rank and _gone(pid)
    ]


def _gone(pid: int) -> bool:
    """No such process, or a zombie (killed, not yet reaped by its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return True


def explain(group: GroupLike = None, wait: float = 1.0) -> str:
    """A sentence naming the exited ranks of ``group``, or "" when none is known to have exited.
    Called on an error path: a peer's sockets close while it is still exiting, so this looks
    again for up to ``wait`` seconds before saying nothing."""
    deadline = time.monotonic() + wait
    gone = exited(group)
    while (
        not gone and PROCESS.peers.get(resolve_group(group).name) and (time.monotonic() < deadline)
    ):
        time.sleep(0.05)
        gone = exited(group)
    if not gone:
        return ""
    names = ", ".join(f"rank {rank} (pid {pid})" for rank, pid in gone)
    return f" [{names} of this group exited]"
