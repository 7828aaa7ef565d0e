"""Where a Qwen2 model's tensors live in Hugging Face checkpoints (transformers' Qwen2 names, or
the original Qwen's fused names), and the config.json of a merged export. The model declares
these to the generic checkpoint code (:mod:`tp_ext.checkpoint.checkpoint_map`)."""

from __future__ import annotations

import torch

from tp_ext.checkpoint.checkpoint_map import Piece
from tp_ext.models.qwen2.config import Qwen2Config

__all__ = ["FORMATS", "checkpoint_map", "hf_to_tp_ext_names", "hf_config"]

FORMATS = ("qwen2", "qwen")


def checkpoint_map(config: Qwen2Config, fmt: str = "qwen2") -> dict[str, list[Piece]]:
    """Where each of this model's full tensors lives in a Hugging Face checkpoint: the pieces,
    stacked along dim 0, that make it up. ``fmt``: "qwen2" (transformers' Qwen2ForCausalLM
    names; q/k/v and gate/up separate) or "qwen" (the original Qwen: fused ``attn.c_attn``,
    ``mlp.w2`` is the gate and ``mlp.w1`` the up projection)."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS}, got {fmt!r}")
    h, inter, vocab = config.hidden_size, config.intermediate_size, config.vocab_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    if fmt == "qwen" and kv_rows != q_rows:
        raise ValueError(
            "the original Qwen format has no grouped-query attention: "
            f"num_key_value_heads={config.num_key_value_heads} must equal "
            f"num_attention_heads={config.num_attention_heads}"
        )

    def whole(name, rows):
        return [Piece(name, 0, rows)]

    mapping = {}
    for i in range(config.num_hidden_layers):
        ours = f"model.layers.{i}."
        if fmt == "qwen2":
            attn, mlp = ours + "self_attn.", ours + "mlp."
            qkv = [
                (attn + "q_proj", 0, q_rows),
                (attn + "k_proj", 0, kv_rows),
                (attn + "v_proj", 0, kv_rows),
            ]
            names = {
                "input_layernorm": ours + "input_layernorm",
                "post_attention_layernorm": ours + "post_attention_layernorm",
                "o_proj": attn + "o_proj",
                "down_proj": mlp + "down_proj",
                "gate": mlp + "gate_proj",
                "up": mlp + "up_proj",
            }
        else:
            theirs = f"transformer.h.{i}."
            qkv = [(theirs + "attn.c_attn", n * q_rows, q_rows) for n in range(3)]
            names = {
                "input_layernorm": theirs + "ln_1",
                "post_attention_layernorm": theirs + "ln_2",
                "o_proj": theirs + "attn.c_proj",
                "down_proj": theirs + "mlp.c_proj",
                "gate": theirs + "mlp.w2",
                "up": theirs + "mlp.w1",
            }
        for leaf in ("weight", "bias"):
            mapping[f"{ours}self_attn.qkv_proj.{leaf}"] = [
                Piece(f"{name}.{leaf}", start, rows) for name, start, rows in qkv
            ]
        mapping[ours + "input_layernorm.weight"] = whole(names["input_layernorm"] + ".weight", h)
        mapping[ours + "post_attention_layernorm.weight"] = whole(
            names["post_attention_layernorm"] + ".weight", h
        )
        mapping[ours + "self_attn.o_proj.weight"] = whole(names["o_proj"] + ".weight", h)
        mapping[ours + "mlp.gate_up_proj.weight"] = [
            Piece(names["gate"] + ".weight", 0, inter),
            Piece(names["up"] + ".weight", 0, inter),
        ]
        mapping[ours + "mlp.down_proj.weight"] = whole(names["down_proj"] + ".weight", h)
    embed = "model.embed_tokens.weight" if fmt == "qwen2" else "transformer.wte.weight"
    mapping["model.embed_tokens.weight"] = whole(embed, vocab)
    mapping["model.norm.weight"] = whole(
        "model.norm.weight" if fmt == "qwen2" else "transformer.ln_f.weight", h
    )
    # A tied head has no tensor of its own in Hugging Face checkpoints.
    mapping["lm_head.weight"] = whole(
        embed if config.tie_word_embeddings else "lm_head.weight", vocab
    )
    return mapping


def hf_to_tp_ext_names(
    state: dict[str, torch.Tensor], config: Qwen2Config, fmt: str = "qwen2"
) -> dict[str, torch.Tensor]:
    """A Hugging Face state dict (in memory) as full tensors under this model's names."""
    return {
        ours: torch.cat([state[p.name][p.start : p.start + p.rows] for p in pieces], 0)
        for ours, pieces in checkpoint_map(config, fmt).items()
    }


def hf_config(config: Qwen2Config, dtype: torch.dtype) -> dict:
    """The config.json of a merged export that transformers' Qwen2ForCausalLM loads."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_dropout": config.attention_dropout,
        "initializer_range": config.initializer_range,
        "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
