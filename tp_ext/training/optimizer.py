"""AdamW with Megatron's parameter groups, its learning-rate schedule, and their settings (the
``optimizer:`` section of a job config)."""

from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch
from torch import nn

from tp_ext.validation import ConfigError, Field, check_fields, check_int

__all__ = [
    "OptimizerSettings",
    "OPTIMIZER_FIELDS",
    "LR_SCHEDULES",
    "build_optimizer",
    "build_lr_scheduler",
    "LRSchedule",
]

LR_SCHEDULES = ("constant", "cosine", "linear")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, with Megatron's defaults for large models, and its learning-rate schedule:
    ``warmup_steps`` of linear warmup, then ``lr_schedule`` from ``lr`` down to ``min_lr`` at
    step ``decay_steps`` (None: the job's last step), flat after it."""

    lr: float = 1.5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    lr_schedule: str = "constant"
    warmup_steps: int = 0
    min_lr: float = 0.0
    decay_steps: Optional[int] = None

    def __post_init__(self) -> None:
        values = dataclasses.asdict(self)
        if values["decay_steps"] is None:
            del values["decay_steps"]
        check_fields("optimizer.", values, OPTIMIZER_FIELDS)
        if self.min_lr > self.lr:
            raise ConfigError(
                f"optimizer.min_lr {self.min_lr:g} is above optimizer.lr {self.lr:g}; the "
                "schedule decays from lr down to min_lr"
            )
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ConfigError(
                f"optimizer.decay_steps {self.decay_steps} must be above optimizer.warmup_steps "
                f"{self.warmup_steps} (the decay runs from the end of warmup to decay_steps)"
            )


# AdamW diverges far below lr 1; weight decay above 1 would shrink weights by more than lr per
# step (decoupled decay multiplies by 1 - lr * wd). Both bounds are beyond any working setting.
OPTIMIZER_FIELDS = {
    "lr": Field("float", 0, 1, low_open=True, help="AdamW's learning rate (after warmup)"),
    "weight_decay": Field("float", 0, 1, help="AdamW's decoupled weight decay"),
    "betas": Field("betas", help="AdamW's two moment decay rates"),
    "lr_schedule": Field(
        "choice", choices=LR_SCHEDULES, help="after warmup, how the LR goes from lr to min_lr"
    ),
    "warmup_steps": Field("int", 0, 10**9, help="steps of linear warmup"),
    "min_lr": Field("float", 0, 1, help="the LR the decay ends at"),
    "decay_steps": Field(
        "int",
        1,
        10**9,
        help="the step the decay ends at (default: the run's last step; set it when a run will be "
        "resumed to a later step, so that the schedule stays the same)",
    ),
}


def build_optimizer(
    model: nn.Module, settings: Optional[OptimizerSettings] = None, **overrides
) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters with ``settings``' lr, betas and weight decay
    (``OptimizerSettings()`` if None; ``overrides`` replace single fields, e.g. ``lr=1e-3``).

    Two parameter groups, as Megatron does: matrices (``dim >= 2``: linear and embedding weights)
    decay; biases and norm weights do not."""
    settings = OptimizerSettings() if settings is None else settings
    if not isinstance(settings, OptimizerSettings):
        raise TypeError(
            f"settings must be a tp_ext.training.OptimizerSettings or None, got "
            f"{type(settings).__name__}"
        )
    known = sorted(f.name for f in dataclasses.fields(OptimizerSettings))
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(f"build_optimizer: unknown setting(s) {unknown}; known: {known}")
    # replace() runs OptimizerSettings' own checks on the overridden values
    settings = dataclasses.replace(settings, **overrides)
    betas = tuple(settings.betas)
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"build_optimizer: {type(model).__name__} has no trainable parameters")
    groups = [
        {
            "params": [p for p in params if p.dim() >= 2],
            "weight_decay": float(settings.weight_decay),
        },
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # On CUDA the fused kernel: fastest, and no temporaries (the foreach default allocates a
    # copy of every parameter at the step, which the planner would have to leave room for)
    fused = all(p.is_cuda for p in params) or None
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=float(settings.lr), betas=betas, fused=fused
    )


class LRSchedule:
    """The learning rate after ``step`` optimizer steps, as a fraction of ``lr`` (the LambdaLR
    lambda of :func:`build_lr_scheduler`). An object rather than a closure because LambdaLR
    saves an object's attributes in its ``state_dict``: a checkpoint then records the schedule
    it was trained with, and loading it restores that schedule (``tp-ext train --resume`` checks
    that the run asks for the same one)."""

    def __init__(self, settings: OptimizerSettings, total_steps: int) -> None:
        self.lr = float(settings.lr)
        self.lr_schedule = settings.lr_schedule
        self.warmup_steps = int(settings.warmup_steps)
        self.min_lr = float(settings.min_lr)
        end = settings.decay_steps if settings.decay_steps is not None else total_steps
        # every end up to warmup + 1 gives the same schedule (flat at min_lr right after the
        # warmup); one value for them all, so equal schedules compare equal
        self.decay_end = max(int(end), self.warmup_steps + 1)

    def settings(self) -> dict:
        """The fields that shape this schedule (a constant one has no decay)."""
        shape = {"lr": self.lr, "lr_schedule": self.lr_schedule, "warmup_steps": self.warmup_steps}
        if self.lr_schedule != "constant":
            shape.update(min_lr=self.min_lr, decay_end=self.decay_end)
        return shape

    def __call__(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return (step + 1) / warmup
        if self.lr_schedule == "constant":
            return 1.0
        floor = self.min_lr / self.lr
        progress = min(1.0, (step - warmup) / (self.decay_end - warmup))
        if self.lr_schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, settings: OptimizerSettings, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    """``settings``' schedule over ``optimizer`` (every group scaled alike) for a run of
    ``total_steps`` steps. A LambdaLR: its ``state_dict()`` is plain numbers, the schedule's
    settings included (:class:`LRSchedule`), so a Trainer checkpoint holds it in its JSON
    manifest, and loading one restores the saved schedule."""
    check_int("total_steps", total_steps, 1)
    return torch.optim.lr_scheduler.LambdaLR(optimizer, LRSchedule(settings, total_steps))
