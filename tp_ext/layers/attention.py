"""Tensor-parallel causal grouped-query attention with a KV cache: each rank computes its own
heads (split whole by :class:`tp_ext.sharding.HeadLayout`), one all-reduce after the output
projection (forward) and one before the QKV projection (backward).

Inputs are ``[batch, seq, hidden]``; under sequence parallelism ``seq`` is this rank's shard
(pass ``seq_len`` when the full length does not divide by the TP size). ``position_ids`` are
always the full sequence's, ``[batch, seq]``.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from tp_ext.distributed.rng import tp_rng
from tp_ext.layers.base import ParallelModule, check_int
from tp_ext.layers.context import context_attention
from tp_ext.layers.linear import QKVParallelLinear, RowParallelLinear
from tp_ext.layers.rotary import RotaryEmbedding

__all__ = ["KVCache", "ParallelAttention", "decoding_mask"]


def decoding_mask(q: torch.Tensor, k: torch.Tensor, past: int, key_mask=None):
    """``(attn_mask, is_causal)`` for scaled dot-product attention of ``q`` (the queries at
    positions past .. past + n) over ``k`` (every key so far): causal alone without a cache or
    padding; else query i sees keys 0..past + i, and with ``key_mask`` ([batch, past + n], bool:
    False at the left padding of a batch of prompts) no padding key, though each query keeps
    its own key, so a padding row is not empty (an empty row's softmax is NaN, which its
    values would carry onwards)."""
    if past == 0 and key_mask is None:
        return None, True
    rows = torch.arange(q.size(2), device=q.device).unsqueeze(1) + past
    keys = torch.arange(k.size(2), device=q.device)
    mask = keys <= rows
    if key_mask is not None:
        if tuple(key_mask.shape) != (q.size(0), k.size(2)):
            raise ValueError(
                f"key_mask must be [batch, past + seq] = [{q.size(0)}, {k.size(2)}], got shape "
                f"{tuple(key_mask.shape)}"
            )
        mask = (mask & key_mask.bool()[:, None, None, :]) | (keys == rows)
    return mask, False


class KVCache:
    """Keys and values of this rank's KV heads for decoding, preallocated to ``max_length``."""

    def __init__(
        self, batch: int, max_length: int, num_kv_heads: int, head_dim: int, device=None, dtype=None
    ):
        shape = (batch, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_length = max_length
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` ([batch, kv_heads, new, head_dim]); return everything so far."""
        end = self.length + k.size(2)
        if end > self.max_length:
            raise ValueError(
                f"KVCache: {end} positions exceed max_length={self.max_length}; "
                "make the cache with a larger max_length"
            )
        if k.shape[:2] != self.k.shape[:2] or k.size(3) != self.k.size(3):
            raise ValueError(
                f"KVCache: keys of shape {tuple(k.shape)} do not fit a cache of "
                f"shape {tuple(self.k.shape)}"
            )
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def reset(self) -> None:
        self.length = 0

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2


class ParallelAttention(ParallelModule):
    """Causal grouped-query self-attention over this rank's heads: fused QKV projection
    (column-parallel), RoPE, scaled dot-product attention, output projection (row-parallel).

    Attention dropout (``dropout`` > 0, training only) draws from the TP stream
    (:func:`tp_ext.distributed.rng.tp_rng`), so different heads on different ranks get different
    masks.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        out_bias: bool = False,
        rope_theta: float = 10000.0,
        dropout: float = 0.0,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        tp = self._setup_tp(tp_group)
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(
                    f"hidden_size={hidden_size} is not divisible by "
                    f"num_heads={num_heads}; pass head_dim explicitly"
                )
            head_dim = hidden_size // num_heads
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.hidden_size, self.head_dim, self.dropout = hidden_size, head_dim, dropout
        self.sequence_parallel = sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = QKVParallelLinear(
            hidden_size, head_dim, num_heads, num_kv_heads, qkv_bias, sequence_parallel, tp, **kw
        )
        layout = self.qkv_proj.layout
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.num_heads_local = self.qkv_proj.num_heads_local
        self.num_kv_heads_local = self.qkv_proj.num_kv_heads_local
        self.o_proj = RowParallelLinear(
            num_heads * head_dim,
            hidden_size,
            out_bias,
            sequence_parallel=sequence_parallel,
            tp_group=tp,
            partition=layout.q_partition(head_dim),
            **kw,
        )
        self.rotary = RotaryEmbedding(head_dim, rope_theta)
        # Local query heads served by each local KV head (the layout keeps them contiguous).
        self.kv_groups_local = self.num_heads_local // self.num_kv_heads_local
        # Context parallelism (set by the model): the CP group its attention runs over, and how
        # (tp_ext.layers.context.CP_MODES)
        self.cp, self.cp_mode = None, "ring"

    def new_kv_cache(self, batch: int, max_length: int) -> KVCache:
        return KVCache(
            batch,
            max_length,
            self.num_kv_heads_local,
            self.head_dim,
            self.qkv_proj.weight.device,
            self.qkv_proj.weight.dtype,
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        seq_len: Optional[int] = None,
        key_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """``key_mask`` ([batch, past + seq], bool): which keys are real tokens (False: the left
        padding of a batch of prompts); a query never attends to padding, and a padding query
        attends to itself alone (no row of the scores is empty)."""
        if x.dim() != 3:
            raise ValueError(
                f"ParallelAttention: input must be [batch, seq, hidden], got shape {tuple(x.shape)}"
            )
        # under context parallelism seq_len is the whole sequence's length (the ring's), and x
        # holds this CP rank's positions (sequence parallelism is not combined with it)
        sp_len = None if self.cp is not None else seq_len
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, sp_len))
        batch, seq = q.shape[0], q.shape[1]  # full sequence, also under sequence parallelism
        q = q.view(batch, seq, self.num_heads_local, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        past = 0 if kv_cache is None else kv_cache.length
        if self.cp is not None:  # this CP rank's positions are not 0..seq: they must be given
            self._check_context(kv_cache, position_ids, seq_len)
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        elif tuple(position_ids.shape) not in ((batch, seq), (1, seq)):
            raise ValueError(
                f"position_ids must be [batch, seq] = [{batch}, {seq}] (full "
                f"sequence), got shape {tuple(position_ids.shape)}"
            )
        q, k = self.rotary.rotate(q, k, position_ids)  # q and k in one fused op
        if self.cp is not None:
            out = context_attention(self.cp_mode, q, k, v, seq_len, self.cp)
        else:
            if kv_cache is not None:
                k, v = kv_cache.update(k, v)
            if self.kv_groups_local > 1:
                k = k.repeat_interleave(self.kv_groups_local, dim=1)
                v = v.repeat_interleave(self.kv_groups_local, dim=1)
            out = self._attend(q, k, v, past, key_mask)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads_local * self.head_dim)
        return self.o_proj(out, sp_len)

    def _check_context(self, kv_cache, position_ids, seq_len) -> None:
        """What attention over the CP group needs (tp_ext.layers.context)."""
        if kv_cache is not None or position_ids is None or seq_len is None:
            raise ValueError(
                "ParallelAttention under context parallelism needs position_ids (this CP rank's "
                "positions, tp_ext.cp_positions) and seq_len (the whole sequence's length), and "
                "does not decode with a KV cache yet (generate with cp=1)"
            )
        if self.training and self.dropout > 0:
            raise ValueError(
                "ParallelAttention: attention dropout under context parallelism is not supported "
                "yet; set attention_dropout=0"
            )

    def _attend(self, q, k, v, past: int, key_mask: Optional[torch.Tensor] = None):
        dropout = self.dropout if self.training else 0.0
        mask, causal = decoding_mask(q, k, past, key_mask)
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        with tp_rng():
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout
            )
