"""The Qwen2/Llama decoder block on tensor-parallel attention and MLP.

Each rank computes its own attention heads and its share of the MLP's hidden units: per block,
one all-reduce after attention and one after the MLP (forward), and the same two backward. With
``sequence_parallel`` the residual stream stays split along the sequence, and each all-reduce
becomes an all-gather before the column-parallel layer plus a reduce-scatter after the
row-parallel one (the same bytes, and norms computed on 1/tp of the tokens).

Inputs are ``[batch, seq, hidden]``; under sequence parallelism ``seq`` is this rank's shard
(pass ``seq_len`` when the full length does not divide by the TP size). ``position_ids`` are
always the full sequence's, ``[batch, seq]``.
"""

from __future__ import annotations

from typing import Optional

import torch

from tp_ext.layers.attention import KVCache, ParallelAttention
from tp_ext.layers.base import ParallelModule
from tp_ext.layers.mlp import ParallelMLP
from tp_ext.layers.norm import RMSNorm

__all__ = ["ParallelTransformerBlock"]


class ParallelTransformerBlock(ParallelModule):
    """A Qwen2/Llama decoder layer: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.

    Full state dict names: ``input_layernorm.weight``, ``self_attn.qkv_proj.{weight,bias}``
    (q, k, v stacked), ``self_attn.o_proj.weight``, ``post_attention_layernorm.weight``,
    ``mlp.gate_up_proj.weight`` (gate, up stacked), ``mlp.down_proj.weight``.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        intermediate_size: int,
        head_dim: Optional[int] = None,
        rms_norm_eps: float = 1e-6,
        rope_theta: float = 10000.0,
        qkv_bias: bool = True,
        attention_dropout: float = 0.0,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = self._setup_tp(tp_group)
        kw = {"device": device, "dtype": dtype}
        self.sequence_parallel = sequence_parallel
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps, sequence_parallel, tp, **kw)
        self.self_attn = ParallelAttention(
            hidden_size,
            num_heads,
            num_kv_heads,
            head_dim,
            qkv_bias,
            False,
            rope_theta,
            attention_dropout,
            sequence_parallel,
            tp,
            **kw,
        )
        self.post_attention_layernorm = RMSNorm(
            hidden_size, rms_norm_eps, sequence_parallel, tp, **kw
        )
        self.mlp = ParallelMLP(hidden_size, intermediate_size, False, sequence_parallel, tp, **kw)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        seq_len: Optional[int] = None,
        key_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), position_ids, kv_cache, seq_len, key_mask)
        norm = self.post_attention_layernorm
        if isinstance(norm, RMSNorm) and not (norm._forward_hooks or norm._forward_pre_hooks):
            normed, h = norm.forward_add(attn, x)  # h = x + attn and its norm in one pass
        else:  # a replaced or hooked norm must see its own call
            h = x + attn
            normed = norm(h)
        return h + self.mlp(normed, seq_len)
