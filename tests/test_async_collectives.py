"""tp_ext.comm's plain collectives with async_op=True: the waited result and track()'s bytes equal
the synchronous call's (uneven sizes, every reduce op, every dim) at world sizes 1-4; handles
wait once, warn when dropped unwaited, overlap compute, and compile with fullgraph=True."""

import gc
import time
import warnings

import pytest
import torch

import tp_ext
from tp_ext import comm

from .common import WORLD_SIZES, assert_close, assert_equal, full
from .dist_utils import rank, run_distributed, world_size

SHAPE = (5, 7, 6)  # 5 and 7 split unevenly over 2, 3 and 4 ranks
SMALL = (2, 3)  # dim 0 over 3 or 4 ranks: empty pieces


def _ints(shape, seed, dtype):
    """Whole numbers in [-50, 50): every reduction order gives the same floats."""
    return full(shape, seed, torch.int64).to(dtype)


def _cases(r, w):
    """(what, call): ``call(async_op)`` runs one collective, synchronous or not."""
    cases = []
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        x = _ints(SHAPE, 100 + r, dtype)
        for reduce in ("sum", "avg", "max", "min", "product"):
            if reduce == "avg" and not dtype.is_floating_point:
                continue
            cases.append(
                (
                    f"all_reduce {reduce} {dtype}",
                    lambda a, x=x, o=reduce: comm.all_reduce(x, o, async_op=a),
                )
            )
    for shape in (SHAPE, SMALL):
        for dim in range(len(shape)):
            for dtype in (torch.float32, torch.bfloat16):
                whole = _ints(shape, 7 + dim, dtype)
                piece = tp_ext.split_tensor(whole, dim, w)[r]
                sizes = tp_ext.shard_sizes(shape[dim], w)
                cases.append(
                    (
                        f"all_gather {shape} dim={dim} {dtype}",
                        lambda a, p=piece, d=dim, s=sizes: comm.all_gather(p, d, s, async_op=a),
                    )
                )
            x = _ints(shape, 40 + r + dim, torch.float64)
            for reduce in ("sum", "avg", "max", "min", "product"):
                cases.append(
                    (
                        f"reduce_scatter {shape} dim={dim} {reduce}",
                        lambda a, x=x, d=dim, o=reduce: comm.reduce_scatter(
                            x, d, reduce=o, async_op=a
                        ),
                    )
                )
    t_piece = tp_ext.split_tensor(_ints(SHAPE, 3, torch.float32).transpose(0, 2), 1, w)[r]
    t_sizes = tp_ext.shard_sizes(SHAPE[1], w)
    cases.append(
        (
            "all_gather non-contiguous",
            lambda a: comm.all_gather(t_piece, 1, t_sizes, async_op=a),
        )
    )
    for src in range(w):
        x = _ints(SHAPE, 500 + r, torch.float32)
        cases.append(
            (f"broadcast src={src}", lambda a, x=x, s=src: comm.broadcast(x, s, async_op=a))
        )
    for scatter_dim in range(3):
        for gather_dim in range(3):
            x = _ints(SHAPE, 900 + r, torch.float32)
            cases.append(
                (
                    f"all_to_all scatter={scatter_dim} gather={gather_dim}",
                    lambda a, x=x, s=scatter_dim, g=gather_dim: comm.all_to_all(
                        x, s, g, async_op=a
                    ),
                )
            )
    # uneven: rank i sends (i + j) % 3 rows to rank j, so receives (j + i) % 3 from rank j
    send = [(r + j) % 3 for j in range(w)]
    x = _ints((sum(send), 4), 60 + r, torch.float32)
    cases.append(("all_to_all_single", lambda a: comm.all_to_all_single(x, send, send, async_op=a)))
    empty = torch.empty(0, 3)
    cases.append(("all_reduce, no elements", lambda a: comm.all_reduce(empty, async_op=a)))
    cases.append(("all_gather, no elements", lambda a: comm.all_gather(empty, async_op=a)))
    # rank 0 sends nothing (and receives nothing from itself); the others send a row to every rank
    send0 = [0 if r == 0 else 1] * w
    recv0 = [0] + [1] * (w - 1)
    x0 = _ints((sum(send0), 2, 3), 80 + r, torch.float32)
    cases.append(
        (
            "all_to_all_single, nothing to send",
            lambda a: comm.all_to_all_single(x0, send0, recv0, async_op=a),
        )
    )
    return cases


def _records(stats):
    return sorted((r.op, r.collective, r.count, r.bytes) for r in stats.records)


