"""AdamW with Megatron's parameter groups, and its settings (the ``optimizer:`` section of a job
config)."""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch import nn

from tp_ext.validation import Field, check_fields

__all__ = ["OptimizerSettings", "OPTIMIZER_FIELDS", "build_optimizer"]


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, with Megatron's defaults for large models."""

    lr: float = 1.5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        check_fields("optimizer.", dataclasses.asdict(self), OPTIMIZER_FIELDS)


# AdamW diverges far below lr 1; weight decay above 1 would shrink weights by more than lr per
# step (decoupled decay multiplies by 1 - lr * wd). Both bounds are beyond any working setting.
OPTIMIZER_FIELDS = {
    "lr": Field("float", 0, 1, low_open=True),
    "weight_decay": Field("float", 0, 1),
    "betas": Field("betas"),
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
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=float(settings.lr), betas=betas)
