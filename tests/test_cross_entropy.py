"""tp_ext.layers.loss.vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits
(computed on every rank from the same deterministic data): loss and logits gradient, every
reduction, ignore_index (also a valid class id), label smoothing over the full vocabulary, uneven
and empty vocabulary shards, fp32 / fp64 / bf16; its communication (two token-sized all-reduces
forward, none backward), torch.compile, torch.export, TorchScript, and bad input."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tp_ext
from tp_ext import comm
from tp_ext.layers.loss import vocab_parallel_cross_entropy

from .common import full
from .dist_utils import rank, run_distributed, world_size

BATCH, SEQ = 2, 5
N = BATCH * SEQ
# Per world size: a main vocabulary (uneven over the ranks) and, from 3 ranks up, one smaller than
# the group, so the last ranks hold empty shards.
VOCABS = {1: [37], 2: [37], 3: [37, 2], 4: [37, 3], 8: [1001, 5]}
TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _targets(vocab, seed, ignore_index=-100):
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    t[0, 1] = t[1, 3] = t[1, 4] = ignore_index
    return t


def _rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def _assert_rel(actual, expected, tol, what):
    assert actual.shape == expected.shape, (
        f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    )
    if expected.numel() == 0:  # an empty vocabulary shard
        return
    err = _rel_err(actual, expected)
    assert err <= tol, f"{what}: max relative error {err:.3g} > {tol:.3g}"


def _reference(logits, target, ignore_index, eps, reduction, upstream):
    """F.cross_entropy on the full logits; returns (loss, gradient of the full logits)."""
    x = logits.detach().clone().requires_grad_()
    loss = F.cross_entropy(
        x.view(-1, x.size(-1)),
        target.view(-1),
        ignore_index=ignore_index,
        label_smoothing=eps,
        reduction=reduction,
    )
    if reduction == "none":
        loss = loss.view(target.shape)
    loss.backward(upstream)
    return loss.detach(), x.grad


def _parallel(logits, target, ignore_index, eps, reduction, upstream, group=None):
    """This rank's shard through vocab_parallel_cross_entropy; (loss, gradient of the shard)."""
    r, w = rank(), world_size()
    shard = tp_ext.split_tensor(logits, -1, w)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(
        shard, target, group, ignore_index=ignore_index, label_smoothing=eps, reduction=reduction
    )
    loss.backward(upstream.to(loss.dtype))
    return loss.detach(), shard.grad


def _compare(
    vocab,
    dtype,
    ignore_index,
    eps,
    reduction,
    seed,
    ref_dtype=None,
    tol=None,
    group=None,
    target=None,
):
    r, w = rank(), world_size()
    ref_dtype = ref_dtype or dtype
    tol = tol if tol is not None else TOL[dtype]
    logits = full((BATCH, SEQ, vocab), seed, ref_dtype)
    target = _targets(vocab, seed, ignore_index) if target is None else target
    up_shape = target.shape if reduction == "none" else ()
    upstream = full(up_shape, seed + 1, ref_dtype)
    ref_loss, ref_grad = _reference(logits, target, ignore_index, eps, reduction, upstream)
    loss, grad = _parallel(logits.to(dtype), target, ignore_index, eps, reduction, upstream, group)
    what = f"V={vocab} {dtype} ignore_index={ignore_index} eps={eps} reduction={reduction}"
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32), what
    assert grad.dtype == dtype, what
    _assert_rel(loss, ref_loss, tol, f"{what}: loss")
    _assert_rel(grad, tp_ext.split_tensor(ref_grad, -1, w)[r], tol, f"{what}: logits gradient")


