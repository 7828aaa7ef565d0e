"""Compressed gradient communication for data parallelism: DDP communication hooks (int8 and
1-bit with error feedback on tp_ext's quantisation ops, and torch's PowerSGD) that anyone's DDP
model can use, and that the Trainer installs with ``gradient_compression=``; and 1-bit Adam's
optimizer half, :class:`OneBitAdam`."""

from tp_ext.compression.hooks import (
    CHUNK_SIZES,
    METHODS,
    CompressionState,
    averages,
    compressed_averages,
    int8_hook,
    onebit_hook,
    register,
)
from tp_ext.compression.onebit_adam import OneBitAdam
from tp_ext.compression.powersgd import PowerSGDCompression

__all__ = [
    "CHUNK_SIZES",
    "METHODS",
    "CompressionState",
    "OneBitAdam",
    "PowerSGDCompression",
    "averages",
    "compressed_averages",
    "int8_hook",
    "onebit_hook",
    "register",
]
