"""Plain collectives against single-process references, even and uneven sizes, every
dimension, at world sizes 1-4."""

import pytest
import torch

import tp_ext
from tp_ext import comm

from .common import WORLD_SIZES, assert_close, assert_equal, full
from .dist_utils import rank, run_distributed, world_size

SHAPE = (5, 7, 6)  # 5 and 7 split unevenly over 2, 3 and 4 ranks


def _check_all_reduce():
    r, w = rank(), world_size()
    for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.int64):
        xs = [full(SHAPE, 100 + k, dtype) for k in range(w)]
        stacked = torch.stack([x.double() for x in xs])
        expected = {
            "sum": stacked.sum(0),
            "max": stacked.max(0).values,
            "min": stacked.min(0).values,
            "product": stacked.prod(0),
        }
        if dtype.is_floating_point:
            expected["avg"] = stacked.mean(0)
        for reduce, ref in expected.items():
            before = xs[r].clone()
            out = comm.all_reduce(xs[r], reduce)
            assert_equal(xs[r], before, f"all_reduce({reduce}) must not modify its input")
            tol = 2e-2 if dtype == torch.bfloat16 else 1e-6
            if reduce == "product" and dtype == torch.bfloat16:
                tol = 5e-2
            assert_close(
                out.double(),
                ref.to(dtype).double(),
                f"all_reduce {reduce} {dtype}",
                rtol=tol,
                atol=tol,
            )


def _check_gather_scatter():
    r, w = rank(), world_size()
    for dim in range(len(SHAPE)):
        for dtype in (torch.float32, torch.bfloat16):
            whole = full(SHAPE, 7 + dim, dtype)
            pieces = tp_ext.split_tensor(whole, dim, w)
            sizes = tp_ext.shard_sizes(SHAPE[dim], w)
            # all_gather of uneven pieces (this rank holds pieces[r]) rebuilds the whole tensor
            got = comm.all_gather(pieces[r], dim, sizes=sizes)
            assert_equal(got, whole, f"all_gather dim={dim} {dtype}")
            # reduce_scatter: reduce every rank's full tensor, keep this rank's piece
            xs = [full(SHAPE, 40 + k + dim, torch.float64) for k in range(w)]
            ref = tp_ext.split_tensor(sum(xs), dim, w)[r]
            got = comm.reduce_scatter(xs[r], dim)  # sizes from the shard policy
            assert_close(got, ref, f"reduce_scatter dim={dim}")
            got = comm.reduce_scatter(xs[r], dim, reduce="max")
            assert_close(
                got,
                tp_ext.split_tensor(torch.stack(xs).max(0).values, dim, w)[r],
                f"reduce_scatter max dim={dim}",
            )
        # non-contiguous input gathers the same values
        whole = full(SHAPE, 3, torch.float32)
        t_piece = tp_ext.split_tensor(whole.transpose(0, 2), dim, w)[r]
        assert not t_piece.is_contiguous() or t_piece.numel() <= 1
        got = comm.all_gather(
            t_piece, dim, sizes=tp_ext.shard_sizes(whole.transpose(0, 2).size(dim), w)
        )
        assert_equal(
            got, whole.transpose(0, 2).contiguous(), f"all_gather non-contiguous dim={dim}"
        )
    # even all_gather needs no sizes
    x = full((2, 3), 11 + r)
    assert_equal(
        comm.all_gather(x, 1),
        torch.cat([full((2, 3), 11 + k) for k in range(w)], 1),
        "all_gather even",
    )


def _check_broadcast_all_to_all():
    r, w = rank(), world_size()
    for src in range(w):
        x = full(SHAPE, 500 + r)
        assert_equal(comm.broadcast(x, src), full(SHAPE, 500 + src), f"broadcast src={src}")
    for scatter_dim in range(3):
        for gather_dim in range(3):
            xs = [full(SHAPE, 900 + k, torch.float32) for k in range(w)]
            ref = torch.cat(
                [tp_ext.split_tensor(xs[k], scatter_dim, w)[r] for k in range(w)], gather_dim
            )
            got = comm.all_to_all(xs[r], scatter_dim, gather_dim)
            assert_equal(got, ref, f"all_to_all scatter={scatter_dim} gather={gather_dim}")


@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize(
    "check",
    [_check_all_reduce, _check_gather_scatter, _check_broadcast_all_to_all],
    ids=["all_reduce", "gather_scatter_uneven_any_dim", "broadcast_all_to_all"],
)
def test_collective_matches_reference(check, ws):
    run_distributed(check, ws)


# ---- ranks that disagree: a clear error on every rank, never an abort, garbage or a hang -------