def _check_matches_cross_entropy():
    w = world_size()
    vocab, *small = VOCABS[w]
    for dtype in (torch.float32, torch.float64):
        for eps in (0.0, 0.1):
            for reduction in ("none", "sum", "mean"):
                _compare(vocab, dtype, -100, eps, reduction, seed=vocab + 7)
        # ignore_index that is also a valid class id: those targets are still ignored
        _compare(vocab, dtype, 1, 0.1, "mean", seed=vocab + 8)
    # bf16 logits: fp32 statistics, close to the fp32 reference at bf16 tolerance
    for reduction in ("none", "mean"):
        _compare(
            vocab,
            torch.bfloat16,
            -100,
            0.1,
            reduction,
            seed=vocab + 9,
            ref_dtype=torch.float32,
            tol=2e-2,
        )
    for vocab in small:  # fewer entries than ranks: the last ranks hold empty shards
        for eps in (0.0, 0.1):
            _compare(vocab, torch.float64, -100, eps, "none", seed=vocab + 7)
        _compare(vocab, torch.float32, -100, 0.1, "mean", seed=vocab + 7)


def _check_edge_cases():
    r, w = rank(), world_size()
    vocab = VOCABS[w][0]
    group = dist.group.WORLD
    # the group given as a ProcessGroup and as its name gives the same as the default (None)
    for g in (group, group.group_name):
        _compare(vocab, torch.float64, -100, 0.1, "none", seed=3, group=g)
    # every target ignored: mean is nan (0 / 0) as in PyTorch, sum 0, gradient 0
    ignored = torch.full((BATCH, SEQ), -100)
    shard = tp_ext.split_tensor(full((BATCH, SEQ, vocab), 4), -1, w)[r].clone().requires_grad_()
    assert torch.isnan(vocab_parallel_cross_entropy(shard, ignored))
    assert torch.isnan(F.cross_entropy(full((N, vocab), 4), ignored.view(-1)))
    loss = vocab_parallel_cross_entropy(shard, ignored, reduction="sum")
    loss.backward()
    assert loss.item() == 0 and shard.grad.abs().max().item() == 0
    # [tokens, vocab] logits and a non-contiguous shard
    logits, target = full((N, vocab), 5, torch.float64), _targets(vocab, 5).view(-1)
    ref_loss, ref_grad = _reference(logits, target, -100, 0.0, "none", full((N,), 6, torch.float64))
    piece = tp_ext.split_tensor(logits, -1, w)[r]
    shard = piece.t().contiguous().t().requires_grad_()  # column-major
    assert not shard.is_contiguous() or piece.size(-1) <= 1
    loss = vocab_parallel_cross_entropy(shard, target, reduction="none")
    loss.backward(full((N,), 6, torch.float64))
    _assert_rel(loss, ref_loss, 1e-12, "[tokens, vocab] loss")
    _assert_rel(shard.grad, tp_ext.split_tensor(ref_grad, -1, w)[r], 1e-12, "[tokens, vocab] grad")
    # no tokens at all
    empty = vocab_parallel_cross_entropy(shard[:0], target[:0], reduction="none")
    assert empty.shape == (0,)


@pytest.mark.parametrize("ws", sorted(VOCABS))
def test_matches_cross_entropy(ws):
    run_distributed(_check_matches_cross_entropy, ws)
    run_distributed(_check_edge_cases, ws)


def _check_accounting():
    r, w = rank(), world_size()
    vocab = VOCABS[w][0]
    target = _targets(vocab, 1)
    for dtype, stats_bytes in ((torch.float32, 4), (torch.bfloat16, 4), (torch.float64, 8)):
        shard = tp_ext.split_tensor(full((BATCH, SEQ, vocab), 2, dtype), -1, w)[r]
        shard = shard.clone().requires_grad_()
        with comm.track() as stats:
            with comm.tag("fwd"):
                loss = vocab_parallel_cross_entropy(shard, target, label_smoothing=0.1)
            with comm.tag("bwd"):
                loss.backward()
        if w == 1:
            assert stats.records == [], "a single rank communicates nothing"
            continue
        # a max all-reduce of [N + W] (token maxima and shard sizes), a sum of [N, 3]
        assert stats.count() == 2 and stats.count("fwd", "all_reduce", "all_reduce") == 2, (
            stats.table()
        )
        assert stats.bytes() == stats_bytes * ((N + w) + 3 * N), (dtype, stats.table())
        assert stats.count("bwd") == 0, "the backward is local"


