"""``Trainer.fit``: the training loop in the library. A run stopped after a checkpoint (a step
that fails after it) and resumed through ``fit`` in a new Trainer (a new model, the random
streams scrambled) gives the uninterrupted run's losses, metrics and weights bit for bit:
over a plain list of step batches (the steps the checkpoint holds are skipped) and over the
Trainer's TokenBatches (its position travels in the checkpoint), without a pipeline and on one
(TP at world 2, PP 2 at world 2, DP 3 at world 3). Bad arguments are refused naming them.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import tp_ext
from tp_ext.training import Trainer, build_optimizer
from tp_ext.training.checkpointer import published
from tp_ext.validation import ConfigError

from .dist_utils import run_distributed
from .test_pipeline import MAX_NORM
from .test_training_state import _batches, _tokens, _trainer, _warmup

STEPS, EVERY, FAIL_AT = 5, 2, 3  # checkpoints after steps 2 and 4 (and 5); the first run dies in 3


class _Stop(Exception):
    """The stopped run's end: raised on every rank by a metrics callable after step FAIL_AT."""


def _plain_trainer(directory: str, tp: int) -> Trainer:
    """A TP model without a pipeline (the Trainer's own loop) and its DP group."""
    from .test_training import OPTIMIZER, _model

    state = tp_ext.init_parallel(tp=tp)
    model, _ = _model(state.tp_group)
    return Trainer(
        model,
        build_optimizer(model, OPTIMIZER),
        max_grad_norm=MAX_NORM,
        lr_scheduler=_warmup,
        data=_batches(directory, 0, 1, model.config.vocab_size),
    )


def _new_trainer(directory: str, dims, pipeline: bool) -> Trainer:
    trainer = (
        _trainer(directory, dims, dropout=0.1) if pipeline else _plain_trainer(directory, dims[0])
    )
    # streams unlike the stopped run's at its checkpoint: the checkpoint must restore them
    torch.manual_seed(987)
    tp_ext.random.manual_seed(987)
    return trainer


def _weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.state_dict().items()}


def _fit(directory, dims, pipeline: bool, source: str, stop: bool):
    """(losses fit returned, this rank's weights) of a fit to STEPS in ``directory``; ``stop``:
    the run fails after step FAIL_AT (its checkpoint after step EVERY stays)."""
    trainer = _new_trainer(directory, dims, pipeline)
    if source == "loader":
        batches = trainer.data
    else:  # the same steps as a plain list: step s is item s - 1
        data = trainer.data
        copy = _batches(directory, data.dp_rank, data.dp_size, data.vocab_size)
        batches = [next(copy) for _ in range(STEPS)]

    def stop_after(entry):
        if stop and entry["step"] == FAIL_AT:
            raise _Stop()

    metrics = [os.path.join(directory, "metrics.jsonl"), stop_after]
    try:
        losses = trainer.fit(
            batches, STEPS, checkpoint_dir=directory, checkpoint_every=EVERY, metrics=metrics
        )
    except _Stop:
        return None, None
    return losses, _weights(trainer)


CASES = [  # dims (tp, pp, dp), through a pipeline (parallel=), batches
    ((1, 1, 1), False, "list"),
    ((1, 1, 1), True, "loader"),
    ((2, 1, 1), False, "loader"),
    ((2, 1, 1), True, "list"),
    ((1, 2, 1), True, "list"),
    ((1, 2, 1), True, "loader"),
    ((1, 1, 3), True, "loader"),
]


