"""Random numbers under TP (tp_ext.random): nested blocks continue one stream, TP ranks differ and
DP replicas agree, recomputation under torch.utils.checkpoint reproduces the forward's dropout
masks exactly (reentrant and not), the states round-trip through a weights_only checkpoint, and
bad input gets a clear error."""

import io

import pytest
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import tp_ext
from tp_ext import comm
from tp_ext.distributed.rng import _stream_seed
from tp_ext.layers import ParallelAttention

from .dist_utils import rank, run_distributed, world_size
from .test_layers import assert_rel


def _tp_stream(seed: int, tp_rank: int, n: int) -> torch.Tensor:
    """What one tp_rng block on ``tp_rank`` draws first after manual_seed(seed): the reference."""
    torch.manual_seed(seed)
    draw = int(torch.randint(0, 2**62, ()).item())
    return torch.rand(n, generator=torch.Generator().manual_seed(_stream_seed(draw, tp_rank)))


def _check_nested_blocks_continue_the_stream():
    tp_ext.random.manual_seed(5)
    with tp_ext.random.tp_rng():
        a = torch.rand(8)
        with tp_ext.random.tp_rng():
            b = torch.rand(8)
        c = torch.rand(8)
    after = torch.rand(8)
    expected = _tp_stream(5, rank(), 24)
    assert torch.equal(torch.cat([a, b, c]), expected), "nested blocks must continue one stream"
    # the replicated stream moved by exactly the one draw the block took, on every rank
    torch.manual_seed(5)
    torch.randint(0, 2**62, ())
    assert torch.equal(after, torch.rand(8))
    rows = comm.all_gather(after[None], 0)
    assert all(torch.equal(rows[0], rows[k]) for k in range(world_size()))


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_nested_blocks_continue_the_stream(ws):
    run_distributed(_check_nested_blocks_continue_the_stream, ws)


def _check_tp_ranks_differ_dp_replicas_agree():
    state = tp_ext.init_parallel(tp=2)
    tp_ext.random.manual_seed(11)  # the TP group of init_parallel
    with tp_ext.random.tp_rng():
        mask = torch.nn.functional.dropout(torch.ones(256), 0.5)
    rows = comm.all_gather(mask[None], 0, group=dist.group.WORLD)
    tp_rank = [r % 2 for r in range(world_size())]  # TP ranks are adjacent
    for i in range(world_size()):
        for j in range(i + 1, world_size()):
            same = torch.equal(rows[i], rows[j])
            assert same == (tp_rank[i] == tp_rank[j]), (i, j, same)
    return state.dp


def test_tp_ranks_differ_and_dp_replicas_agree():
    assert run_distributed(_check_tp_ranks_differ_dp_replicas_agree, 4) == [2] * 4


def _dropout_mlp(x, w1, w2):
    with tp_ext.random.tp_rng():
        h = torch.nn.functional.dropout(torch.relu(x @ w1), 0.5)
        with tp_ext.random.tp_rng():  # nested, as a layer inside a dropout region would be
            h = torch.nn.functional.dropout(h, 0.3)
    return h @ w2


def _grads(use_checkpoint, reentrant):
    g = torch.Generator().manual_seed(3)
    x, w1, w2 = (
        torch.randn(*s, generator=g, requires_grad=True) for s in ((4, 8), (8, 16), (16, 8))
    )
    tp_ext.random.manual_seed(21)
    if use_checkpoint:
        y = checkpoint(_dropout_mlp, x, w1, w2, use_reentrant=reentrant)
    else:
        y = _dropout_mlp(x, w1, w2)
    y.pow(2).sum().backward()
    return y.detach(), x.grad, w1.grad, w2.grad


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non_reentrant"])
def test_recompute_reproduces_the_dropout_masks(reentrant):
    tp_ext.distributed.state.PROCESS.reset()
    from tp_ext.distributed.state import PROCESS

    PROCESS.tp_rng_rank = 0  # a single process is TP rank 0
    expected = _grads(False, reentrant)
    got = _grads(True, reentrant)
    for name, a, b in zip(("output", "dx", "dw1", "dw2"), got, expected):
        assert torch.equal(a, b), f"{name} differs under checkpoint(use_reentrant={reentrant})"
    PROCESS.reset()


def _check_attention_dropout_under_checkpoint():
    torch.manual_seed(0)
    layer = ParallelAttention(32, 4, 2, dropout=0.5).train()
    x0 = torch.randn(2, 6, 32, generator=torch.Generator().manual_seed(1))
    results = []
    for reentrant in (None, True, False):
        x = x0.clone().requires_grad_()
        tp_ext.random.manual_seed(9)
        y = layer(x) if reentrant is None else checkpoint(layer, x, use_reentrant=reentrant)
        layer.zero_grad()
        y.pow(2).sum().backward()
        results.append((y.detach(), x.grad, layer.qkv_proj.weight.grad.clone()))
    for got in results[1:]:
        for a, b in zip(got, results[0]):
            assert_rel(a, b, "attention dropout under checkpoint", 0)


@pytest.mark.parametrize("ws", [2, 3])
def test_attention_dropout_under_checkpoint_matches_no_checkpoint(ws):
    run_distributed(_check_attention_dropout_under_checkpoint, ws)


def _check_states_round_trip():
    tp_ext.random.manual_seed(17)
    torch.rand(3)
    states = tp_ext.random.get_states()
    buffer = io.BytesIO()
    torch.save(states, buffer)  # what a checkpoint holds: plain tensors and ints
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)

    def draws():
        replicated = torch.rand(5)
        with tp_ext.random.tp_rng():
            sharded = torch.rand(5)
        return torch.cat([replicated, sharded, torch.rand(5)])

    first = draws()
    torch.manual_seed(123)  # somewhere else entirely
    tp_ext.random.set_states(loaded)
    assert torch.equal(draws(), first)
    assert loaded["tp_rank"] == rank()


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_states_round_trip_through_a_weights_only_checkpoint(ws):
    run_distributed(_check_states_round_trip, ws)


def _check_bad_input():
    from tp_ext.distributed.state import PROCESS

    PROCESS.reset()
    with pytest.raises(RuntimeError, match="manual_seed"):
        with tp_ext.random.tp_rng():
            pass
    for seed in (-1, True, 1.5, 2**63, "7"):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*63 - 1\]"):
            tp_ext.random.manual_seed(seed)
    tp_ext.random.manual_seed(1)
    with tp_ext.random.tp_rng():
        for fn, args in ((tp_ext.random.get_states, ()), (tp_ext.random.manual_seed, (2,))):
            with pytest.raises(RuntimeError, match="inside a tp_rng"):
                fn(*args)
    states = tp_ext.random.get_states()
    with pytest.raises(ValueError, match="keys 'cpu', 'cuda', 'tp_rank'"):
        tp_ext.random.set_states({"cpu": states["cpu"]})
    with pytest.raises(ValueError, match=r"states\['cpu'\] must be a 1-d uint8 tensor"):
        tp_ext.random.set_states({**states, "cpu": states["cpu"].float()})
    with pytest.raises(ValueError, match=r"states\['cuda'\] must list one state per CUDA"):
        tp_ext.random.set_states({**states, "cuda": [states["cpu"]] * 3})
    if world_size() > 1:
        other = (rank() + 1) % world_size()
        with pytest.raises(ValueError, match=f"taken on TP rank {other}"):
            tp_ext.random.set_states({**states, "tp_rank": other})


@pytest.mark.parametrize("ws", [1, 2])
def test_bad_input_gives_clear_errors(ws):
    run_distributed(_check_bad_input, ws)
