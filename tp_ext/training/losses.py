"""The loss of one micro-batch, by what the model's last stage gives (its declared
:class:`~tp_ext.contract.LossKind`): the sum of the token losses this rank scores.

Position t predicts ``labels[:, t + 1]`` (Hugging Face style). Under context parallelism the
last stage gives the outputs of this rank's positions only (``positions``, in the order
:func:`tp_ext.cp_positions` gives), each scored against the next token of the whole sequence
(the sequence's last position has none).
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Union

import torch
import torch.nn.functional as F

from tp_ext.contract import LossKind
from tp_ext.distributed import comm
from tp_ext.layers import vocab_parallel_cross_entropy
from tp_ext.layers.moe import expert_count, experts_per_token

__all__ = ["BatchLoss", "Loss", "RouterLoss", "router_loss_of"]


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


class RouterLoss:
    """A mixture-of-experts model's load-balancing loss (Switch Transformer's, as transformers'
    ``load_balancing_loss_func`` computes it over every layer's router logits): ``num_experts``
    times the sum over experts of (the share of top-``top_k`` choices it got) x (its mean router
    probability), weighted by ``coef``.

    Under context parallelism each CP rank routes its own positions: the counts and probability
    sums are summed over ``group`` (the CP group) first, so the statistics are the whole
    sequence's, and every rank's gradient is its positions' part of the one loss; its value is
    counted on the group's first rank only."""

    def __init__(self, coef: float, num_experts: int, top_k: int, group=None) -> None:
        self.coef, self.num_experts, self.top_k = coef, num_experts, top_k
        self.group = None if group is None else comm.resolve_group(group)

    def __call__(self, router_logits) -> torch.Tensor:
        experts = self.num_experts
        choices = torch.zeros(experts, device=router_logits[0].device)
        probs = torch.zeros(experts, device=router_logits[0].device)
        rows = torch.zeros((), device=router_logits[0].device)
        for layer in router_logits:
            weights = F.softmax(layer.float(), dim=-1)
            chosen = torch.topk(weights, self.top_k, dim=-1).indices.reshape(-1)
            choices = choices + torch.bincount(chosen, minlength=experts).float()
            probs, rows = probs + weights.sum(dim=0), rows + weights.size(0)
        if self.group is not None and self.group.size > 1:  # the whole sequence's statistics
            counted = comm.all_reduce(torch.cat([choices, rows.view(1)]), "sum", group=self.group)
            choices, rows = counted[:experts], counted[experts]
            probs = comm.reduce_from_tp(probs, self.group)  # summed; each rank's gradient its own
        loss = self.coef * experts * torch.sum((choices / rows) * (probs / rows))
        if self.group is not None and self.group.rank != 0:
            loss = loss - loss.detach()  # its gradient, not its value a second time
        return loss


class Loss:
    """``summed(output, labels, positions)``: the summed token loss of one micro-batch from the
    last stage's ``output``. ``kind`` says what that output is; ``model`` (the 2D model)
    scores its grid block; ``tp_group`` is the vocabulary's for the vocabulary shard;
    ``router``: a mixture-of-experts model's load-balancing loss (full logits; its router
    logits in the output), added per counted token as the model's own loss adds it."""

    def __init__(
        self,
        kind: LossKind,
        ignore_index: int,
        tp_group=None,
        model=None,
        router: Optional[RouterLoss] = None,
    ) -> None:
        self.kind, self.ignore_index = kind, ignore_index
        self.tp, self.model, self.router = tp_group, model, router

    def count(self, labels: torch.Tensor) -> torch.Tensor:
        """The tokens of a micro-batch that count (its targets not ``ignore_index``)."""
        return (labels[:, 1:] != self.ignore_index).sum()

    def summed(self, output, labels: torch.Tensor, positions=None, step_count=None):
        targets = _targets(labels, positions, self.ignore_index)
        if self.kind is LossKind.GRID_BLOCK:  # the whole batch's sum, on every grid rank
            return self.model.summed_loss(_scored(output, positions), targets, self.ignore_index)
        if self.kind is LossKind.VOCAB_SHARD:
            return vocab_parallel_cross_entropy(
                _scored(output, positions),
                targets,
                tp_group=self.tp,
                ignore_index=self.ignore_index,
                reduction="sum",
            )
        loss = self._full_logits(output, targets, positions)
        if self.router is not None:  # per counted token of the whole micro-batch
            loss = loss + self.router(output.router_logits) * self.count(labels)
        return loss

    def _full_logits(self, output, targets, positions) -> torch.Tensor:
        """Whole logits (a transformers output, or the tensor itself)."""
        logits = output if isinstance(output, torch.Tensor) else output.logits
        logits = _scored(logits, positions).flatten(0, 1)
        return F.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)),  # fp64 stays fp64
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )


