"""``torch.nn.MultiheadAttention`` split over the TP group by whole heads.

The packed input projection (``in_proj_weight``: the q, k and v rows end to end) keeps this
rank's heads' rows of each of q, k and v; the output projection (``out_proj``) is row-parallel
over the same heads, its all-reduce making the output whole. The forward takes what
``nn.MultiheadAttention.forward`` takes (``batch_first`` either way, unbatched inputs, a
``key_padding_mask`` and an ``attn_mask``, boolean or additive, 2-D or per head, ``is_causal``,
cross-attention with another key and value) and returns the same: the attention weights when
asked, averaged over every rank's heads or each head's. State-dict names are torch's, so a converted
``nn.Transformer`` saves and loads as the unconverted one does.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tp_ext.distributed import comm
from tp_ext.layers.base import ParallelModule
from tp_ext.layers.linear import RowParallelLinear
from tp_ext.sharding import Partition, shard_offsets, shard_sizes

__all__ = ["ParallelMultiheadAttention"]


class ParallelMultiheadAttention(ParallelModule):
    """``nn.MultiheadAttention(embed_dim, num_heads, dropout, bias, batch_first=...)`` with this
    rank's share of the heads (:func:`~tp_ext.sharding.shard_sizes`: uneven counts allowed).
    Made by :func:`tp_ext.parallelize` from the module it replaces, whose weights it takes
    (``load_full_state_dict``); constructed alone, its parameters are uninitialised."""

    # torch's fused fast paths (nn.TransformerEncoderLayer in eval mode, nn.TransformerEncoder's
    # nested tensors) read the whole projections from these attributes; False sends them down
    # the module path, which calls this forward
    _qkv_same_embed_dim = False

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        batch_first: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
    ) -> None:
        super().__init__()
        tp = self._setup_tp(tp_group)
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads = embed_dim, num_heads
        self.head_dim = embed_dim // num_heads
        self.dropout, self.batch_first = dropout, batch_first
        self.local_heads = shard_sizes(num_heads, tp.size)[tp.rank]
        self.first_head = shard_offsets(num_heads, tp.size)[tp.rank]
        qkv = Partition.merged([embed_dim] * 3, tp.size, unit=self.head_dim)
        kw = {"device": device, "dtype": dtype}
        rows = qkv.local_size(tp.rank)
        self.in_proj_weight = nn.Parameter(torch.empty(rows, embed_dim, **kw))
        self._set_shard("in_proj_weight", 0, qkv)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(rows, **kw))
            self._set_shard("in_proj_bias", 0, qkv)
        else:
            self.register_parameter("in_proj_bias", None)
        heads = Partition.split(embed_dim, tp.size, unit=self.head_dim)
        self.out_proj = RowParallelLinear(
            embed_dim, embed_dim, bias, partition=heads, tp_group=tp_group, **kw
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: Optional[torch.Tensor] = None,
        need_weights: bool = True,
        attn_mask: Optional[torch.Tensor] = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        length, batch, _ = query.shape
        q, k, v = self._project(query, key, value)
        mask = self._mask(attn_mask, key_padding_mask, batch, length, k.size(2), q.dtype)
        if is_causal and attn_mask is None:  # as torch: is_causal is a hint about attn_mask
            raise ValueError("ParallelMultiheadAttention: is_causal=True needs the attn_mask")
        dropout = self.dropout if self.training else 0.0
        weights = None
        if need_weights:  # as torch: the weights returned are those applied (after dropout)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)
            probs = torch.softmax(scores if mask is None else scores + mask, dim=-1)
            probs = F.dropout(probs, dropout, self.training)
            weights = self._weights(probs, average_attn_weights)
            out = probs @ v
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout)
        out = out.permute(2, 0, 1, 3).reshape(length, batch, self.local_heads * self.head_dim)
        out = self.out_proj(out)
        if unbatched:
            return out.squeeze(1), None if weights is None else weights.squeeze(0)
        return (out.transpose(0, 1) if self.batch_first else out), weights

    def _weights(self, probs: torch.Tensor, average: bool) -> torch.Tensor:
        """Every head's attention weights from this rank's ``probs`` [batch, local heads, L, S]:
        averaged over all heads (a sum over the ranks), or each head's (gathered in order)."""
        if average:
            return comm.reduce_from_tp(probs.sum(1), self.tp) / self.num_heads
        sizes = shard_sizes(self.num_heads, self.tp_size)
        return comm.gather_from_tp(probs.contiguous(), 1, sizes, self.tp)

    def _project(self, query, key, value):
        """This rank's heads of q, k and v: [batch, local heads, length, head_dim] each."""
        w = self.in_proj_weight.chunk(3)
        b = (None,) * 3 if self.in_proj_bias is None else self.in_proj_bias.chunk(3)
        inputs = {}  # one copy into the TP region per distinct input (self-attention: one)
        out = []
        for x, weight, bias in zip((query, key, value), w, b):
            if id(x) not in inputs:
                inputs[id(x)] = comm.copy_to_tp(x, self.tp)
            y = F.linear(inputs[id(x)], weight, bias)
            length, batch = y.shape[:2]
            out.append(y.view(length, batch, self.local_heads, self.head_dim).permute(1, 2, 0, 3))
        return out

    def _mask(self, attn_mask, key_padding_mask, batch, length, source, dtype):
        """One additive mask [batch, local heads or 1, length, source] (None: none): torch's
        boolean masks (True: not attended) become -inf; a per-head 3-D ``attn_mask``
        ([batch * num_heads, length, source]) keeps this rank's heads."""
        mask = None
        if attn_mask is not None:
            mask = _additive(attn_mask, dtype)
            if mask.dim() == 3:
                mask = mask.view(batch, self.num_heads, length, source)
                mask = mask[:, self.first_head : self.first_head + self.local_heads]
        if key_padding_mask is not None:
            padding = _additive(key_padding_mask, dtype).view(batch, 1, 1, source)
            mask = padding if mask is None else mask + padding
        return mask


def _additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
            mask, float("-inf")
        )
    return mask.to(dtype)
