"""Rotary position embedding (RoPE), the half-rotation form of Llama/Qwen2."""

from __future__ import annotations

import torch
from torch import nn

from tp_ext.layers.base import check_int

__all__ = ["RotaryEmbedding", "apply_rotary", "rotary_embedding"]


class RotaryEmbedding(nn.Module):
    """cos/sin tables for ``position_ids``; :meth:`apply` rotates q and k.

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
        inv_freq = 1.0 / (self.rope_theta ** (
            torch.arange(0, self.head_dim, 2, dtype=torch.float, device=position_ids.device)
            / self.head_dim))
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor,
               use_kernel: bool = True):
        """Rotate ``q`` [batch, heads, seq, head_dim] and ``k`` [batch, kv_heads, seq, head_dim]
        at ``position_ids`` [batch, seq].

        ``use_kernel`` (default) runs both in one ``tp_ext::rotary_embedding`` call (fp32 math,
        one rounding for bf16/fp16); ``False`` uses the pure-PyTorch :func:`apply_rotary`.
        """
        cos, sin = self(position_ids, q.dtype)
        if use_kernel:
            return rotary_embedding(q, k, cos, sin)
        return apply_rotary(q, cos, sin, False), apply_rotary(k, cos, sin, False)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, rope_theta={self.rope_theta}"


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 use_kernel: bool = True) -> torch.Tensor:
    """x: [batch, heads, seq, head_dim]; cos, sin: [batch, seq, head_dim].

    With ``use_kernel`` (default) and exactly these shapes and one dtype, runs the fused
    ``tp_ext::rotary_embedding`` op (k: an empty head slice of x); otherwise, e.g. for
    broadcast cos/sin, the pure-PyTorch ``x * cos + rotate_half(x) * sin``.
    """
    if (use_kernel and x.dim() == 4 and cos.shape == sin.shape
            and cos.shape == (x.shape[0], x.shape[2], x.shape[3])
            and cos.dtype == sin.dtype == x.dtype):
        return torch.ops.tp_ext.rotary_embedding(x, x[:, :0], cos, sin)[0]
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + _rotate_half(x) * sin


def rotary_embedding(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``(apply_rotary(q, cos, sin), apply_rotary(k, cos, sin))`` in one fused op.

    q: [batch, heads, seq, head_dim], k: [batch, kv_heads, seq, head_dim] (GQA: fewer heads),
    cos, sin: [batch, seq, head_dim] as :class:`RotaryEmbedding` returns them. Differentiable.
    """
    return torch.ops.tp_ext.rotary_embedding(q, k, cos, sin)
