"""Every op under torch.library.opcheck, and the collectives and pairs in every PyTorch mode:
eager, torch.compile(fullgraph=True) forward and backward, torch.export, and TorchScript."""

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm, ops

from .common import assert_close, full
from .dist_utils import rank, run_distributed, world_size


def _op_samples():
    """(op name, args) covering every op, with uneven sizes where the op takes them."""
    r, w = rank(), world_size()
    g = dist.group.WORLD
    name, size = g.group_name, w
    n = 2 * w + 1  # never divisible by w > 1
    sizes = tp_ext.shard_sizes(n, w)
    full_x = full((n, 3), 1)
    piece = tp_ext.split_tensor(full_x, 0, w)[r].contiguous()
    grad = lambda t: t.clone().requires_grad_()  # noqa: E731
    # SUMMA on a 1 x w grid: the row group is the world, each rank's column group is itself;
    # K = n split over the row (uneven), N = n split over the row too
    singles = [dist.new_group([k]) for k in range(w)]
    summa_grid = (sizes, [n], name, size, r, singles[r].group_name, 1, 0)
    x_block, w_block = full((2, sizes[r]), 24), full((sizes[r], n), 25)
    # the fused linear ops: a sequence of n positions over [batch 2, seq, 3] (uneven shards)
    seq_full, seq_piece = full((2, n, 3), 27), full((2, sizes[r], 3), 28)
    lin_w, lin_b = full((4, 3), 29), full((4,), 30)
    ring = (-2, sizes, name, size, r)
    return [
        ("column_linear", (grad(full((2, 5, 3), 31)), grad(lin_w), grad(lin_b), name, size)),
        ("column_linear_backward", (full((2, 5, 4), 32), full((2, 5, 3), 31), lin_w, name, size)),
        (  # q and k reading one input, with and without biases
            "column_linears",
            (grad(full((2, 5, 3), 31)), [grad(lin_w), grad(seq_full[0, :2])], [], name, size),
        ),
        (
            "column_linears",
            (grad(full((2, 5, 3), 31)), [grad(lin_w)], [grad(lin_b)], name, size),
        ),
        (
            "column_linears_backward",
            ([full((2, 5, 4), 32)], full((2, 5, 3), 31), [lin_w], True, name, size),
        ),
        ("all_gather_linear", (grad(seq_piece), grad(lin_w), grad(lin_b), *ring)),
        ("all_gather_linear_backward", (full((2, n, 4), 33), seq_full, lin_w, *ring)),
        ("linear_reduce_scatter", (grad(seq_full), grad(lin_w), *ring)),
        ("linear_reduce_scatter_backward", (full((2, sizes[r], 4), 34), seq_full, lin_w, *ring)),
        ("summa_linear", (grad(x_block), grad(w_block), *summa_grid)),
        ("summa_linear_backward", (full((2, sizes[r]), 26), x_block, w_block, *summa_grid)),
        ("all_reduce", (full((3, 4), 2), "sum", name, size)),
        ("all_gather", (piece, 0, sizes, name, size)),
        ("all_gather", (full((2, 3), 3), 1, None, name, size)),
        ("reduce_scatter", (full_x, 0, sizes, "sum", name, size, r)),
        ("broadcast", (full((3,), 4), 0, name, size)),
        ("all_to_all", (full((n, 2 * w), 5), 1, 0, None, name, size, r)),
        # uneven all-to-all: rank i sends (i + 2 j) % 3 rows to rank j (empty pieces included)
        (
            "all_to_all_single",
            (
                grad(full((sum((r + 2 * j) % 3 for j in range(w)), 3), 35)),
                [(r + 2 * j) % 3 for j in range(w)],
                [(i + 2 * r) % 3 for i in range(w)],
                name,
                size,
            ),
        ),
        ("copy_to_tp", (grad(full((3, 4), 9)), name, size)),
        ("reduce_from_tp", (grad(full((3, 4), 10)), name, size)),
        ("scatter_to_tp", (grad(full_x), 0, sizes, name, size, r)),
        ("gather_from_tp", (grad(piece), 0, sizes, name, size, r)),
        ("gather_from_sp", (grad(piece), 0, sizes, name, size, r)),
        ("reduce_scatter_to_sp", (grad(full_x), 0, sizes, name, size, r)),
        # vocabulary of n split unevenly; target ids on every rank's shard, one ignored
        (
            "vocab_parallel_cross_entropy",
            (
                grad(tp_ext.split_tensor(full((2, 3, n), 11), -1, w)[r].contiguous()),
                torch.tensor([[0, n - 1, -100], [n // 2, 1, 2]]),
                -100,
                0.1,
                name,
                size,
                r,
            ),
        ),
    ]


def _local_op_samples():
    """The loss's local (non-communicating) pieces, checked in this process as rank 1 of 3 with
    a vocabulary of 16 split [6, 5, 5]. Inputs do not require grad: these pieces have no
    derivative of their own (vocab_parallel_cross_entropy's autograd covers them)."""
    logits = full((2, 3, 5), 12)
    target = torch.tensor([[6, 10, -100], [0, 15, 7]])
    maxima = logits.amax(-1).flatten() + 0.5  # any per-token values work for the op checks
    max_sizes = torch.cat([maxima, torch.tensor([6.0, 5.0, 5.0])])
    lse = maxima.view(2, 3) + 2.0
    return [
        ("vocab_ce_local_stats", (logits, 3, 1)),
        ("vocab_ce_target_logit", (logits, target, max_sizes, -100, 1)),
        ("vocab_ce_local_grad", (full((2, 3), 13), logits, target, max_sizes, lse, -100, 0.1, 1)),
    ]


def _fused_op_samples():
    """Fused compute ops (csrc/ops): local, checked in this process (tests/test_fused_kernels.py
    has their parity tests). The forward ops take inputs requiring grad (C++ autograd)."""
    grad = lambda t: t.clone().requires_grad_()  # noqa: E731
    x = full((2, 3, 8), 14)
    w = full((8,), 15)
    gu = full((2, 3, 10), 16)
    moe_ids = torch.tensor([[0, 3], [2, 0], [1, -1], [3, 2], [0, 1]])
    row_map, _ = ops.moe_route(moe_ids, 4)
    samp_logits = full((3, 5), 47, torch.bfloat16)
    samp_logits[1, 2] = float("-inf")
    samp_cands = torch.cat(
        [ops.sampling_candidates(x, 0.7, 4)[0] for x in (samp_logits, full((3, 3), 49))], dim=1
    )
    samp_max = samp_cands.amax(1)
    samp_total = (samp_cands - samp_max.unsqueeze(1)).exp().sum(1)
    return [
        # the local GEMM: with and without bias, a transposed weight (its backward's operands)
        ("linear", (grad(x), grad(full((5, 8), 50)), grad(full((5,), 51)))),
        ("linear", (grad(x), grad(full((8, 5), 52)).t(), None)),
        ("rms_norm", (grad(x), grad(w), 1e-6)),
        ("add_rms_norm", (grad(x), grad(full((2, 3, 8), 17)), grad(w), 1e-6)),
        ("rms_norm_backward", (full((2, 3, 8), 18), x, w, 1e-6)),
        ("swiglu", (grad(gu),)),
        # ring attention's merge: [batch, heads, seq, dim] partial results, one row with no keys
        (
            "attention_merge",
            (
                grad(full((2, 3, 4, 5), 39)),
                grad(torch.tensor([0.5, -1.0, float("-inf"), 2.0]).expand(2, 3, 4).contiguous()),
                grad(full((2, 3, 4, 5), 40)),
                grad(full((2, 3, 4), 41)),
            ),
        ),
        (
            "attention_merge_backward",
            (full((2, 3, 4, 5), 42), full((2, 3, 4), 43))
            + (full((2, 3, 4, 5), 39), full((2, 3, 4), 44), full((2, 3, 4, 5), 40))
            + (full((2, 3, 4), 41), full((2, 3, 4, 5), 45), full((2, 3, 4), 46)),
        ),
        ("swiglu_backward", (full((2, 3, 5), 19), gu)),
        # q [batch, heads, seq, head_dim] and k with fewer heads (GQA); cos/sin [batch, seq, dim]
        (
            "rotary_embedding",
            (
                grad(full((2, 4, 3, 6), 20)),
                grad(full((2, 2, 3, 6), 21)),
                full((2, 3, 6), 22),
                full((2, 3, 6), 23),
            ),
        ),
        # gradient compression: quantise (the residual updated in place), dequantise
        ("quantize_int8_ef", (full((40,), 24), torch.zeros(40), 16)),
        ("dequantize_int8", (torch.arange(-20, 20, dtype=torch.int8), full((3,), 25).abs(), 16)),
        ("quantize_1bit_ef", (full((40,), 26), torch.zeros(40), 16)),
        ("dequantize_1bit", (torch.arange(5, dtype=torch.uint8), full((3,), 27).abs(), 16, 40)),
        # the MoE token permutation: 5 tokens, top-2 of 4 experts, one choice dropped (-1)
        ("moe_route", (moe_ids, 4)),
        ("moe_permute", (grad(full((5, 6), 36)), row_map, grad(full((5, 2), 37)), 10)),
        ("moe_permute", (full((5, 6), 36), row_map, None, 12)),
        ("moe_unpermute", (grad(full((10, 6), 38)), row_map, grad(full((5, 2), 37)))),
        ("moe_weight_grad", (full((5, 6), 36), full((10, 6), 38), row_map)),
        # vocab-parallel sampling's local pieces (no derivatives: inputs without grad), on a
        # shard of 5 and on one of 3 (padded candidates), a -inf logit, all three gathered
        ("sampling_candidates", (samp_logits, 0.7, 4)),
        ("sampling_candidates", (full((3, 3), 48, torch.float64), 1.0, 4)),
        ("sampling_candidates", (torch.empty(3, 0, dtype=torch.bfloat16), 1.0, 2)),
        ("sampling_threshold", (samp_cands, 2, 0.9, samp_total, samp_max, 4)),
        ("sampling_threshold", (samp_cands, 0, 1.0, samp_total, samp_max, 4)),
        ("sampling_kept_mass", (samp_logits, 0.7, samp_cands[:, 3].contiguous(), samp_max)),
        (
            "sampling_pick",
            (samp_logits, 0.7, samp_cands[:, 3].contiguous(), samp_max, samp_total * 0.25),
        ),
        # the serving engine's attention over its paged pools: 2 rows of 3 queries over 5 columns
        (
            "paged_attention",
            (
                full((2, 4, 3, 8), 50),
                full((12, 2, 8), 51),
                full((12, 2, 8), 52),
                torch.tensor([[0, 3, 5, 7, 11], [2, 4, 6, 8, 10]]),
                torch.tensor([[True, False, True, True, True], [True] * 5]),
                2,
                0.35,
            ),
        ),
    ]


def _check_opcheck():
    seen = set()
    for op_name, args in _op_samples():
        op = getattr(torch.ops.tp_ext, op_name).default
        tests = (
            "test_schema",
            "test_autograd_registration",
            "test_faketensor",
            "test_aot_dispatch_dynamic",
        )
        for t in tests:
            result = torch.library.opcheck(op, args, test_utils=t)
            assert result[t] == "SUCCESS", (op_name, result)
        seen.add(op_name)
    return sorted(seen)


# 2 ranks (even splits, 6 s) in `make test-all`: 1 and 3 (uneven) reach every op and check
@pytest.mark.parametrize("ws", [1, pytest.param(2, marks=pytest.mark.full_matrix), 3])
def test_opcheck_every_op(ws):
    checked = run_distributed(_check_opcheck, ws, timeout=300)[0]
    checked = set(checked) | {op_name for op_name, _ in _local_op_samples() + _fused_op_samples()}
    registered = {
        n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("tp_ext::")
    }
    assert checked == registered, f"ops without an opcheck: {registered - checked}"


def test_opcheck_local_ops():
    for op_name, args in _local_op_samples() + _fused_op_samples():
        result = torch.library.opcheck(getattr(torch.ops.tp_ext, op_name).default, args)
        assert all(v == "SUCCESS" for v in result.values()), (op_name, result)


def _tp_block(x, w1_local, w2_local, group, seq_sizes, ffn_sizes):
    """A small Megatron MLP written with the pairs and collectives: sequence-parallel input,
    column-parallel up projection, row-parallel down projection (with and without SP)."""
    h = comm.gather_from_sp(x, 0, sizes=seq_sizes, group=group)
    a = torch.relu(comm.copy_to_tp(h, group) @ w1_local.t())  # (seq, ffn_local)
    partial = a @ w2_local.t()
    y_sp = comm.reduce_scatter_to_sp(
        partial, 0, sizes=seq_sizes, group=group
    )  # (seq_local, hidden)
    y = comm.reduce_from_tp(partial, group)  # (seq, hidden)
    z = comm.gather_from_tp(a, -1, sizes=ffn_sizes, group=group)  # (seq, ffn)
    peak = comm.all_reduce(z.detach().abs().amax(), "max", group)
    return y_sp.pow(2).sum() + y.pow(2).sum() + z.pow(2).sum() / peak


def _block_inputs():
    r, w = rank(), world_size()
    seq, hidden, ffn = 2 * w + 1, 4, 3 * w + 1
    X = full((seq, hidden), 1, torch.float64)
    W1, W2 = full((ffn, hidden), 2, torch.float64), full((hidden, ffn), 3, torch.float64)
    x = tp_ext.split_tensor(X, 0, w)[r].clone().requires_grad_()
    w1 = tp_ext.split_tensor(W1, 0, w)[r].clone().requires_grad_()
    w2 = tp_ext.split_tensor(W2, 1, w)[r].clone().requires_grad_()
    return x, w1, w2, dist.group.WORLD, tp_ext.shard_sizes(seq, w), tp_ext.shard_sizes(ffn, w)


def _run_block(fn):
    inputs = _block_inputs()
    out = fn(*inputs)
    out.backward()
    return (out.detach(),) + tuple(t.grad for t in inputs[:3])


def _check_compile():
    torch._dynamo.reset()
    eager = _run_block(_tp_block)
    compiled = _run_block(torch.compile(_tp_block, fullgraph=True, backend="inductor"))
    for what, a, b in zip(("output", "dx", "dw1", "dw2"), compiled, eager):
        assert_close(a, b, f"compiled vs eager {what}", rtol=1e-10, atol=1e-10)
    # the compiled graph holds the tp_ext ops (not a graph break around them)
    explanation = torch._dynamo.explain(_tp_block)(*_block_inputs())
    assert explanation.graph_break_count == 0
    ops = {
        str(n.target) for g in explanation.graphs for n in g.graph.nodes if n.op == "call_function"
    }
    assert any("tp_ext" in o for o in ops), ops


# Inductor code generation on 2 cores: 8, 13 and 30-35 s at 1, 2 and 3 ranks. `make test` compiles
# the collectives at 2 ranks; 1 and 3 (uneven sizes) in `make test-all`, where test_layers also
# compiles a block with Inductor (test_layers traces every block at 3 ranks with aot_eager in
# `make test`: the uneven sizes through Dynamo and AOTAutograd)
@pytest.mark.parametrize(
    "ws",
    [
        pytest.param(1, marks=pytest.mark.full_matrix),
        2,
        pytest.param(3, marks=pytest.mark.full_matrix),
    ],
)
def test_compile_fullgraph_forward_and_backward(ws):
    run_distributed(_check_compile, ws, timeout=300)


class _Exportable(torch.nn.Module):
    def __init__(self, group_name, group_size, group_rank, sizes):
        super().__init__()
        self.group_name, self.group_size, self.sizes = group_name, group_size, sizes
        self.group_rank = group_rank

    def forward(self, x):
        y = torch.ops.tp_ext.copy_to_tp(x, self.group_name, self.group_size) * 2
        y = torch.ops.tp_ext.gather_from_tp(
            y, 0, self.sizes, self.group_name, self.group_size, self.group_rank
        )
        return torch.ops.tp_ext.all_reduce(y, "sum", self.group_name, self.group_size)


def _check_export():
    r, w = rank(), world_size()
    sizes = tp_ext.shard_sizes(2 * w + 1, w)
    x = full((sizes[r], 3), 10 + r)
    m = _Exportable(dist.group.WORLD.group_name, w, r, sizes)
    ep = torch.export.export(m, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {
        "tp_ext.copy_to_tp.default",
        "tp_ext.gather_from_tp.default",
        "tp_ext.all_reduce.default",
    } <= targets, targets
    assert_close(ep.module()(x), m(x), "exported vs eager")


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_export(ws):
    run_distributed(_check_export, ws, timeout=300)


@torch.jit.script
def _scripted(
    x: torch.Tensor, group_name: str, group_size: int, group_rank: int, sizes: list[int]
) -> torch.Tensor:
    y = torch.ops.tp_ext.gather_from_tp(x * 3.0, 0, sizes, group_name, group_size, group_rank)
    y = torch.ops.tp_ext.copy_to_tp(y, group_name, group_size)  # replicated: enter a TP region
    return torch.ops.tp_ext.reduce_from_tp(y, group_name, group_size) / group_size


@torch.jit.script
def _scripted_plain(x: torch.Tensor, group_name: str, group_size: int) -> torch.Tensor:
    return torch.ops.tp_ext.all_reduce(x, "avg", group_name, group_size)


def _check_torchscript():
    r, w = rank(), world_size()
    sizes = tp_ext.shard_sizes(2 * w + 1, w)
    X = full((2 * w + 1, 3), 1, torch.float64)
    x = tp_ext.split_tensor(X, 0, w)[r].clone().requires_grad_()
    out = _scripted(x, dist.group.WORLD.group_name, w, r, sizes)
    assert_close(out, 3 * X, "scripted forward", rtol=1e-12, atol=1e-12)
    out.sum().backward()  # C++ autograd: works from TorchScript too
    # reduce_from_tp's backward passes 1/w on; gather_from_tp's keeps this rank's slice (times 3);
    # copy_to_tp's all-reduce sums the w ranks: w * 3 / w = 3
    assert_close(x.grad, torch.full_like(x, 3.0), "scripted backward", rtol=1e-12, atol=1e-12)
    y = full((3,), 40 + r, torch.float64)
    expected = sum(full((3,), 40 + k, torch.float64) for k in range(w)) / w
    assert_close(
        _scripted_plain(y, dist.group.WORLD.group_name, w), expected, "scripted all_reduce"
    )


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_torchscript(ws):
    run_distributed(_check_torchscript, ws)
