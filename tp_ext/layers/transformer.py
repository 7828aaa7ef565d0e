"""Tensor-parallel attention (with a KV cache), SwiGLU MLP and the Qwen2/Llama decoder block.

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
import torch.nn.functional as F

from tp_ext.layers.base import ParallelModule, check_int
from tp_ext.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tp_ext.layers.norm import RMSNorm
from tp_ext.layers.rotary import RotaryEmbedding, apply_rotary
from tp_ext.sharding import Partition

__all__ = ["KVCache", "ParallelAttention", "ParallelMLP", "ParallelTransformerBlock"]


class KVCache:
    """Keys and values of this rank's KV heads for decoding, preallocated to ``max_length``."""

    def __init__(self, batch: int, max_length: int, num_kv_heads: int, head_dim: int,
                 device=None, dtype=None):
        shape = (batch, num_kv_heads, max_length, head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self.max_length = max_length
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k``, ``v`` ([batch, kv_heads, new, head_dim]); return everything so far."""
        end = self.length + k.size(2)
        if end > self.max_length:
            raise ValueError(f"KVCache: {end} positions exceed max_length={self.max_length}; "
                             "make the cache with a larger max_length")
        if k.shape[:2] != self.k.shape[:2] or k.size(3) != self.k.size(3):
            raise ValueError(f"KVCache: keys of shape {tuple(k.shape)} do not fit a cache of "
                             f"shape {tuple(self.k.shape)}")
        self.k[:, :, self.length:end] = k
        self.v[:, :, self.length:end] = v
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
    (:func:`tp_ext.random.tp_rng`), so different heads on different ranks get different masks.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: Optional[int] = None,
                 head_dim: Optional[int] = None, qkv_bias: bool = True, out_bias: bool = False,
                 rope_theta: float = 10000.0, dropout: float = 0.0,
                 sequence_parallel: bool = False, tp_group=None, device=None, dtype=None):
        super().__init__()
        tp = self._setup_tp(tp_group)
        check_int("hidden_size", hidden_size)
        check_int("num_heads", num_heads)
        if head_dim is None:
            if hidden_size % num_heads:
                raise ValueError(f"hidden_size={hidden_size} is not divisible by "
                                 f"num_heads={num_heads}; pass head_dim explicitly")
            head_dim = hidden_size // num_heads
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        self.hidden_size, self.head_dim, self.dropout = hidden_size, head_dim, dropout
        self.sequence_parallel = sequence_parallel
        kw = {"device": device, "dtype": dtype}
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads,
                                          qkv_bias, sequence_parallel, tp, **kw)
        layout = self.qkv_proj.layout
        self.num_heads, self.num_kv_heads = layout.num_heads, layout.num_kv_heads
        self.num_heads_local = self.qkv_proj.num_heads_local
        self.num_kv_heads_local = self.qkv_proj.num_kv_heads_local
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, out_bias,
                                        sequence_parallel=sequence_parallel, tp_group=tp,
                                        partition=layout.q_partition(head_dim), **kw)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)
        # Local query heads served by each local KV head (the layout keeps them contiguous).
        self.kv_groups_local = self.num_heads_local // self.num_kv_heads_local

    def new_kv_cache(self, batch: int, max_length: int) -> KVCache:
        return KVCache(batch, max_length, self.num_kv_heads_local, self.head_dim,
                       self.qkv_proj.weight.device, self.qkv_proj.weight.dtype)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, seq_len: Optional[int] = None) -> torch.Tensor:
        if x.dim() != 3:
            raise ValueError(f"ParallelAttention: input must be [batch, seq, hidden], got shape "
                             f"{tuple(x.shape)}")
        q, k, v = self.qkv_proj.split(self.qkv_proj(x, seq_len))
        batch, seq = q.shape[0], q.shape[1]  # full sequence, also under sequence parallelism
        q = q.view(batch, seq, self.num_heads_local, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        past = 0 if kv_cache is None else kv_cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        elif tuple(position_ids.shape) not in ((batch, seq), (1, seq)):
            raise ValueError(f"position_ids must be [batch, seq] = [{batch}, {seq}] (full "
                             f"sequence), got shape {tuple(position_ids.shape)}")
        cos, sin = self.rotary(position_ids, q.dtype)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if self.kv_groups_local > 1:
            k = k.repeat_interleave(self.kv_groups_local, dim=1)
            v = v.repeat_interleave(self.kv_groups_local, dim=1)
        out = self._attend(q, k, v, past)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads_local * self.head_dim)
        return self.o_proj(out, seq_len)

    def _attend(self, q, k, v, past: int) -> torch.Tensor:
        dropout = self.dropout if self.training else 0.0
        if past == 0:
            mask, causal = None, True
        else:  # query i sits at position past + i and sees keys 0..past + i
            rows = torch.arange(q.size(2), device=q.device).unsqueeze(1) + past
            mask, causal = torch.arange(k.size(2), device=q.device) <= rows, False
        if dropout == 0.0:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        from tp_ext.random import tp_rng

        with tp_rng():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                  dropout_p=dropout)


class ParallelMLP(ParallelModule):
    """SwiGLU MLP: ``down(silu(gate(x)) * up(x))`` with gate and up merged in one column-parallel
    matmul and down row-parallel. Each rank holds its share of the hidden units (any count)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False,
                 sequence_parallel: bool = False, tp_group=None, device=None, dtype=None):
        super().__init__()
        tp = self._setup_tp(tp_group)
        check_int("intermediate_size", intermediate_size)
        kw = {"device": device, "dtype": dtype}
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], bias,
            sequence_parallel=sequence_parallel, tp_group=tp, **kw)
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, bias, sequence_parallel=sequence_parallel,
            tp_group=tp, partition=Partition.split(intermediate_size, tp.size), **kw)

    # torch.ops.tp_ext.swiglu on the merged local [gate | up] output (equal halves); False: the
    # unfused F.silu(gate) * up.
    fused_swiglu = True

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> torch.Tensor:
        y = self.gate_up_proj(x, seq_len)
        if self.fused_swiglu:
            return self.down_proj(torch.ops.tp_ext.swiglu(y), seq_len)
        gate, up = self.gate_up_proj.split(y)
        return self.down_proj(F.silu(gate) * up, seq_len)


