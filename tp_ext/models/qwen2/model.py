"""Qwen2 (and the original Qwen) causal language model on tp_ext layers.

Module names follow Hugging Face's Qwen2 where the layers are not fused: ``model.embed_tokens``,
``model.layers.N.{input_layernorm, post_attention_layernorm}``, ``model.norm``, ``lm_head``; the
fused projections are ``self_attn.qkv_proj`` (q; k; v stacked) and ``mlp.gate_up_proj`` (gate;
up). Where they live in Hugging Face checkpoints: :mod:`tp_ext.models.qwen2.hf_layout`.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from tp_ext import checkpoint
from tp_ext.checkpoint.hf import model_group
from tp_ext.checkpoint.layout import detect_layout, expected_shapes
from tp_ext.checkpoint.safetensors_io import SafetensorsFiles, check_names_and_shapes
from tp_ext.distributed import comm
from tp_ext.layers import (
    ParallelLMHead,
    ParallelModule,
    ParallelTransformerBlock,
    RMSNorm,
    VocabParallelEmbedding,
    no_init,
    state_entries,
)
from tp_ext.models.qwen2 import hf_layout
from tp_ext.models.qwen2.config import Qwen2Config

__all__ = ["Qwen2ForCausalLM"]


class _Qwen2Model(ParallelModule):
    def __init__(self, config: Qwen2Config, tp, device, dtype):
        super().__init__()
        self._setup_tp(tp)
        kw = {"tp_group": tp, "device": device, "dtype": dtype}
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList(
            ParallelTransformerBlock(
                config.hidden_size,
                config.num_attention_heads,
                config.num_key_value_heads,
                config.intermediate_size,
                config.head_dim,
                config.rms_norm_eps,
                config.rope_theta,
                qkv_bias=True,
                **kw,
            )
            for _ in range(config.num_hidden_layers)
        )
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
            config.vocab_size,
            config.hidden_size,
            tp_group=tp,
            device=device,
            dtype=dtype,
            tie_to=self.model.embed_tokens if config.tie_word_embeddings else None,
        )

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tp_group=None,
        dtype=None,
        device=None,
        strict: bool = True,
        progress: bool = True,
    ) -> "Qwen2ForCausalLM":
        """Build the model from a Hugging Face checkpoint directory (config.json with
        model.safetensors or a sharded index; Qwen2 or original Qwen format), each rank reading
        only its own slices. ``dtype``: default the checkpoint's. ``model.load_report`` holds
        this rank's bytes read, shard bytes and peak host memory during the load."""
        checkpoint.import_readers()  # their code is mapped once, not counted against the load
        before = checkpoint.current_rss_bytes()
        checkpoint.reset_peak_rss()
        config = Qwen2Config.from_file(path)  # every field checked
        dtype = dtype or checkpoint.checkpoint_dtype(path)
        # The checkpoint's files, names and shapes are checked against the model built on the
        # meta device (nothing allocated) before the real one: a checkpoint that disagrees with
        # its config.json fails at once, not after allocating the model.
        meta = cls(config, tp_group=tp_group, device="meta", dtype=dtype)
        _check_checkpoint(meta, path, strict)
        del meta
        with no_init():
            model = cls(config, tp_group=tp_group, device=device, dtype=dtype)
        report = checkpoint.load_hf_checkpoint(model, path, strict=strict, progress=progress)
        report["peak_rss_increase_bytes"] = report["peak_rss_bytes"] - before
        model.load_report = report
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 1024**3) -> None:
        """A merged Hugging Face checkpoint that transformers' Qwen2ForCausalLM loads (every
        rank calls it; rank 0 writes)."""
        checkpoint.save_hf_checkpoint(self, path, max_shard_bytes)

    # -- what the checkpoint code reads (tp_ext.checkpoint.layout) ------------------------------

    # "qwen2": transformers' Qwen2 names (what saves write); "qwen": the original Qwen's.
    checkpoint_formats = hf_layout.FORMATS

    def checkpoint_layout(self, fmt: Optional[str] = None):
        """This model's tensors in a Hugging Face checkpoint of format ``fmt`` (None: "qwen2")."""
        return hf_layout.checkpoint_layout(self.config, fmt or self.checkpoint_formats[0])

    def hf_config(self, dtype: torch.dtype) -> dict:
        return hf_layout.hf_config(self.config, dtype)

    def forward(
        self, input_ids: torch.Tensor, local_logits: bool = False, kv_caches=None
    ) -> torch.Tensor:
        h = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            h = layer(h, None, None if kv_caches is None else kv_caches[i])
        logits = self.lm_head(self.model.norm(h))
        return logits if local_logits else self.lm_head.gather_features(logits)

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the prompt once, then one token at a time through the KV caches."""
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or max_new_tokens < 0
        ):
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        batch, prompt = input_ids.shape
        caches = [
            layer.self_attn.new_kv_cache(batch, prompt + max_new_tokens)
            for layer in self.model.layers
        ]
        tokens, step = input_ids, input_ids
        for _ in range(max_new_tokens):
            next_token = self(step, kv_caches=caches)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            step = next_token
        return tokens


def _check_checkpoint(model: Qwen2ForCausalLM, path: str, strict: bool) -> None:
    """The checks load_hf_checkpoint makes before reading (files present and readable, every
    tensor the model needs with its full shape, no unused ones when ``strict``), on a
    meta-device ``model``; an error on any rank raises on all."""
    entries = list(state_entries(model))

    def check():
        files = SafetensorsFiles(path)
        layout = detect_layout(model, files.names())
        check_names_and_shapes(files, expected_shapes(entries, layout), strict)

    comm.everywhere(model_group(model), f"checking {path}", check, checkpoint.CheckpointError)
