"""The shard-size policy, split_tensor views, and init_parallel's TP x PP x DP rank order."""

import pytest
import torch
import torch.distributed as dist

import tp_ext

from .dist_utils import run_distributed, world_size


@pytest.mark.parametrize(
    "n,w,expected",
    [
        (10, 4, [3, 3, 2, 2]),
        (8, 4, [2, 2, 2, 2]),
        (1001, 8, [126] + [125] * 7),
        (2, 4, [1, 1, 0, 0]),
        (0, 3, [0, 0, 0]),
        (152064, 8, [19008] * 8),
        (29568, 8, [3696] * 8),
    ],
)
def test_shard_sizes_policy(n, w, expected):
    assert tp_ext.shard_sizes(n, w) == expected
    offsets = tp_ext.shard_offsets(n, w)
    assert offsets == [sum(expected[:k]) for k in range(w)]
    assert [tp_ext.shard_range(n, w, k) for k in range(w)] == list(zip(offsets, expected))


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_split_tensor_returns_views_that_cover_the_tensor(dim):
    t = torch.arange(7 * 10, dtype=torch.float32).reshape(7, 10)
    shards = tp_ext.split_tensor(t, dim, 3)
    assert [s.size(dim) for s in shards] == tp_ext.shard_sizes(t.size(dim), 3)
    for s in shards:
        assert s.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()  # a view
    torch.testing.assert_close(torch.cat(shards, dim), t, rtol=0, atol=0)
    shards[0].zero_()  # writes through to t
    assert t.narrow(dim, 0, shards[0].size(dim)).abs().sum() == 0


def _rank_groups(tp, pp):
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    assert tp_ext.init_parallel(tp=tp, pp=pp) is state  # idempotent
    ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
    default = tp_ext.comm.resolve_group()  # the default group is TP
    assert (default.name, default.size) == (state.tp_group.group_name, tp)
    return dict(
        tp=ranks(state.tp_group),
        dp=ranks(state.dp_group),
        pp=ranks(state.pp_group),
        ranks=(state.tp_rank, state.dp_rank, state.pp_rank),
        dp_size=state.dp,
    )


@pytest.mark.parametrize("ws,tp,pp", [(8, 2, 2), (8, 8, 1), (4, 2, 1), (3, 3, 1), (1, 1, 1)])
def test_init_parallel_rank_order_tp_innermost(ws, tp, pp):
    dp = ws // (tp * pp)
    for r, got in enumerate(run_distributed(_rank_groups, ws, tp, pp)):
        tp_rank, dp_rank, pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)
        base = pp_rank * tp * dp + dp_rank * tp
        assert got["tp"] == list(range(base, base + tp))  # adjacent ranks
        assert got["dp"] == [pp_rank * tp * dp + k * tp + tp_rank for k in range(dp)]
        assert got["pp"] == [k * tp * dp + dp_rank * tp + tp_rank for k in range(pp)]
        assert got["ranks"] == (tp_rank, dp_rank, pp_rank) and got["dp_size"] == dp


def _bad_dims():
    w = world_size()
    errors = {}
    for kwargs in (dict(tp=3), dict(tp=2, pp=1, dp=3), dict(tp=0), dict(tp=2, pp="2")):
        try:
            tp_ext.init_parallel(**kwargs)
        except ValueError as e:
            errors[str(kwargs)] = str(e)
    return w, errors


def test_init_parallel_bad_sizes_say_what_fits():
    w, errors = run_distributed(_bad_dims, 4)[0]
    assert (
        "tp 3 does not fit the 4 ranks (world size): tp x pp x dp must equal 4"
        in errors["{'tp': 3}"]
    )
    assert "tp values that work: [1, 2, 4]" in errors["{'tp': 3}"]
    assert "dp 3 does not fit the 4 ranks (world size)" in errors["{'tp': 2, 'pp': 1, 'dp': 3}"]
    assert "tp must be an int >= 1 (1D tensor parallelism) or a pair (P, Q)" in errors["{'tp': 0}"]
    assert errors["{'tp': 0}"].endswith("got 0")
    assert "pp must be an int >= 1, got '2'" in errors["{'tp': 2, 'pp': '2'}"]


