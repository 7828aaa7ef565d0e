"""Rotary position embedding (RoPE), the half-rotation form of Llama/Qwen2."""

from __future__ import annotations

import torch
from torch import nn

from tp_ext import ops
from tp_ext.layers.base import check_int

__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_embedding"]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``position_ids``; :meth:`rotate` rotates q and k.

    Frequencies ``1 / theta^(2i/d)`` are computed in float32 at each call (cheap, and nothing to
    keep on the right device or to materialise after building on the meta device), then the
    tables are cast to the activations' dtype, exactly as Hugging Face's Qwen2 does.
    """

    def __init__(self, head_dim: int, rope_theta: float = 10000.0):
        super().__init__()
        self.head_dim = check_int("head_dim", head_dim)
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embedding, got {head_dim}")
        if not rope_theta > 0:
            raise ValueError(f"rope_theta must be > 0, got {rope_theta!r}")
        self.rope_theta = float(rope_theta)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype = torch.float32):
        """``(cos, sin)``, each ``[*position_ids.shape, head_dim]``."""
        inv_freq = 1.0 / (
            self.rope_theta
            ** (
                torch.arange(0, self.head_dim, 2, dtype=torch.float, device=position_ids.device)
                / self.head_dim
            )
        )
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor, use_kernel: bool = True
    ):
        """Rotate ``q`` [batch, heads, seq, head_dim] and ``k`` [batch, kv_heads, seq, head_dim]
        at ``position_ids`` [batch, seq].

        ``use_kernel`` (default) runs both in one fused :func:`rotary_embedding` call (what
        :class:`tp_ext.layers.ParallelAttention` does); ``False`` uses the pure-PyTorch
        :func:`apply_rotary`. ``position_ids`` of shape [1, seq] apply to every sequence.
        """
        position_ids = position_ids.expand(q.size(0), -1)
        cos, sin = self(position_ids, q.dtype)
        if use_kernel:
            return rotary_embedding(q, k, cos, sin)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_theta={self.rope_theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Pure-PyTorch RoPE, the reference the fused op is tested against: ``x * cos +
    rotate_half(x) * sin`` with x ``[batch, heads, seq, head_dim]`` and cos, sin ``[batch or 1,
    seq, head_dim]``."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))`` in one fused op (fp32 math,
    one rounding for bf16/fp16).

    q: [batch, heads, seq, head_dim], k: [batch, kv_heads, seq, head_dim] (GQA: fewer heads),
    cos, sin: [batch, seq, head_dim] as :class:`RotaryEmbedding` returns them. Differentiable.
    """
    return ops.rotary_embedding(q, k, cos, sin)
