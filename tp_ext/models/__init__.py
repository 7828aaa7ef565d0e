"""Models on tp_ext layers."""

from tp_ext.models.config import ConfigError, OptimizerSettings, ParallelSettings, Qwen2Config
from tp_ext.models.qwen2 import Qwen2ForCausalLM, hf_to_tp_ext_names

__all__ = ["Qwen2Config", "ParallelSettings", "OptimizerSettings", "ConfigError",
           "Qwen2ForCausalLM", "hf_to_tp_ext_names"]
