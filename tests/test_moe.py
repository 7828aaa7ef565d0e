"""Expert parallelism: the token permutation ops (opcheck, against eager PyTorch, errors), the
uneven all-to-all (against the routing it implements, its backward, its bytes), and
ExpertParallelMoE in transformers' Qwen2-MoE (shared expert) and Mixtral at (tp, dp, ep) dims:
logits, loss and the model's own aux loss on each rank's batch against transformers, every
gradient against the unsharded model, the bytes of the dispatch and combine against the routing,
each rank's expert parameters its share, and the capacity factor's drops."""

import copy
import os

import pytest
import torch
import torch.distributed as dist
import transformers

import tp_ext
from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.layers import ResolvedGroup, full_state_dict, local_shards
from tp_ext.layers.moe import MOE_TAG, ExpertParallelMoE, ParallelExperts
from tp_ext.sharding import shard_sizes
from tp_ext.training import Trainer

from .common import WORLD_SIZES
from .dist_utils import run_distributed

DTYPES = [torch.float32, torch.float64, torch.bfloat16]


# ---- reference permutation (eager PyTorch, the torchtitan way: a stable argsort) ----------------


def _ref_route(ids, num_experts):
    flat = ids.flatten()
    key = torch.where(flat < 0, torch.full_like(flat, num_experts), flat)
    order = torch.argsort(key, stable=True)
    row_map = torch.empty_like(flat)
    row_map[order] = torch.arange(flat.numel())
    row_map = torch.where(flat < 0, -1, row_map)
    counts = torch.bincount(flat[flat >= 0], minlength=num_experts)
    return row_map.view(ids.shape), counts


def _ref_permute(x, row_map, weights, num_rows):
    out = x.new_zeros(num_rows, x.shape[1])
    tokens, k = row_map.shape
    for t in range(tokens):
        for j in range(k):
            r = int(row_map[t, j])
            if r >= 0:
                out[r] = x[t] if weights is None else (x[t].double() * weights[t, j]).to(x.dtype)
    return out


def _ref_unpermute(y, row_map, weights):
    valid = (row_map >= 0).unsqueeze(-1)
    rows = y.double()[row_map.clamp(min=0)] * valid
    w = torch.ones(row_map.shape, dtype=torch.float64) if weights is None else weights.double()
    return (rows * w.unsqueeze(-1)).sum(1).to(y.dtype)


def _routing(tokens, k, experts, seed, drop=0.0):
    g = torch.Generator().manual_seed(seed)
    picks = [torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]
    ids = torch.stack(picks) if picks else torch.zeros(0, k, dtype=torch.int64)
    if drop:
        ids[torch.rand(ids.shape, generator=g) < drop] = -1
    return ids


