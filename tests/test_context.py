"""Context parallelism (tp_ext/layers/context.py): ring attention over a sequence split along its
positions over 1-4 ranks, with the causal load balance (2C chunks, rank i holding chunks i and
2C-1-i) at lengths that do not divide evenly, against the unsplit attention: outputs and the
gradients of queries, keys and values, causal and not, with grouped-query heads. The merge op
(ops/attention_merge.*) against its formula."""

import pytest
import torch
import torch.nn.functional as F

import tp_ext
from tp_ext import ops
from tp_ext.layers import context
from tp_ext.layers.context import all_to_all_attention, cp_positions, ring_attention
from tp_ext.sharding import cp_chunks, shard_sizes

from .common import WORLD_SIZES, full
from .dist_utils import run_distributed
from .reference import hf_qwen2
from .test_models import _TINY as MODEL_TINY


def test_cp_chunks_balance_the_causal_work():
    # 11 positions in 4 chunks [3, 3, 3, 2]: rank 0 holds chunks 0 and 3, rank 1 chunks 1 and 2
    assert cp_chunks(11, 2, 0) == [(0, 0, 3), (3, 9, 2)]
    assert cp_chunks(11, 2, 1) == [(1, 3, 3), (2, 6, 3)]
    for seq, cp in ((11, 3), (8, 4), (3, 2), (0, 2)):
        held = sorted(
            p for r in range(cp) for _, s, n in cp_chunks(seq, cp, r) for p in range(s, s + n)
        )
        assert held == list(range(seq)), (seq, cp)
    with pytest.raises(ValueError, match="cp_rank must be an int in \\[0, 1\\]"):
        cp_chunks(8, 2, 2)


def _merge_reference(oa, la, ob, lb):
    lse = torch.logaddexp(la, lb)
    return torch.exp(la - lse)[..., None] * oa + torch.exp(lb - lse)[..., None] * ob, lse


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_attention_merge_matches_its_formula(dtype):
    lse_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    oa, ob = full((2, 3, 5, 4), 1, dtype), full((2, 3, 5, 4), 2, dtype)
    la, lb = full((2, 3, 5), 3, lse_dtype), full((2, 3, 5), 4, lse_dtype)
    la[0, 0, 0] = float("-inf")  # a block with no keys for that row
    inputs = [t.clone().requires_grad_() for t in (oa, la, ob, lb)]
    out, lse = ops.attention_merge(*inputs)
    ref_inputs = [t.double().clone().requires_grad_() for t in (oa, la, ob, lb)]
    ref_out, ref_lse = _merge_reference(*ref_inputs)
    tol = dict(rtol=1e-2, atol=1e-2) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.double(), ref_out, **tol)
    torch.testing.assert_close(lse.double(), ref_lse, **tol)
    g_out, g_lse = full(out.shape, 5, dtype), full(lse.shape, 6, lse_dtype)
    got = torch.autograd.grad((out * g_out).sum() + (lse * g_lse).sum(), inputs)
    want = torch.autograd.grad(
        (ref_out * g_out.double()).sum() + (ref_lse * g_lse.double()).sum(), ref_inputs
    )
    for a, e in zip(got, want):
        torch.testing.assert_close(a.double(), e, **tol)
    # two blocks with no keys: no attention at all (lse -inf, out 0), not NaN
    none = torch.full((1, 2), float("-inf"))
    out, lse = ops.attention_merge(torch.ones(1, 2, 3), none, torch.ones(1, 2, 3), none)
    assert torch.equal(out, torch.zeros(1, 2, 3)) and torch.isinf(lse).all()