@pytest.mark.parametrize("dims, pipeline, source", CASES)
def test_a_stopped_fit_resumed_in_a_new_trainer_is_the_straight_run_bitwise(
    tmp_path, dims, pipeline, source
):
    world = dims[0] * dims[1] * dims[2]
    straight, stopped = str(tmp_path / "straight"), str(tmp_path / "stopped")
    _tokens(straight)  # beside both directories
    args = (dims, pipeline, source)
    runs = run_distributed(_fit, world, straight, *args, False, timeout=300)
    losses, weights = runs[0]
    assert len(losses) == STEPS and all(isinstance(x, float) for x in losses)
    assert all(r[0] == losses for r in runs), "every rank returns the same losses"
    assert [r[0] for r in run_distributed(_fit, world, stopped, *args, True, timeout=300)] == [
        None
    ] * world
    assert [s for s, _ in published(stopped)] == [EVERY]
    resumed = run_distributed(_fit, world, stopped, *args, False, timeout=300)
    assert resumed[0][0] == losses[EVERY:], "the steps after the checkpoint, bitwise"
    for rank, (_, mine) in enumerate(resumed):
        for name, tensor in runs[rank][1].items():
            assert torch.equal(mine[name], tensor), f"rank {rank}: {name} differs"
    lines = [json.loads(x) for x in open(os.path.join(stopped, "metrics.jsonl"))]
    want = [json.loads(x) for x in open(os.path.join(straight, "metrics.jsonl"))]
    assert [e["step"] for e in lines] == list(range(1, STEPS + 1)), "each step once"
    assert [e["loss"] for e in lines] == [e["loss"] for e in want]
    assert [e["grad_norm"] for e in lines] == [e["grad_norm"] for e in want]
    assert [s for s, _ in published(stopped)] == [2, 4, 5]


# ---- one process: the rest of fit's contract ----------------------------------------------------


def _errors(directory: str) -> list[str]:
    """The message of every refused fit call, in order (one process)."""
    trainer = _plain_trainer(directory, 1)
    vocab = trainer.data.vocab_size
    steps = [next(_batches(directory, 0, 1, vocab)) for _ in range(3)]
    calls = [
        dict(batches=steps, steps=0),
        dict(batches=steps, steps="3"),
        dict(batches=steps, steps=3, checkpoint_every=2),
        dict(batches=steps, steps=3, checkpoint_dir=directory, checkpoint_every=0),
        dict(batches=steps, steps=3, checkpoint_dir=directory, keep_last=-1),
        dict(batches=steps, steps=3, checkpoint_dir=5),
        dict(batches=steps, steps=3, metrics=5),
        dict(batches=steps, steps=3, resume="yes"),
        dict(batches=5, steps=3),
        dict(batches=_batches(directory, 0, 1, vocab), steps=3),
        dict(batches=steps[:1], steps=3),  # trains step 1, then runs out
        dict(batches=steps, steps=3, checkpoint_dir=trainer.checkpoints(directory), keep_last=2),
    ]
    messages = []
    for call in calls:
        try:
            trainer.fit(call.pop("batches"), call.pop("steps"), **call)
        except (ValueError, TypeError) as e:
            messages.append(str(e))
        else:
            messages.append("accepted")
    # a directory holding the checkpoint after step 2
    run = os.path.join(directory, "run")
    assert len(_plain_trainer(directory, 1).fit(steps, 2, checkpoint_dir=run)) == 2
    for steps_wanted, resume in ((3, False), (1, True)):
        try:
            _plain_trainer(directory, 1).fit(steps, steps_wanted, checkpoint_dir=run, resume=resume)
        except ConfigError as e:
            messages.append(str(e))
    messages.append(repr(_plain_trainer(directory, 1).fit(steps, 2, checkpoint_dir=run)))
    return messages


def test_bad_fit_arguments_are_refused_naming_them(tmp_path):
    directory = str(tmp_path / "c")
    _tokens(directory)
    messages = run_distributed(_errors, 1, directory)[0]
    expected = [
        "steps must be an int >= 1 (the step to train up to), got 0",
        "steps must be an int >= 1 (the step to train up to), got '3'",
        "checkpoint_every=2 without checkpoint_dir: give checkpoint_dir=DIR",
        "checkpoint_every must be an int >= 1 (or None), got 0",
        "keep_last must be an int >= 1 (or None), got -1",
        "checkpoint_dir must be a directory path, a CheckpointManager or None, got int",
        "metrics must be None, a file path (JSON lines), a callable",
        "resume must be True or False, got 'yes'",
        "batches must be an iterable whose items are one step's list of micro-batches",
        "batches is a Stateful data loader (TokenBatches) but not this Trainer's data=",
        "batches ran out after 1 steps of this fit (at step 1); steps=3 asks for 2 more",
        "checkpoint_every / keep_last / async_save with a CheckpointManager",
        "holds checkpoints (the newest after step 2): pass resume=True to continue from it, "
        "or give another checkpoint_dir",
        "steps=1 is below the step of the newest checkpoint",
        "[]",  # already at steps: nothing to train
    ]
    assert len(messages) == len(expected), messages
    for got, want in zip(messages, expected):
        assert want in got, (want, got)