def _async_equals_sync():
    r, w = rank(), world_size()
    checked = 0
    for what, call in _cases(r, w):
        with comm.track() as sync_stats:
            expected = call(False)
        with comm.track() as async_stats:
            handle = call(True)
            assert isinstance(handle, comm.Pending), what
            got = handle.wait()
        if got.dtype == torch.bfloat16:
            assert_close(got.float(), expected.float(), what, rtol=1e-2, atol=1e-2)
            assert got.shape == expected.shape, what
        else:
            assert_equal(got, expected, what)
        assert _records(async_stats) == _records(sync_stats), (
            f"{what}: {_records(async_stats)} != {_records(sync_stats)}"
        )
        if w > 1:
            assert _records(sync_stats), f"{what}: nothing recorded"
        checked += 1
    # broadcast on a subgroup: src is a rank of the group (ranks 1..w-1: group rank 1 is rank 2)
    import torch.distributed as dist

    if w >= 3:
        sub = dist.new_group(list(range(1, w)))
        if r >= 1:
            x = torch.full((3,), float(r))
            got = comm.broadcast(x, 1, group=sub, async_op=True).wait()
            assert_equal(got, torch.full((3,), 2.0), "broadcast on a subgroup")
            assert_equal(got, comm.broadcast(x, 1, group=sub), "broadcast on a subgroup, sync")
    return checked


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_async_equals_sync(ws):
    checked = run_distributed(_async_equals_sync, ws)
    assert checked[0] > 60


# ---- the handle ---------------------------------------------------------------------------------


