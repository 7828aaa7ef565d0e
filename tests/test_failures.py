"""Failure behaviour: the launcher fails all ranks together, hangs fail within the timeout, a dead
rank makes the others raise, and bad input gets a clear error naming the argument."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm

from .common import full
from .dist_utils import DistributedTestError, launch_once, rank, run_distributed, world_size


def _rank1_raises():
    if rank() == 1:
        raise ValueError("boom on rank 1")
    comm.all_reduce(torch.ones(3))  # rank 0 waits here for a peer that never comes


def test_one_failing_rank_fails_all_with_every_traceback():
    t0 = time.monotonic()
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_rank1_raises, 2)
    report = str(info.value)
    assert "--- rank 1: FAILED" in report and "boom on rank 1" in report
    # rank 0 is stuck in the collective: reported with its stack, not silently dropped
    assert "--- rank 0: still running" in report and "_rank1_raises" in report
    assert time.monotonic() - t0 < 30


def _everyone_hangs():
    time.sleep(3600)


def test_hang_fails_within_timeout_with_stacks():
    t0 = time.monotonic()
    outcome, report = launch_once(_everyone_hangs, 2, timeout=5)
    elapsed = time.monotonic() - t0
    assert outcome == {}
    assert report.count("still running") == 2 and "_everyone_hangs" in report
    assert elapsed < 60, elapsed


def _collective_with_dead_peer(pg_timeout):
    """Rank 1 is killed (SIGKILL) while both ranks stream all-reduces; rank 0 must raise, not
    wait, and within the process-group timeout."""
    x = torch.ones(1 << 18)
    comm.all_reduce(x)
    if rank() == 1:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 4 * pg_timeout:
            comm.all_reduce(x)
    except RuntimeError as e:
        return ("raised", time.monotonic() - t0, str(e))
    return ("no error", time.monotonic() - t0, "")


def test_dead_rank_makes_the_others_raise():
    pg_timeout = 10.0
    outcome, report = launch_once(
        _collective_with_dead_peer, 2, pg_timeout, timeout=90, pg_timeout=pg_timeout
    )
    assert 1 not in outcome or not outcome[1][0], "rank 1 was killed"
    ok, (status, elapsed, message) = outcome[0]
    assert ok and status == "raised", report
    assert elapsed < pg_timeout + 5, f"rank 0 raised only after {elapsed:.1f}s"
    assert "tp_ext.all_reduce failed on rank 0" in message


def _stalled_peer_times_out():
    """Rank 1 is alive but never joins: rank 0's collective fails at tp_ext's timeout."""
    comm.set_timeout(2.0)
    if rank() == 1:
        time.sleep(8)
        return ("slept", 0.0)
    t0 = time.monotonic()
    try:
        comm.all_reduce(torch.ones(4))
    except RuntimeError:
        return ("raised", time.monotonic() - t0)
    return ("no error", time.monotonic() - t0)


def test_stalled_peer_hits_the_collective_timeout():
    outcome, report = launch_once(_stalled_peer_times_out, 2, timeout=60)
    status, elapsed = outcome[0][1]
    assert status == "raised", report
    assert 1.5 < elapsed < 6, elapsed


def _expect(exc_type, fragments, fn, *args):
    with pytest.raises(exc_type) as info:
        fn(*args)
    message = str(info.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in error: {message}"


def _check_bad_input():
    r, w = rank(), world_size()
    name = dist.group.WORLD.group_name
    x = full((5, 4), 1)
    ops = torch.ops.tp_ext
    _expect(
        ValueError,
        ["group_name='nope'", "unknown process group"],
        ops.all_reduce,
        x,
        "sum",
        "nope",
        w,
    )
    _expect(ValueError, ["group_size=7", f"has {w} ranks"], ops.all_reduce, x, "sum", name, 7)
    _expect(ValueError, ["group_rank=5", f"rank {r}"], ops.scatter_to_tp, x, 0, None, name, w, 5)
    _expect(ValueError, ["reduce='mean'", "'avg'"], comm.all_reduce, x, "mean")
    _expect(
        ValueError,
        ["reduce='avg'", "floating-point", "Long"],
        comm.all_reduce,
        torch.ones(3, dtype=torch.long),
        "avg",
    )
    _expect(ValueError, ["dim=3", "out of range", "[-2, 1]"], comm.all_gather, x, 3)
    _expect(
        ValueError,
        [f"sizes has {w + 1} entries", f"{w} ranks"],
        comm.all_gather,
        x,
        0,
        [5] * (w + 1),
    )
    _expect(ValueError, ["sizes[", "this rank", "x.size(0)=5"], comm.all_gather, x, 0, [9] * w)
    _expect(
        ValueError, ["add up to", "x.size(1)=4", "shard_sizes"], comm.reduce_scatter, x, 1, [1] * w
    )
    _expect(ValueError, ["src=", "not a rank"], comm.broadcast, x, w)
    _expect(ValueError, ["0-d tensor"], comm.all_gather, torch.tensor(1.0), 0)
    if w > 1:
        _expect(
            ValueError,
            ["x.size(0)=", "does not divide evenly", "shard_sizes"],
            ops.reduce_scatter,
            full((w + 1, 2), 1),
            0,
            None,
            "sum",
            name,
            w,
            r,
        )
    _expect(
        ValueError,
        ["not differentiable", "requires grad", "copy_to_tp"],
        comm.all_reduce,
        x.clone().requires_grad_(),
    )
    _expect(TypeError, ["group must be"], comm.all_reduce, x, "sum", 3)
    _expect(ValueError, ["dense", "to_dense"], comm.all_reduce, x.to_sparse())
    # non-contiguous input is handled, not refused
    t = full((4, 6), 2).t()
    assert not t.is_contiguous()
    torch.testing.assert_close(comm.all_reduce(t), t * w)
    if w == 1:
        return
    # sizes that are wrong on this rank alone raise before communicating, with or without the
    # cross-rank check, for every op that takes sizes
    comm.set_consistency_checks(False)
    y = full((2 * w, 3), 1)
    _expect(
        ValueError,
        ["sizes[0]=-1", "negative"],
        comm.all_to_all,
        y,
        0,
        0,
        [-1, 2 * w + 1] + [0] * (w - 2),
    )
    _expect(ValueError, [f"sizes has {w - 1} entries"], comm.all_to_all, y, 0, 0, [2] * (w - 1))
    _expect(ValueError, ["add up to", f"x.size(0)={2 * w}"], comm.all_to_all, y, 0, 0, [1] * w)
    _expect(ValueError, ["add up to"], comm.reduce_scatter_to_sp, y, 0, [3] * w)
    _expect(ValueError, ["add up to"], comm.scatter_to_tp, y, 0, [3] * w)
    _expect(
        ValueError,
        [f"sizes[{r}]=3", "this rank", "x.size(0)=2"],
        comm.gather_from_sp,
        y[:2],
        0,
        [3] * w,
    )
    _expect(
        ValueError,
        ["sizes[1]=-2", "negative"],
        comm.gather_from_tp,
        y[:2],
        0,
        [2, -2] + [2] * (w - 2),
    )
    # ranks that disagree on dtype or shape: the same clear error on every rank, not a hang/abort
    comm.set_consistency_checks(True)
    mixed = torch.ones(3, dtype=torch.float64 if r == 1 else torch.float32)
    _expect(
        ValueError,
        ["do not match", "rank 1", "dtype=Double", "rank 0", "dtype=Float"],
        comm.all_reduce,
        mixed,
    )
    shaped = torch.ones(3 + r)
    _expect(ValueError, ["do not match", "shape=[3]", "shape=[4]"], comm.all_reduce, shaped)
    # uneven gathers may differ along the gathered dim, but nowhere else
    torch.testing.assert_close(
        comm.all_gather(torch.ones(1 + r, 2), 0, [1 + k for k in range(w)]),
        torch.ones(sum(1 + k for k in range(w)), 2),
    )
    _expect(ValueError, ["do not match"], comm.all_gather, torch.ones(2, 1 + r), 0)


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_bad_input_gets_clear_errors(ws):
    run_distributed(_check_bad_input, ws)


def test_sharding_errors():
    with pytest.raises(ValueError, match="world_size must be an int >= 1, got 0"):
        tp_ext.shard_sizes(10, 0)
    with pytest.raises(ValueError, match="n must be an int >= 0, got -1"):
        tp_ext.shard_sizes(-1, 2)
    with pytest.raises(ValueError, match=r"dim=2 is out of range.*\[-2, 1\]"):
        tp_ext.split_tensor(torch.ones(2, 3), 2, 2)
    with pytest.raises(ValueError, match="rank must be an int in"):
        tp_ext.shard_range(10, 4, 4)
