"""The shared-memory transport of tp_ext's synchronous CPU collectives (csrc/comm/shm_channel.cpp):
used by same-host gloo groups, exact against a local reference for every reduction and dtype, at
uneven sizes and above the slot size (several rounds); groups with the channel off use gloo; the
ranks agree on whether to use it; mismatched calls and a dead peer make the others raise at once."""

import os
import signal
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm

from .common import assert_equal, full
from .dist_utils import launch_once, rank, run_distributed, world_size

SLOT_BYTES = 1 << 20  # the default TP_EXT_SHM_SLOT_BYTES


def _inputs(shape, dtype, w):
    return [full(shape, 100 + r, dtype) for r in range(w)]


def _reference(xs, reduce):
    """Rank-order reduction; bf16/fp16 sums and averages in fp32, rounded once, as the channel."""
    if reduce in ("sum", "avg"):
        wide = xs[0].dtype in (torch.bfloat16, torch.float16)
        acc = xs[0].float() if wide else xs[0].clone()
        for x in xs[1:]:
            acc += x
        if reduce == "avg":
            acc /= len(xs)
        return acc.to(xs[0].dtype)
    fn = {"max": torch.maximum, "min": torch.minimum, "product": torch.mul}[reduce]
    acc = xs[0]
    for x in xs[1:]:
        acc = fn(acc, x)
    return acc


def _same(got, want, what, exact):
    """Bitwise through shared memory; through gloo (whose ring adds in another order, and rounds
    bf16 at every step) within rounding."""
    if exact or not got.dtype.is_floating_point:
        assert_equal(got, want, what)
    else:
        tol = 2e-2 if got.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(got, want, rtol=tol, atol=tol, msg=lambda m: f"{what}: {m}")


