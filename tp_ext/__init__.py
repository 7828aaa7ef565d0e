"""tp_ext: tensor parallelism for PyTorch, with collectives and kernels as C++/CUDA torch ops."""

import torch  # noqa: F401  (loads libtorch, which _C links against)

from tp_ext import _C  # noqa: F401  (loads and registers torch.ops.tp_ext.*)
from tp_ext import _fake  # noqa: F401
from tp_ext import _fake_kernels  # noqa: F401
from tp_ext import _fake_rotary  # noqa: F401
from tp_ext import comm, layers, random
from tp_ext.plan import auto_plan, parallelize
from tp_ext.parallel import ParallelState, init_parallel, parallel_state
from tp_ext.sharding import shard_offsets, shard_range, shard_sizes, split_tensor

__version__ = "0.1.0"

__all__ = [
    "comm", "layers", "random", "parallelize", "auto_plan", "init_parallel", "parallel_state", "ParallelState",
    "shard_sizes", "shard_offsets", "shard_range", "split_tensor",
]
