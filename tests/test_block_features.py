"""A transformer block's communication (exactly Megatron's minimum), decoding with the KV cache,
initialisation that does not depend on the TP size, the TP random stream, and bad input."""

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm
from tp_ext.layers import (
    ColumnParallelLinear,
    ParallelAttention,
    ParallelLMHead,
    ParallelTransformerBlock,
    QKVParallelLinear,
    ResolvedGroup,
    RowParallelLinear,
    VocabParallelEmbedding,
    full_state_dict,
)

from .common import full
from .dist_utils import rank, run_distributed, world_size
from .reference import RefAttention, random_state
from .test_layers import LAYER_WORLD_SIZES, assert_rel

HIDDEN, HEADS, HEAD_DIM, INTER = 16, 8, 2, 20


def _block_step(sp: bool, batch: int, seq: int):
    """One forward and backward of an MHA block (8 KV heads: no replicas at <= 8 ranks)."""
    r, w = rank(), world_size()
    block = ParallelTransformerBlock(HIDDEN, HEADS, HEADS, INTER, HEAD_DIM, sequence_parallel=sp)
    X = full((batch, seq, HIDDEN), 1)
    x = (tp_ext.split_tensor(X, 1, w)[r].contiguous() if sp else X).requires_grad_()
    with comm.track() as stats:
        y = block(x, seq_len=seq) if sp else block(x)
        y.sum().backward()
    return stats


def _check_megatron_minimum():
    w = world_size()
    batch, seq = 2, 7
    activation = batch * seq * HIDDEN * 4  # tokens x hidden, fp32
    plain = _block_step(False, batch, seq)
    sp = _block_step(True, batch, seq)
    if w == 1:
        assert plain.records == [] and sp.records == [], "one rank communicates nothing"
        return
    # 2 all-reduces forward (after attention, after the MLP) and 2 backward (the inputs' grads)
    assert plain.count() == 4 and plain.count(collective="all_reduce") == 4, plain.table()
    assert plain.bytes() == 4 * activation, plain.table()
    # Sequence parallel: each all-reduce becomes an all-gather + a reduce-scatter of the same
    # tensor; plus the all-reduce of the two norm weights' partial gradients (Megatron does it too)
    assert sp.count(collective="all_gather") == 4 and sp.count(collective="reduce_scatter") == 4
    assert sp.bytes(collective="all_gather") == 4 * activation, sp.table()
    assert sp.bytes(collective="reduce_scatter") == 4 * activation, sp.table()
    assert sp.count(collective="all_reduce") == 2
    assert sp.bytes(collective="all_reduce") == 2 * HIDDEN * 4, sp.table()
    # the same traffic on the wire for the activations
    assert sp.bus_bytes(w, collective="all_gather") + sp.bus_bytes(
        w, collective="reduce_scatter"
    ) == plain.bus_bytes(w)


# at 8 ranks (23 s on 2 cores) in `make test-all`: the counts follow one formula at every size
@pytest.mark.parametrize(
    "ws",
    [
        pytest.param(ws, marks=pytest.mark.full_matrix) if ws == 8 else ws
        for ws in LAYER_WORLD_SIZES
    ],
)
def test_block_communication_is_megatron_minimum(ws):
    run_distributed(_check_megatron_minimum, ws)


def _check_kv_cache_decoding():
    """Prefill then one token at a time through the cache equals attention over the whole
    sequence (the reference), for GQA with replicated KV heads at 4 and 8 ranks."""
    torch.manual_seed(0)
    ref = RefAttention(HIDDEN, HEADS, 2, HEAD_DIM, 10000.0)
    ref.load_state_dict(random_state(ref, 2))
    attn = ParallelAttention(HIDDEN, HEADS, 2, HEAD_DIM)
    attn.load_full_state_dict(ref.state_dict())
    X = full((2, 9, HIDDEN), 3)
    with torch.no_grad():
        expected = ref(X)
        cache = attn.new_kv_cache(batch=2, max_length=9)
        outs = [attn(X[:, :5], kv_cache=cache)]
        for t in range(5, 9):
            outs.append(attn(X[:, t : t + 1], kv_cache=cache))
        assert cache.length == 9
        assert_rel(torch.cat(outs, 1), expected, "decoding with the KV cache")
        with pytest.raises(ValueError, match="max_length"):
            attn(X[:, :1], kv_cache=cache)
        # explicit position ids (a shifted window, different per sequence), RoPE theta 10000
        positions = torch.stack([torch.arange(5, 14), torch.arange(100, 109)])
        assert_rel(attn(X, position_ids=positions), ref(X, positions), "explicit position ids")


@pytest.mark.parametrize("ws", LAYER_WORLD_SIZES)
def test_kv_cache_decoding_matches_full_attention(ws):
    run_distributed(_check_kv_cache_decoding, ws)


def _build_all(tp_group):
    """Every kind of layer, built from the same seed."""
    torch.manual_seed(1234)
    return torch.nn.ModuleDict(
        {
            "block": ParallelTransformerBlock(HIDDEN, HEADS, 2, INTER, HEAD_DIM, tp_group=tp_group),
            "embed": VocabParallelEmbedding(1001, HIDDEN, padding_idx=0, tp_group=tp_group),
            "head": ParallelLMHead(1001, HIDDEN, tp_group=tp_group),
            "column": ColumnParallelLinear(HIDDEN, 10, tp_group=tp_group),
            "row": RowParallelLinear(10, HIDDEN, tp_group=tp_group),
        }
    )