def test_attention_merge_errors_name_the_argument():
    with pytest.raises(ValueError, match="lse_b has shape \\[2, 4\\] but out_b has shape"):
        ops.attention_merge(
            torch.ones(2, 3, 4), torch.ones(2, 3), torch.ones(2, 3, 4), torch.ones(2, 4)
        )
    with pytest.raises(ValueError, match="lse_a must be float32 or float64"):
        ops.attention_merge(
            torch.ones(2, 3, 4),
            torch.ones(2, 3, dtype=torch.bfloat16),
            torch.ones(2, 3, 4),
            torch.ones(2, 3),
        )


@pytest.mark.parametrize("diagonal", [True, False])
def test_the_matmul_blocks_equal_torchs_flash_attention(diagonal):
    """The blocks off the CPU (matmuls, until a GPU pass gives them flash kernels) against the
    flash attention the CPU path uses, given another block's output and log-sum-exp as the
    merged ones (what the ring's backward passes)."""
    q, k, v = full((2, 3, 5, 4), 1), full((2, 3, 5, 4), 2), full((2, 3, 5, 4), 3)
    flash = context._block(q, k, v, diagonal, 0.7)
    mine = context._block_by_matmuls(q, k, v, diagonal, 0.7)
    for a, e in zip(mine, flash):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)
    out, lse = context._block(q, full((2, 3, 5, 4), 4), v, False, 0.7)  # "merged" ones
    grad = full((2, 3, 5, 4), 5)
    want = context._block_backward(grad, q, k, v, out, lse, diagonal, 0.7)
    got = context._block_backward_by_matmuls(grad, q, k, v, out, lse, diagonal, 0.7)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


SEQ = 11  # over 2C chunks: uneven at every C > 1


def _ring_without_overlap(*args, **kwargs):
    return ring_attention(*args, overlap=False, **kwargs)


def _key_mask() -> torch.Tensor:
    """Row 0 left-padded (its first queries see no key at all), row 1 right-padded with a hole."""
    mask = torch.ones(2, SEQ, dtype=torch.bool)
    mask[0, :4] = False
    mask[1, 7:] = False
    mask[1, 2] = False
    return mask


def _capped_reference(q, k, v, mask, causal, softcap):
    """Attention over soft-capped scores, as Gemma 2's eager attention (its softmax in the
    inputs' dtype here): zeros for a query that sees no key."""
    groups = q.size(1) // k.size(1)
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = q @ k.transpose(-1, -2) / q.size(-1) ** 0.5
    scores = softcap * torch.tanh(scores / softcap)
    if mask is None and causal:
        mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch._safe_softmax(scores, -1) @ v


def _check_ring(
    causal, heads, kv_heads, dtype, attend=ring_attention, padded=False, window=None, softcap=None
):
    g = tp_ext.comm.resolve_group(None)
    torch.manual_seed(0)
    q_full = torch.randn(2, heads, SEQ, 8, dtype=dtype)
    k_full = torch.randn(2, kv_heads, SEQ, 8, dtype=dtype)
    v_full = torch.randn(2, kv_heads, SEQ, 8, dtype=dtype)
    grad_full = torch.randn(2, heads, SEQ, 8, dtype=dtype)
    mine = cp_positions(SEQ)
    q, k, v = (t[:, :, mine].clone().requires_grad_() for t in (q_full, k_full, v_full))
    keys = _key_mask() if padded else None
    extra = {} if keys is None else {"key_mask": keys[:, mine]}
    extra.update({} if window is None else {"window": window})
    extra.update({} if softcap is None else {"softcap": softcap})
    out = attend(q, k, v, SEQ, causal=causal, **extra)
    out.backward(grad_full[:, :, mine])
    refs = [t.clone().requires_grad_() for t in (q_full, k_full, v_full)]
    mask = None
    if keys is not None or window is not None:  # torch's attention: zeros where no key is seen
        back = torch.arange(SEQ)[:, None] - torch.arange(SEQ)[None, :]
        mask = (back >= 0 if causal else back == back) & (back < (window or SEQ + 1))
        mask = mask if keys is None else keys[:, None, None, :] & mask
    if softcap is None:
        expected = F.scaled_dot_product_attention(
            *refs,
            attn_mask=mask,
            is_causal=causal and mask is None,
            enable_gqa=heads != kv_heads,
        )
    else:
        expected = _capped_reference(*refs, mask, causal, softcap)
    expected.backward(grad_full)
    tol = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out, expected[:, :, mine].detach(), **tol)
    for got, ref in zip((q, k, v), refs):
        torch.testing.assert_close(got.grad, ref.grad[:, :, mine], **tol)
    return g.size


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_equals_the_unsplit_attention(world, causal):
    assert run_distributed(_check_ring, world, causal, 4, 2, torch.float64) == [world] * world


