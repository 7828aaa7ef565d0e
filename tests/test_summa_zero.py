"""The distributed optimizer (ZeRO-1 / ZeRO-2, tp_ext/training/zero.py) over the DP replicas of a
2D (SUMMA) model: five AdamW steps with clipping give the losses, gradient norms and weights of
transformers trained in one process (the reference of tests/test_pipeline.py), each DP rank
keeping the optimizer state of its rows of its grid blocks only; ZeRO-2's reduce-scatters go
during the backward. Checkpoints move between ZeRO and DDP runs of a grid at any DP degree, and
what is not supported is refused by name."""

from __future__ import annotations

import pytest
import torch

import tp_ext
from tp_ext import comm
from tp_ext.contract import LossKind
from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.training import Trainer
from tp_ext.training.zero import ShardedOptimizer

from .dist_utils import run_distributed
from .reference import hf_qwen2
from .test_pipeline import (
    MAX_NORM,
    STEPS,
    ZERO2_BUCKET_BYTES,
    _config,
    _micro_batches,
    _optimizer,
    _reference,
    assert_training_matches,
)

LAYERS = 2
MICRO = 2  # micro-batches per replica per step


def _build(grid, dp, data_parallel, **options):
    config = _config(LAYERS, False)
    state = tp_ext.init_parallel(tp=grid, dp=dp)
    model = Qwen2ForCausalLM.from_config(config, parallel=state)
    assert model.loss_kind is LossKind.GRID_BLOCK  # the 2D model: its loss from its blocks
    model.load_full_state_dict(hf_qwen2(config).state_dict())
    trainer = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
        **options,
    )
    return config, state, model, trainer


def _check_rows(state, model, optimizer) -> None:
    """Each DP rank holds the AdamW state of its rows (torch.chunk's split) of each grid block;
    the DP ranks' rows together are every element once."""
    mine = whole = 0
    for param in model.parameters():
        rows = -(-param.shape[0] // state.dp)
        start = min(param.shape[0], state.dp_rank * rows)
        held = (min(param.shape[0], start + rows) - start) * param[0].numel()
        inner = optimizer.inner.state[optimizer._master[param]]
        assert inner["exp_avg"].numel() == held, tuple(param.shape)
        view = optimizer.state[param]["exp_avg"]  # what checkpoints read: a block-shaped DTensor
        assert tuple(view.shape) == tuple(param.shape) and view.to_local().numel() == held
        mine, whole = mine + held, whole + param.numel()
    total = comm.all_reduce(torch.tensor(float(mine)), "sum", group=state.dp_group)
    assert total.item() == whole, (total.item(), whole)


def _train(grid, dp, data_parallel):
    config, state, model, trainer = _build(grid, dp, data_parallel)
    optimizer = trainer.optimizer
    zero2 = data_parallel == "zero2"
    assert isinstance(optimizer, ShardedOptimizer) and optimizer.stage == (2 if zero2 else 1)
    assert trainer.data_parallel == data_parallel
    if zero2:  # buckets of a few parameters: several reduce-scatters during the backward
        optimizer.bucket_bytes = ZERO2_BUCKET_BYTES
    batches = _micro_batches(config, MICRO * dp)
    mine = batches[state.dp_rank * MICRO : (state.dp_rank + 1) * MICRO]
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(trainer.step(mine))
        norms.append(trainer.last_grad_norm)
        if zero2:
            assert optimizer.bucket_count > 2, optimizer.bucket_count
            assert optimizer.buckets_sent_in_backward == optimizer.bucket_count
    _check_rows(state, model, optimizer)
    weights = model.full_state_dict()  # gathered over the grid, under transformers' names
    if state.tp_rank or state.dp_rank:
        return losses, norms, {}
    return losses, norms, hf_to_tp_ext_names(weights, config)


def _check_case(grid, dp, data_parallel):
    results = run_distributed(_train, grid[0] * grid[1] * dp, grid, dp, data_parallel, timeout=300)
    ref_losses, ref_norms, ref_weights = _reference(LAYERS, False, MICRO * dp)
    assert_training_matches(results, ref_losses, ref_norms, ref_weights)


@pytest.mark.parametrize("data_parallel", ["zero1", "zero2"])
def test_zero_on_a_grid_matches_transformers(data_parallel):
    _check_case((2, 1), 2, data_parallel)


@pytest.mark.full_matrix
@pytest.mark.parametrize(
    "grid, dp, data_parallel",
    [((2, 2), 2, "zero2"), ((2, 1), 3, "zero2"), ((1, 2), 3, "zero1")],  # dp 3: uneven rows
    ids=str,
)
def test_zero_on_a_grid_matches_transformers_full(grid, dp, data_parallel):
    _check_case(grid, dp, data_parallel)


# ---- checkpoints: ZeRO <-> DDP of a grid, at another DP degree ----------------------------------

GLOBAL = 6  # micro-batches per step over all replicas (1, 2 and 3 divide it)


def _mine(config, state, step: int):
    """This replica's micro-batches of the step's global batch (the same at every DP degree)."""
    batches = _micro_batches(config, GLOBAL, seed=100 + step)
    per = GLOBAL // state.dp
    return batches[state.dp_rank * per : (state.dp_rank + 1) * per]


def _save_case(directory, grid, dp, data_parallel):
    """Two steps, a checkpoint, two more: the last two losses."""
    config, state, _, trainer = _build(grid, dp, data_parallel)
    for step in range(2):
        trainer.step(_mine(config, state, step))
    trainer.save_checkpoint(directory)
    return [trainer.step(_mine(config, state, step)) for step in (2, 3)]


def _load_case(directory, grid, dp, data_parallel):
    config, state, _, trainer = _build(grid, dp, data_parallel)
    trainer.load_checkpoint(directory)
    assert trainer.steps == 2
    return [trainer.step(_mine(config, state, step)) for step in (2, 3)]


def _crossing(tmp_path, saved, loaded):
    directory = str(tmp_path / "ckpt")
    ranks = lambda grid, dp, _: grid[0] * grid[1] * dp  # noqa: E731
    expected = run_distributed(_save_case, ranks(*saved), directory, *saved, timeout=300)[0]
    got = run_distributed(_load_case, ranks(*loaded), directory, *loaded, timeout=300)[0]
    # the weights (the first loss) and the optimizer state (the second) carried over
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=0)