def _check_collectives(group_name, expect_active):
    r, w = rank(), world_size()
    group = tp_ext.comm.resolve_group(group_name).group if group_name else None
    comm.all_reduce(torch.ones(1), group=group)  # the first collective sets the channel up
    name = group_name or dist.group.WORLD.group_name
    assert comm.shared_memory_active(name) == expect_active
    results = {}
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        xs = _inputs((5, 7), dtype, w)
        reduces = ["sum", "max", "min", "product"] + (["avg"] if dtype.is_floating_point else [])
        for reduce in reduces:
            got = comm.all_reduce(xs[r], reduce, group=group)
            _same(got, _reference(xs, reduce), f"all_reduce {reduce} {dtype}", expect_active)
            results[f"all_reduce {reduce} {dtype}"] = got
        # uneven pieces along dim 1: rank i holds sizes[i] columns (some hold none at w > 3)
        sizes = tp_ext.shard_sizes(2 * w - 1, w)
        pieces = [full((3, sizes[i], 2), 200 + i, dtype) for i in range(w)]
        assert_equal(
            comm.all_gather(pieces[r], 1, sizes, group=group),
            torch.cat(pieces, 1),
            f"all_gather {dtype}",
        )
        # rank 0 holds no rows at all
        sizes0 = [0] + [2] * (w - 1)
        pieces0 = [full((sizes0[i], 3), 250 + i, dtype) for i in range(w)]
        assert_equal(
            comm.all_gather(pieces0[r], 0, sizes0, group=group),
            torch.cat(pieces0),
            f"all_gather with an empty piece {dtype}",
        )
        whole = _inputs((4, 2 * w - 1), dtype, w)
        want = _reference(whole, "sum").split(sizes, 1)[r]
        _same(
            comm.reduce_scatter(whole[r], 1, sizes, group=group),
            want,
            f"reduce_scatter {dtype}",
            expect_active,
        )
    # above the slot size (1 MiB): several rounds through the channel, uneven pieces included
    big = [full((SLOT_BYTES // 4 + 3,), 300 + i) for i in range(w)]
    _same(
        comm.all_reduce(big[r], group=group),
        _reference(big, "sum"),
        "big all_reduce",
        expect_active,
    )
    rows = [(SLOT_BYTES // (4 * 64)) + 5 * i for i in range(w)]  # a slot is 4096 rows of 64
    tall = [full((rows[i], 64), 400 + i) for i in range(w)]
    assert_equal(comm.all_gather(tall[r], 0, rows, group=group), torch.cat(tall), "big all_gather")
    whole_big = [full((64, sum(rows)), 500 + i) for i in range(w)]
    _same(
        comm.reduce_scatter(whole_big[r], 1, rows, group=group),
        _reference(whole_big, "sum").split(rows, 1)[r],
        "big reduce_scatter",
        expect_active,
    )
    return results


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_collectives_through_shared_memory(ws):
    results = run_distributed(_check_collectives, ws, None, True)
    # every rank holds bitwise the same all-reduce results
    for key, value in results[0].items():
        for r in range(1, ws):
            assert torch.equal(results[r][key], value), key


def _with_channel_off(disable_on):
    """A new group made while the channel is off on `disable_on` ranks: no rank uses it."""
    comm.set_shared_memory(rank() not in disable_on)
    try:
        group = dist.new_group(list(range(world_size())))
        out = _check_collectives(group.group_name, False)
        dist.destroy_process_group(group)
        return len(out)
    finally:
        comm.set_shared_memory(None)


@pytest.mark.parametrize("disable_on", [(0, 1, 2), (1,)])
def test_channel_off_uses_gloo_on_every_rank(disable_on):
    assert run_distributed(_with_channel_off, 3, disable_on)[0] > 0


def _small_slots():
    """4 KiB slots: every collective of _check_collectives takes many rounds (a slot holds 1024
    fp32 values, or 16 of the 64-wide rows), uneven pieces included."""
    os.environ["TP_EXT_SHM_SLOT_BYTES"] = "4096"
    try:
        group = dist.new_group(list(range(world_size())))
        n = len(_check_collectives(group.group_name, True))
        dist.destroy_process_group(group)
        return n
    finally:
        del os.environ["TP_EXT_SHM_SLOT_BYTES"]


def test_many_rounds_with_small_slots():
    assert run_distributed(_small_slots, 3)[0] > 0


def _bad_slot_size():
    os.environ["TP_EXT_SHM_SLOT_BYTES"] = "1000" if rank() == 1 else "4096"
    try:
        group = dist.new_group(list(range(world_size())))
        try:
            comm.all_reduce(torch.ones(2), group=group)
            return ""
        except ValueError as e:
            return str(e)
        finally:
            dist.destroy_process_group(group)
    finally:
        del os.environ["TP_EXT_SHM_SLOT_BYTES"]


def test_bad_slot_size_is_reported_on_every_rank():
    for message in run_distributed(_bad_slot_size, 2):
        assert "TP_EXT_SHM_SLOT_BYTES" in message and "rank 1" in message, message
        assert "multiple of 64" in message, message


BAD_SETTINGS = [
    ("TP_EXT_SHM_SLOT_BYTES", str(1 << 62)),  # used to overflow the segment size: SIGSEGV
    ("TP_EXT_SHM_SLOT_BYTES", str(1 << 31)),  # above the 1 GiB limit
    ("TP_EXT_SHM_SLOT_BYTES", "99999999999999999999999"),  # beyond int64
    ("TP_EXT_SHM_SLOT_BYTES", "-4096"),
    ("TP_EXT_SHM_SLOT_BYTES", "4k"),
    ("TP_EXT_SHM", "maybe"),
    ("TP_EXT_SHM", "2"),
    ("TP_EXT_CHECK_COLLECTIVES", "please"),
]


def _bad_settings(on_ranks):
    """Each bad setting, on `on_ranks` only: every rank raises at the group's first collective,
    the bad rank naming variable and value, the others naming the rank and variable."""
    messages = []
    for name, value in BAD_SETTINGS:
        if rank() in on_ranks:
            os.environ[name] = value
        try:
            group = dist.new_group(list(range(world_size())))
            try:
                comm.all_reduce(torch.ones(2), group=group)
                messages.append((name, value, ""))
            except ValueError as e:
                messages.append((name, value, str(e)))
            dist.destroy_process_group(group)
        finally:
            os.environ.pop(name, None)
    return messages


@pytest.mark.parametrize("ws,on_ranks", [(2, (0, 1)), (3, (1,))])
def test_bad_environment_settings_raise_on_every_rank(ws, on_ranks):
    for r, messages in enumerate(run_distributed(_bad_settings, ws, on_ranks)):
        for name, value, message in messages:
            assert name in message, f"rank {r}, {name}={value!r}: {message!r}"
            if r in on_ranks:
                assert f"{name}='{value}'" in message and "use " in message, message
            else:
                assert f"rank {on_ranks[0]}" in message and "allowed:" in message, message


def _env_switch_on_some_ranks(how, off_on):
    """The channel switched off on some ranks only (TP_EXT_SHM=0 or set_shared_memory(False)):
    every rank takes gloo, and the results are exact."""
    r, w = rank(), world_size()
    if r in off_on:
        if how == "env":
            os.environ["TP_EXT_SHM"] = "0"
        else:
            comm.set_shared_memory(False)
    try:
        group = dist.new_group(list(range(w)))
        xs = [full((5,), 10 + k) for k in range(w)]
        got = comm.all_reduce(xs[r], group=group)
        gathered = comm.all_gather(xs[r], 0, group=group)
        active = comm.shared_memory_active(group)
        dist.destroy_process_group(group)
    finally:
        os.environ.pop("TP_EXT_SHM", None)
        comm.set_shared_memory(None)
    torch.testing.assert_close(got, sum(xs))
    assert_equal(gathered, torch.cat(xs), "all_gather")
    return active


@pytest.mark.parametrize("how", ["env", "set_shared_memory"])
@pytest.mark.parametrize("ws,off_on", [(2, (1,)), (3, (0, 2))])
def test_transport_switch_on_some_ranks_only(how, ws, off_on):
    assert run_distributed(_env_switch_on_some_ranks, ws, how, off_on, timeout=60) == [False] * ws


def _segments_of(pid):
    return [f for f in os.listdir("/dev/shm") if f.startswith(f"tp_ext_{pid}_")]


def _die_in_setup(stage):
    """Rank 0 kills itself at `stage` of the channel setup (test-only hook); the others raise
    and remove the segment. Returns rank 0's pid (its segments are named after it)."""
    pids = [None] * world_size()
    dist.all_gather_object(pids, os.getpid())
    if rank() == 0:
        os.environ["TP_EXT_TEST_DIE_IN_SHM_SETUP"] = stage
    try:
        comm.all_reduce(torch.ones(2))
    except RuntimeError as e:
        return pids[0], str(e)
    return pids[0], ""


@pytest.mark.parametrize("stage", ["created", "mapped"])
@pytest.mark.parametrize("ws", [2, 3])
def test_rank0_dying_in_setup_leaves_no_segment(stage, ws):
    outcome, report = launch_once(_die_in_setup, ws, stage, timeout=60, pg_timeout=20.0)
    assert 0 not in outcome or not outcome[0][0], report
    for r in range(1, ws):
        ok, (pid0, message) = outcome[r]
        assert ok and message, report  # the survivors raised
    assert _segments_of(pid0) == [], _segments_of(pid0)


def _idle_cpu_while_waiting():
    """Rank 1 joins 3 s late; the CPU time rank 0's calling thread spends waiting in the channel.

    RUSAGE_THREAD, not RUSAGE_SELF: the process's other threads (gloo's, the watchdog's) do
    their own work meanwhile, and under a loaded CI runner that noise alone crossed the bound."""
    import resource

    comm.set_consistency_checks(False)  # so the wait is in the channel, not the check's gloo call
    comm.all_reduce(torch.ones(1))
    assert comm.shared_memory_active(dist.group.WORLD)
    if rank() == 1:
        time.sleep(3.0)
    before = resource.getrusage(resource.RUSAGE_THREAD)
    t0 = time.monotonic()
    comm.all_reduce(torch.ones(1))
    after = resource.getrusage(resource.RUSAGE_THREAD)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return cpu, time.monotonic() - t0


def test_waiting_rank_stays_idle():
    cpu, elapsed = run_distributed(_idle_cpu_while_waiting, 2)[0]
    assert elapsed > 2.0, elapsed
    # a polling wait used about 14% of a core (0.4 s over 3 s); the futex wait about 1%
    assert cpu < 0.12, f"rank 0 used {cpu:.3f} s of CPU waiting {elapsed:.2f} s"


def _mixed_with_async():
    """Synchronous collectives (shared memory) between an async gloo one and its wait, on the
    same group."""
    r, w = rank(), world_size()
    pending = full((64,), r)
    work = torch.distributed.all_reduce(pending, async_op=True)
    small = comm.all_gather(full((2, 3), 10 + r), 0)
    work.wait()
    assert_equal(small, torch.cat([full((2, 3), 10 + i) for i in range(w)]), "all_gather")
    torch.testing.assert_close(pending, sum(full((64,), i) for i in range(w)))
    return True


def test_async_gloo_and_shared_memory_interleave():
    assert all(run_distributed(_mixed_with_async, 3))


def _mismatched_calls():
    """With the cross-rank checks off, ranks that call different collectives at the same point
    (a bug in the caller) get an error on every rank, not each other's bytes."""
    comm.set_consistency_checks(False)
    group = dist.new_group(list(range(world_size())))
    comm.all_reduce(torch.ones(1), group=group)
    assert comm.shared_memory_active(group)
    x = torch.ones(3)
    try:
        if rank() == 0:
            comm.all_reduce(x, group=group)
        else:
            comm.all_gather(x, 0, group=group)
    except RuntimeError as e:
        message = str(e)
    else:
        message = ""
    try:  # the channel refuses further use
        comm.all_reduce(x, group=group)
        later = ""
    except RuntimeError as e:
        later = str(e)
    dist.destroy_process_group(group)
    return message, later


def test_mismatched_collectives_raise_on_every_rank():
    for message, later in run_distributed(_mismatched_calls, 3):
        assert "called a different collective" in message, message
        assert "out of step" in later, later


def _dead_peer_small_collectives():
    """Rank 1 is SIGKILLed while both stream small (shared-memory) all-reduces; rank 0 raises
    within a fraction of a second, not at the 30 s process-group timeout. (Cross-rank checks off:
    their gloo all-gather would notice the closed socket first.)"""
    comm.set_consistency_checks(False)
    x = torch.ones(16)
    comm.all_reduce(x)
    assert comm.shared_memory_active(dist.group.WORLD)
    if rank() == 1:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < 60:
            comm.all_reduce(x)
    except RuntimeError as e:
        return ("raised", time.monotonic() - t0, str(e))
    return ("no error", time.monotonic() - t0, "")


def test_dead_peer_fails_the_shared_memory_collective_fast():
    outcome, report = launch_once(_dead_peer_small_collectives, 2, timeout=90, pg_timeout=30.0)
    ok, (status, elapsed, message) = outcome[0]
    assert ok and status == "raised", report
    assert elapsed < 5, f"rank 0 raised only after {elapsed:.1f}s"
    assert "tp_ext.all_reduce failed on rank 0" in message and "rank 1" in message
    assert "exited" in message