def _dims_groups(dims):
    """init_parallel given a ParallelDims: its groups, and the same state for the same dims
    given as keywords."""
    state = tp_ext.init_parallel(dims)
    want = dims.resolve(world_size())
    tp = want.tp if want.grid is None else want.grid
    again = tp_ext.init_parallel(tp=tp, pp=want.pp, dp=want.dp, ep=want.ep)
    ranks = lambda g: dist.get_process_group_ranks(g)  # noqa: E731
    return dict(
        dims=state.dims,
        degrees=(state.tp, state.pp, state.dp, state.ep),
        grid=None if state.tp_grid is None else state.tp_grid.shape,
        same=again is state,
        tp=ranks(state.tp_group),
        dp=ranks(state.dp_group),
        pp=ranks(state.pp_group),
    )


@pytest.mark.parametrize(
    "ws, dims, want",
    [
        (1, tp_ext.ParallelDims(), tp_ext.ParallelDims(tp=1, dp=1)),
        (2, tp_ext.ParallelDims(tp=1), tp_ext.ParallelDims(tp=1, dp=2)),
        (3, tp_ext.ParallelDims(pp=3, dp=1), tp_ext.ParallelDims(tp=1, pp=3, dp=1)),
        (4, tp_ext.ParallelDims(tp=2, pp=2), tp_ext.ParallelDims(tp=2, pp=2, dp=1)),
        (4, tp_ext.ParallelDims(tp=1, ep=4), tp_ext.ParallelDims(tp=1, dp=4, ep=4)),
        (4, tp_ext.ParallelDims(tp=(2, 2)), tp_ext.ParallelDims(tp=(2, 2), dp=1)),
    ],
    ids=lambda x: x.describe() if isinstance(x, tp_ext.ParallelDims) else f"world{x}",
)
def test_init_parallel_takes_a_parallel_dims(ws, dims, want):
    tp, pp, dp = want.tp_size, want.pp, want.dp
    for r, got in enumerate(run_distributed(_dims_groups, ws, dims)):
        assert got["dims"] == want and got["same"], got
        assert got["degrees"] == (tp, pp, dp, want.ep) and got["grid"] == want.grid
        tp_rank, dp_rank, pp_rank = r % tp, (r // tp) % dp, r // (tp * dp)
        base = pp_rank * tp * dp + dp_rank * tp
        assert got["tp"] == list(range(base, base + tp))
        assert got["dp"] == [pp_rank * tp * dp + k * tp + tp_rank for k in range(dp)]
        assert got["pp"] == [k * tp * dp + dp_rank * tp + tp_rank for k in range(pp)]


def _dims_and_keywords():
    try:
        tp_ext.init_parallel(tp_ext.ParallelDims(tp=2), pp=2)
    except ValueError as e:
        return str(e)
    return None


def test_init_parallel_refuses_dims_and_keywords_together():
    message = run_distributed(_dims_and_keywords, 2)[0]
    assert "give the degrees either as a ParallelDims or as tp=, pp=, dp=, ep=" in message
    assert "{'pp': 2}" in message


def test_degree_helpers():
    from tp_ext.dims import grid_shape_of

    assert tp_ext.ParallelDims.tp_choices(8, 2) == [1, 2, 4]
    assert tp_ext.ParallelDims(tp=2, dp=4).ep_choices() == [1, 2, 4, 8]
    assert grid_shape_of([2, 3]) == (2, 3)


def test_default_backend_is_nccl_only_with_a_gpu_per_local_rank(monkeypatch):
    from tp_ext.distributed.mesh import default_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert default_backend() == "nccl"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # NCCL refuses two ranks on one GPU
    with pytest.warns(UserWarning, match="8 ranks per node but 2 GPU"):
        assert default_backend() == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert default_backend() == "gloo"


def _dtensor_checks():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from tp_ext.distributed.dtensors import is_dtensor, local_tensor

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    whole = torch.arange(12.0).reshape(6, 2)
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    assert is_dtensor(sharded) and not is_dtensor(whole) and not is_dtensor(None)
    assert local_tensor(whole) is whole
    return local_tensor(sharded)


@pytest.mark.parametrize("ws", [1, 3])
def test_dtensor_helpers_find_dtensors_and_their_local_pieces(ws):
    pieces = run_distributed(_dtensor_checks, ws)
    assert torch.equal(torch.cat(pieces), torch.arange(12.0).reshape(6, 2))
