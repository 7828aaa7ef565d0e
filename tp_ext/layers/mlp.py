"""Tensor-parallel SwiGLU MLP: gate and up merged in one column-parallel matmul, the fused
``swiglu`` op, down row-parallel. Each rank holds its share of the hidden units (any count)."""

from __future__ import annotations

from typing import Optional

import torch

from tp_ext import ops
from tp_ext.layers.base import ParallelModule, check_int
from tp_ext.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from tp_ext.sharding import Partition

__all__ = ["ParallelMLP"]


class ParallelMLP(ParallelModule):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up merged in one column-parallel
    matmul and down row-parallel. Each rank holds its share of the hidden units (any count)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool = False,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = self._setup_tp(tp_group)
        check_int("intermediate_size", intermediate_size)
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size,
            [intermediate_size, intermediate_size],
            bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp,
            **kw,
        )
        self.down_proj = RowParallelLinear(
            intermediate_size,
            hidden_size,
            bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp,
            partition=Partition.split(intermediate_size, tp.size),
            **kw,
        )

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        # The local [gate | up] output has equal halves: the fused op computes silu(gate) * up.
        return self.down_proj(ops.swiglu(self.gate_up_proj(x, seq_len)), seq_len)
