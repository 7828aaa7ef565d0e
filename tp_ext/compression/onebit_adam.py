"""1-bit Adam's optimizer half: AdamW whose second moment stops changing after a warm-up.

Sign compression cannot feed Adam's second moment: every element of a chunk arrives with the
chunk's one magnitude, so ``v`` (and the step size it sets per element) is wrong, and error
feedback cannot repair a non-linear statistic. 1-bit Adam (Tang et al., 2021) therefore trains
``freeze_step`` steps uncompressed, then freezes ``v``: the update becomes linear in the first
moment, which is what is sent compressed, with error feedback, from then on.

The communication half is :mod:`tp_ext.compression.hooks`: a 1-bit :class:`CompressionState`
attached to this optimizer (``register(ddp, "1bit", optimizer=opt)``, or the Trainer with
``gradient_compression="1bit"`` and this optimizer) all-reduces uncompressed while a
parameter's ``step`` is below ``freeze_step``, then sends each rank's momentum
``beta1 * exp_avg + (1 - beta1) * grad`` compressed and hands DDP the gradient whose momentum
update gives the averaged momentum. Unlike DeepSpeed's, the compressed exchange stays in the
DDP hook (overlapping the backward) and this optimizer does no communication.

During the warm-up the update is ``torch.optim.AdamW``'s (same state names: ``step``,
``exp_avg``, ``exp_avg_sq``), so checkpoints and DCP treat it as AdamW.
"""

from __future__ import annotations

import math

import torch

from tp_ext.validation import check_int, is_number

__all__ = ["OneBitAdam"]


class OneBitAdam(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with the second moment frozen after ``freeze_step``
    steps of each parameter."""

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        freeze_step: int = 100,
    ) -> None:
        if not is_number(lr) or lr < 0:
            raise ValueError(f"OneBitAdam: lr must be a number >= 0, got {lr!r}")
        if len(betas) != 2 or not all(is_number(b) and 0 <= b < 1 for b in betas):
            raise ValueError(f"OneBitAdam: betas must be two numbers in [0, 1), got {betas!r}")
        if not is_number(eps) or eps <= 0:
            raise ValueError(f"OneBitAdam: eps must be a number > 0, got {eps!r}")
        if not is_number(weight_decay) or weight_decay < 0:
            raise ValueError(f"OneBitAdam: weight_decay must be >= 0, got {weight_decay!r}")
        try:
            check_int("freeze_step", freeze_step)
        except ValueError as e:
            raise ValueError(
                f"OneBitAdam: {e} (uncompressed steps before the variance is frozen)"
            ) from None
        # freeze_step is a group setting, so the optimizer's state_dict carries it
        defaults = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, freeze_step=freeze_step
        )
        super().__init__(params, defaults)

    def group_of(self, param: torch.Tensor) -> dict:
        """``param``'s group (an index by identity, rebuilt when groups change: the DDP hook
        asks for every parameter every step)."""
        count = sum(len(g["params"]) for g in self.param_groups)
        index = getattr(self, "_group_index", None)
        if index is None or len(index) != count:
            index = self._group_index = {id(p): g for g in self.param_groups for p in g["params"]}
        group = index.get(id(param))
        if group is None:
            raise KeyError("OneBitAdam: the parameter is not one of this optimizer's")
        return group

    def compressing(self, param: torch.Tensor) -> bool:
        """Whether ``param``'s next gradient is sent compressed (its warm-up is over)."""
        state = self.state.get(param)
        return state is not None and int(state["step"]) >= self.group_of(param)["freeze_step"]

    def momentum_of(self, param: torch.Tensor) -> torch.Tensor:
        return self.state[param]["exp_avg"]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            lr, eps, decay = group["lr"], group["eps"], group["weight_decay"]
            freeze = group["freeze_step"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                step = int(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * decay)
                m.lerp_(p.grad, 1 - beta1)
                if step <= freeze:
                    v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                # v's bias correction stays at the step it was frozen
                correction2 = 1 - beta2 ** min(step, freeze)
                denom = (v.sqrt() / math.sqrt(correction2)).add_(eps)
                p.addcdiv_(m, denom, value=-lr / (1 - beta1**step))
        return loss
