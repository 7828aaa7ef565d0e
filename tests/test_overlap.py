"""The linear ops fused with their TP communication (csrc/comm/overlapped_linear.cpp): each against
the unfused composition of tp_ext's collectives and F.linear (outputs and every gradient), at world
sizes 1-4 with uneven and empty sequence shards, the accounting (the same bytes as the unfused
collectives, under the fused op's name), opcheck, and argument errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_ext
from tp_ext import comm, ops

from .common import WORLD_SIZES, full
from .dist_utils import run_distributed

TOL = dict(rtol=1e-12, atol=1e-12)  # fp64: only the order of the sums differs


def _group():
    g = comm.resolve_group(dist.group.WORLD)
    return g.name, g.size, g.rank


def _grads(out, inputs, seed):
    grad = full(out.shape, seed, out.dtype)
    return torch.autograd.grad(out, inputs, grad)


def _same(y, y_ref, fused, plain, fused_stats, plain_stats, op):
    """Outputs and gradients equal; (bytes per collective of both paths, calls of ``op``)."""
    torch.testing.assert_close(y, y_ref, **TOL)
    for a, e in zip(fused, plain):
        torch.testing.assert_close(a, e, **TOL)
    by_collective = {
        c: (fused_stats.bytes(collective=c), plain_stats.bytes(collective=c))
        for c in ("all_gather", "reduce_scatter")
    }
    return by_collective, fused_stats.count(op=op)


def _check_column_linear():
    name, size, rank = _group()
    x = full((2, 5, 6), 1, torch.float64).requires_grad_()
    w = full((3 + rank, 6), 2 + rank, torch.float64).requires_grad_()  # uneven rows per rank
    b = full((3 + rank,), 3 + rank, torch.float64).requires_grad_()
    with comm.track() as fused_stats:
        y = ops.column_linear(x, w, b, name, size)
        fused = _grads(y, (x, w, b), 4 + rank)
    with comm.track() as plain_stats:
        y_ref = F.linear(comm.copy_to_tp(x, dist.group.WORLD), w, b)
        plain = _grads(y_ref, (x, w, b), 4 + rank)
    blocking = _grads(ops.column_linear(x, w, b, name, size, False), (x, w, b), 4 + rank)
    torch.testing.assert_close(y, y_ref, **TOL)
    for a, e, c in zip(fused, plain, blocking):
        torch.testing.assert_close(a, e, **TOL)
        torch.testing.assert_close(c, e, **TOL)
    return (
        fused_stats.bytes(collective="all_reduce"),
        plain_stats.bytes(collective="all_reduce"),
        fused_stats.count(op="column_linear_backward"),
    )


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_linear_matches_copy_to_tp_and_linear(world):
    for fused, plain, count in run_distributed(_check_column_linear, world):
        assert fused == plain  # the same all-reduce, overlapped
        assert count == (1 if world > 1 else 0)


def _check_column_linears(overlap, bias):
    """q, k and v as one op: their outputs and every gradient as three column_linear calls, one
    all-reduce of the summed input gradient where those make three; an unused output (its
    gradient None) counts as zero."""
    name, size, rank = _group()
    x = full((2, 5, 6), 1, torch.float64).requires_grad_()
    ws = [full((3 + rank + i, 6), 2 + i, torch.float64).requires_grad_() for i in range(3)]
    bs = [full((3 + rank + i,), 5 + i, torch.float64).requires_grad_() for i in range(3)]
    params = [x, *ws, *(bs if bias else [])]
    with comm.track() as fused_stats:
        ys = ops.column_linears(x, ws, bs if bias else [], name, size, overlap)
        loss = sum((y * full(y.shape, 7 + i, torch.float64)).sum() for i, y in enumerate(ys[:2]))
        fused = torch.autograd.grad(loss, params, allow_unused=True)
    with comm.track() as plain_stats:
        refs = [ops.column_linear(x, w, b if bias else None, name, size) for w, b in zip(ws, bs)]
        loss = sum((y * full(y.shape, 7 + i, torch.float64)).sum() for i, y in enumerate(refs[:2]))
        plain = torch.autograd.grad(loss, params, allow_unused=True)
    for y, y_ref in zip(ys, refs):
        torch.testing.assert_close(y, y_ref, **TOL)
    for i, (a, e) in enumerate(zip(fused, plain)):
        if e is None:  # v's weight and bias: its output was not used
            e = torch.zeros_like(params[i])
        torch.testing.assert_close(a, e, **TOL)
    with comm.track() as frozen_stats:  # no input gradient wanted: no all-reduce
        ys = ops.column_linears(x.detach(), ws, [], name, size, overlap)
        gw = torch.autograd.grad(sum(y.sum() for y in ys), ws)
    for g, w in zip(gw, ws):
        torch.testing.assert_close(
            g,
            torch.ones(2 * 5, w.shape[0], dtype=w.dtype).t() @ x.detach().reshape(10, 6),
            **TOL,
        )
    return (
        fused_stats.count(collective="all_reduce"),
        plain_stats.count(collective="all_reduce"),
        fused_stats.bytes(collective="all_reduce"),
        frozen_stats.count(),
    )


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_linears_all_reduce_the_summed_input_gradient_once(world, overlap, bias):
    for fused, plain, nbytes, frozen in run_distributed(
        _check_column_linears, world, overlap, bias
    ):
        assert (fused, plain) == ((1, 2) if world > 1 else (0, 0))  # v's output unused: 2 not 3
        assert nbytes == (2 * 5 * 6 * 8 if world > 1 else 0) and frozen == 0


def _shared_column_input():
    """Two column-parallel layers joined by SharedColumnInput: fed the offered tensor they give
    the separate layers' outputs and gradients with one all-reduce; fed another tensor, each
    computes alone."""
    from tp_ext.layers import ColumnParallelLinear, SharedColumnInput

    torch.manual_seed(0)
    q, k = ColumnParallelLinear(6, 8, dtype=torch.float64), ColumnParallelLinear(6, 5, False)
    k.double()
    x = full((2, 5, 6), 1, torch.float64).requires_grad_()

    def run(fed):
        for p in (x, *q.parameters(), *k.parameters()):
            p.grad = None
        with comm.track() as stats:
            y = (q(fed) * 2 + k(fed).sum(-1, keepdim=True)).sum()
            y.backward()
        grads = [x.grad] + [p.grad for p in (*q.parameters(), *k.parameters())]
        return y.detach(), grads, {r.op: r.count for r in stats.records}

    alone = run(x)
    group = SharedColumnInput([q, k])
    group.offer(x)
    shared = run(x)
    group.offer(x.detach())  # not the tensor the layers read: each computes alone
    again = run(x)
    assert group._x is None and not group._outputs  # nothing kept after a miss
    for other in (shared, again):
        torch.testing.assert_close(other[0], alone[0], **TOL)
        for a, e in zip(other[1], alone[1]):
            torch.testing.assert_close(a, e, **TOL)
    errors = []
    for bad in ([q], [q, ColumnParallelLinear(6, 4, sequence_parallel=True)]):
        try:
            SharedColumnInput(bad)
        except ValueError as e:
            errors.append(str(e))
    return alone[2], shared[2], again[2], errors


@pytest.mark.parametrize("world", [2, 3])
def test_layers_sharing_an_input_all_reduce_its_gradient_once(world):
    for alone, shared, again, errors in run_distributed(_shared_column_input, world):
        assert alone == again == {"column_linear_backward": 2}, (alone, again)
        assert shared == {"column_linears_backward": 1}, shared
        assert "takes two or more ColumnParallelLinear layers" in errors[0]
        assert "communicates its input elsewhere" in errors[1]


def _siblings_save_their_input_itself(overlap):
    """Two column-parallel projections of one input (q and k) save that input for backward, not
    a copy each (copy_to_tp + F.linear would save copy_to_tp's fresh output)."""
    from tp_ext.layers import ColumnParallelLinear

    comm.set_overlap(overlap, 0)
    q, k = (ColumnParallelLinear(6, 8, dtype=torch.float64) for _ in range(2))
    x = full((2, 5, 6), 1, torch.float64).requires_grad_()
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = q(x) + k(x)
    y.sum().backward()
    comm.set_overlap(None, 1 << 16)
    mine = x.untyped_storage().data_ptr()
    shared = sum(t.untyped_storage().data_ptr() == mine for t in saved)
    copies = sum(t.numel() == x.numel() and t.untyped_storage().data_ptr() != mine for t in saved)
    return shared, copies


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_column_parallel_siblings_save_no_copy_of_their_input(world, overlap):
    assert run_distributed(_siblings_save_their_input_itself, world, overlap) == [(2, 0)] * world


def _column_linear_without_input_grad():
    name, size, rank = _group()
    x = full((2, 5, 6), 1, torch.float64)  # a frozen input: no gradient wanted
    w = full((3 + rank, 6), 2 + rank, torch.float64).requires_grad_()
    b = full((3 + rank,), 3 + rank, torch.float64).requires_grad_()
    with comm.track() as stats:
        gw, gb = _grads(ops.column_linear(x, w, b, name, size), (w, b), 4 + rank)
    want = _grads(F.linear(x, w, b), (w, b), 4 + rank)
    torch.testing.assert_close(gw, want[0], **TOL)
    torch.testing.assert_close(gb, want[1], **TOL)
    return stats.count()


@pytest.mark.parametrize("world", [2, 3])
def test_column_linear_skips_the_all_reduce_when_no_input_gradient_is_wanted(world):
    assert run_distributed(_column_linear_without_input_grad, world) == [0] * world


def _seq_sizes(seq, world):
    return tp_ext.shard_sizes(seq, world)


def _check_all_gather_linear(seq):
    name, size, rank = _group()
    sizes = _seq_sizes(seq, size)
    x_full = full((2, seq, 6), 1, torch.float64)
    start = sum(sizes[:rank])
    x = x_full[:, start : start + sizes[rank]].clone().requires_grad_()
    w = full((4, 6), 2 + rank, torch.float64).requires_grad_()
    b = full((4,), 3 + rank, torch.float64).requires_grad_()
    with comm.track() as fused_stats:
        y, gathered = ops.all_gather_linear(x, w, b, -2, sizes, name, size, rank)
        fused = _grads(y, (x, w, b), 4 + rank)
    with comm.track() as plain_stats:
        full_x = comm.gather_from_sp(x, -2, sizes, dist.group.WORLD)
        y_ref = F.linear(full_x, w, b)
        plain = _grads(y_ref, (x, w, b), 4 + rank)
    torch.testing.assert_close(gathered, x_full, rtol=0, atol=0)
    return _same(y, y_ref, fused, plain, fused_stats, plain_stats, "all_gather_linear")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("seq", [8, 7, 2])  # even, uneven, fewer positions than ranks
def test_all_gather_linear_matches_gather_from_sp_and_linear(world, seq):
    for by_collective, count in run_distributed(_check_all_gather_linear, world, seq):
        for fused, plain in by_collective.values():
            assert fused == plain  # Megatron's volume: one all-gather forward, one RS backward
        assert count == (1 if world > 1 else 0)


def _check_linear_reduce_scatter(seq):
    name, size, rank = _group()
    sizes = _seq_sizes(seq, size)
    x = full((2, seq, 3 + rank), 1 + rank, torch.float64).requires_grad_()
    w = full((5, 3 + rank), 2 + rank, torch.float64).requires_grad_()
    with comm.track() as fused_stats:
        y = ops.linear_reduce_scatter(x, w, -2, sizes, name, size, rank)
        fused = _grads(y, (x, w), 4 + rank)
    with comm.track() as plain_stats:
        y_ref = comm.reduce_scatter_to_sp(F.linear(x, w), -2, sizes, dist.group.WORLD)
        plain = _grads(y_ref, (x, w), 4 + rank)
    return _same(y, y_ref, fused, plain, fused_stats, plain_stats, "linear_reduce_scatter")


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("seq", [8, 7, 2])
def test_linear_reduce_scatter_matches_linear_and_reduce_scatter_to_sp(world, seq):
    for by_collective, count in run_distributed(_check_linear_reduce_scatter, world, seq):
        for fused, plain in by_collective.values():
            assert fused == plain
        assert count == (1 if world > 1 else 0)


def _reduce_scatter_bf16_weight_grad():
    name, size, rank = _group()
    sizes = _seq_sizes(64, size)
    x = full((2, 64, 32), 1, torch.bfloat16)
    w = full((48, 32), 2, torch.bfloat16).requires_grad_()
    y = ops.linear_reduce_scatter(x, w, -2, sizes, name, size, rank)
    (gw,) = _grads(y, (w,), 4 + rank)
    # every rank's output-gradient shard, gathered: the weight gradient in fp32, rounded once
    g_full = torch.cat([full((2, n, 48), 4 + r, torch.bfloat16) for r, n in enumerate(sizes)], 1)
    want = (g_full.float().flatten(0, 1).t() @ x.float().flatten(0, 1)).to(torch.bfloat16)
    torch.testing.assert_close(gw, want, rtol=2**-7, atol=0)  # at most one bf16 step apart
    return (gw == want).float().mean().item()


@pytest.mark.parametrize("world", [2, 4])
def test_linear_reduce_scatter_sums_bf16_weight_gradients_in_fp32(world):
    # summed in fp32 over the ring's steps and rounded once: equal to the once-rounded fp32
    # product but for rare ties (summed in bf16, 27% of the entries differ at 2 ranks, 40% at 4)
    assert min(run_distributed(_reduce_scatter_bf16_weight_grad, world)) >= 0.98


def _check_opcheck():
    name, size, rank = _group()
    sizes = _seq_sizes(7, size)
    x = full((2, 5, 6), 1).requires_grad_()
    w = full((3, 6), 2).requires_grad_()
    b = full((3,), 3).requires_grad_()
    torch.library.opcheck(ops.column_linear.default, (x, w, b, name, size))
    w2 = full((4, 6), 9).requires_grad_()
    torch.library.opcheck(ops.column_linears.default, (x, [w, w2], [b, full((4,), 3)], name, size))
    torch.library.opcheck(
        ops.column_linears_backward.default,
        ([full((2, 5, 3), 6), full((2, 5, 4), 7)], x.detach(), [w.detach(), w2.detach()], True)
        + (name, size),
    )
    x_shard = full((2, sizes[rank], 6), 4).requires_grad_()
    torch.library.opcheck(
        ops.all_gather_linear.default, (x_shard, w, b, -2, sizes, name, size, rank)
    )
    x_seq = full((2, 7, 6), 5).requires_grad_()
    torch.library.opcheck(
        ops.linear_reduce_scatter.default, (x_seq, w, -2, sizes, name, size, rank)
    )
    g = full((2, 5, 3), 6)
    torch.library.opcheck(
        ops.column_linear_backward.default, (g, x.detach(), w.detach(), name, size)
    )
    g_full = full((2, 7, 3), 7)
    torch.library.opcheck(
        ops.all_gather_linear_backward.default,
        (g_full, x_seq.detach(), w.detach(), -2, sizes, name, size, rank),
    )
    g_shard = full((2, sizes[rank], 3), 8)
    torch.library.opcheck(
        ops.linear_reduce_scatter_backward.default,
        (g_shard, x_seq.detach(), w.detach(), -2, sizes, name, size, rank),
    )


@pytest.mark.parametrize("world", [1, 2])
def test_opcheck(world):
    run_distributed(_check_opcheck, world)


def _errors():
    name, size, rank = _group()
    x = full((2, 4, 6), 1)
    out = []
    for call in (
        lambda: ops.column_linear(x, full((3, 5), 2), None, name, size),
        lambda: ops.all_gather_linear(x, full((3, 6), 2), None, -1, None, name, size, rank),
        lambda: ops.linear_reduce_scatter(x, full((3, 6), 2), -2, [4, 1], name, size, rank),
        lambda: ops.column_linears(x, [full((3, 6), 2)], [full((3,), 1)] * 2, name, size),
        lambda: ops.column_linears(x, [], [], name, size),
    ):
        try:
            call()
        except ValueError as e:
            out.append(str(e))
    return out


def test_errors_name_the_argument():
    errors = run_distributed(_errors, 2)[0]
    assert "x has shape [2, 4, 6] but weight [3, 5] takes 5 input features" in errors[0]
    assert "dim=2 is the feature dimension; pass the sequence dimension" in errors[1]
    assert "sizes [4, 1] add up to 5 but x.size(1)=4" in errors[2]
    assert "biases has 2 tensors for 1 weights; pass one bias per weight, or none" in errors[3]
    assert "weights is empty" in errors[4]


# ---- the layers take the fused ops: the same numbers as the unfused path ---------------------


def _mlp_both_paths(sp, seq):
    from tp_ext.layers import ParallelMLP

    name, size, rank = _group()
    torch.manual_seed(0)
    mlp = ParallelMLP(16, 40, sequence_parallel=sp, dtype=torch.float64)
    x_full = full((2, seq, 16), 1, torch.float64)
    sizes = tp_ext.shard_sizes(seq, size)
    start = sum(sizes[:rank])
    x_in = x_full[:, start : start + sizes[rank]] if sp else x_full
    results = []
    for enabled in (False, True):
        comm.set_overlap(enabled, 0)
        x = x_in.clone().requires_grad_()
        mlp.zero_grad()
        with comm.track() as stats:
            y = mlp(x, seq) if sp else mlp(x)
            y.backward(full(y.shape, 2 + rank, torch.float64))
        grads = [x.grad] + [p.grad.clone() for p in mlp.parameters()]
        fused_ops = {r.op for r in stats.records} & {
            "column_linear_backward",
            "all_gather_linear",
            "all_gather_linear_backward",
            "linear_reduce_scatter",
            "linear_reduce_scatter_backward",
        }
        bus = {c: stats.bytes(collective=c) for c in ("all_reduce", "all_gather", "reduce_scatter")}
        results.append((y.detach(), grads, sorted(fused_ops), bus))
    comm.set_overlap(None, 1 << 16)
    (y0, g0, ops0, bus0), (y1, g1, ops1, bus1) = results
    torch.testing.assert_close(y1, y0, **TOL)
    for a, e in zip(g1, g0):
        torch.testing.assert_close(a, e, **TOL)
    return ops0, ops1, bus0 == bus1


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("sp", [False, True])
def test_parallel_mlp_is_the_same_with_overlap(world, sp):
    """ParallelMLP with the fused ops (min_elements=0) gives the unfused path's output and
    gradients, moves the same bytes, and the records say the fused ops ran."""
    for ops0, ops1, same_bytes in run_distributed(_mlp_both_paths, world, sp, 7):
        # without overlap the column layer still takes column_linear (it saves no copy of its
        # input), with a blocking all-reduce
        assert ops0 == ([] if sp or world == 1 else ["column_linear_backward"])
        assert same_bytes
        if world == 1:
            assert ops1 == []
        elif sp:
            assert ops1 == [
                "all_gather_linear",
                "all_gather_linear_backward",
                "linear_reduce_scatter",
                "linear_reduce_scatter_backward",
            ]
        else:
            assert ops1 == ["column_linear_backward"]


def test_set_overlap_checks_its_arguments():
    with pytest.raises(TypeError, match="enabled must be True, False or None, got 1"):
        comm.set_overlap(1)
    with pytest.raises(ValueError, match="min_elements must be an int >= 0, got -1"):
        comm.set_overlap(True, -1)


def _uneven_features_decide_alike():
    """A row-parallel SP layer whose input features split 4 / 3: x.numel() is 32 on rank 0 and
    24 on rank 1; with the threshold between them, both ranks must still take the same path."""
    from tp_ext.layers import RowParallelLinear

    torch.manual_seed(0)
    layer = RowParallelLinear(7, 5, bias=False, sequence_parallel=True, dtype=torch.float64)
    x = full((1, 8, layer.in_features_local), 1, torch.float64)
    outs = []
    for enabled in (False, True):
        comm.set_overlap(enabled, 30)  # 30: between the ranks' 24 and 32 input elements
        with comm.track() as stats:
            y = layer(x)
        outs.append((y, sorted({r.op for r in stats.records})))
    comm.set_overlap(None, 1 << 16)
    torch.testing.assert_close(outs[1][0], outs[0][0], **TOL)
    return outs[1][1]


def test_ranks_with_uneven_shards_take_the_same_path():
    ops_seen = run_distributed(_uneven_features_decide_alike, 2)
    assert ops_seen[0] == ops_seen[1] == ["linear_reduce_scatter"]  # 8 tokens x 5 outputs = 40
