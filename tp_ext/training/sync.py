"""The gradient sync of a training step: how the gradients a rank computed for its tokens
become, on every replica, the gradient of the mean loss over every token of the step.

Replicas are the ranks that hold the same weights: the DP x CP ranks of a stage's TP position
for dense parameters (each CP rank scores its own positions of the same sequences), the
expert-DP ranks for an expert's. Each micro-batch's summed loss is divided by
``global token count / averages_over`` before its backward; the sync then leaves:

- :class:`EngineSync`: DDP or FSDP2 wrapping the stage modules summed them already; a
  zero-bubble schedule writes weight gradients outside autograd, where their hooks never fire,
  so its sum runs after the step (with gradient compression, which averages, ``averages_over``
  is the replica group's size);
- :class:`ReplicaSums`: one all-reduce (a sum) of each parameter group's gradients over its
  replica group: the dense parameters over DP x CP, a mixture-of-experts model's experts over
  the ranks holding the same experts;
- :class:`ReduceScatterSync`: ZeRO-2's bucketed reduce-scatter (the sharded optimizer's),
  sent during the backward, each replica keeping its rows.

The loss is divided by the global count (one all-reduce of the counts before the first
forward) for every sync alike, so the sums are exact whichever sync runs.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
from torch import nn

from tp_ext.distributed import comm
from tp_ext.pipeline.data_parallel import ReplicatedStages, reduce_scatter_in
from tp_ext.sharding import shard_sizes

__all__ = ["GradientSync", "EngineSync", "ReplicaSums", "ReduceScatterSync"]


class GradientSync:
    """The interface every sync gives the runner and the Trainer.

    - ``averages_over``: how many replicas the sync averages over (1: it sums), which the
      loss denominator takes out;
    - ``shards_gradients``: whether each replica is left with its rows of the gradients (the
      gradient norm counts each row once) rather than whole ones (counted on one replica).
    """

    averages_over: int = 1
    shards_gradients: bool = False
    compression_states: list = []

    def __init__(self, stages: ReplicatedStages) -> None:
        self.stages = stages

    @property
    def modules(self) -> list[nn.Module]:
        """The stage modules the runner calls (wrapped by the engine, if any)."""
        return self.stages.modules

    def accumulating(self, module: nn.Module, last: bool):
        """The context one micro-batch's backward runs in under the local runner: every one but
        the ``last`` leaves its gradients unsynchronised."""
        return contextlib.nullcontext()

    def before_backward(self, micro_batches: int) -> None:
        """Called once per step before the first forward."""

    def after_backward(self, params) -> None:
        """Called once per step after the last backward: what is left to synchronise."""


class EngineSync(GradientSync):
    """DDP or FSDP2 (``stages.modules`` wrapped on the replica ``group``): their hooks sum the
    gradients in the last micro-batch's backward (compression's average them)."""

    def __init__(self, stages: ReplicatedStages, engine: str, group) -> None:
        super().__init__(stages)
        self.engine, self.group = engine, group
        self.shards_gradients = engine == "fsdp"
        self.compression_states = stages.compression_states
        self.averages_over = group.size() if self.compression_states else 1

    def accumulating(self, module: nn.Module, last: bool):
        if last or self.group.size() == 1:
            return contextlib.nullcontext()
        if self.engine == "ddp":
            return module.no_sync()
        return _fsdp_no_sync(module)

    def after_backward(self, params) -> None:
        if self.stages.sync_after_step:  # (a zero-bubble schedule: the hooks never fired)
            self.stages.synchronise(params, self.group)


@contextlib.contextmanager
def _fsdp_no_sync(module: nn.Module):
    """FSDP2 accumulating without its reduce-scatter, its parameters kept gathered for the next
    micro-batch (as torch's pipeline stages run it)."""
    module.set_is_last_backward(False)
    module.set_reshard_after_backward(False)
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True)
        module.set_requires_gradient_sync(True)


class ReplicaSums(GradientSync):
    """Each ``(parameters, group)`` pair's gradients summed over ``group`` in one flat
    all-reduce (``reduce_dtype``: the pieces travel in it and add in fp32)."""

    def __init__(self, stages: ReplicatedStages, groups, reduce_dtype=None) -> None:
        super().__init__(stages)
        self.groups = [(params, comm.resolve_group(g)) for params, g in groups]
        self.reduce_dtype = reduce_dtype

    @torch.no_grad()
    def after_backward(self, params) -> None:
        wanted = {id(p) for p in params}
        for members, group in self.groups:
            members = [p for p in members if id(p) in wanted]
            if members and group.size > 1:
                with comm.tag("train.dp_sync"):
                    flat = sum_over(flat_grads(members), group, self.reduce_dtype)
                set_grads(members, flat)


class ReduceScatterSync(GradientSync):
    """ZeRO-2: the sharded ``optimizer`` reduce-scatters each bucket as the backward finishes
    its gradients and keeps this replica's rows."""

    shards_gradients = True

    def __init__(self, stages: ReplicatedStages, optimizer) -> None:
        super().__init__(stages)
        self.optimizer = optimizer

    def before_backward(self, micro_batches: int) -> None:
        self.optimizer.expect_backward(micro_batches, divide_by=1.0)

    def after_backward(self, params) -> None:
        self.optimizer.reduce_gradients(divide_by=1.0)


# ---- flat gradients -----------------------------------------------------------------------------


def sum_over(flat: torch.Tensor, group, reduce_dtype: Optional[torch.dtype]) -> torch.Tensor:
    """``flat`` summed over ``group``: one all-reduce, or with ``reduce_dtype`` the pieces sent
    in it and added in ``flat``'s dtype, then gathered (every replica the same sums)."""
    if reduce_dtype is None:
        return comm.all_reduce(flat, "sum", group=group)
    sizes = shard_sizes(flat.numel(), group.size)
    mine = reduce_scatter_in(flat, sizes, reduce_dtype, group)
    return comm.all_gather(mine.to(reduce_dtype), 0, sizes, group=group).to(flat.dtype)


def flat_grads(params, extras=()) -> torch.Tensor:
    """Every gradient (zeros where None), then the 0-d ``extras``, in one flat tensor (fp64 when
    a parameter is, else fp32), for one all-reduce."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    pieces = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype) for p in params
    ]
    return torch.cat(pieces + [e.view(1).to(dtype) for e in extras])


def set_grads(params, flat: torch.Tensor) -> torch.Tensor:
    """The gradients back from a tensor of :func:`flat_grads`; returns the extras after them."""
    offset = 0
    for p in params:
        grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)
        offset += p.numel()
    return flat[offset:]
