"""The training loop behind :meth:`Trainer.fit <tp_ext.training.Trainer.fit>`: steps up to a
total, resumable checkpoints in a directory (:class:`CheckpointManager`), the LR-schedule check
on resume, and the metrics of every step.

- Resume: when the directory holds a published checkpoint, the run continues from the newest
  (``resume=True``) or refuses to start, so nothing is overwritten. The LR schedule goes on as
  the checkpoint has it; a run asking for another one is refused (:func:`check_schedule`).
- A data loader that is the Trainer's ``data`` (Stateful, e.g.
  :class:`tp_ext.data.TokenBatches`) continues from the position the checkpoint holds; over a
  plain iterable the items of the steps the checkpoint already holds are skipped.
- Metrics: one ``{"step", "loss", "grad_norm", "lr", "tokens_per_s"}`` per step, appended by
  rank 0 as a JSON line to a file (the lines after the resumed step dropped first, so each step
  appears once) and/or given to callables.

Errors name :meth:`~tp_ext.training.Trainer.fit`'s arguments; a command that calls it passes a
:class:`Wording` that names its flags instead.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import time
from typing import Callable, Iterable, Optional, Union

import torch.distributed as dist

from tp_ext.dims import ParallelDims
from tp_ext.training.checkpointer import CheckpointManager
from tp_ext.training.zero import is_sharded
from tp_ext.validation import ConfigError, check_int

__all__ = ["Wording", "check_schedule", "fit", "keep_metrics"]

log = logging.getLogger(__name__)

Metrics = Union[None, str, os.PathLike, Callable[[dict], None], list]


class Wording:
    """How fit's errors name what to change: fit's keyword arguments (``steps=3``); a command
    passes one that names its flags (``--steps 3``)."""

    @staticmethod
    def show(value) -> str:
        return _show(value)

    def arg(self, name: str, value=None) -> str:
        """``name`` given ``value`` (``name`` alone when value is None)."""
        return name if value is None else f"{name}={_show(value)}"

    def schedule(self, field: str, value=None) -> str:
        """An LR-schedule setting (a field of :meth:`LRSchedule.settings`)."""
        name = "decay_steps" if field == "decay_end" else field
        return self.arg(name, value)

    def decay_note(self) -> str:
        return "(the decay ends at the total steps unless decay_steps is given)"

    def schedule_hint(self) -> str:
        return "build the lr_scheduler with the settings it was trained with"


# ---- the loop -----------------------------------------------------------------------------------


def fit(
    trainer,
    batches: Iterable,
    steps: int,
    *,
    checkpoint_dir: Union[None, str, os.PathLike, CheckpointManager] = None,
    checkpoint_every: Optional[int] = None,
    keep_last: Optional[int] = None,
    async_save: bool = False,
    resume: bool = True,
    metrics: Metrics = None,
    wording: Optional[Wording] = None,
) -> list[float]:
    """Train ``trainer`` until ``trainer.steps == steps``; see :meth:`Trainer.fit
    <tp_ext.training.Trainer.fit>`. Returns the losses of the steps it ran."""
    wording = wording or Wording()
    _check_steps(steps, trainer.steps, checkpoint_dir is not None)
    manager = _manager(trainer, checkpoint_dir, checkpoint_every, keep_last, async_save)
    if not isinstance(resume, bool):
        raise TypeError(f"resume must be True or False, got {resume!r}")
    source, plain = _source(trainer, batches)
    sinks = _sinks(metrics)
    before = trainer.steps
    if manager is not None:
        found = manager.find(steps, resume, wording)
        if found is not None and found[0] == steps:
            if _rank() == 0:
                log.info(
                    "%s already holds the checkpoint after step %d; nothing to train (give a "
                    "larger %s to go on)",
                    manager.directory,
                    steps,
                    wording.arg("steps"),
                )
            return []
        if found is not None:
            resume_from(trainer, found[1], wording)
    for path in sinks.files:
        keep_metrics(path, trainer.steps)
    if plain:  # a plain iterable: its items are the steps from the one fit started at
        source = itertools.islice(source, max(0, trainer.steps - before), None)
    return _run(trainer, source, steps, manager, sinks)


def _run(trainer, source, steps: int, manager, sinks) -> list[float]:
    """The steps themselves: each one's metrics, a checkpoint when due, the last one published."""
    losses: list[float] = []
    files = [open(path, "a") for path in sinks.files] if _rank() == 0 else []
    try:
        while trainer.steps < steps:
            micro_batches = next(source, None)
            if micro_batches is None:
                raise ValueError(
                    f"batches ran out after {len(losses)} steps of this fit (at step "
                    f"{trainer.steps}); steps={steps} asks for {steps - trainer.steps} more"
                )
            t0 = time.perf_counter()
            lr = trainer.optimizer.param_groups[0]["lr"]
            loss = trainer.step(micro_batches)
            seconds = time.perf_counter() - t0
            losses.append(loss)
            entry = {
                "step": trainer.steps,
                "loss": loss,
                "grad_norm": trainer.last_grad_norm,
                "lr": float(lr),
                "tokens_per_s": _tokens(trainer) / seconds,
            }
            for f in files:
                f.write(json.dumps(entry) + "\n")
                f.flush()
                os.fsync(f.fileno())
            for call in sinks.calls:
                call(entry)
            if manager is not None and manager.due(trainer.steps, steps):
                manager.save_step(trainer.steps)
        if manager is not None:
            manager.finish()
        if is_sharded(trainer.optimizer):  # the caller reads whole parameters
            trainer.optimizer.finish_gather()
    finally:
        for f in files:
            f.close()
    return losses