@pytest.mark.parametrize("world", WORLD_SIZES)
@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 3), (3, 1)])
def test_all_to_all_attention_equals_the_unsplit_attention(world, heads, kv_heads):
    """Ulysses: heads split whole (uneven at 3 ranks; fewer KV heads than ranks repeated)."""
    for causal in (True, False):
        run_distributed(
            _check_ring, world, causal, heads, kv_heads, torch.float64, all_to_all_attention
        )


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_padded_keys_are_seen_by_no_query_of_any_rank(world, mode, dtype):
    """A key mask per rank (padding, either side, and a hole): it travels round the ring with
    its keys, or is all-gathered for the all-to-all; a query that sees no key gets zeros and
    no gradient, as torch's attention gives."""
    attend = ring_attention if mode == "ring" else all_to_all_attention
    for causal in (True, False):
        run_distributed(_check_ring, world, causal, 4, 2, dtype, attend, True)


def test_the_ring_skips_the_chunks_a_window_leaves_out():
    """16 positions in 4 chunks over 2 ranks (rank 1: positions 4-7 and 8-11), window 2: of rank
    0's block (0-3, 12-15) only chunk 0 against 4-7 is computed, partly (masked)."""
    pairs = context._pairs(16, 2, 1, 0, True, window=2)
    assert [(p.q_start, p.k_start, p.diagonal) for p in pairs] == [(4, 0, False)]
    assert context._allowed(pairs[0], None, 2, "cpu").sum() == 1  # 4 sees 3
    assert len(context._pairs(16, 2, 1, 0, True)) == 2  # without a window: 0 before both


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("window", [1, 2, 4, 6])
def test_a_sliding_window_shorter_than_the_sequence(world, mode, window):
    """Each query sees the keys less than ``window`` positions back: a pair of chunks wholly
    outside the window is skipped, one partly inside masked; with padded keys too."""
    attend = ring_attention if mode == "ring" else all_to_all_attention
    for padded in (False, True):
        run_distributed(_check_ring, world, True, 4, 2, torch.float64, attend, padded, window)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_soft_capped_scores_inside_the_online_softmax(world, mode, dtype):
    """``softcap`` (Gemma 2's attention logit soft-capping, small here so that it bends): the
    capped scores in the ring's merged softmax and its backward, or the all-to-all's; with a
    window and padded keys too, and without causality."""
    attend = ring_attention if mode == "ring" else all_to_all_attention
    run_distributed(_check_ring, world, True, 4, 2, dtype, attend, False, None, 0.7)
    run_distributed(_check_ring, world, False, 6, 3, dtype, attend, False, None, 0.7)
    run_distributed(_check_ring, world, True, 4, 1, dtype, attend, True, 3, 1.5)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_without_overlap_is_the_same(world):
    run_distributed(_check_ring, world, True, 4, 2, torch.float64, _ring_without_overlap)


@pytest.mark.parametrize("world", [2, 3])
def test_ring_attention_in_fp32_with_one_kv_head(world):
    run_distributed(_check_ring, world, True, 4, 1, torch.float32)


