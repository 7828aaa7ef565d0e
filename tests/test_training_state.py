"""Trainer checkpoints: model, optimizer state, LR schedule, loss scale, step, data position and
random streams, saved at one (tp, pp, dp) and resumed at the same (losses bitwise those of the
uninterrupted run, dropout included) or another (within 1e-5 relative: only reduction order
differs); asynchronous saves; a rank SIGKILLed during a save, an asynchronous save or a load
leaves the last committed checkpoint loadable; clear errors for what cannot be restored.

``make test`` runs a subset covering every path; ``make test-all`` (``--full-matrix``) adds the
other layout pairs.
"""

from __future__ import annotations

import pytest
import torch

from tp_ext.checkpoint import complete_checkpoint
from tp_ext.training import Trainer

from .dist_utils import run_distributed
from .test_pipeline import MAX_NORM, MICRO_BATCH, SEQ, _build, _config

STEPS, SAVE_AT = 5, 2
GLOBAL_MICRO_BATCHES = 4  # micro-batches per step over every DP rank
RTOL = 1e-5


class _Batches:
    """A Stateful data source with the property the resharding relies on: step s is the same
    ``GLOBAL_MICRO_BATCHES`` micro-batches whatever the DP degree; DP rank r takes its share."""

    def __init__(self, vocab: int, dp_rank: int, dp: int) -> None:
        self.vocab, self.dp_rank, self.dp, self.step = vocab, dp_rank, dp, 0

    def __next__(self):
        g = torch.Generator().manual_seed(1000 + self.step)
        batches = [
            torch.randint(0, self.vocab, (MICRO_BATCH, SEQ), generator=g)
            for _ in range(GLOBAL_MICRO_BATCHES)
        ]
        share = GLOBAL_MICRO_BATCHES // self.dp
        self.step += 1
        return batches[self.dp_rank * share : (self.dp_rank + 1) * share]

    def state_dict(self):
        return {"step": self.step}

    def load_state_dict(self, state):
        self.step = state["step"]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, eps=1e-6)


def _warmup(optimizer):
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))


def _trainer(layout, schedule="1F1B", data_parallel="ddp", dropout=0.0, tie=False, **kwargs):
    tp, pp, dp = layout
    config = _config(4, tie, dropout)
    state, model = _build(config, tp, pp, dp, schedule)
    torch.manual_seed(11)  # dropout's streams, the same at every layout
    import tp_ext

    tp_ext.random.manual_seed(11)
    return Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        schedule=schedule,
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
        lr_scheduler=_warmup,
        data=_Batches(config.vocab_size, state.dp_rank, dp),
        **kwargs,
    )


def _train(
    layout,
    schedule="1F1B",
    data_parallel="ddp",
    dropout=0.0,
    tie=False,
    *,
    save=None,
    async_save=False,
    load=None,
    steps=STEPS,
    **kwargs,
):
    """Losses and norms per step of a run that saves at SAVE_AT (``save``) or starts from a
    checkpoint (``load``)."""
    trainer = _trainer(layout, schedule, data_parallel, dropout, tie, **kwargs)
    if load is not None:
        info = trainer.load_checkpoint(load)
        assert info["step"] == trainer.steps == SAVE_AT
    losses, norms = {}, {}
    while trainer.steps < steps:
        step = trainer.steps + 1
        losses[step] = trainer.step(next(trainer.data))
        norms[step] = trainer.last_grad_norm
        if save is not None and trainer.steps == SAVE_AT:
            trainer.save_checkpoint(save, async_save=async_save)
    trainer.wait_for_checkpoint()
    return losses, norms


def _world(layout) -> int:
    return layout[0] * layout[1] * layout[2]


def _run(layout, *args, **kwargs):
    results = run_distributed(_train, _world(layout), layout, *args, timeout=300, **kwargs)
    for rank, result in enumerate(results):
        assert result == results[0], f"rank {rank}'s losses differ from rank 0's"
    return results[0]


# ---- the same layout: bitwise -------------------------------------------------------------------