def resume_from(trainer, path: str, wording: Wording) -> dict:
    """Load checkpoint ``path`` into ``trainer``, refusing one whose LR schedule differs from
    the one the trainer was built with. Returns the checkpoint's manifest."""
    wanted = schedule_of(trainer.lr_scheduler)
    info = trainer.load_checkpoint(path)  # restores the checkpoint's schedule
    if wanted is not None:
        check_schedule(wanted, schedule_of(trainer.lr_scheduler), wording)
    saved_schedule = (info.get("lr_scheduler") or {}).get("lr_lambdas", [None])[0]
    if wanted is not None and saved_schedule is None and _rank() == 0:
        log.warning(
            "%s was saved before checkpoints held their LR schedule, so only its base lr was "
            "checked: %s (%s when %s changed)",
            path,
            wording.schedule_hint(),
            wording.schedule("decay_end"),
            wording.arg("steps"),
        )
    if _rank() == 0:
        where = ParallelDims.from_dict(info["dims"]).describe()
        log.info("resumed from %s (step %d, saved at %s)", path, trainer.steps, where)
    return info


# ---- the LR schedule ----------------------------------------------------------------------------


def schedule_of(scheduler) -> Optional[dict]:
    """The settings of a :func:`~tp_ext.training.build_lr_scheduler` schedule (None for other
    schedulers: their shape is not known, so not checked)."""
    lambdas = getattr(scheduler, "lr_lambdas", None) or [None]
    settings = getattr(lambdas[0], "settings", None)
    if not callable(settings):
        return None
    # base_lrs: restored from every checkpoint, also those older than the saved settings
    return {**settings(), "lr": scheduler.base_lrs[0]}


_SCHEDULE_FIELDS = ("lr", "lr_schedule", "warmup_steps", "min_lr", "decay_end")


def check_schedule(wanted: dict, saved: dict, wording: Optional[Wording] = None) -> None:
    """The schedule resumes from the checkpoint (as Megatron-Core does by default): a run asking
    for another one (another LR, shape, warmup, floor, or decay end) is refused rather than
    silently changed mid-run. Every rank holds the same schedule, so every rank raises."""
    wording = wording or Wording()
    # a field one of them lacks (a constant schedule's decay) follows from lr_schedule differing
    both = [k for k in _SCHEDULE_FIELDS if k in wanted and k in saved]
    differ = [k for k in both if not _same(wanted[k], saved[k])]
    if not differ:
        return
    said = "; ".join(f"{k} {_show(saved[k])} there, {_show(wanted[k])} here" for k in differ)
    # another shape: every field of the saved one, so that the next try is not refused again
    give = list(saved) if "lr_schedule" in differ else differ
    give = [k for k in _SCHEDULE_FIELDS if k in give and not _same(wanted.get(k), saved[k])]
    keep = " ".join(wording.schedule(k, saved[k]) for k in give)
    why = f" {wording.decay_note()}" if "decay_end" in differ else ""
    raise ConfigError(
        f"the checkpoint's LR schedule differs from this run's: {said}{why}. A resumed run keeps "
        f"its schedule: give {keep}, or start a new run in another "
        f"{wording.arg('checkpoint_dir')}"
    )


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b))
    return a == b


