"""Compressed gradient communication for data parallelism: DDP communication hooks (int8 and
1-bit with error feedback on tp_ext's quantisation ops, and torch's PowerSGD) that anyone's DDP
model can use, and that the Trainer installs with ``gradient_compression=``."""

from tp_ext.compression.hooks import (
    CHUNK_SIZES,
    METHODS,
    CompressionState,
    compressed_average,
    int8_hook,
    onebit_hook,
    register,
)

__all__ = [
    "CHUNK_SIZES",
    "METHODS",
    "CompressionState",
    "compressed_average",
    "int8_hook",
    "onebit_hook",
    "register",
]
