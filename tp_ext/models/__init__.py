"""Models on tp_ext layers. Each model declares its checkpoint map to the generic checkpoint
code; :mod:`.footprint` sizes a model per rank on the meta device."""

from tp_ext.models.qwen2 import (
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen2ForCausalLM2D,
    hf_to_tp_ext_names,
)
from tp_ext.validation import ConfigError

__all__ = [
    "Qwen2Config",
    "ConfigError",
    "Qwen2ForCausalLM",
    "Qwen2ForCausalLM2D",
    "hf_to_tp_ext_names",
]
