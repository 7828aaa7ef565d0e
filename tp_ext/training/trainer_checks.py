"""What the :class:`~tp_ext.training.Trainer` checks of its arguments and builds from them:
each bad value refused by name, with what would work, before anything is built."""

from __future__ import annotations

import torch
from torch import nn

from tp_ext.pipeline.data_parallel import ZERO_STAGES
from tp_ext.training.adapters import WholeModel
from tp_ext.training.optimizer import build_optimizer
from tp_ext.validation import is_number

__all__ = [
    "check_arguments",
    "check_overlap",
    "check_zero",
    "set_recompute",
    "built_optimizer",
    "built_scheduler",
    "stateful_data",
]


def check_arguments(max_grad_norm, autocast_dtype, activation_checkpointing) -> None:
    if max_grad_norm is not None and (not is_number(max_grad_norm) or not max_grad_norm > 0):
        raise ValueError(
            f"max_grad_norm must be a number > 0, or None for no clipping; got {max_grad_norm!r}"
        )
    if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
        raise TypeError(
            f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16) or None, got "
            f"{autocast_dtype!r}"
        )
    if not isinstance(activation_checkpointing, bool):
        raise TypeError(
            f"activation_checkpointing must be True or False, got {activation_checkpointing!r}"
        )


def check_overlap(overlap_param_gather, data_parallel) -> None:
    if not isinstance(overlap_param_gather, bool):
        raise TypeError(f"overlap_param_gather must be True or False, got {overlap_param_gather!r}")
    if overlap_param_gather and data_parallel not in ZERO_STAGES:
        raise ValueError(
            f"overlap_param_gather=True with data_parallel={data_parallel!r}: only the "
            "distributed optimizer gathers parameters after its step; use data_parallel="
            "'zero1' or 'zero2' (FSDP2 prefetches its own)"
        )


def set_recompute(model, activation_checkpointing: bool) -> None:
    """Per-layer recompute, which tp_ext's models and stages have; a whole plain module not."""
    if isinstance(model, WholeModel) and activation_checkpointing:
        raise ValueError(
            f"activation_checkpointing: {type(model.module).__name__} has no per-layer "
            "recompute switch (tp_ext's models and the stages parallelize returns do)"
        )
    model.activation_checkpointing = activation_checkpointing


def built_optimizer(optimizer, model: nn.Module) -> torch.optim.Optimizer:
    if optimizer is None:
        optimizer = build_optimizer(model)
    elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
        built = optimizer([p for p in model.parameters() if p.requires_grad])
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer: the callable must return a torch.optim.Optimizer, got "
                f"{type(built).__name__}"
            )
        optimizer = built
    _check_float16_parameters(optimizer)
    return optimizer


def check_zero(data_parallel, parallel, autocast_dtype, grad_reduce_dtype, compression) -> None:
    """What the distributed optimizer and the reduced-precision gradient sum need."""
    if grad_reduce_dtype is not None and compression is not None:
        raise ValueError(
            f"grad_reduce_dtype and gradient_compression={compression!r}: the compression sends "
            "its own encoding; use one of them"
        )
    if grad_reduce_dtype is not None and grad_reduce_dtype not in (
        torch.bfloat16,
        torch.float16,
        torch.float32,
    ):
        raise ValueError(
            f"grad_reduce_dtype must be torch.bfloat16, torch.float16 or torch.float32 (or None: "
            f"the gradients' own), got {grad_reduce_dtype!r}"
        )
    if data_parallel == "fsdp" and grad_reduce_dtype is not None:
        raise ValueError(
            "grad_reduce_dtype with data_parallel='fsdp': FSDP2 sets its own reduce dtype "
            "(MixedPrecisionPolicy); use 'ddp', 'zero1' or 'zero2'"
        )
    if data_parallel not in ZERO_STAGES:
        return
    if parallel is None:
        raise ValueError(
            f"data_parallel={data_parallel!r} shards the optimizer over the DP mesh dimension: "
            "pass parallel=tp_ext.init_parallel(...)"
        )


def stateful_data(data):
    if data is not None and not (
        callable(getattr(data, "state_dict", None))
        and callable(getattr(data, "load_state_dict", None))
    ):
        raise TypeError(
            f"data must be Stateful (state_dict() and load_state_dict(), e.g. "
            f"tp_ext.data.TokenBatches) so checkpoints hold its position, got "
            f"{type(data).__name__}"
        )
    return data


def built_scheduler(lr_scheduler, optimizer):
    if lr_scheduler is None:
        return None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    if not (hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")):
        raise TypeError(
            f"lr_scheduler must be a torch LR scheduler (or a callable taking the optimizer and "
            f"returning one), got {type(lr_scheduler).__name__}"
        )
    if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "lr_scheduler schedules another optimizer than this Trainer's; pass a callable "
            "(lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, ...)) to build it "
            "over the Trainer's"
        )
    return lr_scheduler


def _check_float16_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Adam's second moment and eps (1e-8) underflow in float16: the first step divides by
    zero and the weights become NaN. Say so instead."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        if any(p.dtype == torch.float16 for p in group["params"]):
            raise ValueError(
                f"{type(optimizer).__name__} over float16 parameters: its eps "
                f"({group.get('eps')}) and squared gradients underflow in float16, so the first "
                "step turns the weights into NaN. Keep the parameters in float32 (or bfloat16) "
                "and pass autocast_dtype=torch.float16 for mixed precision with a loss scale"
            )