def _mismatch_cases(r, w, g):
    """Calls on group g whose arguments differ between ranks (rank 0 is the odd one out). Each
    passes every local check on its own rank; only a cross-rank comparison can tell."""
    odd = r == 0
    skewed = [1, 3] + [2] * (w - 2)  # adds up to 2w like the even split
    one_more = [2, 3] + [2] * (w - 2)  # rank 0 believes rank 1 holds 3 rows; it holds 2
    return {
        "all_gather sizes": lambda: comm.all_gather(
            torch.ones(2), 0, one_more if odd else [2] * w, group=g
        ),
        "all_gather uneven without sizes": lambda: comm.all_gather(torch.ones(2 + r, 3), group=g),
        "all_gather dim": lambda: comm.all_gather(torch.ones(2, 2), 1 if odd else 0, group=g),
        "all_gather other dim": lambda: comm.all_gather(torch.ones(2, 3 + odd), 0, group=g),
        "reduce_scatter sizes": lambda: comm.reduce_scatter(
            torch.ones(2 * w), 0, skewed if odd else [2] * w, group=g
        ),
        "reduce_scatter dim": lambda: comm.reduce_scatter(
            torch.ones(w, w), 1 if odd else 0, group=g
        ),
        "reduce_scatter reduce": lambda: comm.reduce_scatter(
            torch.ones(w), 0, reduce="max" if odd else "sum", group=g
        ),
        "all_to_all sizes": lambda: comm.all_to_all(
            torch.ones(2 * w, 2), 0, 0, skewed if odd else [2] * w, group=g
        ),
        "all_to_all shape": lambda: comm.all_to_all(torch.ones(w, 2 + odd), 0, 0, group=g),
        "all_reduce shape": lambda: comm.all_reduce(torch.ones(3 + odd), group=g),
        "all_reduce same numel": lambda: comm.all_reduce(
            torch.ones((2, 3) if odd else (3, 2)), group=g
        ),
        "all_reduce dtype": lambda: comm.all_reduce(
            torch.ones(3, dtype=torch.float64 if odd else torch.float32), group=g
        ),
        # complex does not go through shared memory: the ranks would take different transports
        "all_reduce transport": lambda: comm.all_reduce(
            torch.ones(3, dtype=torch.complex64 if odd else torch.float32), group=g
        ),
        "all_reduce reduce": lambda: comm.all_reduce(
            torch.ones(3), "max" if odd else "sum", group=g
        ),
        "op": lambda: (
            comm.all_reduce(torch.ones(4), group=g)
            if odd
            else comm.all_gather(torch.ones(4), group=g)
        ),
        "broadcast src": lambda: comm.broadcast(torch.ones(3), 1 if odd else 0, group=g),
        "gather_from_sp sizes": lambda: comm.gather_from_sp(
            torch.ones(2, 3), 0, one_more if odd else [2] * w, group=g
        ),
        "reduce_scatter_to_sp sizes": lambda: comm.reduce_scatter_to_sp(
            torch.ones(2 * w, 3), 0, skewed if odd else [2] * w, group=g
        ),
    }


def _mismatches_raise(mode):
    """Every case raises on every rank. mode: "checks" (TP_EXT_CHECK_COLLECTIVES, on the world
    group), "checks-gloo" (the same on a group without the channel), or "signature" (checks off:
    the shared-memory channel's round signature; a new group per case, since a mismatch retires
    the channel)."""
    import torch.distributed as dist

    r, w = rank(), world_size()
    comm.set_consistency_checks(mode != "signature")
    group = None
    if mode == "checks-gloo":
        comm.set_shared_memory(False)
        group = dist.new_group(list(range(w)))
        comm.all_reduce(torch.ones(1), group=group)  # the group decides here: no channel
        comm.set_shared_memory(None)
    messages = {}
    for what in _mismatch_cases(r, w, None):
        if mode == "signature":
            group = dist.new_group(list(range(w)))
            comm.all_reduce(torch.ones(1), group=group)  # sets the channel up
            assert comm.shared_memory_active(group)
        try:
            _mismatch_cases(r, w, group)[what]()
        except (ValueError, RuntimeError) as e:
            messages[what] = str(e)
        else:
            messages[what] = None
        if mode == "signature":
            dist.destroy_process_group(group)
    if mode == "checks-gloo":
        assert not comm.shared_memory_active(group)
        dist.destroy_process_group(group)
    # the world group still works afterwards
    assert_equal(comm.all_reduce(torch.ones(2)), torch.full((2,), float(w)), "after")
    return messages


@pytest.mark.parametrize("ws", [2, 3])
@pytest.mark.parametrize("mode", ["checks", "checks-gloo", "signature"])
def test_ranks_that_disagree_raise_on_every_rank(mode, ws):
    results = run_distributed(_mismatches_raise, ws, mode)
    expected = "called a different collective" if mode == "signature" else "do not match"
    for r, messages in enumerate(results):
        for what, message in messages.items():
            assert message is not None, f"rank {r}: {what} did not raise ({mode})"
            assert expected in message, f"rank {r}: {what} ({mode}): {message}"