def test_route_is_the_stable_sort_of_the_routing():
    for tokens, k, experts, drop in [
        (13, 2, 8, 0.0),
        (40, 3, 5, 0.3),
        (0, 2, 4, 0.0),
        (7, 1, 1, 0.0),
    ]:
        ids = _routing(tokens, k, experts, seed=tokens + k, drop=drop)
        row_map, counts = ops.moe_route(ids, experts)
        want_map, want_counts = _ref_route(ids, experts)
        assert torch.equal(row_map, want_map)
        assert torch.equal(counts, want_counts)
    # int32 ids (what some routers give) work the same
    ids = _routing(9, 2, 6, seed=1)
    assert torch.equal(ops.moe_route(ids.int(), 6)[0], ops.moe_route(ids, 6)[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weighted", [False, True])
def test_permute_and_unpermute_equal_eager_pytorch(dtype, weighted):
    tokens, k, experts, hidden = 21, 2, 6, 37  # hidden not a multiple of any vector width
    ids = _routing(tokens, k, experts, seed=3, drop=0.2)
    row_map, _ = ops.moe_route(ids, experts)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    y = torch.randn(tokens * k, hidden, generator=g).to(dtype)
    w = torch.rand(tokens, k, generator=g) if weighted else None
    tol = {"rtol": 1e-2, "atol": 1e-2} if dtype == torch.bfloat16 else {"rtol": 1e-6, "atol": 1e-6}
    torch.testing.assert_close(
        ops.moe_permute(x, row_map, w, tokens * k), _ref_permute(x, row_map, w, tokens * k), **tol
    )
    torch.testing.assert_close(
        ops.moe_unpermute(y, row_map, w), _ref_unpermute(y, row_map, w), **tol
    )


def test_permute_and_unpermute_gradients():
    tokens, k, experts, hidden = 9, 2, 4, 5
    row_map, _ = ops.moe_route(_routing(tokens, k, experts, seed=5, drop=0.2), experts)
    x = torch.randn(tokens, hidden, dtype=torch.float64, requires_grad=True)
    y = torch.randn(tokens * k, hidden, dtype=torch.float64, requires_grad=True)
    w = torch.rand(tokens, k, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: ops.moe_permute(x, row_map, w, tokens * k), (x, w))
    assert torch.autograd.gradcheck(lambda y, w: ops.moe_unpermute(y, row_map, w), (y, w))
    assert torch.autograd.gradcheck(lambda x: ops.moe_permute(x, row_map, None, tokens * k), (x,))
    assert torch.autograd.gradcheck(lambda y: ops.moe_unpermute(y, row_map, None), (y,))
    # weight gradient: dot products of the two sides
    g = ops.moe_weight_grad(x.detach(), y.detach(), row_map)
    rows = y.detach()[row_map.clamp(min=0)] * (row_map >= 0).unsqueeze(-1)
    torch.testing.assert_close(g, (rows * x.detach().unsqueeze(1)).sum(-1))


def test_opcheck():
    row_map, _ = ops.moe_route(_routing(6, 2, 4, seed=6, drop=0.2), 4)
    x, y, w = torch.randn(6, 8), torch.randn(12, 8), torch.rand(6, 2)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor")
    torch.library.opcheck(ops.moe_route, (_routing(6, 2, 4, seed=6), 4), test_utils=tests)
    torch.library.opcheck(ops.moe_permute, (x, row_map, w, 12), test_utils=tests)
    torch.library.opcheck(ops.moe_permute, (x, row_map, None, 14), test_utils=tests)
    torch.library.opcheck(ops.moe_unpermute, (y, row_map, w), test_utils=tests)
    torch.library.opcheck(ops.moe_weight_grad, (x, y, row_map), test_utils=tests)


def test_bad_arguments_are_named():
    ids = torch.tensor([[0, 1], [2, 5]])
    with pytest.raises(ValueError, match=r"expert_ids\[1, 1\] = 5 is not an expert; use 0 .. 3"):
        ops.moe_route(ids, 4)
    with pytest.raises(ValueError, match="integer tensor"):
        ops.moe_route(ids.float(), 4)
    row_map, _ = ops.moe_route(torch.tensor([[0, 1], [2, 3]]), 4)
    with pytest.raises(ValueError, match="two entries to row 0"):
        ops.moe_permute(torch.randn(2, 3), torch.tensor([[0, 1], [0, 2]]), None, 4)
    with pytest.raises(ValueError, match=r"rows in \[0, 3\)"):
        ops.moe_permute(torch.randn(2, 3), row_map, None, 3)
    with pytest.raises(ValueError, match="row_map has 2 tokens"):
        ops.moe_permute(torch.randn(3, 3), row_map, None, 4)
    with pytest.raises(ValueError, match="weights has shape"):
        ops.moe_unpermute(torch.randn(4, 3), row_map, torch.rand(2, 3))


# ---- the uneven all-to-all -----------------------------------------------------------------------


def _split_matrix(ws, seed, most):
    """sends[i][j]: rows rank i sends to rank j (zeros included)."""
    g = torch.Generator().manual_seed(seed)
    sends = torch.randint(0, most, (ws, ws), generator=g)
    sends[0, -1] = 0  # an empty piece
    return sends.tolist()


def _rows(src, dst, n, hidden):
    """The rows rank src sends to rank dst: their values name both."""
    base = torch.arange(n, dtype=torch.float64).unsqueeze(1) + 1000 * src + 100 * dst
    return base + torch.arange(hidden, dtype=torch.float64) / 10


def _all_to_all_single(ws, transport):
    """On a fresh group: through the shared-memory channel (in rounds of a small slot, so rows
    of one sender straddle rounds) or through gloo."""
    import os

    rank, hidden = dist.get_rank(), 3
    comm.set_shared_memory(transport != "gloo")
    os.environ["TP_EXT_SHM_SLOT_BYTES"] = "4096"  # 170 rows of 24 bytes a round
    try:
        group = dist.new_group(list(range(ws)))
        sends = _split_matrix(ws, seed=ws, most=400)
        send = sends[rank]
        recv = [sends[src][rank] for src in range(ws)]
        x = torch.cat([_rows(rank, dst, send[dst], hidden) for dst in range(ws)]).requires_grad_()
        with comm.track() as stats:
            out = comm.all_to_all_single(x, send, recv, group)
            (0.5 * (out * out).sum() + out.sum()).backward()  # gradient out + 1 names the rows
        assert comm.shared_memory_active(group) == (transport == "shm" and ws > 1)
        want = torch.cat([_rows(src, rank, recv[src], hidden) for src in range(ws)])
        torch.testing.assert_close(out.detach(), want, rtol=0, atol=0)
        torch.testing.assert_close(x.grad, x.detach() + 1, rtol=0, atol=1e-9)  # rows differ by 0.1
        row = hidden * 8
        sent_away = (sum(send) - send[rank]) * row
        received_back = (sum(recv) - recv[rank]) * row  # the backward sends what arrived back
        assert stats.bytes(collective="all_to_all_v") == sent_away + received_back
        if ws == 1:
            return None
        # a rank that expects the wrong count: every rank raises, naming the pair
        comm.set_consistency_checks(transport == "gloo")  # the channel always checks
        wrong = list(recv)
        wrong[(rank + 1) % ws] += 1 if rank == 0 else 0
        errors = []
        try:
            comm.all_to_all_single(x.detach(), send, wrong, group)
        except ValueError as e:
            errors.append(str(e))
        # bad arguments on rank 0 only: every rank raises, none waits for the others
        bad = send + [1] if rank == 0 else send
        try:
            comm.all_to_all_single(x.detach(), bad, recv, group)
        except ValueError as e:
            errors.append(str(e))
        return errors
    finally:
        del os.environ["TP_EXT_SHM_SLOT_BYTES"]
        comm.set_shared_memory(None)


@pytest.mark.parametrize("transport", ["shm", "gloo"])
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_all_to_all_single_moves_the_rows_and_their_gradients(ws, transport):
    errors = run_distributed(_all_to_all_single, ws, ws, transport)
    if ws > 1:
        for rank, (mismatch, bad_count) in enumerate(errors):
            assert "expects" in mismatch and "recv_sizes[r] must equal" in mismatch
            want = "has %d entries" % (ws + 1) if rank == 0 else "rank 0 of process group"
            assert want in bad_count, bad_count


# ---- ExpertParallelMoE in transformers' MoE models -----------------------------------------------

HIDDEN, EXPERTS, TOP_K, VOCAB = 32, 8, 2, 96


def _config(kind):
    common = dict(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts_per_tok=TOP_K,
        output_router_logits=True,
        router_aux_loss_coef=0.02,
        max_position_embeddings=64,
    )
    if kind == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(
            num_experts=EXPERTS,
            moe_intermediate_size=24,
            shared_expert_intermediate_size=40,
            norm_topk_prob=False,
            **common,
        )
    elif kind == "qwen3_moe":  # per-head q/k norms, top-k renormalised
        cfg = transformers.Qwen3MoeConfig(
            num_experts=EXPERTS, moe_intermediate_size=24, norm_topk_prob=True, **common
        )
    else:
        cfg = transformers.MixtralConfig(num_local_experts=EXPERTS, **common)
    cfg._attn_implementation = "eager"
    return cfg


_CLASSES = {"qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}


def _model(kind):
    torch.manual_seed(0)
    cls = getattr(transformers, _CLASSES.get(kind, "MixtralForCausalLM"))
    return cls(_config(kind)).eval()


def _batch(seed, tokens=(2, 9)):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, tokens, generator=g)


def _choices_per_expert(model, ids, share=None):
    """[layers, experts]: how many (token, choice) pairs of this batch pick each expert, from
    the unsharded model's own routing. ``share=(tp_rank, tp)``: of that TP rank's share of the
    tokens only (an EP group across TP ranks)."""
    with torch.no_grad():
        out = model(ids, output_router_logits=True)
    counts = []
    for logits in out.router_logits:
        chosen = torch.topk(torch.softmax(logits.float(), -1), TOP_K, -1).indices
        if share is not None:
            sizes = shard_sizes(chosen.shape[0], share[1])
            chosen = chosen[sum(sizes[: share[0]]) :][: sizes[share[0]]]
        counts.append(torch.bincount(chosen.flatten(), minlength=EXPERTS))
    return torch.stack(counts)


def _rows_moved(model, state, tp, dp):
    """Per layer: rows this rank sends in the dispatch (its choices of other ranks' experts)
    plus rows it sends back in the combine (other ranks' choices of its experts)."""
    sizes = shard_sizes(EXPERTS, state.ep)
    first = sum(sizes[: state.ep_rank])
    mine = torch.zeros(EXPERTS, dtype=torch.bool)
    mine[first : first + sizes[state.ep_rank]] = True
    me = dist.get_rank()
    moved = 0
    across_tp = state.ep > dp
    for member in dist.get_process_group_ranks(state.ep_group):
        share = (member % tp, tp) if across_tp else None  # tp is the innermost mesh dim
        counts = _choices_per_expert(model, _batch(seed=100 + (member // tp) % dp), share)
        moved = moved + (counts[:, ~mine].sum(1) if member == me else counts[:, mine].sum(1))
    return moved.tolist()


def _check_gradients(model, ref, state, close=None):
    """Dense parameters: this rank's batch, as the unsharded model's (TP slices). Experts: the
    sum over the EP group's batches (their tokens came here), so the reference gradients are
    summed over the EP group first. With the EP group across TP ranks each TP rank sent only its
    share of the tokens: the experts' gradients summed over the expert-DP group (every share)
    then equal the reference's summed over DP (every batch). ``close(got, want, what)``
    compares (default: 1e-5 relative)."""
    across_tp = state.ep > state.dp
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}
    for name, t in ref_grads.items():
        if ".experts." in name and state.ep > 1:
            dist.all_reduce(t, group=state.dp_group if across_tp else state.ep_group)
    want = local_shards(model, ref_grads)
    for name, p in model.named_parameters():
        if p.numel() == 0:  # the expert weights of a rank holding none
            assert p.grad is None or p.grad.numel() == 0
            continue
        got = p.grad
        if across_tp and ".experts." in name:
            got = got.clone()
            dist.all_reduce(got, group=state.expert_dp_group)
        if close is not None:
            close(got, want[name], f"gradient of {name}")
            continue
        torch.testing.assert_close(
            got, want[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"gradient of {name}: {m}"
        )


def _parity(kind, tp, dp, ep):
    state = tp_ext.init_parallel(tp=tp, dp=dp, ep=ep)
    model = _model(kind)
    ref = copy.deepcopy(model)
    dp_rank = state.mesh.get_local_rank("dp")
    ids = _batch(seed=100 + dp_rank)

    ref_out = ref(ids, labels=ids)
    ref_out.loss.backward()
    tp_ext.parallelize(model, "auto", parallel=state)
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    assert len(layers) == 2
    with comm.track() as stats:
        out = model(ids, labels=ids)
    out.loss.backward()

    def close(a, b, what):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")

    close(out.logits, ref_out.logits, "logits")
    close(out.loss, ref_out.loss, "loss")
    close(out.aux_loss, ref_out.aux_loss, "aux loss (the model's own, from its router logits)")

    _check_gradients(model, ref, state)

    # Memory: each rank holds its share of the experts, no more.
    sizes = shard_sizes(EXPERTS, ep)
    experts = layers[0].experts
    inter = _config(kind).moe_intermediate_size if kind == "qwen2_moe" else 48
    # (an EP group across TP ranks holds whole experts; else each is split over TP)
    local_inter = inter if ep > dp else shard_sizes(inter, tp)[state.mesh.get_local_rank("tp")]
    assert experts.gate_up_proj.shape == (sizes[state.ep_rank], 2 * local_inter, HIDDEN)
    assert experts.down_proj.shape == (sizes[state.ep_rank], HIDDEN, local_inter)

    # Bytes: the dispatch and the combine move exactly the rows routed to other EP ranks, plus
    # each rank's counts for the other ranks' experts.
    counts_bytes = (EXPERTS - sizes[state.ep_rank]) * 8
    want_bytes = sum(n * HIDDEN * 4 + counts_bytes for n in _rows_moved(ref, state, tp, dp))
    assert stats.bytes(tag=MOE_TAG, collective="all_to_all_v") == want_bytes
    return layers[0].tokens_per_expert.sum().item()


# the five, then EP groups across TP ranks (ep > dp): all of a TP group's ranks, a
# part of them (tp4-ep2), and with DP (tp2-dp2-ep4); 18 tokens over 4 TP ranks are uneven
DIMS = [(1, 2, 2), (1, 4, 4), (1, 4, 2), (2, 2, 2), (1, 3, 3), (2, 1, 2), (4, 1, 2), (2, 2, 4)]


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral"])
@pytest.mark.parametrize("dims", DIMS, ids=lambda t: "tp{}-dp{}-ep{}".format(*t))
def test_expert_parallel_moe_equals_transformers(kind, dims):
    tp, dp, ep = dims
    routed = run_distributed(_parity, tp * dp, kind, tp, dp, ep, timeout=240)
    assert routed == [2 * 9 * TOP_K] * (tp * dp)  # tokens_per_expert counts every choice


def _full_state_round_trip():
    state = tp_ext.init_parallel(tp=1, dp=dist.get_world_size(), ep=dist.get_world_size())
    model = _model("mixtral")
    full = {k: v.clone() for k, v in model.state_dict().items()}
    tp_ext.parallelize(model, "auto", parallel=state)
    gathered = model.state_dict()
    assert (
        gathered["model.layers.0.mlp.experts.gate_up_proj"].shape[0]
        == shard_sizes(EXPERTS, state.ep)[state.ep_rank]
    )
    back = full_state_dict(model)
    assert set(back) == set(full)
    for k in full:
        torch.testing.assert_close(back[k], full[k], rtol=0, atol=0)


@pytest.mark.parametrize("ws", [2, 3])
def test_full_state_dict_gathers_the_experts_in_the_hugging_face_layout(ws):
    run_distributed(_full_state_round_trip, ws)


def _capacity(ep, factor):
    state = tp_ext.init_parallel(tp=1, dp=ep, ep=ep)
    torch.manual_seed(0)
    experts_full = ParallelExperts(EXPERTS, HIDDEN, 16, torch.nn.SiLU(), ep=ResolvedGroup.local())
    full = {k: v.detach().clone() for k, v in experts_full.state_dict().items()}
    experts = ParallelExperts(EXPERTS, HIDDEN, 16, torch.nn.SiLU(), ep=state.ep_group)
    experts.load_full_state_dict(full)
    router = _Router()
    layer = ExpertParallelMoE(router, experts, state.ep_group, capacity_factor=factor)
    x = torch.randn(10, HIDDEN, generator=torch.Generator().manual_seed(dist.get_rank()))
    out = layer(x)
    # reference: the same routing with choices past capacity removed, on the full experts
    _, w, ids = router(x)
    capacity = -(-int(factor * 10 * TOP_K) // EXPERTS)
    seen = [0] * EXPERTS
    want = torch.zeros_like(x)
    dropped = 0
    order = sorted(((int(ids[t, j]), t, j) for t in range(10) for j in range(TOP_K)))
    for e, t, j in order:
        seen[e] += 1
        if seen[e] > capacity:
            dropped += 1
            continue
        h = torch.nn.functional.linear(x[t], full["gate_up_proj"][e])
        g, u = h.chunk(2)
        want[t] += w[t, j] * torch.nn.functional.linear(
            torch.nn.functional.silu(g) * u, full["down_proj"][e]
        )
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    assert layer.dropped_tokens == dropped
    return dropped


class _Router(torch.nn.Module):
    """A skewed router (most tokens prefer expert 0), so a capacity factor drops some."""

    def forward(self, x):
        logits = x[:, :EXPERTS] + torch.linspace(3, 0, EXPERTS)
        probs = torch.softmax(logits, -1)
        w, ids = torch.topk(probs, TOP_K, -1)
        return logits, w, ids


@pytest.mark.parametrize("ws", [2, 3])
def test_capacity_factor_drops_and_counts_the_choices_past_capacity(ws):
    dropped = run_distributed(_capacity, ws, ws, 1.0)
    assert all(d > 0 for d in dropped)  # the case drops something on every rank


def test_misuse_is_refused_clearly():
    with pytest.raises(ValueError, match="capacity_factor=0 must be a positive number"):
        experts = ParallelExperts(4, 8, 8, torch.nn.SiLU(), ep=ResolvedGroup.local())
        ExpertParallelMoE(_Router(), experts, ResolvedGroup.local(), capacity_factor=0)
    with pytest.raises(ValueError, match="is not a sparse-MoE block"):
        ExpertParallelMoE.from_block(torch.nn.Linear(2, 2))


# ---- training with the Trainer -------------------------------------------------------------------


def _micro_batches(dp_rank, step):
    return [_batch(seed=1000 * step + 10 * dp_rank + m, tokens=(2, 8)) for m in range(2)]


def _reference_step(ref, opt, batches, with_aux):
    """One SGD step of the unsharded model on every rank's micro-batches: the mean token loss
    over all of them, plus each micro-batch's aux loss weighted by its tokens (the Trainer's
    rule), clipped at norm 0.5."""
    opt.zero_grad()
    total = sum(ids[:, 1:].numel() for ids in batches)
    loss = 0
    for ids in batches:
        out = ref(ids)
        ce = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten(), reduction="sum"
        )
        if with_aux:
            ce = ce + ref.config.router_aux_loss_coef * out.aux_loss * ids[:, 1:].numel()
        loss = loss + ce / total
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    opt.step()
    return loss.item(), norm.item()


def _train(kind, tp, dp, ep, with_aux, data_parallel="ddp"):
    state = tp_ext.init_parallel(tp=tp, dp=dp, ep=ep)
    model = _model(kind)
    model.config.output_router_logits = with_aux
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    tp_ext.parallelize(model, "auto", parallel=state)
    trainer = Trainer(
        model,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),
        parallel=state,
        max_grad_norm=0.5,
        data_parallel=data_parallel,
    )
    if data_parallel == "zero2":  # buckets of a few parameters, sent during the backward
        trainer.optimizer.bucket_bytes = 8192
    dp_rank = state.mesh.get_local_rank("dp")
    for step in range(3):
        loss = trainer.step(_micro_batches(dp_rank, step))
        every = [b for r in range(dp) for b in _micro_batches(r, step)]
        want, norm = _reference_step(ref, ref_opt, every, with_aux)
        assert abs(loss - want) <= 1e-5 * abs(want), (step, loss, want)
        # the norm counts every expert once, over the EP and TP splits (and clips: norm > 0.5)
        assert abs(trainer.last_grad_norm - norm) <= 1e-5 * norm and norm > 0.5, (step, norm)
    want = local_shards(model, dict(ref.named_parameters()))
    for name, p in model.named_parameters():
        torch.testing.assert_close(
            p.detach(), want[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
        )
    if data_parallel in ("zero1", "zero2"):
        _check_zero_rows(trainer, state, ep)


def _check_zero_rows(trainer, state, ep):
    """Each rank steps its rows: dense parameters' over DP, experts' over the ranks holding the
    same experts (dp / ep of them when EP runs across DP); ZeRO-2 sent buckets in the backward."""
    from tp_ext.layers.moe import expert_parameters

    optimizer = trainer.optimizer
    experts = {id(p) for p in expert_parameters(trainer.model)[0]}
    replicas = comm.resolve_group(state.expert_dp_group).size
    for p in trainer.model.parameters():
        start, count = optimizer._rows[p]
        over = replicas if id(p) in experts else state.dp
        assert count == len(range(p.shape[0])[start:][: -(-p.shape[0] // over)]), p.shape
    if optimizer.stage == 2:
        assert optimizer.buckets_sent_in_backward > 0, optimizer.bucket_count


TRAIN_CASES = [("qwen2_moe", (1, 2, 2), False), ("mixtral", (2, 2, 2), False),
               ("qwen2_moe", (1, 3, 3), True), ("mixtral", (1, 4, 2), True),
               ("qwen2_moe", (4, 1, 2), True), ("mixtral", (2, 2, 4), False)]  # fmt: skip


@pytest.mark.parametrize("kind,dims,with_aux", TRAIN_CASES, ids=str)
def test_trainer_steps_equal_single_process_training_on_the_global_batch(kind, dims, with_aux):
    tp, dp, ep = dims
    run_distributed(_train, tp * dp, kind, tp, dp, ep, with_aux, timeout=300)


# the distributed optimizer with experts: dense rows over DP, expert rows over expert-DP (the
# ranks holding the same experts; none at dp = ep)
ZERO_CASES = [
    pytest.param("qwen2_moe", (1, 4, 2), False, "zero2", id="dp4-ep2-zero2"),
    pytest.param("mixtral", (2, 2, 2), True, "zero1", id="tp2-dp2-ep2-zero1"),
    pytest.param("qwen2_moe", (1, 2, 2), True, "zero2", id="dp2-ep2-zero2",
                 marks=pytest.mark.full_matrix),
    pytest.param("mixtral", (1, 3, 3), False, "zero2", id="dp3-ep3-zero2",
                 marks=pytest.mark.full_matrix),
    pytest.param("mixtral", (2, 2, 4), False, "zero2", id="tp2-dp2-ep4-zero2",
                 marks=pytest.mark.full_matrix),
]  # fmt: skip


@pytest.mark.parametrize("kind,dims,with_aux,data_parallel", ZERO_CASES)
def test_zero_with_experts_equals_single_process_training(kind, dims, with_aux, data_parallel):
    tp, dp, ep = dims
    run_distributed(_train, tp * dp, kind, tp, dp, ep, with_aux, data_parallel, timeout=300)


# ---- checkpoints in the Hugging Face format, loaded at another EP degree ------------------------


def _reshard(path):
    ws = dist.get_world_size()
    state = tp_ext.init_parallel(tp=1, dp=ws, ep=ws)
    model = _model("qwen2_moe")
    tp_ext.parallelize(model, "auto", parallel=state)
    trainer = Trainer(model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5), parallel=state)
    trainer.step(_micro_batches(state.mesh.get_local_rank("dp"), 0))  # experts now differ by rank
    ids = _batch(seed=7)
    with torch.no_grad():
        logits = model(ids).logits
    full = full_state_dict(model)  # experts gathered over the EP group
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=full)
    dist.barrier()
    for ep in (ws // 2, 1):
        again = tp_ext.init_parallel(tp=1, dp=ws, ep=ep)
        loaded = transformers.Qwen2MoeForCausalLM.from_pretrained(path).eval()
        if ep > 1:
            tp_ext.parallelize(loaded, "auto", parallel=again)
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, logits, rtol=1e-5, atol=1e-6)


def test_saved_at_ep4_loads_at_ep2_and_ep1_with_the_same_logits(tmp_path):
    run_distributed(_reshard, 4, str(tmp_path / "moe"), timeout=300)


def _fewer_experts_than_ranks():
    """2 experts over 3 EP ranks: the third holds none, yet takes part in every exchange."""
    state = tp_ext.init_parallel(tp=1, dp=3, ep=3)
    cfg = _config("mixtral")
    cfg.num_local_experts = 2
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(cfg).eval()
    ref = copy.deepcopy(model)
    ids = _batch(seed=100 + state.ep_rank)
    ref_out = ref(ids, labels=ids)
    ref_out.loss.backward()
    tp_ext.parallelize(model, "auto", parallel=state)
    out = model(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits, ref_out.logits, rtol=1e-5, atol=1e-6)
    _check_gradients(model, ref, state)
    return model.model.layers[0].mlp.experts.gate_up_proj.shape[0]


def test_fewer_experts_than_ep_ranks():
    assert run_distributed(_fewer_experts_than_ranks, 3) == [1, 1, 0]


# ---- a checkpoint directory read by slices into EP ranks ---------------------------------------


def _checkpoint(path: str, kind: str, form: str) -> None:
    """``kind``'s model saved in ``form``: "fused", under its modules' own names (as tp_ext's
    merged export writes it), or "per_expert", as transformers' save_pretrained writes it (one
    tensor per expert and projection, converted on load by its conversion mapping)."""
    from safetensors.torch import save_file

    model = _model(kind)
    model.config.output_router_logits = False  # (refused under pipelining)
    if form == "per_expert":
        model.save_pretrained(path)
        return
    model.config.save_pretrained(path)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_a_per_expert_checkpoint_reads_as_the_fused_tensors(tmp_path, kind):
    """transformers' own form (Mixtral's block_sparse_moe.experts.3.w1.weight, ...) seen under the
    model's names: any slice of a fused expert tensor equals the model's."""
    from tp_ext.checkpoint.hf_conversions import converted_files
    from tp_ext.checkpoint.safetensors_io import SafetensorsFiles
    from tp_ext.models.hf.shards import meta_model

    _checkpoint(str(tmp_path), kind, "per_expert")
    files = SafetensorsFiles(str(tmp_path))
    assert not any(n.endswith("gate_up_proj") for n in files.names())
    view = converted_files(files, meta_model(_config(kind)))
    state = _model(kind).state_dict()
    assert view.names() == set(state)
    fused = "model.layers.1.mlp.experts.gate_up_proj"
    assert view.shape(fused) == tuple(state[fused].shape)
    for index in [(slice(0, EXPERTS),), (slice(2, 5), slice(40, 60)), (slice(7, 8), slice(3, 9))]:
        torch.testing.assert_close(view.read(fused, index), state[fused][index], rtol=0, atol=0)
    down = "model.layers.0.mlp.experts.down_proj"
    index = (slice(1, 3), slice(None), slice(10, 20))
    torch.testing.assert_close(view.read(down, index), state[down][index], rtol=0, atol=0)


def _load_by_slices(path, kind, tp, pp, dp, ep):
    from tp_ext.models.hf.source import HFModelSource

    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp, ep=ep)
    model, report = HFModelSource.from_path(path).build_and_load(state, dtype=torch.float32, seed=0)
    with torch.no_grad():
        logits = model(_batch(7))
    held = model.model.layers[0].mlp.experts.gate_up_proj.shape[0] if pp == 1 else None
    return getattr(logits, "logits", logits), held, report


@pytest.mark.parametrize(
    "kind, form, dims",
    [
        ("mixtral", "fused", (1, 1, 2, 2)),  # four experts each
        ("mixtral", "per_expert", (2, 1, 2, 2)),  # and each expert split over TP
        ("qwen2_moe", "per_expert", (1, 2, 2, 2)),  # inside pipeline stages, shared expert
        pytest.param("mixtral", "fused", (2, 1, 2, 2), marks=pytest.mark.full_matrix),
        pytest.param("mixtral", "per_expert", (1, 1, 3, 3), marks=pytest.mark.full_matrix),
        pytest.param("qwen2_moe", "fused", (2, 2, 1, 2), marks=pytest.mark.full_matrix),
    ],
)
def test_expert_ranks_read_their_experts_from_a_checkpoint(tmp_path, kind, form, dims):
    """Each EP rank reads only its experts' rows of the files (and its TP columns of them), from
    the fused tensors or from transformers' one tensor per expert: the unsharded model's
    logits, and less than the whole checkpoint read."""
    _checkpoint(str(tmp_path), kind, form)
    with torch.no_grad():
        expected = _model(kind)(_batch(7)).logits
    tp, pp, dp, ep = dims
    results = run_distributed(_load_by_slices, tp * pp * dp, str(tmp_path), kind, *dims)
    for logits, held, report in results:
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
        assert not report.get("read_whole") and report["read_bytes"] < report["checkpoint_bytes"]
    if pp == 1:
        assert sorted({h for _, h, _ in results}) == sorted(set(shard_sizes(EXPERTS, ep)))


# ---- Trainer checkpoints: resumed at another EP degree ----------------------------------------


def _resume_at_other_dims(path, saved=(1, 4, 4, "ddp"), loads=None):
    """One step of SGD with momentum at (tp, dp, ep) = (1, 4, 4), saved with
    Trainer.save_checkpoint; loaded at (1, 4, 2), (2, 2, 2) and (2, 2, 4) (EP across TP ranks),
    the next step equals single-process training on the global batch (the experts and their
    momentum resharded over the new EP and TP groups)."""

    def unsharded():
        model = _model("qwen2_moe")
        model.config.output_router_logits = False  # no aux loss: the reference step has none
        return model

    def build(tp, dp, ep, data_parallel):
        state = tp_ext.init_parallel(tp=tp, dp=dp, ep=ep)
        model = tp_ext.parallelize(unsharded(), "auto", parallel=state)
        trainer = Trainer(
            model,
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.5, momentum=0.9),
            parallel=state,
            max_grad_norm=0.5,
            data_parallel=data_parallel,
        )
        return state, model, trainer

    def every(dp, step):
        return [b for r in range(dp) for b in _micro_batches(r, step)]

    ref = unsharded()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5, momentum=0.9)
    state, model, trainer = build(*saved)
    trainer.step(_micro_batches(state.mesh.get_local_rank("dp"), 0))
    _reference_step(ref, ref_opt, every(4, 0), False)
    trainer.save_checkpoint(path)
    for tp, dp, ep, data_parallel in loads or (
        (1, 4, 2, "ddp"),
        (2, 2, 2, "ddp"),
        (2, 2, 4, "ddp"),
    ):
        state, model, trainer = build(tp, dp, ep, data_parallel)
        manifest = trainer.load_checkpoint(path)
        assert manifest["step"] == 1
        want = local_shards(model, dict(ref.named_parameters()))
        for name, p in model.named_parameters():  # the weights after step 0, resharded
            torch.testing.assert_close(
                p.detach(), want[name].detach(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}"
            )
        ref_again = copy.deepcopy(ref)
        opt_again = torch.optim.SGD(ref_again.parameters(), lr=0.5, momentum=0.9)
        # a deep copy: load_state_dict keeps the very momentum tensors, which step() changes
        opt_again.load_state_dict(copy.deepcopy(ref_opt.state_dict()))
        loss = trainer.step(_micro_batches(state.mesh.get_local_rank("dp"), 1))
        want_loss, _ = _reference_step(ref_again, opt_again, every(dp, 1), False)
        assert abs(loss - want_loss) <= 1e-5 * abs(want_loss), (tp, dp, ep, loss, want_loss)
        want = local_shards(model, dict(ref_again.named_parameters()))
        for name, p in model.named_parameters():  # the optimizer state came along too
            torch.testing.assert_close(
                p.detach(), want[name].detach(), rtol=1e-5, atol=1e-6,
                msg=lambda m: f"{name} at tp={tp} dp={dp} ep={ep}: {m}",
            )  # fmt: skip


def test_trainer_checkpoint_saved_at_ep4_resumes_at_ep2_and_with_tp(tmp_path):
    run_distributed(_resume_at_other_dims, 4, str(tmp_path / "ckpt"), timeout=300)


def test_zero_checkpoint_with_experts_resumes_under_ddp_and_zero_at_other_dims(tmp_path):
    """Saved under ZeRO-2 with each expert's momentum in rows over 2 ranks (dp 4, ep 2); loaded
    by DDP at (2, 2, 2) and by ZeRO-1 at (1, 4, 4) and ZeRO-2 at (2, 2, 2)."""
    loads = ((2, 2, 2, "ddp"), (1, 4, 4, "zero1"), (2, 2, 2, "zero2"))
    path = str(tmp_path / "ckpt")
    run_distributed(_resume_at_other_dims, 4, path, (1, 4, 2, "zero2"), loads, timeout=300)