class ParallelTransformerBlock(ParallelModule):
    """A Qwen2/Llama decoder layer: ``h = x + attn(norm1(x)); out = h + mlp(norm2(h))``.

    Full state dict names: ``input_layernorm.weight``, ``self_attn.qkv_proj.{weight,bias}``
    (q, k, v stacked), ``self_attn.o_proj.weight``, ``post_attention_layernorm.weight``,
    ``mlp.gate_up_proj.weight`` (gate, up stacked), ``mlp.down_proj.weight``.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int,
                 intermediate_size: int, head_dim: Optional[int] = None,
                 rms_norm_eps: float = 1e-6, rope_theta: float = 10000.0, qkv_bias: bool = True,
                 attention_dropout: float = 0.0, sequence_parallel: bool = False, tp_group=None,
                 device=None, dtype=None):
        super().__init__()
        tp = self._setup_tp(tp_group)
        kw = {"device": device, "dtype": dtype}
        self.sequence_parallel = sequence_parallel
        self.input_layernorm = RMSNorm(hidden_size, rms_norm_eps, sequence_parallel, tp, **kw)
        self.self_attn = ParallelAttention(hidden_size, num_heads, num_kv_heads, head_dim,
                                           qkv_bias, False, rope_theta, attention_dropout,
                                           sequence_parallel, tp, **kw)
        self.post_attention_layernorm = RMSNorm(hidden_size, rms_norm_eps, sequence_parallel, tp,
                                                **kw)
        self.mlp = ParallelMLP(hidden_size, intermediate_size, False, sequence_parallel, tp, **kw)

    def forward(self, x: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                kv_cache: Optional[KVCache] = None, seq_len: Optional[int] = None) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), position_ids, kv_cache, seq_len)
        norm = self.post_attention_layernorm
        if isinstance(norm, RMSNorm) and not (norm._forward_hooks or norm._forward_pre_hooks):
            normed, h = norm.forward_add(attn, x)  # h = x + attn and its norm in one pass
        else:  # a replaced or hooked norm must see its own call
            h = x + attn
            normed = norm(h)
        return h + self.mlp(normed, seq_len)
