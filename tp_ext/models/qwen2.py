"""Qwen2 (and the original Qwen) causal language model on tp_ext layers.

Module names follow Hugging Face's Qwen2 where the layers are not fused: ``model.embed_tokens``,
``model.layers.N.{input_layernorm, post_attention_layernorm}``, ``model.norm``, ``lm_head``; the
fused projections are ``self_attn.qkv_proj`` (q; k; v stacked) and ``mlp.gate_up_proj`` (gate;
up). :func:`hf_to_tp_ext_names` maps a Hugging Face state dict onto these names.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tp_ext.layers import (
    ParallelLMHead, ParallelModule, ParallelTransformerBlock, RMSNorm, VocabParallelEmbedding)
from tp_ext.layers.base import no_init
from tp_ext.models.config import Qwen2Config

__all__ = ["Qwen2ForCausalLM", "Qwen2Config", "Piece", "checkpoint_layout", "hf_to_tp_ext_names"]


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

    @classmethod
    def from_pretrained(cls, path: str, tp_group=None, dtype=None, device=None,
                        strict: bool = True, progress: bool = True) -> "Qwen2ForCausalLM":
        """Build the model from a Hugging Face checkpoint directory (config.json with
        model.safetensors or a sharded index; Qwen2 or original Qwen format), each rank reading
        only its own slices. ``dtype``: default the checkpoint's. ``model.load_report`` holds
        this rank's bytes read, shard bytes and peak host memory during the load."""
        from tp_ext import checkpoint

        checkpoint.import_readers()  # their code is mapped once, not counted against the load
        before = checkpoint.current_rss_bytes()
        checkpoint.reset_peak_rss()
        config = Qwen2Config.from_file(path)
        dtype = dtype or checkpoint.checkpoint_dtype(path)
        with no_init():
            model = cls(config, tp_group=tp_group, device=device, dtype=dtype)
        report = checkpoint.load_hf_checkpoint(model, path, strict=strict, progress=progress)
        report["peak_rss_increase_bytes"] = report["peak_rss_bytes"] - before
        model.load_report = report
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 1024 ** 3) -> None:
        """A merged Hugging Face checkpoint that transformers' Qwen2ForCausalLM loads (every
        rank calls it; rank 0 writes)."""
        from tp_ext import checkpoint

        checkpoint.save_hf_checkpoint(self, path, max_shard_bytes)

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


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + rows)`` (dim 0) of checkpoint tensor ``name``."""
    name: str
    start: int
    rows: int


def checkpoint_layout(config: Qwen2Config, fmt: str = "qwen2") -> dict[str, list[Piece]]:
    """Where each of this model's full tensors lives in a Hugging Face checkpoint: the pieces,
    stacked along dim 0, that make it up. ``fmt``: "qwen2" (transformers' Qwen2ForCausalLM
    names; q/k/v and gate/up separate) or "qwen" (the original Qwen: fused ``attn.c_attn``,
    ``mlp.w2`` is the gate and ``mlp.w1`` the up projection)."""
    if fmt not in ("qwen2", "qwen"):
        raise ValueError(f"fmt must be 'qwen2' or 'qwen', got {fmt!r}")
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    if fmt == "qwen" and kv_rows != q_rows:
        raise ValueError("the original Qwen format has no grouped-query attention: "
                         f"num_key_value_heads={config.num_key_value_heads} must equal "
                         f"num_attention_heads={config.num_attention_heads}")

    def whole(name, rows):
        return [Piece(name, 0, rows)]

    layout = {}
    for i in range(config.num_hidden_layers):
        ours = f"model.layers.{i}."
        if fmt == "qwen2":
            attn, mlp = ours + "self_attn.", ours + "mlp."
            qkv = [(attn + "q_proj", 0, q_rows), (attn + "k_proj", 0, kv_rows),
                   (attn + "v_proj", 0, kv_rows)]
            names = {"input_layernorm": ours + "input_layernorm",
                     "post_attention_layernorm": ours + "post_attention_layernorm",
                     "o_proj": attn + "o_proj", "down_proj": mlp + "down_proj",
                     "gate": mlp + "gate_proj", "up": mlp + "up_proj"}
        else:
            theirs = f"transformer.h.{i}."
            qkv = [(theirs + "attn.c_attn", n * q_rows, q_rows) for n in range(3)]
            names = {"input_layernorm": theirs + "ln_1", "post_attention_layernorm": theirs + "ln_2",
                     "o_proj": theirs + "attn.c_proj", "down_proj": theirs + "mlp.c_proj",
                     "gate": theirs + "mlp.w2", "up": theirs + "mlp.w1"}
        for leaf in ("weight", "bias"):
            layout[f"{ours}self_attn.qkv_proj.{leaf}"] = [
                Piece(f"{name}.{leaf}", start, rows) for name, start, rows in qkv]
        layout[ours + "input_layernorm.weight"] = whole(names["input_layernorm"] + ".weight", h)
        layout[ours + "post_attention_layernorm.weight"] = whole(
            names["post_attention_layernorm"] + ".weight", h)
        layout[ours + "self_attn.o_proj.weight"] = whole(names["o_proj"] + ".weight", h)
        layout[ours + "mlp.gate_up_proj.weight"] = [Piece(names["gate"] + ".weight", 0, inter),
                                                    Piece(names["up"] + ".weight", 0, inter)]
        layout[ours + "mlp.down_proj.weight"] = whole(names["down_proj"] + ".weight", h)
    embed = "model.embed_tokens.weight" if fmt == "qwen2" else "transformer.wte.weight"
    layout["model.embed_tokens.weight"] = whole(embed, vocab)
    layout["model.norm.weight"] = whole(
        "model.norm.weight" if fmt == "qwen2" else "transformer.ln_f.weight", h)
    # A tied head has no tensor of its own in Hugging Face checkpoints.
    layout["lm_head.weight"] = whole(embed if config.tie_word_embeddings else "lm_head.weight",
                                     vocab)
    return layout


def hf_to_tp_ext_names(state: dict[str, torch.Tensor], config: Qwen2Config,
                       fmt: str = "qwen2") -> dict[str, torch.Tensor]:
    """A Hugging Face state dict (in memory) as full tensors under this model's names."""
    return {ours: torch.cat([state[p.name][p.start:p.start + p.rows] for p in pieces], 0)
            for ours, pieces in checkpoint_layout(config, fmt).items()}
