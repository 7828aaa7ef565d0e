"""The six Megatron pairs: forward values and gradients against a single-process autograd
reference (the unsharded computation the pair stands for), even and uneven sizes, every dim, at
world sizes 1-4; and the communication accounting, byte for byte."""

import pytest
import torch

import tp_ext
from tp_ext import comm

from .common import WORLD_SIZES, assert_close, full
from .dist_utils import rank, run_distributed, world_size

SHAPE = (5, 6, 7)


def _upstream(shape, seed):
    """Gradient arriving at a pair's output on rank k (seed varies with k where ranks differ)."""
    return full(shape, seed, torch.float64)


def _check_pair(name, dim):
    r, w = rank(), world_size()
    X = full(SHAPE, 1 + dim, torch.float64)
    sizes = tp_ext.shard_sizes(SHAPE[dim], w)

    if name == "copy_to_tp":  # X replicated; each rank computes with it; grads summed
        x = X.clone().requires_grad_()
        y = comm.copy_to_tp(x)
        G = [_upstream(SHAPE, 50 + k) for k in range(w)]
        ref_y, ref_grad = X, sum(G)
    elif name == "reduce_from_tp":  # partial sums -> total; same grad on every rank
        parts = [full(SHAPE, 20 + k, torch.float64) for k in range(w)]
        x = parts[r].clone().requires_grad_()
        y = comm.reduce_from_tp(x)
        G = [_upstream(SHAPE, 50)] * w
        ref_y, ref_grad = sum(parts), G[r]
    elif name == "scatter_to_tp":  # X replicated -> my slice; grad of X gathers slice grads
        x = X.clone().requires_grad_()
        y = comm.scatter_to_tp(x, dim)
        G = [_upstream(tp_ext.split_tensor(X, dim, w)[k].shape, 50 + k) for k in range(w)]
        ref_y, ref_grad = tp_ext.split_tensor(X, dim, w)[r], torch.cat(G, dim)
    elif name == "gather_from_tp":  # my slice -> X; replicated grad, keep my slice of it
        x = tp_ext.split_tensor(X, dim, w)[r].clone().requires_grad_()
        y = comm.gather_from_tp(x, dim, sizes=sizes)
        G = [_upstream(SHAPE, 50)] * w
        ref_y, ref_grad = X, tp_ext.split_tensor(G[r], dim, w)[r]
    elif name == "gather_from_sp":  # sequence shard -> X; per-rank grads summed then split
        x = tp_ext.split_tensor(X, dim, w)[r].clone().requires_grad_()
        y = comm.gather_from_sp(x, dim, sizes=sizes)
        G = [_upstream(SHAPE, 50 + k) for k in range(w)]
        ref_y, ref_grad = X, tp_ext.split_tensor(sum(G), dim, w)[r]
    elif name == "reduce_scatter_to_sp":  # partial sums -> my shard of the total; grads gathered
        parts = [full(SHAPE, 20 + k, torch.float64) for k in range(w)]
        x = parts[r].clone().requires_grad_()
        y = comm.reduce_scatter_to_sp(x, dim)
        G = [_upstream(tp_ext.split_tensor(X, dim, w)[k].shape, 50 + k) for k in range(w)]
        ref_y, ref_grad = tp_ext.split_tensor(sum(parts), dim, w)[r], torch.cat(G, dim)
    else:
        raise AssertionError(name)

    assert_close(y, ref_y, f"{name} dim={dim} forward", rtol=1e-12, atol=1e-12)
    y.backward(G[r])
    assert_close(x.grad, ref_grad, f"{name} dim={dim} gradient", rtol=1e-12, atol=1e-12)


PAIRS = [
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
]


def _check_all_pairs():
    for name in PAIRS:
        for dim in range(len(SHAPE)):
            _check_pair(name, dim)


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_pairs_forward_and_backward_match_reference(ws):
    run_distributed(_check_all_pairs, ws)


def _check_pairs_compose_to_unsharded_linear():
    """copy_to_tp -> column-parallel matmul -> gather_from_tp equals x @ W.T, gradients included."""
    r, w = rank(), world_size()
    X, W = full((4, 6), 1, torch.float64), full((10, 6), 2, torch.float64)  # 10 outputs: uneven
    x = X.clone().requires_grad_()
    w_local = tp_ext.split_tensor(W, 0, w)[r].clone().requires_grad_()
    y = comm.gather_from_tp(comm.copy_to_tp(x) @ w_local.t(), -1, sizes=tp_ext.shard_sizes(10, w))
    G = full((4, 10), 3, torch.float64)
    y.backward(G)
    Xr, Wr = X.clone().requires_grad_(), W.clone().requires_grad_()
    (Xr @ Wr.t()).backward(G)
    assert_close(y, X @ W.t(), "output", rtol=1e-12, atol=1e-12)
    assert_close(x.grad, Xr.grad, "input gradient", rtol=1e-12, atol=1e-12)
    assert_close(
        w_local.grad,
        tp_ext.split_tensor(Wr.grad, 0, w)[r],
        "weight gradient",
        rtol=1e-12,
        atol=1e-12,
    )


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_pairs_compose_to_unsharded_linear(ws):
    run_distributed(_check_pairs_compose_to_unsharded_linear, ws)


def _check_accounting():
    r, w = rank(), world_size()
    x = full((5, 6), 1)  # float32: 120 bytes
    with comm.tag("fwd"), comm.track() as stats:
        comm.all_reduce(x)
        comm.all_gather(tp_ext.split_tensor(x, 0, w)[r], 0, sizes=tp_ext.shard_sizes(5, w))
        comm.reduce_scatter(x, 1)
        comm.broadcast(x.double(), 0)
        with comm.tag("pairs"):
            a = x.clone().requires_grad_()
            y = comm.gather_from_sp(comm.copy_to_tp(a)[:1], 0, sizes=[1] * w)
            y.sum().backward()
    if w == 1:
        assert stats.records == [], "a single rank communicates nothing"
        return
    assert stats.bytes("fwd", "all_reduce", "all_reduce") == 120
    assert stats.bytes("fwd", "all_gather", "all_gather") == 120  # the gathered whole
    assert stats.bytes("fwd", "reduce_scatter", "reduce_scatter") == 120  # the full input
    assert stats.bytes("fwd", "broadcast", "broadcast") == 240
    # gather_from_sp forward gathers w rows of 6 floats; its backward reduce-scatters them;
    # copy_to_tp's backward all-reduces the (5, 6) gradient
    assert stats.bytes("pairs", "gather_from_sp", "all_gather") == w * 6 * 4
    assert stats.bytes("pairs", "reduce_scatter", "reduce_scatter") == w * 6 * 4
    assert stats.bytes("pairs", "all_reduce", "all_reduce") == 120
    assert stats.count() == 7
    assert stats.bytes() == 120 * 4 + 240 + 2 * w * 24
    assert all(rec.seconds >= 0 for rec in stats.records)
    # outside track() nothing is recorded
    comm.all_reduce(x)
    assert stats.count() == 7


@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_accounting_counts_bytes_exactly(ws):
    run_distributed(_check_accounting, ws)