def _bytes_under_track(mode, heads, kv_heads):
    """What tp_ext.comm.track() files under "cp" for one forward + backward of ``mode``,
    against the count from the chunk sizes (fp64: 8 bytes; batch 2, head_dim 8)."""
    g = tp_ext.comm.resolve_group(None)
    size, me = g.size, g.rank
    local = [sum(n for _, _, n in cp_chunks(SEQ, size, r)) for r in range(size)]
    torch.manual_seed(0)
    q = torch.randn(2, heads, local[me], 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, kv_heads, local[me], 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    attend = ring_attention if mode == "ring" else all_to_all_attention
    with tp_ext.comm.tag("outside"), tp_ext.comm.track() as stats:
        attend(q, k, v, SEQ).sum().backward()
    row = 2 * 8 * 8  # batch x head_dim x 8 bytes: one head at one position
    if mode == "ring":  # the block held at step s came from rank me - s
        held = [local[(me - s) % size] for s in range(size)]
        kv_hops = sum(2 * kv_heads * n * row for n in held[:-1])
        forward, backward = kv_hops, kv_hops + sum(2 * kv_heads * n * row for n in held)
        ops = {"ring_attention": forward, "ring_attention_backward": backward}
        collective = "send_recv"
    else:  # heads split whole by KV group; each all-to-all sends others their share
        q_heads = [h * (heads // kv_heads) for h in shard_sizes(kv_heads, size)]
        kv_split = shard_sizes(kv_heads, size)
        others = [r for r in range(size) if r != me]
        scatter = sum((q_heads[j] + 2 * kv_split[j]) * local[me] * row for j in others)
        gather = sum(q_heads[me] * local[j] * row for j in others)  # the outputs go home
        # backward: the output's gradient travels as q did, q/k/v's gradients as the output
        back = sum(q_heads[j] * local[me] * row for j in others)
        back += sum((q_heads[me] + 2 * kv_split[me]) * local[j] * row for j in others)
        ops = {"all_to_all_single": scatter + gather + back}
        collective = "all_to_all_v"
    got = {r.op: r.bytes for r in stats.records if r.tag == "cp"}
    assert got == {op: n for op, n in ops.items() if n}, (got, ops)
    assert all(r.collective == collective for r in stats.records if r.tag == "cp")
    assert not [r for r in stats.records if r.tag != "cp"], stats.table()  # all of it is CP's
    return sum(ops.values())


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_track_counts_each_modes_bytes_under_the_cp_tag(world, mode):
    """Forward and backward, at 2 and 3 ranks (uneven chunks); GQA with 4 / 2 heads at 2
    ranks, 6 / 3 at 3 (whole KV groups per rank)."""
    heads, kv_heads = (4, 2) if world == 2 else (6, 3)
    assert all(n > 0 for n in run_distributed(_bytes_under_track, world, mode, heads, kv_heads))


def _ring_errors():
    q = torch.ones(1, 4, 3, 8)
    errors = []
    for call in (
        lambda: ring_attention(q, q[:, :2], q[:, :2], 12),
        lambda: ring_attention(q, q[:, :3], q[:, :3], 6),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_ring_attention_refuses_bad_shapes_by_name():
    errors = run_distributed(_ring_errors, 2)[0]
    assert "q has shape (1, 4, 3, 8); it must be [batch, heads, 6, head_dim]" in errors[0]
    assert "4 query heads are not a multiple of 3 key/value heads" in errors[1]


def _state_with_cp(tp, cp):
    import torch.distributed as dist

    state = tp_ext.init_parallel(tp=tp, cp=cp)
    g = tp_ext.comm.resolve_group(state.cp_group)
    members = dist.get_process_group_ranks(state.cp_group)
    mine = tp_ext.cp_positions(SEQ, parallel=state).tolist()
    # the ring over the state's CP group (the default once init_parallel(cp=...) ran)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, SEQ, 4, dtype=torch.float64) for _ in range(3))
    out = ring_attention(q[:, :, mine], k[:, :, mine], v[:, :, mine], SEQ)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True)[:, :, mine]
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-10)
    return state.dims.describe(), members, g.rank, mine


@pytest.mark.parametrize("tp, cp", [(1, 2), (2, 2)])
def test_init_parallel_makes_the_cp_group_next_to_tp(tp, cp):
    results = run_distributed(_state_with_cp, tp * cp, tp, cp)
    chunks = {
        r: [p for _, s, n in cp_chunks(SEQ, cp, r) for p in range(s, s + n)] for r in range(cp)
    }
    for rank, (dims, members, cp_rank, mine) in enumerate(results):
        assert dims == f"tp={tp} pp=1 dp=1 cp={cp}"
        # TP innermost, then CP: rank = cp_rank * tp + tp_rank
        assert members == [c * tp + rank % tp for c in range(cp)], (rank, members)
        assert cp_rank == rank // tp and mine == chunks[cp_rank]


def _expert_groups_with_cp():
    import torch.distributed as dist

    state = tp_ext.init_parallel(tp=1, cp=2, dp=2, ep=2)
    ranks = dist.get_process_group_ranks
    return ranks(state.ep_group), ranks(state.expert_dp_group)


def test_expert_groups_form_at_each_cp_position_and_expert_dp_spans_them():
    """Mesh (dp, cp) = (2, 2), rank = 2 dp + cp: the EP group of a CP position is its DP ranks
    (their tokens are that position's); the ranks holding the same experts are both CP
    positions' (their expert gradients are summed over both)."""
    got = run_distributed(_expert_groups_with_cp, 4)
    assert got == [([0, 2], [0, 1]), ([1, 3], [0, 1]), ([0, 2], [2, 3]), ([1, 3], [2, 3])], got


def _grid_under_cp(mode):
    """The 2D model on a (2, 1) grid at cp 2: its logits are the unsharded model's at this CP
    rank's positions (the whole logits gathered over the grid)."""
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM

    state = tp_ext.init_parallel(tp=(2, 1), cp=2)
    config = Qwen2Config(**{**_TINY, "tie_word_embeddings": False})
    torch.manual_seed(0)
    reference = hf_qwen2(config)
    model = Qwen2ForCausalLM.from_config(config, parallel=state, cp_mode=mode)
    model.load_full_state_dict(reference.state_dict())
    ids = torch.randint(0, config.vocab_size, (3, 13), generator=torch.Generator().manual_seed(2))
    mine = tp_ext.cp_positions(13, parallel=state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids).logits[:, mine], rtol=1e-5, atol=1e-5)
    return mine.tolist()


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_a_2d_grid_under_cp_gives_the_logits_of_its_positions(mode):
    held = run_distributed(_grid_under_cp, 4, mode)
    assert held[0] == held[1]  # ranks 0 and 1: the grid of CP rank 0; 2 and 3: CP rank 1's
    assert sorted(held[0] + held[2]) == list(range(13))


# the model tests' tiny Qwen2, with 2 layers
_TINY = {**MODEL_TINY, "num_hidden_layers": 2}


def _qwen2_under_cp(tp, cp, recompute, mode):
    """The native Qwen2 at (tp, cp): this rank's logits at its positions and, with the loss
    summed over every CP rank's positions and the gradients summed over CP, every gradient
    equal to the one-process model's."""
    import torch.distributed as dist

    from tp_ext.distributed import ResolvedGroup
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_dict(_TINY)
    state = tp_ext.init_parallel(tp=tp, cp=cp)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config, parallel=state, dtype=torch.float64, cp_mode=mode)
    model.activation_checkpointing = recompute
    torch.manual_seed(3)
    reference = Qwen2ForCausalLM(config, tp_group=ResolvedGroup.local(), dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mine = tp_ext.cp_positions(SEQ, parallel=state)
    logits = model(ids)
    expected = reference(ids)
    torch.testing.assert_close(logits, expected[:, mine].detach(), rtol=1e-9, atol=1e-9)
    # next-token loss, summed: each CP rank over its positions (the last position has no target)
    targets = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    loss = F.cross_entropy(logits.flatten(0, 1), targets[:, mine].flatten(), reduction="sum")
    loss.backward()
    F.cross_entropy(expected.flatten(0, 1), targets.flatten(), reduction="sum").backward()
    full = {n: p.grad for n, p in reference.named_parameters()}
    want = tp_ext.layers.local_shards(model, full)
    for name, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad, group=state.cp_group)  # the CP ranks' shares of the gradient
        # the fused RMSNorm computes fp64 in fp32: its weight gradient, a sum over positions
        # grouped by CP rank here, rounds at 1e-7
        err = (grad - want[name]).abs().max().item() / want[name].abs().max().item()
        assert err < 1e-6, (name, err)
    return mine.tolist()


