"""RMSNorm, replicated over the TP group."""

from __future__ import annotations

import torch
from torch import nn

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.layers.base import ParallelModule, check_int

__all__ = ["FusedRMSNorm", "RMSNorm"]


class RMSNorm(ParallelModule):
    """``weight * x / sqrt(mean(x^2) + eps)``, computed in float32 and cast back (as Hugging
    Face's Qwen2/Llama RMSNorm). The weight is replicated; with ``sequence_parallel`` each rank
    normalises only its sequence shard, so the weight's gradient is all-reduced over TP."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self._setup_tp(tp_group)
        self.hidden_size = check_int("hidden_size", hidden_size)
        if not eps > 0:
            raise ValueError(f"eps must be > 0, got {eps!r}")
        self.eps = float(eps)
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def _check(self, x: torch.Tensor) -> None:
        if x.dim() == 0 or x.size(-1) != self.hidden_size:
            raise ValueError(
                f"RMSNorm: input has shape {tuple(x.shape)} but its last dimension "
                f"must be hidden_size = {self.hidden_size}"
            )

    def _weight(self) -> torch.Tensor:
        return comm.copy_to_tp(self.weight, self.tp) if self.sequence_parallel else self.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        # Fused op (csrc/ops/rms_norm.cpp): same result as the fp32-then-cast reference.
        return ops.rms_norm(x, self._weight(), self.eps)

    def forward_add(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(norm(h), h)`` with ``h = x + residual``, in one pass when x and residual have the
        same shape and dtype (otherwise, e.g. mixed dtypes under autocast, the unfused sum)."""
        self._check(x)
        if x.shape == residual.shape and x.dtype == residual.dtype:
            return ops.add_rms_norm(x, residual, self._weight(), self.eps)
        h = x + residual
        return self(h), h

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class FusedRMSNorm(nn.Module):
    """A Hugging Face RMSNorm (Llama's, Qwen2's, Mistral's: ``weight * normed.to(x.dtype)`` with
    ``normed`` computed in float32) run by the fused ``rms_norm`` op: one pass forward and one
    backward instead of six elementwise kernels each way, the same roundings. ``parallelize``
    swaps it in for norms that compute exactly this (checked on a probe), keeping the norm's own
    ``weight`` Parameter, so names, state dicts and ties stay as they were. Not a
    :class:`~tp_ext.layers.ParallelModule`: it holds nothing sharded."""

    def __init__(self, weight: nn.Parameter, eps: float):
        super().__init__()
        if not isinstance(weight, nn.Parameter) or weight.dim() != 1:
            raise ValueError(
                f"FusedRMSNorm(weight=...) must be the norm's 1-D weight Parameter, got "
                f"{type(weight).__name__} of shape {tuple(getattr(weight, 'shape', ()))}"
            )
        if not eps > 0:
            raise ValueError(f"FusedRMSNorm(eps=...) must be > 0, got {eps!r}")
        self.weight = weight
        self.variance_epsilon = float(eps)  # Hugging Face's attribute name

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"