def _check_masked_vocabulary():
    """Logits of -inf (a masked vocabulary), some tokens with a whole rank's shard masked: each
    shard's sums are taken against its own max and rescaled after the max all-reduce, and a
    shard with no finite logit must add nothing (not exp(-inf - -inf) = nan)."""
    vocab = 37
    logits = full((BATCH, SEQ, vocab), 40) * 3
    first = tp_ext.shard_sizes(vocab, world_size())[0]
    if world_size() > 1:
        logits[0, 0, :first] = float("-inf")  # rank 0's whole shard, on one token
    logits[1, :, 5:30] = float("-inf")  # the middle of the vocabulary, on five tokens
    target = _targets(vocab, seed=41)
    target[0, 0] = first % vocab  # targets on finite logits (a masked one's loss is inf)
    target[1, :3] = torch.tensor([3, 31, 36])
    upstream = full((BATCH, SEQ), 42)
    want, want_grad = _reference(logits, target, -100, 0.0, "none", upstream)
    got, grad = _parallel(logits, target, -100, 0.0, "none", upstream)
    assert torch.isfinite(got).all()
    _assert_rel(got, want, TOL[torch.float32], "loss")
    shard_grad = tp_ext.split_tensor(want_grad, -1, world_size())[rank()]
    _assert_rel(grad, shard_grad, TOL[torch.float32], "gradient")


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_masked_vocabulary_shards(ws):
    run_distributed(_check_masked_vocabulary, ws)


@pytest.mark.parametrize("ws", [1, 3])
def test_accounting_two_token_sized_all_reduces(ws):
    run_distributed(_check_accounting, ws)


def _loss_fn(shard, target, group):
    return vocab_parallel_cross_entropy(
        shard, target, group, ignore_index=-100, label_smoothing=0.1, reduction="mean"
    )


def _check_compile(backend):
    r, w = rank(), world_size()
    torch._dynamo.reset()
    vocab = VOCABS[w][0]
    compiled = torch.compile(_loss_fn, fullgraph=True, backend=backend)
    group = dist.group.WORLD  # a ProcessGroup: dynamo cannot look a group name up
    for seed in (1, 2):  # a second call reuses the compiled graph
        logits, target = full((BATCH, SEQ, vocab), seed), _targets(vocab, seed)
        results = []
        for fn in (_loss_fn, compiled):
            shard = tp_ext.split_tensor(logits, -1, w)[r].clone().requires_grad_()
            loss = fn(shard, target, group)
            loss.backward()
            results.append((loss.detach(), shard.grad))
        (loss_e, grad_e), (loss_c, grad_c) = results
        _assert_rel(loss_c, loss_e, 1e-5, "compiled vs eager loss")
        _assert_rel(grad_c, grad_e, 1e-5, "compiled vs eager gradient")


# On three ranks with aot_eager: the Dynamo + AOTAutograd graphs (collectives as ordered effects,
# the local kernels, the backward). Inductor's C++ codegen on one rank (24 s on 2 cores) is in
# `make test-all`; `make test` runs tp_ext's ops under Inductor in test_layers and test_modes.
@pytest.mark.parametrize(
    "ws,backend", [pytest.param(1, "inductor", marks=pytest.mark.full_matrix), (3, "aot_eager")]
)
def test_compile_fullgraph_forward_and_backward(ws, backend):
    run_distributed(_check_compile, ws, backend, timeout=300)