@pytest.mark.parametrize(
    "tp, cp, recompute, mode",
    [
        (1, 2, False, "ring"),
        (1, 3, True, "ring"),
        (1, 4, False, "ring"),
        (2, 2, False, "ring"),
        (1, 3, False, "all_to_all"),
        (2, 2, True, "all_to_all"),
    ],
    ids=["cp2", "cp3-recompute", "cp4", "tp2-cp2", "cp3-a2a", "tp2-cp2-a2a-recompute"],
)
def test_native_qwen2_under_context_parallelism_equals_one_process(tp, cp, recompute, mode):
    held = run_distributed(_qwen2_under_cp, tp * cp, tp, cp, recompute, mode)
    assert sorted(p for positions in held[::tp] for p in positions) == list(range(SEQ))


def _pipelined_logits_under_cp(pp, cp, mode):
    """The native Qwen2 at (pp, cp): model(ids) (inference through the stages) gives every rank
    of a pipeline the logits of its CP positions, equal to the one-process model's there."""
    from tp_ext.distributed import ResolvedGroup
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config.from_dict({**_TINY, "num_hidden_layers": 4})
    state = tp_ext.init_parallel(tp=1, cp=cp, pp=pp)
    torch.manual_seed(3)
    model = Qwen2ForCausalLM(config, parallel=state, dtype=torch.float64, cp_mode=mode)
    torch.manual_seed(3)
    reference = Qwen2ForCausalLM(config, tp_group=ResolvedGroup.local(), dtype=torch.float64)
    ids = torch.randint(0, config.vocab_size, (2, SEQ), generator=torch.Generator().manual_seed(1))
    mine = tp_ext.cp_positions(SEQ, parallel=state)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), reference(ids)[:, mine], rtol=1e-9, atol=1e-9)
    return mine.tolist()


