"""tp_ext: tensor parallelism for PyTorch, with collectives and kernels as C++/CUDA torch ops.

The package's layers, top to bottom (imports point down only; docs/architecture.md):
cli > config > training > pipeline > models > parallelize, checkpoint, data > layers >
distributed > ops > dims > sharding, validation.
"""

import sys

import torch  # noqa: F401  (loads libtorch, which the extension links against)

from tp_ext import (
    checkpoint,
    data,
    layers,
    models,
    ops,  # noqa: F401  (loads tp_ext._C: registers torch.ops.tp_ext.* and fakes)
    training,
)
from tp_ext.dims import ParallelDims
from tp_ext.distributed import ParallelState, comm, init_parallel, parallel_state
from tp_ext.distributed import rng as random
from tp_ext.generation import generate
from tp_ext.layers.context import cp_positions
from tp_ext.parallelize import (
    Colwise,
    Experts,
    ParallelStyle,
    Replicate,
    Rowwise,
    SequenceParallel,
    VocabParallel,
    auto_plan,
    parallelize,
)
from tp_ext.sharding import shard_offsets, shard_range, shard_sizes, split_tensor

# `import tp_ext.comm` and `from tp_ext.random import manual_seed` work as the docs write them;
# the modules themselves live in tp_ext.distributed (their layer)
sys.modules[f"{__name__}.comm"] = comm
sys.modules[f"{__name__}.random"] = random

__version__ = "0.1.0"

__all__ = [
    "comm",
    "layers",
    "random",
    "models",
    "checkpoint",
    "data",
    "training",
    "parallelize",
    "auto_plan",
    "ParallelStyle",
    "Colwise",
    "Rowwise",
    "VocabParallel",
    "Experts",
    "SequenceParallel",
    "Replicate",
    "init_parallel",
    "parallel_state",
    "ParallelState",
    "ParallelDims",
    "shard_sizes",
    "shard_offsets",
    "shard_range",
    "split_tensor",
    "cp_positions",
    "generate",
]
