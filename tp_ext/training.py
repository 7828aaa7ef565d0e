"""Training a tp_ext model: AdamW with Megatron's parameter groups, the TP-aware gradient norm and
clipping, and a :class:`Trainer` whose step accumulates gradients over micro-batches.

Gradients of sharded parameters live in pieces on the TP ranks; replicated parameters (norms,
row-parallel biases) and replicated rows (KV heads when ``num_kv_heads < tp``) hold the same
gradient on every rank that has them. :func:`grad_norm` counts every element of the unsharded
model exactly once, so it equals ``torch.nn.utils.get_total_norm`` of the unsharded model's
gradients, with one all-reduce over TP.

Collectives issued by :class:`Trainer` are tagged for :func:`tp_ext.comm.track`:
``train.compute`` (the model's own, per micro-batch), ``train.dp_sync`` (one per step with a
data-parallel group) and ``train.grad_norm`` (one per step when clipping at TP > 1)::

    trainer = Trainer(model, max_grad_norm=1.0, dp_group=state.dp_group)
    loss = trainer.step([ids_0, ids_1])          # two micro-batches, one optimizer step
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Optional, Union

import torch
from torch import nn

from tp_ext import comm
from tp_ext.layers.base import ParallelModule, TPGroup, resolve_tp_group
from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.models.config import OptimizerSettings

__all__ = ["build_optimizer", "grad_norm", "clip_grad_norm_", "Trainer"]

MicroBatch = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


# ---- optimizer --------------------------------------------------------------------------------

def build_optimizer(model: nn.Module, settings: Optional[OptimizerSettings] = None,
                    **overrides) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters with ``settings``' lr, betas and weight decay
    (``OptimizerSettings()`` if None; ``overrides`` replace single fields, e.g. ``lr=1e-3``).

    Two parameter groups, as Megatron does: matrices (``dim >= 2``: linear and embedding weights)
    decay; biases and norm weights do not."""
    settings = OptimizerSettings() if settings is None else settings
    if not isinstance(settings, OptimizerSettings):
        raise TypeError(f"settings must be a tp_ext.models.OptimizerSettings or None, got "
                        f"{type(settings).__name__}")
    known = sorted(f.name for f in dataclasses.fields(OptimizerSettings))
    unknown = sorted(set(overrides) - set(known))
    if unknown:
        raise TypeError(f"build_optimizer: unknown setting(s) {unknown}; known: {known}")
    settings = dataclasses.replace(settings, **overrides)
    if not _is_number(settings.lr) or not settings.lr > 0:
        raise ValueError(f"lr must be a number > 0, got {settings.lr!r}")
    if not _is_number(settings.weight_decay) or not settings.weight_decay >= 0:
        raise ValueError(f"weight_decay must be a number >= 0, got {settings.weight_decay!r}")
    betas = tuple(settings.betas) if isinstance(settings.betas, (tuple, list)) else ()
    if len(betas) != 2 or not all(_is_number(b) and 0 <= b < 1 for b in betas):
        raise ValueError(f"betas must be two numbers in [0, 1), got {settings.betas!r}")
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(f"build_optimizer: {type(model).__name__} has no trainable parameters")
    groups = [{"params": [p for p in params if p.dim() >= 2],
               "weight_decay": float(settings.weight_decay)},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=float(settings.lr),
                             betas=betas)


# ---- gradient norm and clipping ---------------------------------------------------------------