@pytest.mark.parametrize("mode", ["ring", "all_to_all"])
def test_pipelined_inference_under_context_parallelism_equals_one_process(mode):
    held = run_distributed(_pipelined_logits_under_cp, 4, 2, 2, mode)
    assert sorted(held[0] + held[1]) == list(range(SEQ))  # ranks (pp, cp) = (0, 0), (0, 1)


def _cp_refusals():
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

    state = tp_ext.init_parallel(tp=1, cp=2)
    config = Qwen2Config.from_dict(_TINY)
    errors = []
    for call in (
        lambda: Qwen2ForCausalLM(config, parallel=state, cp_mode="ulysses"),
        lambda: Qwen2ForCausalLM(config, parallel=state).generate(torch.ones(1, 4).long(), 2),
    ):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_what_context_parallelism_does_not_do_yet_is_refused_by_name():
    errors = run_distributed(_cp_refusals, 2)[0]
    assert "cp_mode must be 'ring' or 'all_to_all', got 'ulysses'" in errors[0]
    assert "generate: context parallelism (cp=2) does not decode yet" in errors[1]


def _train_under_cp(tp, cp, dp, pp=1, schedule="1F1B", data_parallel="ddp"):
    """Three AdamW steps of the native Qwen2 at (tp, cp, dp), each DP replica its own
    micro-batches (full sequences on every CP rank), against one process training on all of
    them: the same losses each step and the same weights after."""
    from tp_ext.distributed import ResolvedGroup
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from tp_ext.training import Trainer

    config = Qwen2Config.from_dict({**_TINY, "num_hidden_layers": 4 if pp > 1 else 2})
    state = tp_ext.init_parallel(tp=tp, cp=cp, dp=dp, pp=pp)
    torch.manual_seed(3)
    virtual = 2 if schedule == "Interleaved1F1B" else 1
    model = Qwen2ForCausalLM(config, parallel=state, dtype=torch.float64, virtual_stages=virtual)
    torch.manual_seed(3)
    reference = Qwen2ForCausalLM(config, tp_group=ResolvedGroup.local(), dtype=torch.float64)

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)

    trainer = Trainer(
        model,
        optimizer=adamw,
        parallel=state,
        max_grad_norm=1.0,
        schedule=schedule,
        data_parallel=data_parallel,
    )
    if data_parallel == "zero2":  # several buckets, sent during the backward
        trainer.optimizer.bucket_bytes = 16384
    ref_trainer = Trainer(reference, optimizer=adamw, max_grad_norm=1.0)
    assert trainer.dp_group.size == dp  # the data's replicas; the CP ranks of one share batches
    gen = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(3):
        batches = [
            torch.randint(0, config.vocab_size, (2, SEQ), generator=gen) for _ in range(dp * 2)
        ]
        mine = batches[2 * state.dp_rank : 2 * state.dp_rank + 2]
        losses.append((trainer.step(mine), ref_trainer.step(batches)))
    assert_same_weights(model.full_state_dict(), reference.state_dict())
    if data_parallel in ("zero1", "zero2"):  # the state in rows over the DP x CP ranks
        optimizer = trainer.optimizer
        assert optimizer.dp.size == dp * cp
        rows = sum(optimizer._rows[p][1] * p[0].numel() for p in model.parameters())
        assert rows < sum(p.numel() for p in model.parameters())
        if data_parallel == "zero2" and pp == 1:
            assert optimizer.buckets_sent_in_backward == optimizer.bucket_count > 1
    return losses


