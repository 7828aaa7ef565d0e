"""The micro-batches a :class:`~tp_ext.training.Trainer` step takes, checked and put in the one
form the runners feed to the model (:class:`MicroBatch`):

- token batches (a causal LM's next-token loss): ``input_ids``, ``(input_ids, labels)`` or
  ``(input_ids, labels, attention_mask)``; the model gets ``model(input_ids)`` (and the mask);
- dict batches (any model, with ``Trainer(loss_fn=...)``): ``{"input_ids": ..., "labels": ...,
  "pixel_values": ..., ...}``; the model gets the keys its forward takes as keyword arguments,
  and the loss the whole dict.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any, Optional

import torch
from torch import nn

__all__ = ["MicroBatch", "token_batches", "dict_batches", "forward_keys"]


@dataclasses.dataclass
class MicroBatch:
    """One micro-batch as a runner feeds it: ``model(*args, **kwargs)``, and ``target`` (the
    labels of a token batch, the whole dict of a dict batch) for the loss. ``tokens``: the
    tokens it holds (the items, for a dict batch without ``input_ids``), for throughput."""

    args: tuple
    kwargs: dict
    target: Any
    tokens: int

    @property
    def input_ids(self) -> torch.Tensor:
        return self.args[0] if self.args else self.kwargs["input_ids"]

    @property
    def device(self) -> torch.device:
        tensors = [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]
        return tensors[0].device

    @property
    def attention_mask(self) -> Optional[torch.Tensor]:
        return self.kwargs.get("attention_mask")


def _batch_list(micro_batches, what: str) -> list:
    if isinstance(micro_batches, torch.Tensor):
        raise ValueError(
            f"micro_batches must be a list of micro-batches, got one tensor of shape "
            f"{tuple(micro_batches.shape)}; pass [input_ids]"
        )
    if isinstance(micro_batches, Mapping):
        raise ValueError(
            "micro_batches must be a list of micro-batches, got one dict; pass [batch]"
        )
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError(f"micro_batches must be a non-empty list of {what}, got {micro_batches!r}")
    return list(micro_batches)


def token_batches(micro_batches, device, ignore_index: int = -100) -> list[MicroBatch]:
    """``micro_batches`` of a causal LM on ``device``, each checked (input ids alone: their own
    labels). A padded micro-batch, ``(input_ids, labels, attention_mask)``, has its labels at
    padded positions (mask 0) set to ``ignore_index``: a padded position is never a target."""
    items = _batch_list(
        micro_batches,
        "input_ids tensors, (input_ids, labels) pairs or (input_ids, labels, attention_mask) "
        "triples",
    )
    batches = []
    for i, item in enumerate(items):
        ids, labels, mask = _parts(item, i)
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
        padding = {}
        if mask is not None:
            _check_mask(mask, ids, i)
            labels = labels.masked_fill(mask.to(labels.device) == 0, ignore_index)
            padding = {"attention_mask": mask.to(device)}
        batches.append(MicroBatch((ids.to(device),), padding, labels.to(device), ids.numel()))
    return batches


def _parts(item, i: int) -> tuple:
    """``(input_ids, labels, attention_mask or None)`` of one micro-batch, as given."""
    if isinstance(item, torch.Tensor):
        return item, item.long(), None
    parts = tuple(item) if isinstance(item, (list, tuple)) and len(item) in (2, 3) else ()
    if not parts or not all(isinstance(t, torch.Tensor) for t in parts):
        hint = (
            "; a dict micro-batch trains with Trainer(loss_fn=...)"
            if isinstance(item, Mapping)
            else ""
        )
        raise ValueError(
            f"micro_batches[{i}] must be an input_ids tensor, an (input_ids, labels) pair or an "
            f"(input_ids, labels, attention_mask) triple of tensors, got "
            f"{type(item).__name__}{hint}"
        )
    return parts if len(parts) == 3 else (*parts, None)


def _check_mask(mask: torch.Tensor, ids: torch.Tensor, i: int) -> None:
    if mask.shape != ids.shape or mask.is_floating_point() or mask.is_complex():
        raise ValueError(
            f"micro_batches[{i}]: attention_mask must be an integer or bool tensor of the "
            f"input_ids' shape {tuple(ids.shape)} (1: a token, 0: padding), got {mask.dtype} of "
            f"shape {tuple(mask.shape)}"
        )


def forward_keys(module: nn.Module) -> Optional[frozenset]:
    """The keyword arguments ``module``'s forward takes by name (None: any, it has
    ``**kwargs``)."""
    params = inspect.signature(module.forward).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    return frozenset(p.name for p in params if p.kind is not inspect.Parameter.VAR_POSITIONAL)


def dict_batches(
    micro_batches, device, takes: Optional[frozenset], *, labels_to_model: bool, model_name: str
) -> list[MicroBatch]:
    """Dict ``micro_batches`` on ``device``: the model gets each key its forward ``takes``
    (None: every key), ``labels`` only when ``labels_to_model`` (the model's own loss); the loss
    gets the whole dict. With ``labels_to_model``, a key the forward does not take is refused
    (nothing would read it)."""
    batches = []
    for i, item in enumerate(_batch_list(micro_batches, "dicts of tensors")):
        if not isinstance(item, Mapping) or not item:
            raise ValueError(
                f"micro_batches[{i}]: with loss_fn, each micro-batch is a non-empty dict of "
                f"tensors (e.g. {{'input_ids': ..., 'labels': ...}}), got {type(item).__name__}"
            )
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in item.items()}
        given = [k for k in batch if labels_to_model or k != "labels"]
        inputs = [k for k in given if takes is None or k in takes]
        unread = sorted(set(given) - set(inputs))
        if labels_to_model and unread:
            raise ValueError(
                f"micro_batches[{i}]: {model_name}.forward takes no {unread}, and with "
                f"loss_fn='model' nothing else reads them; it takes {sorted(takes)}"
            )
        if not inputs:
            raise ValueError(
                f"micro_batches[{i}]: none of its keys {sorted(batch)} is an argument of "
                f"{model_name}.forward ({sorted(takes or ())})"
            )
        kwargs = {k: batch[k] for k in inputs}
        batches.append(MicroBatch((), kwargs, batch, _tokens_of(batch, i)))
    return batches


def _tokens_of(batch: dict, i: int) -> int:
    ids = batch.get("input_ids")
    if isinstance(ids, torch.Tensor):
        return ids.numel()
    first = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.dim()), None)
    if first is None:
        raise ValueError(f"micro_batches[{i}]: it holds no tensor with a batch dimension")
    return first.size(0)