def grad_norm(model: nn.Module, tp_group=None, norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type``-norm of all of ``model``'s gradients as if it were unsharded: equal to
    ``torch.nn.utils.get_total_norm`` over the unsharded model's gradients, on every TP rank.

    Sharded parameters contribute their local pieces (rows held by several ranks only on the
    first of them), replicated parameters only on TP rank 0; the partial sums travel in one
    all-reduce (a max for ``norm_type=inf``). ``tp_group``: None takes the group of the model's
    parallel layers. A collective: every TP rank must call it. Returns a 0-d float tensor."""
    p = _check_norm_type(norm_type)
    tp = _model_tp(model, tp_group)
    terms = []
    for param, spec in _grads_with_specs(model, tp):
        g = param.grad
        if spec is None:
            if tp.rank != 0 and p != math.inf:  # replicated: identical on every rank
                continue
        elif spec[1].replicated and p != math.inf:
            dim, partition = spec
            keep = _first_owner_positions(partition, tp.rank)
            if len(keep) != g.size(dim):
                g = g.index_select(dim, torch.tensor(keep, device=g.device))
        acc = torch.float64 if g.dtype == torch.float64 else torch.float32
        terms.append(torch.linalg.vector_norm(g, p, dtype=acc))
    device = next((q.device for q in model.parameters()), torch.device("cpu"))
    if not terms:
        local = torch.zeros((), device=device)
    else:
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in terms) else torch.float32
        stacked = torch.stack([t.to(dtype) for t in terms])
        local = stacked.max() if p == math.inf else stacked.pow(p).sum()
    if tp.size > 1:
        local = comm.all_reduce(local, "max" if p == math.inf else "sum", group=tp.group)
    return local if p == math.inf else local.pow(1.0 / p)


def clip_grad_norm_(model: nn.Module, max_norm: float, tp_group=None,
                    norm_type: float = 2.0) -> torch.Tensor:
    """Scale every gradient by ``max_norm / (norm + 1e-6)`` when that is below 1, with the norm
    from :func:`grad_norm` (so all TP ranks scale alike, as torch.nn.utils.clip_grad_norm_ would
    on the unsharded model). Returns the norm before clipping."""
    if not _is_number(max_norm) or not max_norm > 0:
        raise ValueError(f"max_norm must be a number > 0, got {max_norm!r}")
    total = grad_norm(model, tp_group, norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(coef.to(param.grad.dtype))
    return total


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check_norm_type(norm_type) -> float:
    if not _is_number(norm_type) or not norm_type > 0:
        raise ValueError(f"norm_type must be a number > 0 or math.inf, got {norm_type!r}")
    return float(norm_type)


def _model_tp(model: nn.Module, tp_group) -> TPGroup:
    """The explicit group, else the one group of the model's parallel layers (a group of one
    for a model without any)."""
    if tp_group is not None:
        return resolve_tp_group(tp_group)
    groups = {}
    for module in model.modules():
        tp = getattr(module, "tp", None) if isinstance(module, ParallelModule) else None
        if tp is not None and tp.size > 1:
            groups[tp.name] = tp
    if len(groups) > 1:
        raise ValueError(f"{type(model).__name__} has layers on several TP groups "
                         f"({sorted(groups)}); pass tp_group= to say which one to reduce over")
    return next(iter(groups.values()), TPGroup.local())


def _grads_with_specs(model: nn.Module, tp: TPGroup):
    """(parameter, shard spec or None) for each distinct parameter with a gradient."""
    seen = set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:  # tied weights: counted once
                continue
            seen.add(id(param))
            if param.grad is None:
                continue
            spec = module.shard_spec(name) if isinstance(module, ParallelModule) else None
            if spec is not None and spec[1].world_size != tp.size:
                raise ValueError(
                    f"{type(module).__name__}.{name} is sharded over {spec[1].world_size} ranks "
                    f"but tp_group has {tp.size}; pass the group the model was built with")
            yield param, spec


def _first_owner_positions(partition, rank: int) -> list[int]:
    """Local positions of the rows no lower rank also holds."""
    earlier = {i for r in range(rank) for i in partition.local_indices(r)}
    return [pos for pos, i in enumerate(partition.local_indices(rank)) if i not in earlier]


# ---- trainer ----------------------------------------------------------------------------------

class Trainer:
    """One optimizer step per :meth:`step` over a list of micro-batches, for a tp_ext causal LM
    (``model(input_ids, local_logits=True)`` gives this rank's vocabulary shard of the logits).

    - ``optimizer``: None builds :func:`build_optimizer` from ``model.config.optimizer`` (if the
      model has a config) or the defaults.
    - ``max_grad_norm``: clip to this TP-aware norm (None: no clipping; the norm is not computed).
    - ``dp_group``: a data-parallel group (e.g. ``init_parallel(...).dp_group``); each DP rank
      passes its own micro-batches, and the step equals one over all of them.
    - ``autocast_dtype``: e.g. ``torch.bfloat16`` runs forward under ``torch.autocast``
      (parameters, gradients and optimizer state stay in their own dtype).
    - ``tp_group``: None takes the model's.

    The loss is the mean token cross-entropy over every target of every micro-batch (of every
    DP rank); targets equal to ``ignore_index`` do not count.
    """

    def __init__(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer] = None, *,
                 max_grad_norm: Optional[float] = None, dp_group=None, tp_group=None,
                 autocast_dtype: Optional[torch.dtype] = None, ignore_index: int = -100) -> None:
        if max_grad_norm is not None and (not _is_number(max_grad_norm) or
                                          not max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a number > 0, or None for no clipping; got "
                             f"{max_grad_norm!r}")
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise TypeError(f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16) or "
                            f"None, got {autocast_dtype!r}")
        self.model = model
        if optimizer is None:
            config = getattr(model, "config", None)
            optimizer = build_optimizer(model, getattr(config, "optimizer", None))
        self.optimizer = optimizer
        self.max_grad_norm = max_grad_norm
        self.tp = _model_tp(model, tp_group)
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
        count = torch.stack([(labels[:, 1:] != self.ignore_index).sum()
                             for _, labels in batches]).sum()
        scale = count.clamp_min(1).float()
        count = count.float()
        loss_sum = torch.zeros((), device=batches[0][0].device)
        with comm.tag("train.compute"):
            for ids, labels in batches:
                with self._autocast(ids.device):
                    logits = self.model(ids, local_logits=True)
                    loss = vocab_parallel_cross_entropy(
                        logits[:, :-1], labels[:, 1:], tp_group=self.tp,
                        ignore_index=self.ignore_index, reduction="sum")
                (loss / scale).backward()
                loss_sum += loss.detach().float()
        if self.dp_group is not None and self.dp_group.size() > 1:
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
            raise ValueError(f"micro_batches must be a list of micro-batches, got one tensor of "
                             f"shape {tuple(micro_batches.shape)}; pass [input_ids]")
        if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
            raise ValueError(f"micro_batches must be a non-empty list of input_ids tensors or "
                             f"(input_ids, labels) pairs, got {micro_batches!r}")
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        batches = []
        for i, item in enumerate(micro_batches):
            ids, labels = (item, item.long()) if isinstance(item, torch.Tensor) else (
                tuple(item) if isinstance(item, (list, tuple)) and len(item) == 2 else (None, None))
            if not isinstance(ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
                raise ValueError(f"micro_batches[{i}] must be an input_ids tensor or an "
                                 f"(input_ids, labels) pair of tensors, got {type(item).__name__}")
            if ids.dim() != 2 or ids.size(1) < 2 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(f"micro_batches[{i}]: input_ids must be an int64/int32 tensor "
                                 f"[batch, seq] with seq >= 2, got {ids.dtype} of shape "
                                 f"{tuple(ids.shape)}")
            if labels.shape != ids.shape or labels.dtype != torch.int64:
                raise ValueError(f"micro_batches[{i}]: labels must be an int64 tensor of the "
                                 f"input_ids' shape {tuple(ids.shape)} (shifted here), got "
                                 f"{labels.dtype} of shape {tuple(labels.shape)}")
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
        pieces = [(p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype)
                  for p in params]
        flat = torch.cat(pieces + [loss_sum.view(1).to(dtype), count.view(1).to(dtype)])
        flat[:-2] *= scale.to(dtype)  # back to the gradient of this rank's summed loss
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(flat, "sum", group=self.dp_group)
        total = flat[-1]
        flat[:-2] /= total.clamp_min(1)
        offset = 0
        for p in params:
            n = p.numel()
            grad = flat[offset:offset + n].view_as(p).to(p.dtype)
            if p.grad is None:
                p.grad = grad
            else:
                p.grad.copy_(grad)
            offset += n
        return flat[-2], total