def router_loss_of(module, cp_group=None) -> Optional[RouterLoss]:
    """The load-balancing loss a transformers mixture-of-experts model asks for
    (``config.output_router_logits`` with a ``router_aux_loss_coef``), or None."""
    config = getattr(module, "config", None)  # (a plain module has none)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0)
    if not getattr(config, "output_router_logits", False) or not coef:
        return None
    return RouterLoss(coef, expert_count(config), experts_per_token(config), cp_group)


class BatchLoss:
    """The loss of a dict micro-batch (:class:`~tp_ext.contract.LossKind` ``MODEL_OUTPUT``):
    ``fn(output, batch)`` over the model's output and the whole dict, or the model's own
    ``output.loss`` (``fn="model"``, the batch's labels given to the model, as transformers'
    Trainer does).

    Each returns the micro-batch's mean: the step's loss is the mean over every micro-batch of
    every DP rank (torchtitan's and transformers' accumulation). A ``fn`` that takes a
    ``num_items_in_batch`` keyword (transformers' name) gets the step's count of labels that
    are not ``ignore_index``, over every micro-batch of every DP rank, and returns its sum
    divided by it: then the step's loss weighs every label alike (a masked LM whose
    micro-batches mask different numbers of tokens) and equals the one over the whole batch."""

    kind = LossKind.MODEL_OUTPUT

    def __init__(self, fn: Union[Callable, str], ignore_index: int = -100) -> None:
        self.fn, self.ignore_index = fn, ignore_index
        self.per_item = callable(fn) and "num_items_in_batch" in _keywords(fn)
        self.labels_to_model = fn == "model"

    def count(self, batch: dict) -> torch.Tensor:
        """The micro-batch's weight in the step's mean: its counted labels (``per_item``), or 1."""
        if not self.per_item:
            return torch.ones((), dtype=torch.long, device=_device_of(batch))
        labels = batch.get("labels")
        if not isinstance(labels, torch.Tensor):
            raise ValueError(
                "loss_fn takes num_items_in_batch, which counts the batch's 'labels' that are not "
                f"ignore_index; this micro-batch has no 'labels' tensor (keys {sorted(batch)})"
            )
        return (labels != self.ignore_index).sum()

    def summed(self, output, batch: dict, positions=None, step_count=None) -> torch.Tensor:
        """The micro-batch's loss times its weight (what the core divides by the step's)."""
        if self.labels_to_model:
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if loss is None:
                raise ValueError(
                    f"loss_fn='model': the model's output ({type(output).__name__}) has no loss; "
                    "give the batch its 'labels', or pass loss_fn=callable(output, batch)"
                )
        elif self.per_item:
            loss = self.fn(output, batch, num_items_in_batch=step_count) * step_count
        else:
            loss = self.fn(output, batch)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"loss_fn must return a scalar tensor (0-dim), got {shape}")
        return loss.float() if loss.dtype in (torch.float16, torch.bfloat16) else loss


def _keywords(fn: Callable) -> set:
    try:
        return set(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return set()


def _device_of(batch: dict) -> torch.device:
    tensor = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
    return torch.device("cpu") if tensor is None else tensor.device
