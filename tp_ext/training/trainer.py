"""A :class:`Trainer` whose step accumulates gradients over micro-batches, synchronises data
parallelism once, clips by the TP-aware norm and steps the optimizer.

Collectives issued by :class:`Trainer` are tagged for :func:`tp_ext.comm.track`:
``train.compute`` (the model's own, per micro-batch), ``train.dp_sync`` (one per step with a
data-parallel group) and ``train.grad_norm`` (one per step when clipping at TP > 1)::

    trainer = Trainer(model, max_grad_norm=1.0, dp_group=state.dp_group)
    loss = trainer.step([ids_0, ids_1])          # two micro-batches, one optimizer step
"""

from __future__ import annotations

import contextlib
from typing import Optional, Union

import torch
from torch import nn

from tp_ext.distributed import comm
from tp_ext.layers import vocab_parallel_cross_entropy
from tp_ext.training.grad_norm import clip_grad_norm_, model_tp_group
from tp_ext.training.optimizer import build_optimizer
from tp_ext.validation import is_number

__all__ = ["Trainer"]

MicroBatch = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


class Trainer:
    """One optimizer step per :meth:`step` over a list of micro-batches, for a tp_ext causal LM
    (``model(input_ids, local_logits=True)`` gives this rank's vocabulary shard of the logits).

    - ``optimizer``: None builds :func:`build_optimizer` with the default settings.
    - ``max_grad_norm``: clip to this TP-aware norm (None: no clipping; the norm is not computed).
    - ``dp_group``: a data-parallel group (e.g. ``init_parallel(...).dp_group``); each DP rank
      passes its own micro-batches, and the step equals one over all of them.
    - ``autocast_dtype``: e.g. ``torch.bfloat16`` runs forward under ``torch.autocast``
      (parameters, gradients and optimizer state stay in their own dtype).
    - ``tp_group``: None takes the model's.

    The loss is the mean token cross-entropy over every target of every micro-batch (of every
    DP rank); targets equal to ``ignore_index`` do not count.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        *,
        max_grad_norm: Optional[float] = None,
        dp_group=None,
        tp_group=None,
        autocast_dtype: Optional[torch.dtype] = None,
        ignore_index: int = -100,
    ) -> None:
        if max_grad_norm is not None and (not is_number(max_grad_norm) or not max_grad_norm > 0):
            raise ValueError(
                f"max_grad_norm must be a number > 0, or None for no clipping; got "
                f"{max_grad_norm!r}"
            )
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise TypeError(
                f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16) or "
                f"None, got {autocast_dtype!r}"
            )
        self.model = model
        if optimizer is None:
            optimizer = build_optimizer(model)
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.tp = model_tp_group(model, tp_group)
        self.dp_group = None if dp_group is None else comm.resolve_group(dp_group)
        self.autocast_dtype = autocast_dtype
        self.ignore_index = ignore_index
        self.last_grad_norm: Optional[float] = None

    def step(self, micro_batches: list[MicroBatch]) -> float:
        """Forward and backward every micro-batch (``input_ids`` ``[batch, seq]``, or
        ``(input_ids, labels)`` with labels of the same shape, Hugging Face style: position t
        predicts ``labels[:, t + 1]``; without labels, the ids themselves), then one DP
        synchronisation, clipping and ``optimizer.step()``. Gradients already on the parameters
        are discarded first. Returns the step's mean loss, the same on every rank; the norm
        before clipping is left in ``last_grad_norm``."""
        batches = self._check(micro_batches)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        # Known before any forward: scale each micro-batch's summed loss by the local token
        # count, so the accumulated gradient is that of the mean (no host sync needed).
        count = torch.stack(
            [(labels[:, 1:] != self.ignore_index).sum() for _, labels in batches]
        ).sum()
        scale = count.clamp_min(1).float()
        count = count.float()
        loss_sum = torch.zeros((), device=batches[0][0].device)
        with comm.tag("train.compute"):
            for ids, labels in batches:
                with self._autocast(ids.device):
                    logits = self.model(ids, local_logits=True)
                    loss = vocab_parallel_cross_entropy(
                        logits[:, :-1],
                        labels[:, 1:],
                        tp_group=self.tp,
                        ignore_index=self.ignore_index,
                        reduction="sum",
                    )
                (loss / scale).backward()
                loss_sum += loss.detach().float()
        if self.dp_group is not None and self.dp_group.size > 1:
            loss_sum, count = self._sync_data_parallel(params, loss_sum, scale, count)
        if self.max_grad_norm is not None:
            with comm.tag("train.grad_norm"):
                norm = clip_grad_norm_(self.model, self.max_grad_norm, self.tp)
            self.last_grad_norm = norm.item()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (loss_sum / count).item()  # nan when no target counts, as torch's mean

    def _check(self, micro_batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(micro_batches, torch.Tensor):
            raise ValueError(
                f"micro_batches must be a list of micro-batches, got one tensor of "
                f"shape {tuple(micro_batches.shape)}; pass [input_ids]"
            )
        if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
            raise ValueError(
                f"micro_batches must be a non-empty list of input_ids tensors or "
                f"(input_ids, labels) pairs, got {micro_batches!r}"
            )
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        batches = []
        for i, item in enumerate(micro_batches):
            ids, labels = (
                (item, item.long())
                if isinstance(item, torch.Tensor)
                else (
                    tuple(item)
                    if isinstance(item, (list, tuple)) and len(item) == 2
                    else (None, None)
                )
            )
            if not isinstance(ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
                raise ValueError(
                    f"micro_batches[{i}] must be an input_ids tensor or an "
                    f"(input_ids, labels) pair of tensors, got {type(item).__name__}"
                )
            if ids.dim() != 2 or ids.size(1) < 2 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"micro_batches[{i}]: input_ids must be an int64/int32 tensor "
                    f"[batch, seq] with seq >= 2, got {ids.dtype} of shape "
                    f"{tuple(ids.shape)}"
                )
            if labels.shape != ids.shape or labels.dtype != torch.int64:
                raise ValueError(
                    f"micro_batches[{i}]: labels must be an int64 tensor of the "
                    f"input_ids' shape {tuple(ids.shape)} (shifted here), got "
                    f"{labels.dtype} of shape {tuple(labels.shape)}"
                )
            batches.append((ids.to(device), labels.to(device)))
        return batches

    def _autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def _sync_data_parallel(self, params, loss_sum, scale, count):
        """One all-reduce of every gradient, the loss sum and the token count: gradients become
        the gradient of the mean over all DP ranks' tokens (weighted by each rank's count)."""
        dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
        pieces = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype)
            for p in params
        ]
        flat = torch.cat(pieces + [loss_sum.view(1).to(dtype), count.view(1).to(dtype)])
        flat[:-2] *= scale.to(dtype)  # back to the gradient of this rank's summed loss
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(flat, "sum", group=self.dp_group)
        total = flat[-1]
        flat[:-2] /= total.clamp_min(1)
        offset = 0
        for p in params:
            n = p.numel()
            grad = flat[offset : offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
            offset += n
        return flat[-2], total