def _check_init_is_tp_invariant():
    gathered = full_state_dict(_build_all(None))
    single = _build_all(ResolvedGroup.local()).state_dict()
    assert gathered.keys() == single.keys()
    for name, value in single.items():
        assert torch.equal(gathered[name], value), f"{name} differs from the TP=1 model"
    # and a ColumnParallelLinear draws exactly what torch.nn.Linear draws
    torch.manual_seed(5)
    col = ColumnParallelLinear(6, 10)
    torch.manual_seed(5)
    lin = torch.nn.Linear(6, 10)
    got = col.full_state_dict()
    assert torch.equal(got["weight"], lin.weight) and torch.equal(got["bias"], lin.bias)


@pytest.mark.parametrize("ws", [2, 3, 8])
def test_initialisation_does_not_depend_on_tp_size(ws):
    run_distributed(_check_init_is_tp_invariant, ws)


def _check_rng():
    w = world_size()
    tp_ext.random.manual_seed(42)
    replicated_before = torch.rand(64)
    with tp_ext.random.tp_rng():
        sharded = torch.rand(64)
        mask = torch.nn.functional.dropout(torch.ones(64), 0.5)
    replicated_after = torch.rand(64)
    every = [
        torch.stack(comm.all_gather(t[None], 0).unbind(0))
        for t in (replicated_before, sharded, mask, replicated_after)
    ]
    for name, rows in zip(("before", "tp", "mask", "after"), every):
        same = all(torch.equal(rows[0], rows[k]) for k in range(w))
        if name in ("before", "after"):
            assert same, f"replicated-region draws ({name}) differ across TP ranks"
        else:
            assert w == 1 or not any(
                torch.equal(rows[i], rows[j]) for i in range(w) for j in range(i + 1, w)
            ), f"{name}: TP ranks repeat"
    # the replicated stream advanced by the one draw the block took (tests/test_rng.py)
    tp_ext.random.manual_seed(42)
    assert torch.equal(torch.rand(64), replicated_before)
    torch.randint(0, 2**62, ())
    assert torch.equal(torch.rand(64), replicated_after)


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_tp_random_stream(ws):
    run_distributed(_check_rng, ws)


def _check_bad_input():
    w = world_size()
    with pytest.raises(ValueError, match=r"last dimension must be in_features = 6"):
        ColumnParallelLinear(6, 10)(torch.zeros(2, 5))
    with pytest.raises(ValueError, match=r"this rank's share of in_features=10"):
        RowParallelLinear(10, 6)(torch.zeros(2, 10 + 1))
    with pytest.raises(ValueError, match="num_heads=6 must be a multiple of num_kv_heads=4"):
        QKVParallelLinear(12, 2, 6, 4)
    if w == 8:
        with pytest.raises(
            ValueError, match=r"cannot be split over 8 ranks.*one of \[1, 2, 3, 4, 5, 6\]"
        ):
            ParallelAttention(12, 6, 6, 2)
    with pytest.raises(KeyError, match="missing keys"):
        ColumnParallelLinear(6, 10).load_full_state_dict({"weight": torch.zeros(10, 6)})
    if w > 1:
        layer = ColumnParallelLinear(6, 10)
        with pytest.raises(ValueError, match="expected the unsharded shape"):
            layer.load_full_state_dict({"weight": layer.weight.detach(), "bias": torch.zeros(10)})
        with pytest.raises(ValueError, match="same tp_group"):
            ParallelLMHead(
                11,
                4,
                tie_to=VocabParallelEmbedding(11, 4, tp_group=ResolvedGroup.local()),
                tp_group=dist.group.WORLD,
            )
    with pytest.raises(ValueError, match="outside the vocabulary"):
        VocabParallelEmbedding(11, 4)(torch.tensor([3, 11]))
    if w > 1:  # 5 positions cannot be this rank's share of 7
        block = ParallelTransformerBlock(HIDDEN, HEADS, 2, INTER, HEAD_DIM, sequence_parallel=True)
        with pytest.raises(ValueError, match=r"seq_len=7 over \d ranks gives this rank"):
            block(torch.zeros(1, 5, HIDDEN), seq_len=7)
    with pytest.raises(ValueError, match="gather_output=True cannot be combined"):
        ColumnParallelLinear(6, 10, gather_output=True, sequence_parallel=True)


@pytest.mark.parametrize("ws", [1, 2, 8])
def test_bad_input_gives_clear_errors(ws):
    run_distributed(_check_bad_input, ws)


def _check_uneven_sequence_shards_without_seq_len():
    r, w = rank(), world_size()
    x = tp_ext.split_tensor(full((1, 2 * w - 1, HIDDEN), 1), 1, w)[r].contiguous()  # 2, .., 1
    hint = "need that length on every rank: seq_len= on tp_ext's layers"
    # with the consistency checks (on in these tests), then without: the shared-memory channel
    for checks, error in ((True, ValueError), (False, RuntimeError)):
        comm.set_consistency_checks(checks)
        group = dist.new_group(list(range(w)))  # a failed collective retires a group's channel
        block = ParallelTransformerBlock(
            HIDDEN, HEADS, HEADS, INTER, HEAD_DIM, sequence_parallel=True, tp_group=group
        )
        with pytest.raises(error, match=hint):
            block(x)
    comm.set_consistency_checks(None)


@pytest.mark.parametrize("ws", [2, 3])
def test_uneven_sequence_shards_without_seq_len_say_to_pass_it(ws):
    run_distributed(_check_uneven_sequence_shards_without_seq_len, ws)