def assert_same_weights(full: dict, expected: dict, tol: float = 1e-6) -> None:
    """``full`` (a rank's unsharded weights: under pipelining its stages') equal to the
    reference's under the same names, within ``tol`` of each tensor's largest entry."""
    assert full and set(full) <= set(expected), sorted(set(full) - set(expected))
    for name, tensor in full.items():
        want = expected[name]
        err = (tensor - want).abs().max().item() / want.abs().max().item()
        assert err < tol, (name, err)


@pytest.mark.parametrize(
    "tp, cp, dp, pp, schedule",
    [
        (1, 2, 1, 1, "1F1B"),
        (1, 3, 1, 1, "1F1B"),
        (1, 2, 2, 1, "1F1B"),
        (2, 2, 1, 1, "1F1B"),
        (1, 2, 1, 2, "1F1B"),  # context parallelism inside pipeline stages
        pytest.param(1, 2, 1, 2, "GPipe", marks=pytest.mark.full_matrix),
        pytest.param(2, 2, 1, 2, "1F1B", marks=pytest.mark.full_matrix),
        pytest.param(1, 2, 2, 2, "Interleaved1F1B", marks=pytest.mark.full_matrix),
    ],
)
def test_trainer_under_context_parallelism_trains_like_one_process(tp, cp, dp, pp, schedule):
    world = tp * cp * dp * pp
    runs = run_distributed(_train_under_cp, world, tp, cp, dp, pp, schedule, timeout=300)
    for losses in runs:
        for got, want in losses:
            # the Trainer sums the loss in fp32 (the one-process run) or fp64 (the all-reduce)
            assert abs(got - want) <= 1e-6 * abs(want), (got, want)


