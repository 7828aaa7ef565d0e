"""Tied embeddings on a P x Q grid of 2D tensor parallelism: one ``[vocab, hidden]`` parameter
in the embedding's blocks, which the LM head reads in its own layout through one all-to-all
over the grid (``tp_ext.layers.regrid``; the tied layers themselves: tests/test_summa_layers.py).
Against the unsharded references: the exchange, the 2D Qwen2 with ``tie_word_embeddings=True``
against transformers' (Trainer steps: losses, gradient norms, weights) at 2x1, 1x2 and 2x2, in
pipeline stages (a copy on each end, gradients summed) and beside DP (DDP, FSDP2, ZeRO); its
logits, greedy decoding with a KV cache and Hugging Face checkpoints (the tie read and written
once); training checkpoints between tied grids, 1D TP and pipeline stages. fp32, 1e-5
relative; a vocabulary (1001) no grid dimension divides."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

import tp_ext
from tests.common import full
from tests.dist_utils import run_distributed
from tests.reference import hf_qwen2, train_in_one_process
from tests.test_generate import NEW, _prompts
from tests.test_pipeline import (
    MAX_NORM,
    STEPS,
    _config,
    _micro_batches,
    _optimizer,
    _train,
    _virtual,
    assert_training_matches,
)
from tests.test_summa_layers import _grid, assert_rel, check_resharding
from tp_ext.models import Qwen2ForCausalLM

HEAD = "lm_head.weight"  # a tied model's head: the embedding's tensor

# ---- the exchange of blocks -------------------------------------------------------------------


def _regrid_parity(rows: int, cols: int):
    from tp_ext.layers import regrid
    from tp_ext.layers.summa_blocks import TiedLMHead2D, table_block

    grid = _grid(rows, cols)
    vocab, hidden = 13, 7  # no grid dimension divides either
    table = full((vocab, hidden), 3)
    head = TiedLMHead2D(vocab, hidden, grid)
    src, dst = table_block(vocab, hidden, grid), head.product_block
    mine = src.take(table, grid.row, grid.col).clone().requires_grad_()
    out = regrid(mine, src, dst, grid)
    assert torch.equal(out, dst.take(table, grid.row, grid.col))
    upstream = full((vocab, hidden), 4)
    (out * dst.take(upstream, grid.row, grid.col)).sum().backward()
    assert torch.equal(mine.grad, src.take(upstream, grid.row, grid.col))  # sent back


@pytest.mark.parametrize("rows, cols", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 3), (3, 2)])
def test_regrid_moves_blocks_exactly(rows, cols):
    run_distributed(_regrid_parity, rows * cols, rows, cols)


def test_a_tied_head_refuses_a_mismatched_embedding():
    from tp_ext.distributed.grid import make_tp_grid
    from tp_ext.layers import Embedding2D, TiedLMHead2D

    grid = make_tp_grid(1, 1)
    with pytest.raises(ValueError, match="tie_to has shape \\(5, 3\\)"):
        TiedLMHead2D(6, 3, grid, tie_to=Embedding2D(5, 3, grid))


# ---- Trainer steps against transformers' tied Qwen2 ---------------------------------------------


@functools.lru_cache(maxsize=None)
def _reference(layers: int, total_micro_batches: int):
    """transformers' tied Qwen2 trained in one process on every replica's micro-batches: losses,
    norms before clipping, and the weights after (its names; the tie once, as the embedding)."""
    config = _config(layers, True)
    hf = hf_qwen2(config)
    batches = _micro_batches(config, total_micro_batches)
    losses, norms = train_in_one_process(hf, batches, STEPS, _optimizer(hf.parameters()), MAX_NORM)
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items() if k != HEAD}
    return losses, norms, weights


def _micro(case) -> int:
    grid, pp, dp, schedule, data_parallel, layers = case
    return max(2, pp * _virtual(schedule))


def _check_training(case):
    """tests/test_pipeline.py's training run, on a grid: its losses, norms and weights."""
    grid, pp, dp, schedule, data_parallel, layers = case
    world, micro = grid[0] * grid[1] * pp * dp, _micro(case)
    args = (grid, pp, dp, schedule, data_parallel, layers, True, micro)
    results = run_distributed(_train, world, *args, timeout=300)
    ref_losses, ref_norms, ref_weights = _reference(layers, micro * dp)
    assert_training_matches(results, ref_losses, ref_norms, ref_weights)


def _case_id(case) -> str:
    grid, pp, dp, schedule, data_parallel, layers = case
    parts = [f"grid{grid[0]}x{grid[1]}", f"pp{pp}", f"dp{dp}"]
    return "-".join(parts + ([schedule] if pp > 1 else []) + [data_parallel])


