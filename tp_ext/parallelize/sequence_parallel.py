"""Megatron's sequence parallelism on an existing model, by hooks (the model's modules keep their
names in state dicts and checkpoints): the residual stream is split along the sequence where the
first sequence-parallel norm's block begins, each such norm runs on this rank's shard, and its
output is all-gathered once for the column-parallel layers after it."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tp_ext.distributed import comm
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.sharding import shard_sizes, uneven_sizes

__all__ = ["SequenceShards", "sum_gradients_over"]


def sum_gradients_over(module: nn.Module, group: ResolvedGroup) -> list[str]:
    """Make the gradients of ``module``'s own trainable parameters the sum over ``group`` (each
    rank's is a partial sum: a sequence-parallel norm saw only its tokens, a per-head norm only
    its heads). Returns their names.

    Why a forward pre-hook and not one hook on each parameter: under FSDP2 the forward reads a
    gathered copy of the parameter (a tensor of FSDP2's, the same one every step), not the
    parameter itself, and a gradient hook must sit on what the forward reads. The pre-hook
    hooks whatever parameter the module holds when it runs, once per tensor."""
    hooked = WeakIdKeyDictionary()  # by identity: tensors compare element by element

    def all_reduce(grad: torch.Tensor) -> torch.Tensor:
        return comm.all_reduce(grad, "sum", group)

    def hook_what_runs(mod, args):
        for param in mod.parameters(recurse=False):
            if param.requires_grad and param not in hooked:
                param.register_hook(all_reduce)
                hooked[param] = True

    module.register_forward_pre_hook(hook_what_runs)
    return [name for name, p in module.named_parameters(recurse=False) if p.requires_grad]


class SequenceShards:
    """Every rank's sequence-shard length for the current forward, set where the residual stream
    is split and read where it is gathered (uneven lengths need all ranks' sizes)."""

    def __init__(self, tp: ResolvedGroup) -> None:
        self.tp = tp
        self.sizes: Optional[list[int]] = None

    def split(self, module, args, kwargs):
        """Forward pre-hook of the first sequence-parallel decoder layer: keep this rank's shard
        of its hidden states (the gradient is all-gathered back)."""
        x = args[0] if args else kwargs["hidden_states"]
        self.sizes = uneven_sizes(shard_sizes(x.size(-2), self.tp.size))
        x = comm.scatter_to_tp(x, -2, self.sizes, self.tp)
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return comm.gather_from_sp(x, -2, self.sizes, self.tp)

    def gather_output(self, module, args, output):
        """Forward hook of a sequence-parallel norm: all-gather its output for the
        column-parallel layers that follow (one gather shared by q, k and v)."""
        return self.gather(output)