class _Loss(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.group_name, self.group_size, self.group_rank = (
            group.group_name,
            group.size(),
            group.rank(),
        )

    def forward(self, shard, target):
        return torch.ops.tp_ext.vocab_parallel_cross_entropy(
            shard, target, -100, 0.1, self.group_name, self.group_size, self.group_rank
        )


@torch.jit.script
def _scripted_loss(
    shard: torch.Tensor, target: torch.Tensor, group_name: str, group_size: int, group_rank: int
) -> torch.Tensor:
    return torch.ops.tp_ext.vocab_parallel_cross_entropy(
        shard, target, -100, 0.1, group_name, group_size, group_rank
    ).sum()


def _check_export_torchscript_inference():
    r, w = rank(), world_size()
    vocab = VOCABS[w][0]
    group = dist.group.WORLD
    shard = tp_ext.split_tensor(full((BATCH, SEQ, vocab), 3, torch.float64), -1, w)[r].contiguous()
    target = _targets(vocab, 3)
    eager = _Loss(group)(shard, target)
    # torch.export keeps the op as one node
    ep = torch.export.export(_Loss(group), (shard, target))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "tp_ext.vocab_parallel_cross_entropy.default" in targets, targets
    _assert_rel(ep.module()(shard, target), eager, 1e-12, "exported vs eager")
    # TorchScript: the C++ autograd gives the gradient
    leaf = shard.clone().requires_grad_()
    _scripted_loss(leaf, target, group.group_name, w, r).backward()
    ref = shard.clone().requires_grad_()
    _Loss(group)(ref, target).sum().backward()
    _assert_rel(leaf.grad, ref.grad, 1e-12, "scripted gradient")
    # inference mode runs the kernel below autograd
    with torch.inference_mode():
        _assert_rel(_Loss(group)(shard, target), eager, 1e-12, "inference mode")


@pytest.mark.parametrize("ws", [1, 3])
def test_export_torchscript_and_inference_mode(ws):
    run_distributed(_check_export_torchscript_inference, ws)


def _check_bad_inputs():
    r, w = rank(), world_size()
    vocab = VOCABS[w][0]
    shard = tp_ext.split_tensor(full((BATCH, SEQ, vocab), 1), -1, w)[r].contiguous()
    target = _targets(vocab, 1)
    for bad_id in (vocab, -1):
        t = target.clone()
        t[1, 2] = bad_id
        with pytest.raises(
            ValueError,
            match=rf"target id {bad_id} .*outside the vocabulary "
            rf"\[0, {vocab}\).*ignore_index=-100",
        ):
            vocab_parallel_cross_entropy(shard, t)
    with pytest.raises(ValueError, match=r"target has shape \[2, 6\] .*logits.shape\[:-1\]"):
        vocab_parallel_cross_entropy(shard, torch.zeros(BATCH, SEQ + 1, dtype=torch.long))
    with pytest.raises(ValueError, match="target must hold int64 class ids, got Int"):
        vocab_parallel_cross_entropy(shard, target.int())
    with pytest.raises(ValueError, match="logits must be floating point"):
        vocab_parallel_cross_entropy(shard.long(), target)
    with pytest.raises(ValueError, match=r"label_smoothing=1.5 is outside \[0, 1\]"):
        vocab_parallel_cross_entropy(shard, target, label_smoothing=1.5)
    with pytest.raises(ValueError, match="reduction='avg' is not supported; use 'none', 'sum'"):
        vocab_parallel_cross_entropy(shard, target, reduction="avg")
    with pytest.raises(ValueError, match="group_rank=7 but this process is rank"):
        torch.ops.tp_ext.vocab_parallel_cross_entropy(
            shard, target, -100, 0.0, dist.group.WORLD.group_name, w, 7
        )
    # every rank raised at the same point, so the group is still in step
    ok = vocab_parallel_cross_entropy(shard, target, reduction="sum")
    assert torch.isfinite(ok)


@pytest.mark.parametrize("ws", [1, 3])
def test_bad_inputs_raise_clear_errors_on_every_rank(ws):
    run_distributed(_check_bad_inputs, ws)


# ---- the local (non-communicating) kernels against PyTorch, one process ----


def _local_reference(logits, target, sizes, rank_, ignore_index, eps, grad_loss):
    """local max, sums, target logit and gradient of the local pieces, in float64 PyTorch."""
    x = logits.double().reshape(target.numel(), logits.size(-1))
    t = target.reshape(-1)
    start, vocab = sum(sizes[:rank_]), sum(sizes)
    local_max = x.amax(-1) if x.size(-1) else torch.full((x.size(0),), float("-inf"), dtype=x.dtype)
    m = local_max + 0.5  # a "global" max above the local one, as after the all-reduce
    local = t - start
    mine = (t != ignore_index) & (local >= 0) & (local < x.size(-1))
    picked = (
        x.gather(-1, local.clamp(0, max(x.size(-1) - 1, 0)).unsqueeze(-1)).squeeze(-1)
        if x.size(-1)
        else torch.zeros_like(m)
    )
    sums = torch.stack([(x - local_max[:, None]).exp().sum(-1), x.sum(-1)], -1)
    if not x.size(-1):
        sums = torch.zeros(x.size(0), 2, dtype=x.dtype)
    lse = m + 1.0  # any per-token value works for the gradient formula
    grad = (x - lse[:, None]).exp() - eps / vocab
    grad[mine, local[mine]] -= 1 - eps
    grad = grad * grad_loss.double().reshape(-1, 1)
    grad[t == ignore_index] = 0
    return local_max, m, sums, torch.where(mine, picked, 0), lse, grad.reshape(logits.shape)


def _check_local_kernels(device, dtype, vocab_local, sizes, rank_, eps=0.1, ignore_index=-100):
    g = torch.Generator().manual_seed(vocab_local + rank_)
    logits = (torch.randn(3, 7, vocab_local, generator=g) * 4).to(dtype)
    start = sum(sizes[:rank_])
    target = torch.randint(0, sum(sizes), (3, 7), generator=g)
    target[0, :3] = torch.arange(start, start + 3).clamp(max=sum(sizes) - 1)  # some in this shard
    target[1, 2] = ignore_index
    grad_loss = torch.randn(3, 7, generator=g)
    ref_max, m, ref_sums, ref_target, lse, ref_grad = _local_reference(
        logits, target, sizes, rank_, ignore_index, eps, grad_loss
    )
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    ops = torch.ops.tp_ext
    dev = lambda t: t.to(device)  # noqa: E731
    local_max_sizes, sums = ops.vocab_ce_local_stats(dev(logits), len(sizes), rank_)
    n = ref_max.numel()
    torch.testing.assert_close(local_max_sizes[:n].cpu().double(), ref_max)
    want_sizes = [vocab_local if r == rank_ else 0 for r in range(len(sizes))]
    assert local_max_sizes[n:].tolist() == want_sizes
    # fp32 sums: error grows with the number and size of the terms, so scale atol by sum |l|
    scale = logits.double().abs().sum(-1).max().item() if vocab_local else 0.0
    tol = dict(atol=1e-6 * scale + 1e-5, rtol=1e-5) if dtype != torch.float64 else {}
    torch.testing.assert_close(sums.cpu().double(), ref_sums, **tol)
    # the all-reduced layout: global maxima, then every rank's size
    max_sizes = torch.cat([m, torch.tensor(sizes, dtype=torch.float64)]).to(acc)
    target_logit = ops.vocab_ce_target_logit(
        dev(logits), dev(target), dev(max_sizes), ignore_index, rank_
    )
    assert target_logit.dtype == acc
    torch.testing.assert_close(target_logit.cpu().double(), ref_target)
    grad = ops.vocab_ce_local_grad(
        dev(grad_loss.to(acc)),
        dev(logits),
        dev(target),
        dev(max_sizes),
        dev(lse.to(acc)),
        ignore_index,
        eps,
        rank_,
    )
    gtol = {
        torch.float64: {},
        torch.float32: dict(atol=1e-5, rtol=1e-4),
        torch.bfloat16: dict(atol=1e-2, rtol=2e-2),
        torch.float16: dict(atol=1e-3, rtol=2e-3),
    }
    assert grad.dtype == dtype and grad.shape == logits.shape
    torch.testing.assert_close(grad.cpu().double(), ref_grad, **gtol[dtype])


LOCAL_CASES = [
    (37, [37], 0),
    (5, [4, 5, 3], 1),
    (0, [6, 6, 0], 2),
    (1001, [1000, 1001], 1),
    (33000, [33000, 33000], 0),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_local_kernels_match_pytorch_cpu(dtype):
    for vocab_local, sizes, rank_ in LOCAL_CASES:
        _check_local_kernels("cpu", dtype, vocab_local, sizes, rank_)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_local_kernels_cuda_match_pytorch(dtype):
    for vocab_local, sizes, rank_ in LOCAL_CASES:
        _check_local_kernels("cuda", dtype, vocab_local, sizes, rank_)
        _check_local_kernels("cuda", dtype, vocab_local, sizes, rank_, eps=0.0, ignore_index=1)