# grid, pp, dp, schedule, data_parallel, layers
TRAINING = [
    ((2, 1), 1, 1, "1F1B", "ddp", 2),
    ((1, 2), 1, 1, "1F1B", "ddp", 2),
    ((2, 2), 1, 1, "1F1B", "ddp", 2),
    ((2, 1), 2, 1, "1F1B", "ddp", 2),  # a copy on each end, gradients summed
    ((2, 1), 1, 2, "1F1B", "fsdp", 2),
    ((1, 2), 1, 2, "1F1B", "zero2", 2),
]
TRAINING_FULL = [
    ((2, 1), 2, 1, "ZBVZeroBubble", "ddp", 4),  # both ends on pipeline rank 0
    ((1, 2), 2, 2, "Interleaved1F1B", "fsdp", 4),
    ((2, 2), 2, 1, "GPipe", "ddp", 2),
    ((2, 2), 1, 2, "1F1B", "zero1", 2),
    ((1, 2), 2, 2, "1F1B", "zero2", 2),
    ((3, 2), 1, 1, "1F1B", "ddp", 2),  # three grid rows: uneven blocks of every size
]


@pytest.mark.parametrize(
    "case",
    TRAINING + [pytest.param(c, marks=pytest.mark.full_matrix) for c in TRAINING_FULL],
    ids=_case_id,
)
def test_tied_2d_training_matches_transformers(case):
    _check_training(case)


# ---- Hugging Face checkpoints and decoding -----------------------------------------------------


def _tied_checkpoint_case(grid, pp: int, tmp: str):
    """A tied transformers checkpoint (the embedding's tensor only) read by the 2D model: its
    logits and greedy tokens (a KV cache, left-padded prompts) are transformers', and its save
    holds the tie once and loads back into transformers bitwise."""
    import transformers
    from safetensors import safe_open

    config = _config(2, True)
    reference = hf_qwen2(config, seed=3).double().eval()
    source, saved = os.path.join(tmp, "source"), os.path.join(tmp, "saved")
    if dist.get_rank() == 0:
        reference.save_pretrained(source)
    dist.barrier()
    state = tp_ext.init_parallel(tp=grid, pp=pp)
    model = Qwen2ForCausalLM.from_pretrained(source, parallel=state, dtype=torch.float64)
    if pp == 1:  # one parameter; under pipelining a copy on each end, summed over a pair
        assert model.lm_head.weight is model.model.embed_tokens.weight
    assert len(model.tied_weights()) == int(pp > 1) and (model.tied_group() is None) == (pp == 1)
    ids, mask = _prompts()
    with torch.no_grad():
        assert_rel(model(ids), reference(ids).logits, "tied logits against transformers")
    want = reference.generate(
        ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0
    )
    with tp_ext.comm.track() as stats:
        got = tp_ext.generate(model, ids, mask, max_new_tokens=NEW)
    assert torch.equal(got, want), (got, want)
    exchanges = stats.count(collective="all_to_all_v")  # the head's blocks: once, not per token
    assert exchanges == (1 if model.lm_head is not None else 0), exchanges
    model.save_pretrained(saved)
    dist.barrier()
    with safe_open(os.path.join(saved, "model.safetensors"), framework="pt") as f:
        assert HEAD not in f.keys() and "model.embed_tokens.weight" in f.keys()
    back = transformers.Qwen2ForCausalLM.from_pretrained(saved, dtype=torch.float64)
    assert back.lm_head.weight is back.model.embed_tokens.weight
    for name, tensor in reference.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    return model.stage_ids


@pytest.mark.parametrize(
    "grid, pp",
    [((2, 1), 1), ((1, 2), 2), pytest.param((2, 2), 1, marks=pytest.mark.full_matrix)],
    ids=str,
)
def test_tied_2d_checkpoints_and_decoding_match_transformers(grid, pp, tmp_path):
    world = grid[0] * grid[1] * pp
    stages = run_distributed(_tied_checkpoint_case, world, grid, pp, str(tmp_path), timeout=300)
    assert sorted({tuple(s) for s in stages}) == [(s,) for s in range(pp)]


# ---- training checkpoints: a tied grid <-> another grid, 1D, pipeline stages -------------------


@pytest.mark.parametrize(
    "saved_at, resumed_at",
    [
        ((2, 1), [(1, 2), 2, ((2, 1), 2)]),
        (((1, 2), 2), [(2, 1), {"tp": 1, "pp": 2}]),  # the head's copy saved once, read by both
        (2, [(1, 2)]),  # from 1D TP
        pytest.param(
            {"tp": (2, 1), "pp": 2, "schedule": "ZBVZeroBubble"},  # both ends on pipeline rank
            [(1, 2), {"tp": (2, 1), "pp": 2, "schedule": "ZBVZeroBubble"}],  # 0: two copies
            marks=pytest.mark.full_matrix,
        ),
    ],
    ids=str,
)
def test_tied_2d_training_checkpoints_reshard(tmp_path, saved_at, resumed_at):
    check_resharding(tmp_path, saved_at, resumed_at, tie_word_embeddings=True, num_hidden_layers=4)
