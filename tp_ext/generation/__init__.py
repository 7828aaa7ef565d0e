"""Generation: ``tp_ext.generate`` (batched, left-padded, greedy or sampled decoding with a KV
cache under TP x PP x EP, for tp_ext's Qwen2 and Hugging Face models converted by
``parallelize``, those also under context parallelism at pp = 1) and the adapters it runs
models through."""

from tp_ext.generation.decoders import Decoder, as_decoder
from tp_ext.generation.loop import generate

__all__ = ["generate", "Decoder", "as_decoder"]
