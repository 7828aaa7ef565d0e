"""Serving: the engine (continuous batching over a paged KV cache) and ``tp-ext serve``'s
OpenAI-compatible server."""

from tp_ext.serving.engine import Engine, StepOutput
from tp_ext.serving.scheduler import FinishReason, SamplingParams

__all__ = ["Engine", "StepOutput", "SamplingParams", "FinishReason"]
