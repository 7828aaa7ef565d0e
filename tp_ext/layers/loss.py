"""Cross-entropy of vocabulary-parallel logits (the output of a ``ParallelLMHead`` left sharded).

The logits are never gathered: per token, two all-reduces of token-sized tensors (a max, then
three sums) give the full-vocabulary logsumexp, the target logit and the logit sum, and the
backward is purely local. The op: ``tp_ext::vocab_parallel_cross_entropy`` (docs/ops.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tp_ext.distributed import comm
from tp_ext.distributed.groups import resolve_group

__all__ = ["vocab_parallel_cross_entropy"]

_REDUCTIONS = ("none", "sum", "mean")


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    tp_group=None,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy(full_logits.view(-1, V), target.view(-1), ...)`` from this rank's shard.

    ``logits_shard``: ``[..., V_r]``, this rank's slice of the vocabulary (last) dim, split over
    ``tp_group`` by :func:`tp_ext.shard_sizes` (the first ``V % W`` ranks hold one extra entry).
    ``target``: int64 class ids in ``[0, V)`` (or ``ignore_index``) of shape
    ``logits_shard.shape[:-1]``, the same on every rank. ``tp_group``: a ProcessGroup, a group
    name, a layer's ``.tp``, or None for the default TP group (a group of one without
    torch.distributed). ``label_smoothing`` spreads over the full vocabulary.

    ``reduction``: ``"none"`` gives the per-token loss (shape of ``target``, 0 where ignored),
    ``"sum"`` its sum, ``"mean"`` the sum over the number of non-ignored targets (nan if all are
    ignored), as PyTorch does. The loss is fp32 (fp64 for fp64 logits) whatever the logits' dtype.
    """
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction={reduction!r} is not supported; use 'none', 'sum' or 'mean'")
    tp = resolve_group(tp_group)
    if tp.group is None:  # no process group at all: the logits are the full vocabulary
        logits = logits_shard.flatten(0, -2)
        logits = logits if logits.dtype == torch.float64 else logits.float()
        loss = F.cross_entropy(
            logits,
            target.flatten(),
            ignore_index=ignore_index,
            label_smoothing=label_smoothing,
            reduction="none",
        ).view(target.shape)
    else:
        loss = comm.vocab_parallel_cross_entropy(
            logits_shard, target, ignore_index, label_smoothing, tp
        )
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / (target != ignore_index).sum()
