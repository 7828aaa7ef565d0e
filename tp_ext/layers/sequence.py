"""The sequence shards of Megatron's sequence parallelism: every TP rank's share of the positions
for the current forward, and the moves between a shard and the whole sequence along dim -2
(``[..., seq, features]``). :func:`tp_ext.parallelize` splits the residual stream with it (a
decoder layer's pre-hook) and gathers it for the TP-split modules; a sparse-MoE block gathers
and reduce-scatters its own (:mod:`tp_ext.layers.moe`)."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from tp_ext.distributed import comm
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers.base import SEQUENCE_DIM
from tp_ext.sharding import shard_sizes, uneven_sizes

__all__ = ["SequenceShards", "sum_gradients_over"]


class SequenceShards:
    """Every rank's sequence-shard length for the current forward (:attr:`lengths`, by
    :func:`tp_ext.shard_sizes`) and the batch dims in front of it, set where the residual stream
    is split (:meth:`split`, or :meth:`set_length`) and read where it is gathered: uneven
    lengths need all ranks' sizes."""

    def __init__(self, tp: ResolvedGroup) -> None:
        self.tp = tp
        self.lengths: Optional[list[int]] = None
        self.batch: tuple[int, ...] = ()

    def set_length(self, length: int, batch: tuple[int, ...] = ()) -> None:
        """The whole sequence has ``length`` positions (``batch``: the dims before it)."""
        self.lengths = shard_sizes(length, self.tp.size)
        self.batch = tuple(batch)

    @property
    def sizes(self) -> Optional[list[int]]:
        """The collectives' ``sizes``: None when every rank holds as many positions."""
        return None if self.lengths is None else uneven_sizes(self.lengths)

    @property
    def mine(self) -> tuple[int, int]:
        """``(start, stop)`` of this rank's positions in the whole sequence."""
        start = sum(self.lengths[: self.tp.rank])
        return start, start + self.lengths[self.tp.rank]

    def split(self, module, args, kwargs):
        """Forward pre-hook of the first sequence-parallel decoder layer: keep this rank's shard
        of its hidden states (the gradient is all-gathered back)."""
        x = args[0] if args else kwargs["hidden_states"]
        self.set_length(x.size(SEQUENCE_DIM), x.shape[:SEQUENCE_DIM])
        x = comm.scatter_to_tp(x, SEQUENCE_DIM, self.sizes, self.tp)
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def gather(self, x: torch.Tensor, where: str = "") -> torch.Tensor:
        """The whole sequence from every rank's shard ``x``, for modules split over TP: the
        backward reduce-scatters their partial input gradients. ``where`` names the caller in
        the error for an ``x`` that is not this rank's shard."""
        if self.lengths is not None and x.size(SEQUENCE_DIM) != self.lengths[self.tp.rank]:
            raise ValueError(
                f"{where or 'sequence parallelism'}: expected this rank's sequence shard "
                f"({self.lengths[self.tp.rank]} of {sum(self.lengths)} positions on TP rank "
                f"{self.tp.rank}), got a tensor of shape {tuple(x.shape)}; a module that gathers "
                "the sequence itself must be given the shard (its norm 'sequence_parallel_local')"
            )
        return comm.gather_from_sp(x, SEQUENCE_DIM, self.sizes, self.tp)

    def gather_output(self, module, args, output):
        """Forward hook of a sequence-parallel norm: all-gather its output for the
        column-parallel layers that follow (one gather shared by q, k and v)."""
        return self.gather(output)

    def gather_output_whole(self, module, args, output):
        """Forward hook of a sequence-parallel norm whose readers compute in full on every rank:
        all-gather its output, the backward keeping this rank's rows of the gradient."""
        return self.gather_replicated(output)

    def gather_replicated(self, x: torch.Tensor) -> torch.Tensor:
        """The whole sequence from every rank's shard ``x``, for what every rank computes in full
        (a loss): the backward keeps this rank's rows of the gradient."""
        return comm.gather_from_tp(x, SEQUENCE_DIM, self.sizes, self.tp)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the sum of every rank's ``x`` (partial sums over the whole
        sequence); the backward all-gathers the shards' gradients."""
        return comm.reduce_scatter_to_sp(x, SEQUENCE_DIM, self.sizes, self.tp)

    def own_gradient(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (the whole sequence, the same on every rank) whose gradient reaches only this
        rank's positions: what every rank computes from it in full then counts once, when the
        ranks' gradients are summed."""
        start, stop = self.mine
        pieces = x[..., :start, :].detach(), x[..., start:stop, :], x[..., stop:, :].detach()
        return torch.cat(pieces, SEQUENCE_DIM)

    def tokens(self, x: torch.Tensor, whole: bool) -> torch.Tensor:
        """Flattened tokens ``x`` (``[batch * seq, features]``: a router's) as ``[*batch, seq,
        features]``, ``seq`` the whole sequence or (``whole=False``) this rank's shard."""
        length = sum(self.lengths) if whole else self.lengths[self.tp.rank]
        return x.view(*self.batch, length, x.size(-1))


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
