"""Precision of a training step: autocast to a lower dtype and, for float16, a dynamic loss
scale whose overflow check is agreed over every rank (so every rank skips the same steps)."""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["Precision"]


class Precision:
    """Autocast to ``autocast_dtype`` (None: none) and, for float16, a dynamic loss scale whose
    overflow check is agreed over every rank (so every rank skips the same steps)."""

    def __init__(self, autocast_dtype: Optional[torch.dtype], model: nn.Module) -> None:
        self.autocast_dtype = autocast_dtype
        self.scaler = None
        if autocast_dtype == torch.float16:
            device = next(model.parameters()).device
            self.scaler = _loss_scaler(device)
            # the scale is made on first use; ranks without the loss (earlier pipeline stages)
            # never scale one, yet take part in the agreed overflow check
            self.scaler.scale(torch.zeros((), device=device))

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # the overflow check, agreed over every rank

    def step(self, optimizer) -> bool:
        """``optimizer.step()`` (skipped when any rank overflowed); returns whether skipped."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale


def _loss_scaler(device: torch.device):
    """fp16's dynamic loss scale. torch's ShardedGradScaler all-reduces the overflow flag over
    the default group, so every rank (TP, PP and DP) skips the same steps; plain GradScaler
    checks only its own process's gradients."""
    if dist.is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(device.type)
