"""tp_ext.summa_linear, the SUMMA 2D matmul: every grid rank's output block and its gradient
blocks against torch.nn.functional.linear on the full tensors (grids 1x1 to 4x1 and 2x3 / 3x2,
uneven and empty splits of tokens, in_features and out_features), fp64 / bf16, opcheck, the
accounting byte for byte, and the argument errors."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_ext
from tp_ext import comm, ops

from .common import full
from .dist_utils import rank, run_distributed, world_size

# ---- grid helpers (run in the workers) -----------------------------------------------------------


def _grid(P, Q):
    """This rank's (i, j) and its row / column groups on a P x Q grid over ranks [0, P*Q) (every
    rank of the world creates every group, in the same order; a world of P*Q ranks). A 1x1 grid
    gives every rank its own one-rank groups."""
    r = rank()
    if P * Q == 1:
        singles = [dist.new_group([k]) for k in range(world_size())]
        return 0, 0, singles[r], singles[r]
    assert world_size() == P * Q
    rows = [dist.new_group([i * Q + j for j in range(Q)]) for i in range(P)]
    cols = [dist.new_group([i * Q + j for i in range(P)]) for j in range(Q)]
    i, j = divmod(r, Q)
    return i, j, rows[i], cols[j]


def _block(sizes, k):
    start = sum(sizes[:k])
    return slice(start, start + sizes[k])


def _case(P, Q, T, K, N, x_in, w_in, seed):
    """The two K splits, the token and output splits, and the full X, W and upstream gradient."""
    x_in = x_in if x_in is not None else tp_ext.shard_sizes(K, Q)
    w_in = w_in if w_in is not None else tp_ext.shard_sizes(K, P)[::-1]  # other boundaries
    t_sizes, n_sizes = tp_ext.shard_sizes(T, P), tp_ext.shard_sizes(N, Q)
    X, W, G = full((T, K), seed), full((N, K), seed + 1), full((T, N), seed + 2)
    return x_in, w_in, t_sizes, n_sizes, X, W, G


def _run_case(grid, P, Q, T, K, N, x_in=None, w_in=None, dtype=torch.float32, lead=False, seed=0):
    i, j, row, col = grid
    x_in, w_in, t_sizes, n_sizes, X, W, G = _case(P, Q, T, K, N, x_in, w_in, seed)
    rows, ncols = _block(t_sizes, i), _block(n_sizes, j)
    x = X[rows, _block(x_in, j)].to(dtype)
    w = W[ncols, _block(w_in, i)].to(dtype).clone().requires_grad_()
    g = G[rows, ncols].to(dtype)
    if lead:  # leading dims are flattened and restored
        x, g = x.unsqueeze(0), g.unsqueeze(0)
    x = x.clone().requires_grad_()
    y = ops.summa_linear(x, w, x_in, w_in, row.group_name, Q, j, col.group_name, P, i)
    y.backward(g)

    ref_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    Xr = X.to(ref_dtype).requires_grad_()
    Wr = W.to(ref_dtype).requires_grad_()
    F.linear(Xr, Wr).backward(G.to(ref_dtype))
    Yr = F.linear(Xr, Wr).detach()
    squeeze = (lambda t: t.squeeze(0)) if lead else (lambda t: t)
    return {
        "y": (squeeze(y.detach()), Yr[rows, ncols]),
        "grad_x": (squeeze(x.grad), Xr.grad[rows, _block(x_in, j)]),
        "grad_w": (w.grad, Wr.grad[ncols, _block(w_in, i)]),
    }


def _assert_blocks(blocks, what, rtol, atol):
    for name, (got, want) in blocks.items():
        assert got.shape == want.shape, f"{what} {name}: {tuple(got.shape)} != {tuple(want.shape)}"
        torch.testing.assert_close(
            got.to(want.dtype), want, rtol=rtol, atol=atol, msg=lambda m: f"{what} {name}: {m}"
        )


# (P, Q, T, K, N, x_in, w_in, lead); None: shard_sizes (w_in reversed, so the panels interleave).
# A 1x1 grid runs on every rank of the world alone (one-rank groups).
CASES = {
    4: [
        (1, 1, 7, 13, 11, None, None, False),
        (1, 1, 5, 0, 3, None, None, True),  # K=0: zeros, no panels
        (2, 2, 7, 13, 11, None, None, False),
        (2, 2, 7, 13, 11, [13, 0], [4, 9], True),  # an empty x part; one panel boundary inside
        (1, 4, 7, 13, 11, None, None, False),
        (1, 4, 7, 13, 3, None, None, False),  # N=3 over 4 columns: one rank has no outputs
        (4, 1, 7, 13, 11, None, None, True),
        (4, 1, 3, 3, 11, None, None, False),  # K=3: w_in [0, 1, 1, 1]; T=3: a row without tokens
    ],
    6: [(2, 3, 7, 13, 11, None, None, False), (3, 2, 7, 13, 11, None, None, True)],
}
DTYPE_GRID = {4: (2, 2), 6: (2, 3)}  # where fp64 and bf16 run


def _check_cases(ws):
    grids = {}
    for P, Q, T, K, N, x_in, w_in, lead in CASES[ws]:
        grid = grids.get((P, Q)) or grids.setdefault((P, Q), _grid(P, Q))
        what = f"grid {P}x{Q} T={T} K={K} N={N} x_in={x_in} w_in={w_in} lead={lead}"
        _assert_blocks(
            _run_case(grid, P, Q, T, K, N, x_in, w_in, lead=lead), what, rtol=1e-5, atol=1e-5
        )
    P, Q = DTYPE_GRID[ws]
    grid = grids[(P, Q)]
    # Without the consistency check's blocking round per call, only the panels' own order keeps
    # the ranks in step.
    comm.set_consistency_checks(False)
    blocks = _run_case(grid, P, Q, 7, 13, 11, [2, 11] + [0] * (Q - 2), None, lead=True)
    _assert_blocks(blocks, f"grid {P}x{Q} no consistency check", rtol=1e-5, atol=1e-5)
    comm.set_consistency_checks(True)
    blocks = _run_case(grid, P, Q, 7, 13, 11, dtype=torch.float64)
    _assert_blocks(blocks, f"grid {P}x{Q} fp64", rtol=1e-12, atol=1e-12)
    blocks = _run_case(grid, P, Q, 7, 13, 11, dtype=torch.bfloat16)
    for name, (got, _) in blocks.items():
        assert got.dtype == torch.bfloat16, name
    _assert_blocks(blocks, f"grid {P}x{Q} bf16", rtol=3e-2, atol=6e-2)


@pytest.mark.parametrize("ws", [4, 6])
def test_summa_matches_unsharded_linear(ws):
    # 300 s: starting six workers on a loaded machine can take most of the default 120 s; a real
    # hang still fails through the process group's 60 s collective timeout.
    run_distributed(_check_cases, ws, ws, timeout=300)


# ---- accounting and opcheck ----------------------------------------------------------------------


def _panel_widths(x_in, w_in):
    cuts = sorted(
        {0}
        | {sum(x_in[: k + 1]) for k in range(len(x_in))}
        | {sum(w_in[: k + 1]) for k in range(len(w_in))}
    )
    return [b - a for a, b in zip(cuts, cuts[1:]) if b > a]


def _check_accounting():
    P = Q = 2
    T, K, N = 7, 13, 11
    i, j, row, col = _grid(P, Q)
    x_in, w_in = tp_ext.shard_sizes(K, Q), [4, 9]
    t_i, n_j = tp_ext.shard_sizes(T, P)[i], tp_ext.shard_sizes(N, Q)[j]
    x = full((t_i, x_in[j]), 1).requires_grad_()
    w = full((n_j, w_in[i]), 2).requires_grad_()
    with comm.track() as stats:
        with comm.tag("fwd"):
            y = comm.summa_linear(x, w, x_in, w_in, row, col)  # the Python wrapper
        with comm.tag("bwd"):
            y.backward(torch.ones_like(y))
    widths = _panel_widths(x_in, w_in)
    assert widths == [4, 3, 6]
    # fp32 panels: x's [T_i, width] over the row group, w's [N_j, width] over the column group
    per_panel = sum((t_i + n_j) * width * 4 for width in widths)
    assert stats.bytes("fwd", "summa_linear", "broadcast") == per_panel
    assert stats.count("fwd", "summa_linear", "broadcast") == 2 * len(widths)
    assert stats.bytes("fwd", collective="reduce") == 0
    # backward: the same broadcasts, and the partials [T_i, width] / [N_j, width] reduced
    assert stats.bytes("bwd", "summa_linear_backward", "broadcast") == per_panel
    assert stats.bytes("bwd", "summa_linear_backward", "reduce") == per_panel
    assert stats.count("bwd", "summa_linear_backward", "reduce") == 2 * len(widths)


def test_accounting_counts_the_panel_bytes():
    run_distributed(_check_accounting, 4)


def _check_opcheck(P, Q):
    i, j, row, col = _grid(P, Q)
    x_in, w_in = tp_ext.shard_sizes(5, Q), tp_ext.shard_sizes(5, P)[::-1]
    t_i, n_j = tp_ext.shard_sizes(4, P)[i], tp_ext.shard_sizes(3, Q)[j]
    x = full((2, t_i, x_in[j]), 1).requires_grad_()
    w = full((n_j, w_in[i]), 2).requires_grad_()
    args = (x_in, w_in, row.group_name, Q, j, col.group_name, P, i)
    torch.library.opcheck(ops.summa_linear.default, (x, w, *args))
    g = full((2, t_i, n_j), 3)
    torch.library.opcheck(ops.summa_linear_backward.default, (g, x.detach(), w.detach(), *args))


@pytest.mark.parametrize("P,Q", [(1, 1), (2, 2)])
def test_opcheck(P, Q):
    run_distributed(_check_opcheck, 4, P, Q)


# ---- argument errors (raised before any group is looked up: no process group needed) -------------


def _call(x_shape=(3, 7), w_shape=(5, 6), x_in=(4, 7), w_in=(6, 5), grid=(2, 1, 2, 0)):
    x, w = torch.zeros(x_shape), torch.zeros(w_shape)
    Q, j, P, i = grid
    return ops.summa_linear(x, w, list(x_in), list(w_in), "no-such-row", Q, j, "no-such-col", P, i)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (
            {"x_shape": (3, 5)},
            r"^tp_ext\.summa_linear: x\.size\(-1\)=5 but x_in_sizes\[grid_col=1\]=7; x must hold",
        ),
        (
            {"grid": (2, 0, 2, 0)},
            r"^tp_ext\.summa_linear: x\.size\(-1\)=7 but x_in_sizes\[grid_col=0\]=4",
        ),
        (
            {"w_shape": (5, 5)},
            r"^tp_ext\.summa_linear: weight\.size\(1\)=5 but w_in_sizes\[grid_row=0\]=6",
        ),
        (
            {"w_in": (6, 6)},
            r"^tp_ext\.summa_linear: x_in_sizes=\[4, 7\] add up to 11 but w_in_sizes=\[6, 6\] "
            r"add up to 12",
        ),
        (
            {"x_in": (4, 7, 0)},
            r"^tp_ext\.summa_linear: x_in_sizes=\[4, 7, 0\] has 3 entries but grid_cols=2",
        ),
        (
            {"w_in": (11,)},
            r"^tp_ext\.summa_linear: w_in_sizes=\[11\] has 1 entries but grid_rows=2",
        ),
        ({"grid": (2, 2, 2, 0)}, r"^tp_ext\.summa_linear: grid_col=2 is not in \[0, grid_cols=2\)"),
    ],
)
def test_bad_arguments_raise_clear_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _call(**kwargs)


def test_unknown_group_is_named():
    with pytest.raises(ValueError, match="tp_ext.summa_linear: unknown process group name"):
        _call()