@pytest.mark.parametrize(
    "tp, cp, dp, pp, data_parallel",
    [
        (1, 2, 1, 1, "zero2"),  # the optimizer state over the CP ranks alone
        (1, 2, 2, 1, "zero1"),
        pytest.param(1, 2, 1, 2, "zero2", marks=pytest.mark.full_matrix),  # inside stages
        pytest.param(2, 2, 1, 1, "zero2", marks=pytest.mark.full_matrix),
        pytest.param(1, 3, 1, 1, "zero1", marks=pytest.mark.full_matrix),  # uneven rows
    ],
)
def test_zero_under_context_parallelism_trains_like_one_process(tp, cp, dp, pp, data_parallel):
    world = tp * cp * dp * pp
    runs = run_distributed(
        _train_under_cp, world, tp, cp, dp, pp, "1F1B", data_parallel, timeout=300
    )
    for losses in runs:
        for got, want in losses:
            assert abs(got - want) <= 1e-6 * abs(want), (got, want)


def _checkpoint_across_cp(path, save_cp, data_parallel="ddp"):
    """Trained 2 steps at (cp=save_cp), saved; loaded at cp = world / save_cp's other dims
    (cp=2 <-> dp=2): the same weights, and the next step's loss equal to the saver's."""
    from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
    from tp_ext.training import Trainer

    config = Qwen2Config.from_dict(_TINY)
    gen = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, config.vocab_size, (2, SEQ), generator=gen) for _ in range(6)]

    def trainer_at(cp, data_parallel="ddp"):
        state = tp_ext.init_parallel(tp=1, cp=cp, dp=2 // cp)
        torch.manual_seed(3)
        model = Qwen2ForCausalLM(config, parallel=state, dtype=torch.float64)
        opt = lambda params: torch.optim.AdamW(params, lr=1e-2)  # noqa: E731
        trainer = Trainer(model, optimizer=opt, parallel=state, data_parallel=data_parallel)
        return trainer, state

    def mine(state, step):  # this DP replica's micro-batches of the step's global batch
        both = batches[2 * step : 2 * step + 2]
        return both if state.dp == 1 else [both[state.dp_rank]]

    saver, state = trainer_at(save_cp, data_parallel)
    for step in range(2):
        saver.step(mine(state, step))
    saver.save_checkpoint(path)
    weights = saver.model.full_state_dict()
    next_loss = saver.step(mine(state, 2))
    tp_ext.distributed.destroy_parallel()
    loader, state = trainer_at(2 if save_cp == 1 else 1)
    loader.load_checkpoint(path)
    for name, tensor in loader.model.full_state_dict().items():
        assert torch.equal(tensor, weights[name]), name
    return next_loss, loader.step(mine(state, 2))


@pytest.mark.parametrize("save_cp, data_parallel", [(2, "ddp"), (1, "ddp"), (2, "zero2")])
def test_checkpoints_reshard_across_cp_degrees(save_cp, data_parallel, tmp_path):
    path = str(tmp_path / "ck")
    for saved, loaded in run_distributed(_checkpoint_across_cp, 2, path, save_cp, data_parallel):
        assert abs(saved - loaded) <= 1e-6 * abs(saved), (saved, loaded)


def test_attention_under_cp_needs_its_positions():
    from tp_ext.layers import ParallelAttention

    attn = ParallelAttention(16, 4, 2, dtype=torch.float64)
    attn.cp = tp_ext.comm.resolve_group(None)  # a group of one suffices for the check
    x = torch.ones(1, 3, 16, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs position_ids .* and seq_len"):
        attn(x)  # without positions it would rotate at 0..2, not this rank's positions
    with pytest.raises(ValueError, match="needs position_ids"):
        attn(x, torch.arange(3).unsqueeze(0))  # no seq_len
