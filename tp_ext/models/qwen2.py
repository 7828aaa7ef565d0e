"""Qwen2 (and the original Qwen) causal language model on tp_ext layers.

Module names follow Hugging Face's Qwen2 where the layers are not fused: ``model.embed_tokens``,
``model.layers.N.{input_layernorm, post_attention_layernorm}``, ``model.norm``, ``lm_head``; the
fused projections are ``self_attn.qkv_proj`` (q; k; v stacked) and ``mlp.gate_up_proj`` (gate;
up). :func:`hf_to_tp_ext_names` maps a Hugging Face state dict onto these names.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_ext.layers import (
    ParallelLMHead, ParallelModule, ParallelTransformerBlock, RMSNorm, VocabParallelEmbedding)
from tp_ext.models.config import Qwen2Config

__all__ = ["Qwen2ForCausalLM", "Qwen2Config", "hf_to_tp_ext_names"]


class _Qwen2Model(ParallelModule):
    def __init__(self, config: Qwen2Config, tp, device, dtype):
        super().__init__()
        self._setup_tp(tp)
        kw = {"tp_group": tp, "device": device, "dtype": dtype}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            ParallelTransformerBlock(config.hidden_size, config.num_attention_heads,
                                     config.num_key_value_heads, config.intermediate_size,
                                     config.head_dim, config.rms_norm_eps, config.rope_theta,
                                     qkv_bias=True, **kw)
            for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)


class Qwen2ForCausalLM(ParallelModule):
    """``forward(input_ids)`` gives full-vocabulary logits ``[batch, seq, vocab]`` on every rank
    (``local_logits=True``: this rank's vocabulary shard, for the vocab-parallel loss);
    ``generate(input_ids, max_new_tokens)`` decodes greedily with a KV cache."""

    def __init__(self, config: Qwen2Config, tp_group=None, device=None, dtype=None):
        super().__init__()
        tp = self._setup_tp(tp_group)
        config.check_tp(tp.size)
        self.config = config
        self.model = _Qwen2Model(config, tp, device, dtype)
        self.lm_head = ParallelLMHead(
            config.vocab_size, config.hidden_size, tp_group=tp, device=device, dtype=dtype,
            tie_to=self.model.embed_tokens if config.tie_word_embeddings else None)

    def forward(self, input_ids: torch.Tensor, local_logits: bool = False,
                kv_caches=None) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None, None if kv_caches is None else kv_caches[i])
        logits = self.lm_head(self.model.norm(h))
        return logits if local_logits else self.lm_head.gather_features(logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the prompt once, then one token at a time through the KV caches."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or \
                max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        batch, prompt = input_ids.shape
        caches = [layer.self_attn.new_kv_cache(batch, prompt + max_new_tokens)
                  for layer in self.model.layers]
        tokens, step = input_ids, input_ids
        for _ in range(max_new_tokens):
            next_token = self(step, kv_caches=caches)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            step = next_token
        return tokens


def hf_to_tp_ext_names(state: dict[str, torch.Tensor], config: Qwen2Config) -> dict:
    """A Hugging Face Qwen2 state dict as full tensors under this model's names (fusing q/k/v
    and gate/up)."""
    out = {}
    for name, value in state.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            parts = [state[name.replace("q_proj", p)] for p in ("q_proj", "k_proj", "v_proj")]
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(parts, 0)
            continue
        if ".mlp.up_proj." in name:
            continue
        if ".mlp.gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [value, state[name.replace("gate_proj", "up_proj")]], 0)
            continue
        out[name] = value
    if config.tie_word_embeddings:
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out