CROSSINGS = [
    (((2, 1), 2, "zero2"), ((2, 1), 1, "ddp")),  # ZeRO's rows into DDP at another DP degree
    (((2, 1), 1, "ddp"), ((2, 1), 2, "zero2")),  # and back
]
CROSSINGS_FULL = [
    (((2, 1), 2, "zero2"), ((2, 1), 2, "ddp")),  # the same DP degree
    (((2, 1), 2, "zero2"), ((2, 1), 3, "zero1")),  # another DP degree and stage, uneven rows
    (((2, 2), 2, "zero1"), ((1, 2), 2, "zero2")),  # another grid
]


def _crossing_id(case):
    (grid, dp, kind), (grid2, dp2, kind2) = case
    return f"{kind}-{grid[0]}x{grid[1]}-dp{dp}-to-{kind2}-{grid2[0]}x{grid2[1]}-dp{dp2}"


@pytest.mark.parametrize("case", CROSSINGS, ids=_crossing_id)
def test_zero_checkpoints_of_a_grid_load_into_ddp_and_back(tmp_path, case):
    _crossing(tmp_path, *case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", CROSSINGS_FULL, ids=_crossing_id)
def test_zero_checkpoints_of_a_grid_reshard(tmp_path, case):
    _crossing(tmp_path, *case)


# ---- what is refused ----------------------------------------------------------------------------


def _refusals():
    config = _config(LAYERS, False)
    state = tp_ext.init_parallel(tp=(1, 1), dp=2)
    model = Qwen2ForCausalLM.from_config(config, parallel=state)
    cases = [
        (dict(data_parallel="zero1", gradient_compression="int8"),
         "data_parallel='zero1' with gradient_compression='int8' is not supported: use "
         "data_parallel='ddp'"),
    ]  # fmt: skip
    for options, words in cases:
        with pytest.raises(ValueError, match=words):
            Trainer(model, optimizer=_optimizer, parallel=state, **options)


def test_what_zero_on_a_grid_does_not_run_is_refused():
    run_distributed(_refusals, 2)
