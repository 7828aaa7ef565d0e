"""The loss of one micro-batch, by what the model's last stage gives (its declared
:class:`~tp_ext.contract.LossKind`): the sum of the token losses this rank scores.

Position t predicts ``labels[:, t + 1]`` (Hugging Face style). Under context parallelism the
last stage gives the outputs of this rank's positions only (``positions``, in the order
:func:`tp_ext.cp_positions` gives), each scored against the next token of the whole sequence
(the sequence's last position has none).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tp_ext.contract import LossKind
from tp_ext.layers import vocab_parallel_cross_entropy

__all__ = ["Loss", "loss_for"]


def _targets(labels: torch.Tensor, positions: Optional[torch.Tensor], ignore_index: int):
    """The next token of each scored position: ``labels[:, 1:]`` (the outputs of every position
    but the last are scored), or under context parallelism the next token of each of
    ``positions`` (the last position's is ``ignore_index``)."""
    if positions is None:
        return labels[:, 1:]
    none = labels.new_full((labels.size(0), 1), ignore_index)
    return torch.cat([labels[:, 1:], none], 1)[:, positions.to(labels.device)]


def _scored(output: torch.Tensor, positions: Optional[torch.Tensor]) -> torch.Tensor:
    """The outputs that have a target (all of them under context parallelism)."""
    return output if positions is not None else output[:, :-1]


class Loss:
    """``summed(output, labels, positions)``: the summed token loss of one micro-batch from the
    last stage's ``output``. ``kind`` says what that output is; ``model`` (the 2D model)
    scores its grid block; ``tp_group`` is the vocabulary's for the vocabulary shard;
    ``aux_loss_coef``: a mixture-of-experts model's router-loss weight (full logits)."""

    def __init__(
        self,
        kind: LossKind,
        ignore_index: int,
        tp_group=None,
        model=None,
        aux_loss_coef: float = 0.0,
    ) -> None:
        self.kind, self.ignore_index = kind, ignore_index
        self.tp, self.model, self.aux_loss_coef = tp_group, model, aux_loss_coef

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The tokens of a micro-batch that count (its targets not ``ignore_index``)."""
        return (labels[:, 1:] != self.ignore_index).sum()

    def summed(self, output, labels: torch.Tensor, positions=None) -> torch.Tensor:
        if self.kind is LossKind.GRID_BLOCK:  # the whole batch's sum, on every grid rank
            return self.model.summed_loss(output, labels, self.ignore_index)
        targets = _targets(labels, positions, self.ignore_index)
        if self.kind is LossKind.VOCAB_SHARD:
            return vocab_parallel_cross_entropy(
                _scored(output, positions),
                targets,
                tp_group=self.tp,
                ignore_index=self.ignore_index,
                reduction="sum",
            )
        return self._full_logits(output, targets, positions)

    def _full_logits(self, output, targets, positions) -> torch.Tensor:
        """Whole logits (a transformers output, or the tensor itself); a mixture-of-experts
        model's load-balancing loss is added as its own loss adds it: ``coef * aux_loss`` per
        counted token."""
        logits = output if isinstance(output, torch.Tensor) else output.logits
        logits = _scored(logits, positions).flatten(0, 1)
        loss = F.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)),  # fp64 stays fp64
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        aux = None if isinstance(output, torch.Tensor) else output.get("aux_loss")
        if aux is not None and self.aux_loss_coef:
            loss = loss + self.aux_loss_coef * aux.float() * (targets != self.ignore_index).sum()
        return loss


def loss_for(model, ignore_index: int, tp_group, aux_loss_coef: float = 0.0) -> Loss:
    """The loss of a :class:`~tp_ext.contract.ParallelModel` (its declared loss kind)."""
    return Loss(model.loss_kind, ignore_index, tp_group, model, aux_loss_coef)