SAME = [
    # layout, schedule, data parallel, dropout, tied, async
    ((1, 1, 1), "1F1B", "ddp", 0.1, True, False),
    ((2, 2, 1), "1F1B", "ddp", 0.1, True, True),  # TP streams, tied across stages
    ((1, 2, 2), "1F1B", "fsdp", 0.1, False, True),  # FSDP2's sharded optimizer state
    ((1, 2, 1), "Interleaved1F1B", "ddp", 0.1, False, False),
]
SAME_FULL = [
    ((3, 1, 1), "1F1B", "ddp", 0.1, False, True),
    ((1, 2, 2), "1F1B", "ddp", 0.1, True, False),
    ((1, 2, 1), "ZBVZeroBubble", "ddp", 0.1, True, True),
    ((2, 2, 2), "GPipe", "fsdp", 0.1, False, False),
]


def _same_layout(tmp_path, layout, schedule, data_parallel, dropout, tie, async_save):
    path = str(tmp_path / "ckpt")
    args = (layout, schedule, data_parallel, dropout, tie)
    losses, norms = _run(*args, save=path, async_save=async_save)
    assert complete_checkpoint(path)
    resumed, resumed_norms = _run(*args, load=path)
    assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
    for step, loss in resumed.items():
        assert loss == losses[step], f"step {step}: {loss!r} != {losses[step]!r} (bitwise)"
        assert resumed_norms[step] == norms[step], f"step {step}'s gradient norm differs"


@pytest.mark.parametrize("case", SAME, ids=str)
def test_resume_at_the_same_layout_is_bitwise(tmp_path, case):
    _same_layout(tmp_path, *case)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", SAME_FULL, ids=str)
def test_resume_at_the_same_layout_is_bitwise_full(tmp_path, case):
    _same_layout(tmp_path, *case)


# ---- another layout: within 1e-5 ----------------------------------------------------------------

# saved at, data parallel there, resumed at
RESHARD = [
    ((2, 2, 2), "fsdp", [(1, 1, 1), (4, 1, 2), (1, 4, 1)]),
    ((1, 2, 1), "ddp", [(3, 1, 1)]),  # uneven TP, tied embedding across stages into one
]
RESHARD_FULL = [
    ((1, 1, 1), "ddp", [(2, 2, 2), (1, 2, 2), (3, 1, 1)]),
    ((3, 1, 1), "ddp", [(1, 2, 2), (2, 1, 2)]),
    ((2, 2, 2), "ddp", [(1, 2, 1)]),
]


def _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie):
    path = str(tmp_path / "ckpt")
    losses, norms = _run(saved_at, "1F1B", data_parallel, 0.0, tie, save=path)
    for layout in resumed_at:
        kind = data_parallel if layout[2] > 1 else "ddp"
        resumed, resumed_norms = _run(layout, "1F1B", kind, 0.0, tie, load=path)
        assert sorted(resumed) == list(range(SAVE_AT + 1, STEPS + 1))
        torch.testing.assert_close(
            [resumed[s] for s in sorted(resumed)],
            [losses[s] for s in sorted(resumed)],
            rtol=RTOL,
            atol=0,
            msg=lambda m, layout=layout: f"resumed at {layout}: {m}",
        )
        torch.testing.assert_close(
            [resumed_norms[s] for s in sorted(resumed)],
            [norms[s] for s in sorted(resumed)],
            rtol=RTOL,
            atol=0,
        )


@pytest.mark.parametrize("case", RESHARD, ids=str)
def test_resume_at_another_layout(tmp_path, case):
    saved_at, data_parallel, resumed_at = case
    _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie=saved_at[1] > 1)


@pytest.mark.full_matrix
@pytest.mark.parametrize("case", RESHARD_FULL, ids=str)
def test_resume_at_another_layout_full(tmp_path, case):
    saved_at, data_parallel, resumed_at = case
    _reshard(tmp_path, saved_at, data_parallel, resumed_at, tie=True)