def _handles():
    r, w = rank(), world_size()
    x = torch.full((4,), float(r + 1))
    # wait() twice: the same tensor
    h = comm.all_reduce(x, async_op=True)
    first = h.wait()
    assert h.wait() is first
    assert_equal(first, torch.full((4,), float(w * (w + 1) // 2)), "all_reduce async")
    # dropped without wait(): a warning naming it and where it was issued; still waited on and
    # counted, and the next collectives pair up
    with comm.track() as stats:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            h = comm.all_gather(x, async_op=True)
            del h
            gc.collect()
    messages = [str(m.message) for m in caught if issubclass(m.category, RuntimeWarning)]
    assert len(messages) == 1, messages
    assert "tp_ext.comm.all_gather(..., async_op=True)" in messages[0], messages[0]
    assert "test_async_collectives.py" in messages[0], messages[0]
    assert "without wait()" in messages[0], messages[0]
    if w > 1:
        assert stats.bytes(collective="all_gather") == 4 * 4 * w
    assert_equal(comm.all_reduce(x, "max"), torch.full((4,), float(w)), "after a dropped handle")
    # not differentiable: refused, as the synchronous call
    leaf = torch.ones(3, requires_grad=True)
    with pytest.raises(ValueError, match="not differentiable"):
        comm.all_reduce(leaf, async_op=True)
    assert comm.all_reduce(leaf.detach(), async_op=True).wait().shape == (3,)
    with pytest.raises(ValueError, match="reduce='mean' is not supported"):
        comm.all_reduce(x, "mean", async_op=True)
    # the issuing tag is the record's tag, wherever the wait happens
    with comm.track() as stats:
        with comm.tag("early"):
            h = comm.broadcast(x, 0, async_op=True)
        h.wait()
    if w > 1:
        assert stats.bytes(tag="early", collective="broadcast") == 16, stats.table()
    return True


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_handles_wait_once_and_warn_when_dropped(ws):
    run_distributed(_handles, ws)


def _overlap(delay):
    """Rank 0 starts a 4 MiB all-reduce that rank 1 joins ``delay`` seconds late, multiplies
    matrices meanwhile, then waits."""
    import torch.distributed as dist

    r, w = rank(), world_size()
    x = torch.full((1 << 20,), float(r + 1))
    a = torch.randn(256, 256)
    # the group's first asynchronous collective sets up its gloo companion, every rank joining
    # (tp_ext/distributed/async_groups.py); time the next one
    comm.all_reduce(torch.zeros(1), async_op=True).wait()
    dist.barrier()
    t0 = time.perf_counter()
    if r == 1:
        time.sleep(delay)
    h = comm.all_reduce(x, async_op=True)
    issued = time.perf_counter()
    for _ in range(4):
        a = torch.tanh(a @ a)
    computed = time.perf_counter()
    out = h.wait()
    waited = time.perf_counter()
    assert_equal(out, torch.full((1 << 20,), float(w * (w + 1) // 2)), "overlapped all_reduce")
    return issued - t0, computed - t0, waited - t0


@pytest.mark.parametrize("ws", [2, 3])
def test_compute_overlaps_a_pending_collective(ws):
    delay = 0.4
    timings = run_distributed(_overlap, ws, delay)
    issued, computed, waited = timings[0]
    # rank 0's start did not wait for rank 1, its GEMMs ran while the all-reduce was pending
    # (they ended before rank 1 even joined), and only its wait blocked until rank 1 had joined
    assert issued < delay / 2, timings
    assert computed < delay, timings
    assert waited > 0.75 * delay, timings  # (the barrier frees the ranks a little apart)
    assert waited - computed > delay / 4, timings


def _on_a_single_threaded_companion():
    """Asynchronous collectives of CPU tensors on a gloo group run on a companion group of the
    same ranks with one worker thread (tp_ext/distributed/async_groups.py: torch's
    ProcessGroupGloo corrupts its heap when two collectives finish together on its two workers):
    many in flight at once, mixed with synchronous ones on the group itself, all come back
    right; release() drops it and the next one makes another."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import _resolve_process_group

    from tp_ext.distributed import async_groups

    r, w = rank(), world_size()
    g = comm.resolve_group(None)
    own_threads = g.group._get_backend(torch.device("cpu")).options._threads
    handles, expected = [], []
    for i in range(12):  # issued before any wait, of three kinds, with synchronous ones between
        x = torch.full((i % 3 + 1, 4), float(r + i))
        handles.append(comm.all_gather(x, async_op=True))
        expected.append(torch.cat([torch.full((i % 3 + 1, 4), float(q + i)) for q in range(w)]))
        handles.append(comm.all_reduce(x, async_op=True))
        expected.append(torch.full((i % 3 + 1, 4), float(w * (w - 1) // 2 + w * i)))
        total = comm.all_reduce(torch.full((2,), float(r)))
        assert_equal(total, torch.full((2,), float(w * (w - 1) // 2)), f"synchronous {i}")
    for i, (h, want) in enumerate(zip(handles, expected)):
        assert_equal(h.wait(), want, f"asynchronous {i}")
    companion = async_groups.companion_of(g)
    gloo = companion._get_backend(torch.device("cpu"))
    ran = gloo._get_sequence_number_for_group()  # collectives the companion ran
    first = (companion.group_name, companion.size(), companion.rank(), gloo.options._threads)
    async_groups.release()
    try:
        _resolve_process_group(first[0])
        released = False
    except (RuntimeError, ValueError):
        released = True
    again = comm.broadcast(torch.full((3,), float(r)), w - 1, async_op=True).wait()
    assert_equal(again, torch.full((3,), float(w - 1)), "after release")
    second = async_groups.companion_of(g).group_name
    # a group of the last two ranks: group ranks, not global ones, on the companion too
    sub = dist.new_group(list(range(w - 2, w)))
    from_sub = None
    if r >= w - 2:
        x = torch.full((2,), float(r))
        from_sub = comm.broadcast(x, 1, group=sub, async_op=True).wait()
        gathered = comm.all_gather(x, async_op=True, group=sub).wait()
        assert_equal(gathered, torch.tensor([w - 2.0] * 2 + [w - 1.0] * 2), "subgroup gather")
        assert (
            comm.resolve_group(sub).name
            in async_groups.companion_of(comm.resolve_group(sub)).group_name
        )
    dist.barrier()
    return own_threads, first, ran, released, second, g.name, from_sub


@pytest.mark.parametrize("ws", [2, 3])
def test_gloo_async_collectives_run_on_a_single_threaded_companion(ws):
    for r, (own_threads, first, ran, released, second, name, from_sub) in enumerate(
        run_distributed(_on_a_single_threaded_companion, ws)
    ):
        assert own_threads > 1  # torch's default: the race is possible on the group itself
        assert ran == 1 + 24  # its setup's barrier, then every asynchronous collective
        if r >= ws - 2:  # the subgroup's rank 1 is the last global rank
            assert_equal(from_sub, torch.full((2,), float(ws - 1)), "subgroup broadcast")
        made = int(first[0].rsplit(":", 1)[1])  # companions this worker made before
        assert first == (f"{name}:tp_ext_async:{made}", ws, r, 1)
        assert released and second == f"{name}:tp_ext_async:{made + 1}"


def _made_and_released(times):
    """A companion released as soon as it is made, again and again: a rank that releases first
    must not close connections a slower rank is still setting up (prepare_async returns once
    every rank has connected)."""
    import torch.distributed as dist

    from tp_ext.distributed import async_groups

    g = comm.resolve_group(None)
    names = []
    for _ in range(times):
        dist.barrier()
        comm.prepare_async(g)
        names.append(async_groups.companion_of(g).group_name)
        async_groups.release()
    out = comm.all_reduce(torch.ones(2), async_op=True).wait()  # and one more works after
    assert_equal(out, torch.full((2,), float(world_size())), "after the releases")
    return names


@pytest.mark.parametrize("ws", [2, 3, 4])
def test_companion_released_right_after_it_is_made(ws):
    names = run_distributed(_made_and_released, ws, 12)
    assert all(n == names[0] for n in names) and len(set(names[0])) == 12, names


# ---- torch.compile ------------------------------------------------------------------------------


def _overlapped_step(x, a, b):
    h = comm.all_reduce(x, async_op=True)
    y = torch.relu(a @ b)  # independent of the all-reduce: runs while it travels
    return h.wait(), y


# Inductor's comm passes: collectives as early, waits as late as their uses allow (with its
# default settings it places each wait right after its collective)
OVERLAP_PASSES = {
    "reorder_for_compute_comm_overlap": True,
    "reorder_for_compute_comm_overlap_passes": ["sink_waits", "raise_comms"],
}


def _compiled_overlap():
    from torch._inductor.utils import run_and_get_code

    r = rank()
    x = _ints((64,), 10 + r, torch.float32)
    a, b = full((32, 32), 1), full((32, 32), 2)
    eager = _overlapped_step(x, a, b)
    torch._dynamo.reset()
    compiled = torch.compile(_overlapped_step, fullgraph=True, options=OVERLAP_PASSES)
    with comm.track() as stats:
        got, code = run_and_get_code(compiled, x, a, b)
        again = compiled(x, a, b)
    assert_equal(got[0], eager[0], "compiled all_reduce")
    assert_close(got[1], eager[1], "compiled matmul", rtol=1e-5, atol=1e-5)
    assert_equal(again[0], eager[0], "compiled all_reduce, second call")
    assert stats.count(collective="all_reduce") == 2, stats.table()
    assert stats.bytes(collective="all_reduce") == 2 * 64 * 4, stats.table()
    code = "\n".join(code)
    start = code.index("_c10d_functional.all_reduce")
    mm = code.index("extern_kernels.mm(")
    wait = code.index("_c10d_functional.wait_tensor")
    assert start < mm < wait, code
    return True


@pytest.mark.parametrize("ws", [2])
def test_compiled_issues_early_and_waits_late(ws):
    run_distributed(_compiled_overlap, ws, timeout=240)


def _compiled_every_collective():
    r, w = rank(), world_size()
    x = _ints(SHAPE, 70 + r, torch.float32)
    piece = tp_ext.split_tensor(_ints(SHAPE, 5, torch.float32), 1, w)[r]
    sizes = tp_ext.shard_sizes(SHAPE[1], w)
    rows = SHAPE[0] * SHAPE[1]
    send = tp_ext.shard_sizes(rows, w)  # every rank sends the same split: receives send[r] each
    send_recv = [send[r]] * w
    eager = [  # the synchronous calls
        comm.all_reduce(x, "avg"),
        comm.all_gather(piece, 1, sizes),
        comm.reduce_scatter(x, 1, reduce="max"),
        comm.broadcast(x, w - 1),
        comm.all_to_all(x, 0, 2),
        comm.all_to_all_single(x.flatten(0, 1), send, send_recv),
    ]

    def step(x, piece):
        handles = [
            comm.all_reduce(x, "avg", async_op=True),
            comm.all_gather(piece, 1, sizes, async_op=True),
            comm.reduce_scatter(x, 1, reduce="max", async_op=True),
            comm.broadcast(x, w - 1, async_op=True),
            comm.all_to_all(x, 0, 2, async_op=True),
            comm.all_to_all_single(x.flatten(0, 1), send, send_recv, async_op=True),
        ]
        y = (x * 2).sum()
        return [h.wait() for h in handles] + [y]

    torch._dynamo.reset()
    with comm.track() as stats:
        got = torch.compile(step, fullgraph=True, backend="aot_eager")(x, piece)
    for i, (g, e) in enumerate(zip(got, eager)):
        assert_equal(g, e, f"compiled collective {i}")
    with comm.track() as sync_stats:
        comm.all_reduce(x, "avg")
        comm.all_gather(piece, 1, sizes)
        comm.reduce_scatter(x, 1, reduce="max")
        comm.broadcast(x, w - 1)
        comm.all_to_all(x, 0, 2)
        comm.all_to_all_single(x.flatten(0, 1), send, send_recv)
    assert _records(stats) == _records(sync_stats), (stats.table(), sync_stats.table())
    return True


@pytest.mark.parametrize("ws", [3])
def test_every_async_collective_compiles_fullgraph(ws):
    run_distributed(_compiled_every_collective, ws, timeout=240)