def _show(value) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


# ---- metrics ------------------------------------------------------------------------------------


class _Sinks:
    def __init__(self, files: list[str], calls: list[Callable]) -> None:
        self.files, self.calls = files, calls


def _sinks(metrics: Metrics) -> _Sinks:
    items = metrics if isinstance(metrics, (list, tuple)) else [metrics]
    files, calls = [], []
    for item in items:
        if item is None:
            continue
        if isinstance(item, (str, os.PathLike)):
            files.append(os.fspath(item))
        elif callable(item):
            calls.append(item)
        else:
            raise TypeError(
                f"metrics must be None, a file path (JSON lines), a callable taking each step's "
                f"metrics dict, or a list of these; got {type(item).__name__}"
            )
    return _Sinks(files, calls)


def keep_metrics(path: str, step: int) -> None:
    """Keep the metrics of steps up to ``step`` in the JSON-lines file ``path`` (those a
    resumed run does not repeat); a line cut short by a kill is dropped. Rank 0 only."""
    if _rank() != 0 or not os.path.exists(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and isinstance(entry.get("step"), int):
                if entry["step"] <= step:
                    kept.append(line if line.endswith("\n") else line + "\n")
    temp = path + ".tmp"
    with open(temp, "w") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)


def _tokens(trainer) -> int:
    """The last step's tokens over every DP rank (each passes as many as this one)."""
    local = trainer.last_step_tokens
    dp = trainer.dp_group.size if trainer.dp_group is not None else 1
    return local * dp


# ---- arguments ----------------------------------------------------------------------------------


def _check_steps(steps, done: int, with_checkpoints: bool) -> None:
    check_int("steps", steps, 1, why="the step to train up to")
    if steps < done and not with_checkpoints:
        raise ValueError(
            f"steps={steps} is below this Trainer's step {done}: steps is the total to train "
            f"up to; give steps={done + 1} or more"
        )


def _check_positive(name: str, value) -> None:
    if value is not None:
        check_int(name, value, 1, why="or None")


def _manager(trainer, checkpoint_dir, every, keep_last, async_save):
    if isinstance(checkpoint_dir, CheckpointManager):
        if every is not None or keep_last is not None or async_save:
            raise ValueError(
                "checkpoint_every / keep_last / async_save with a CheckpointManager as "
                "checkpoint_dir: give them to the CheckpointManager"
            )
        return checkpoint_dir
    if checkpoint_dir is None:
        if every is not None or keep_last is not None or async_save:
            given = {"checkpoint_every": every, "keep_last": keep_last, "async_save": async_save}
            named = ", ".join(f"{k}={v!r}" for k, v in given.items() if v not in (None, False))
            raise ValueError(f"{named} without checkpoint_dir: give checkpoint_dir=DIR to save")
        return None
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise TypeError(
            f"checkpoint_dir must be a directory path, a CheckpointManager or None, got "
            f"{type(checkpoint_dir).__name__}"
        )
    return trainer.checkpoints(
        checkpoint_dir, every=every, keep_last=keep_last, async_save=async_save
    )


def _source(trainer, batches):
    """An iterator over ``batches`` and whether it is plain (not the Trainer's data loader,
    whose position travels in the checkpoints)."""
    stateful = callable(getattr(batches, "state_dict", None)) and callable(
        getattr(batches, "load_state_dict", None)
    )
    if stateful and trainer.data is not batches:
        raise ValueError(
            f"batches is a Stateful data loader ({type(batches).__name__}) but not this "
            "Trainer's data=: pass it as Trainer(..., data=batches) so that its position "
            "travels in the checkpoints (or pass a plain iterable of step batches)"
        )
    if isinstance(batches, (str, bytes)) or not hasattr(batches, "__iter__"):
        raise TypeError(
            f"batches must be an iterable whose items are one step's list of micro-batches "
            f"(what Trainer.step takes), or the Trainer's data loader; got "
            f"{type(batches).__name__}"
        )
    return iter(batches), not stateful


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
