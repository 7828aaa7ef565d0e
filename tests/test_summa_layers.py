"""2D tensor parallelism (SUMMA) layers on P x Q grids against their unsharded references: the
grid groups of ``init_parallel(tp=(P, Q))``, ``Linear2D`` with ``split_2d`` / ``gather_2d``, the
2D embedding (and the LM head tied to it), RMSNorm and cross-entropy, and the 2D Qwen2 against
transformers (logits, loss and a Trainer step). fp32, 1e-5 relative; uneven sizes everywhere
(T = 7 tokens, 13 -> 11 features, vocabularies and hidden sizes that no grid dimension
divides)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.common import full
from tests.dist_utils import run_distributed
from tests.reference import hf_qwen2

GRIDS = [(1, 1), (2, 2), (2, 3), (3, 2), (1, 4), (4, 1)]
RTOL = 1e-5


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    scale = expected.double().norm().item()
    return (actual.double() - expected.double()).norm().item() / max(scale, 1e-30)


def assert_rel(actual, expected, what: str, rtol: float = RTOL) -> None:
    err = rel_err(actual, expected)
    assert err <= rtol, f"{what}: relative error {err:.3g} > {rtol:g}"


def _grid(rows: int, cols: int):
    from tp_ext.distributed.grid import make_tp_grid

    return make_tp_grid(rows, cols, dist.group.WORLD)


# ---- Linear2D -----------------------------------------------------------------------------------


def _linear_parity(rows: int, cols: int, tokens: int, n_in: int, n_out: int, bias: bool):
    from tp_ext.layers import Linear2D, gather_2d, split_2d

    grid = _grid(rows, cols)
    x = full((tokens, n_in), 1).requires_grad_()
    w, b = full((n_out, n_in), 2), full((n_out,), 3)
    upstream = full((tokens, n_out), 4)
    lin = Linear2D(n_in, n_out, bias, grid)
    lin.load_full_state_dict({"weight": w, "bias": b} if bias else {"weight": w})
    y = gather_2d(lin(split_2d(x, grid)), grid)
    (y * upstream).sum().backward()

    w_ref = w.clone().requires_grad_()
    b_ref = b.clone().requires_grad_() if bias else None
    x_ref = x.detach().clone().requires_grad_()
    y_ref = F.linear(x_ref, w_ref, b_ref)
    (y_ref * upstream).sum().backward()
    assert_rel(y, y_ref, "output")
    assert_rel(x.grad, x_ref.grad, "input gradient")
    block = lin.grid_block("weight")
    assert_rel(lin.weight.grad, block.take(w_ref.grad, grid.row, grid.col), "weight gradient")
    state = lin.full_state_dict()
    assert torch.equal(state["weight"], w)
    if bias:
        bias_block = lin.grid_block("bias").take(b_ref.grad, grid.row, grid.col)
        assert_rel(lin.bias.grad, bias_block, "bias gradient")
        assert torch.equal(state["bias"], b)
    return tuple(lin.weight.shape)


@pytest.mark.parametrize("rows, cols", GRIDS)
def test_linear2d_equals_the_unsharded_layer(rows, cols):
    shapes = run_distributed(_linear_parity, rows * cols, rows, cols, 7, 13, 11, True)
    # each rank holds its block: out over the columns, in over the rows (uneven)
    from tp_ext import shard_sizes

    expected = [
        (shard_sizes(11, cols)[r % cols], shard_sizes(13, rows)[r // cols])
        for r in range(rows * cols)
    ]
    assert shapes == expected


def test_linear2d_with_empty_blocks():
    # 3 input features over 4 grid rows: one weight block is empty; 2 tokens over 4 rows too
    run_distributed(_linear_parity, 4, 4, 1, 2, 3, 5, False)
    run_distributed(_linear_parity, 4, 1, 4, 3, 2, 3, True)


# ---- the grid of init_parallel ------------------------------------------------------------------


def _grid_of_init_parallel(rows: int, cols: int, dp: int):
    import tp_ext

    state = tp_ext.init_parallel(tp=(rows, cols), dp=dp)
    grid = state.tp_grid
    assert state.tp == rows * cols and grid.shape == (rows, cols)
    assert (grid.row, grid.col) == divmod(state.tp_rank, cols)
    row_ranks = dist.get_process_group_ranks(grid.row_group.group)
    col_ranks = dist.get_process_group_ranks(grid.col_group.group)
    tp_ranks = dist.get_process_group_ranks(state.tp_group)
    assert row_ranks == [tp_ranks[grid.row * cols + c] for c in range(cols)]
    assert col_ranks == [tp_ranks[r * cols + grid.col] for r in range(rows)]
    assert tp_ext.init_parallel(tp=(rows, cols), dp=dp) is state  # same dims: same groups
    return grid.row_group.rank, grid.col_group.rank


@pytest.mark.parametrize("rows, cols, dp", [(2, 2, 1), (1, 2, 2), (2, 1, 2)])
def test_init_parallel_makes_the_grid(rows, cols, dp):
    out = run_distributed(_grid_of_init_parallel, rows * cols * dp, rows, cols, dp)
    assert out == [(r % cols, (r // cols) % rows) for r in range(rows * cols * dp)]


def test_bad_grids_are_refused():
    import tp_ext
    from tp_ext.distributed.grid import make_tp_grid
    from tp_ext.layers import Linear2D

    for bad in [(2,), (0, 2), (2, 1.5), "2x2", (True, 2)]:
        with pytest.raises(ValueError, match="a pair \\(P, Q\\) of ints >= 1"):
            tp_ext.init_parallel(tp=bad)
    with pytest.raises(ValueError, match="a 2 x 2 grid needs 4 ranks, but the TP group has 1"):
        make_tp_grid(2, 2)
    grid = make_tp_grid(1, 1)
    with pytest.raises(ValueError, match="in_sizes must list 1 sizes"):
        Linear2D(4, 4, grid=grid, in_sizes=[2, 2])
    lin = Linear2D(4, 3, grid=grid)
    with pytest.raises(ValueError, match="last dimension must be this grid column's share"):
        lin(torch.ones(2, 5))
    from tp_ext.layers.summa import linear_2d_shared_input

    with pytest.raises(ValueError, match="the same in_sizes; got \\(4,\\) and \\(5,\\)"):
        linear_2d_shared_input(torch.ones(2, 4), [lin, Linear2D(5, 3, grid=grid)])


# ---- embedding, norm and loss -------------------------------------------------------------------


def _blocks_parity(rows: int, cols: int):
    from tp_ext.layers import (
        Embedding2D,
        RMSNorm2D,
        TiedLMHead2D,
        cross_entropy_2d,
        gather_2d,
        split_2d,
    )
    from tp_ext.sharding import shard_range

    grid = _grid(rows, cols)
    vocab, hidden, batch, seq = 29, 11, 5, 3
    # embedding: whole ids on every rank -> block (i, j) of [batch, seq, hidden]
    table = full((vocab, hidden), 5)
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(6))
    emb = Embedding2D(vocab, hidden, grid)
    emb.load_full_state_dict({"weight": table})
    out = emb(ids)
    upstream = full((batch, seq, hidden), 7)
    (gather_2d(out, grid) * upstream).sum().backward()
    ref_table = table.clone().requires_grad_()
    ref = F.embedding(ids, ref_table)
    (ref * upstream).sum().backward()
    assert_rel(gather_2d(out.detach(), grid), ref, "embedding output")
    block = emb.grid_block("weight")
    assert_rel(emb.weight.grad, block.take(ref_table.grad, grid.row, grid.col), "embedding grad")

    # the LM head tied to it: one parameter, its gradient summed from both uses
    head = TiedLMHead2D(vocab, hidden, grid, tie_to=emb)
    assert head.weight is emb.weight
    emb.weight.grad = ref_table.grad = None
    logits = head(emb(ids) * 0.5)
    dlogits = full((batch, seq, vocab), 12)
    (gather_2d(logits, grid) * dlogits).sum().backward()
    ((ref_table[ids] * 0.5) @ ref_table.t() * dlogits).sum().backward()
    ref = (table[ids] * 0.5) @ table.t()
    assert_rel(gather_2d(logits.detach(), grid), ref, "tied logits")
    assert_rel(emb.weight.grad, block.take(ref_table.grad, grid.row, grid.col), "tied grad")
    with torch.no_grad():
        plain = head(emb(ids))
        with head.held():  # decoding: the exchanged blocks kept, the same logits
            assert torch.equal(head(emb(ids)), plain)

    # RMSNorm on feature blocks (Hugging Face's formula)
    x = full((batch, seq, hidden), 8).requires_grad_()
    weight = full((hidden,), 9)
    norm = RMSNorm2D(hidden, 1e-6, grid)
    norm.load_full_state_dict({"weight": weight})
    y = gather_2d(norm(split_2d(x, grid)), grid)
    (y * upstream).sum().backward()
    x_ref, w_ref = x.detach().clone().requires_grad_(), weight.clone().requires_grad_()
    h = x_ref * torch.rsqrt(x_ref.pow(2).mean(-1, keepdim=True) + 1e-6)
    y_ref = w_ref * h
    (y_ref * upstream).sum().backward()
    assert_rel(y, y_ref, "rmsnorm output")
    assert_rel(x.grad, x_ref.grad, "rmsnorm input grad")
    w_block = norm.grid_block("weight").take(w_ref.grad, grid.row, grid.col)
    assert_rel(norm.weight.grad, w_block, "rmsnorm weight grad (summed over the grid rows)")

    # the cross-entropy of 2D logits, without gathering them
    logits = full((batch, seq, vocab), 10).requires_grad_()
    target = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(11))
    target[0, 0] = -100
    start, count = shard_range(batch, grid.rows, grid.row)
    for reduction in ("mean", "sum"):
        logits.grad = None
        loss = cross_entropy_2d(
            split_2d(logits, grid), target[start : start + count], grid, reduction=reduction
        )
        loss.backward()
        ref_logits = logits.detach().clone().requires_grad_()
        ref_loss = F.cross_entropy(ref_logits.view(-1, vocab), target.view(-1), reduction=reduction)
        ref_loss.backward()
        assert_rel(loss.detach().view(1), ref_loss.detach().view(1), f"loss ({reduction})")
        # split_2d's backward gathers every rank's block gradient: the whole gradient
        assert_rel(logits.grad, ref_logits.grad * 1, f"logits grad ({reduction})")


@pytest.mark.parametrize("rows, cols", [(1, 1), (2, 2), (2, 3), (3, 1)])
def test_embedding_norm_and_loss_equal_the_unsharded_ones(rows, cols):
    run_distributed(_blocks_parity, rows * cols, rows, cols)


# ---- the 2D Qwen2 against transformers ----------------------------------------------------------


def _tiny_config():
    from tp_ext.models import Qwen2Config

    return Qwen2Config.from_dict(
        dict(
            vocab_size=301,  # no grid dimension divides it
            hidden_size=64,
            intermediate_size=97,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=4,  # up to 4 grid columns, whole KV heads
            max_position_embeddings=64,
            rope_theta=10000.0,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        )
    )


def _qwen2_against_transformers(rows: int, cols: int, tmp: str):
    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM, Qwen2ForCausalLM2D
    from tp_ext.training import Trainer

    config = _tiny_config()
    reference = hf_qwen2(config, seed=3)
    if dist.get_rank() == 0:
        reference.save_pretrained(tmp)
    dist.barrier()
    state = tp_ext.init_parallel(tp=(rows, cols))
    model = Qwen2ForCausalLM.from_pretrained(tmp, parallel=state)
    assert isinstance(model, Qwen2ForCausalLM2D)
    ids = torch.randint(0, config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_rel(model(ids), reference(ids).logits, "logits against transformers")
    # one training step (AdamW, no clipping) against transformers' own loss and AdamW
    trainer = Trainer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2),
        parallel=state,
        max_grad_norm=1.0,
    )
    loss = trainer.step([ids[:3], ids[3:]])
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_loss = reference(ids, labels=ids).loss
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    ref_opt.step()
    assert abs(loss - ref_loss.item()) <= RTOL * abs(ref_loss.item()), (loss, ref_loss.item())
    assert abs(trainer.last_grad_norm - ref_norm.item()) <= 1e-4 * ref_norm.item()
    trained = model.full_state_dict()
    for name, tensor in reference.state_dict().items():
        assert_rel(trained[name], tensor, f"{name} after a step", rtol=1e-4)
    return tuple(model.lm_head.weight.shape)


@pytest.mark.parametrize("rows, cols", [(2, 2), (2, 3), (3, 2), (1, 4), (4, 1)])
def test_qwen2_2d_matches_transformers(rows, cols, tmp_path):
    run_distributed(
        _qwen2_against_transformers, rows * cols, rows, cols, str(tmp_path), timeout=300
    )


def _pipelined_2d_model(rows: int, cols: int, pp: int, tmp: str):
    """A 2D model over ``pp`` pipeline stages (one decoder layer each) read from a transformers
    checkpoint: its logits (the stages run one after another) equal transformers', and its
    merged save loads back into transformers bitwise."""
    import transformers

    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM, Qwen2ForCausalLM2D

    config = _tiny_config()
    reference = hf_qwen2(config, seed=3)
    source, saved = os.path.join(tmp, "source"), os.path.join(tmp, "saved")
    if dist.get_rank() == 0:
        reference.save_pretrained(source)
    dist.barrier()
    state = tp_ext.init_parallel(tp=(rows, cols), pp=pp)
    model = Qwen2ForCausalLM.from_pretrained(source, parallel=state)
    assert isinstance(model, Qwen2ForCausalLM2D) and len(model.model.layers) == 2 // pp
    ids = torch.randint(0, config.vocab_size, (5, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert_rel(model(ids), reference(ids).logits, "logits against transformers")
    model.save_pretrained(saved)
    dist.barrier()
    back = transformers.Qwen2ForCausalLM.from_pretrained(saved, dtype=torch.float32)
    for name, tensor in reference.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name
    return model.stage_ids


@pytest.mark.parametrize(
    "rows, cols, pp",
    [
        (2, 1, 2),
        pytest.param(1, 2, 2, marks=pytest.mark.full_matrix),
        pytest.param(2, 2, 1, marks=pytest.mark.full_matrix),
    ],
)
def test_a_2d_model_in_pipeline_stages_loads_runs_and_saves(rows, cols, pp, tmp_path):
    stages = run_distributed(
        _pipelined_2d_model, rows * cols * pp, rows, cols, pp, str(tmp_path), timeout=300
    )
    assert sorted({tuple(s) for s in stages}) == [(s,) for s in range(pp)]


# ---- training checkpoints: 2D <-> 2D at another grid, and 2D <-> 1D -----------------------------

STEPS, SAVE_AT = 4, 2


def _train_steps(dims, path: str, load: bool, changes: dict):
    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM
    from tp_ext.training import Trainer

    from .test_pipeline import _stage_order, _virtual

    torch.manual_seed(5)
    degrees = _degrees(dims)
    schedule = degrees.pop("schedule", "1F1B")
    state = tp_ext.init_parallel(**degrees)
    config = _tiny_config().replace(**changes)
    stages = dict(virtual_stages=_virtual(schedule), stage_order=_stage_order(schedule))
    model = Qwen2ForCausalLM.from_config(config, parallel=state, **stages)
    trainer = Trainer(
        model,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3),
        parallel=state,
        schedule=schedule,
        max_grad_norm=1.0,
    )
    if load:
        trainer.load_checkpoint(path)
    losses = {}
    while trainer.steps < STEPS:
        step = trainer.steps + 1
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, 301, (4, 8), generator=g)
        micro = 2 * stages["virtual_stages"]  # a micro-batch per stage at least
        losses[step] = trainer.step(list(ids.split(4 // micro)))
        if not load and trainer.steps == SAVE_AT:
            trainer.save_checkpoint(path)
    return losses


def _degrees(dims) -> dict:
    """``init_parallel``'s keywords (and a ``schedule``): a TP degree, a grid, ``(grid, pp)``,
    or the keywords themselves."""
    if isinstance(dims, dict):
        return dict(dims)
    if isinstance(dims, tuple) and isinstance(dims[0], tuple):
        return {"tp": dims[0], "pp": dims[1]}
    return {"tp": dims}


def _world(dims) -> int:
    degrees = _degrees(dims)
    tp = degrees["tp"] if isinstance(degrees["tp"], int) else degrees["tp"][0] * degrees["tp"][1]
    return tp * degrees.get("pp", 1)


def check_resharding(tmp_path, saved_at, resumed_at, **changes) -> None:
    """Trained at ``saved_at`` (a checkpoint after SAVE_AT steps), then resumed from it at each
    entry of ``resumed_at``: the same losses as the uninterrupted run. ``changes``: to the
    tiny config."""
    path = str(tmp_path / "ckpt")
    losses = run_distributed(_train_steps, _world(saved_at), saved_at, path, False, changes)[0]
    for dims in resumed_at:
        resumed = run_distributed(_train_steps, _world(dims), dims, path, True, changes)[-1]
        assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
        for step in resumed:
            assert resumed[step] == pytest.approx(losses[step], rel=RTOL, abs=0), (dims, step)


@pytest.mark.parametrize(
    "saved_at, resumed_at",
    [
        ((2, 2), [(1, 4), (4, 1), 4, 2]),
        (2, [(2, 2), (1, 2)]),
        (((2, 1), 2), [(2, 2), 2, ((1, 2), 2)]),  # a grid in pipeline stages
    ],
    ids=str,
)
def test_training_checkpoints_reshard_between_2d_and_1d(tmp_path, saved_at, resumed_at):
    check_resharding(tmp_path, saved_at, resumed_at)
