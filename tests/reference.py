"""Unsharded pure-PyTorch references for the layer tests, written from the math (no tp_ext code):
the Qwen2/Llama decoder block with torch.nn.Linear, RMSNorm, RoPE and causal GQA attention. Its
state dict uses the names of tp_ext.layers.ParallelTransformerBlock's full state dict."""

import torch
import torch.nn.functional as F
from torch import nn


class RefRMSNorm(nn.Module):
    def __init__(self, hidden, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)


def ref_rope(x, positions, theta):
    """x: [b, h, s, d]; positions: [b, s]."""
    d = x.size(-1)
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float, device=x.device) / d))
    angles = positions[..., None].float() * inv_freq  # [b, s, d/2]
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(x.dtype)[:, None]
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(x.dtype)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


class RefAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, theta):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.qkv_proj = nn.Linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=True)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, positions=None):
        b, s, _ = x.shape
        if positions is None:
            positions = torch.arange(s, device=x.device).expand(b, s)
        q, k, v = self.qkv_proj(x).split(
            [
                self.heads * self.head_dim,
                self.kv_heads * self.head_dim,
                self.kv_heads * self.head_dim,
            ],
            -1,
        )
        q = q.view(b, s, self.heads, self.head_dim).transpose(1, 2)
        k = k.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.view(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = ref_rope(q, positions, self.theta), ref_rope(k, positions, self.theta)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        out = scores.softmax(-1) @ v
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))


class RefMLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).split(self.inter, -1)
        return self.down_proj(F.silu(gate) * up)


class RefBlock(nn.Module):
    def __init__(self, hidden, heads, kv_heads, inter, head_dim, eps=1e-6, theta=10000.0):
        super().__init__()
        self.input_layernorm = RefRMSNorm(hidden, eps)
        self.self_attn = RefAttention(hidden, heads, kv_heads, head_dim, theta)
        self.post_attention_layernorm = RefRMSNorm(hidden, eps)
        self.mlp = RefMLP(hidden, inter)

    def forward(self, x, positions=None):
        h = x + self.self_attn(self.input_layernorm(x), positions)
        return h + self.mlp(self.post_attention_layernorm(h))


def random_state(module: nn.Module, seed: int) -> dict:
    """Random values for every entry of module's state dict (norm weights too, so they matter)."""
    g = torch.Generator().manual_seed(seed)
    return {
        k: (torch.randn(v.shape, generator=g, dtype=torch.float64) * 0.5).to(v.dtype)
        for k, v in module.state_dict().items()
    }


def hf_qwen2(config, seed: int = 0):
    """transformers' Qwen2ForCausalLM (fp32) for a tp_ext Qwen2Config, seeded: the reference
    model of the model, checkpoint and training tests."""
    import transformers  # requirements-dev.txt; a missing reference fails the test

    hf_config = transformers.Qwen2Config(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        max_position_embeddings=config.max_position_embeddings,
        rope_theta=config.rope_theta,
        rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=config.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    return transformers.Qwen2ForCausalLM(hf_config).float()


def train_in_one_process(model, batches, steps: int, optimizer, max_norm: float):
    """The reference of the pipeline tests: ``model`` (transformers') trained ``steps`` steps in
    one process on every micro-batch of ``batches`` (equal token counts: the step's loss is the
    mean of their means), clipped to ``max_norm``. Returns (losses, norms before clipping)."""
    losses, norms = [], []
    for _ in range(steps):
        total = 0.0
        for ids in batches:
            loss = model(ids, labels=ids).loss / len(batches)
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        optimizer.zero_grad()
        losses.append(total)
    return losses, norms
