"""Qwen2 / Qwen2.5 (and the original Qwen) on tp_ext layers: the model config (architecture
only), the model, and its Hugging Face checkpoint map."""

from tp_ext.models.qwen2.config import Qwen2Config
from tp_ext.models.qwen2.hf_checkpoint_map import checkpoint_map, hf_to_tp_ext_names
from tp_ext.models.qwen2.model import Qwen2ForCausalLM
from tp_ext.models.qwen2.model_2d import Qwen2ForCausalLM2D

__all__ = [
    "Qwen2Config",
    "Qwen2ForCausalLM",
    "Qwen2ForCausalLM2D",
    "checkpoint_map",
    "hf_to_tp_ext_names",
]
