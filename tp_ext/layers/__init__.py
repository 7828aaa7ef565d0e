"""Tensor-parallel layers: each equals its torch.nn equivalent at any TP size.

Every layer takes ``tp_group`` (a ProcessGroup, a group name, or None for the group made by
:func:`tp_ext.init_parallel`), can ``load_full_state_dict(full)`` and ``full_state_dict()``, and
initialises itself so that the gathered weights do not depend on the TP size.
"""

from tp_ext.layers.base import (
    SEQUENCE_DIM, ParallelModule, TPGroup, full_state_dict, load_full_state_dict, local_shards)
from tp_ext.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.layers.linear import (
    ColumnParallelLinear, MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear)
from tp_ext.layers.norm import RMSNorm
from tp_ext.layers.rotary import RotaryEmbedding, apply_rotary
from tp_ext.layers.transformer import (
    KVCache, ParallelAttention, ParallelMLP, ParallelTransformerBlock)

__all__ = [
    "ParallelModule", "TPGroup", "SEQUENCE_DIM", "load_full_state_dict", "full_state_dict",
    "local_shards",
    "ColumnParallelLinear", "RowParallelLinear", "MergedColumnParallelLinear",
    "QKVParallelLinear", "VocabParallelEmbedding", "ParallelLMHead", "RMSNorm",
    "RotaryEmbedding", "apply_rotary", "KVCache", "ParallelAttention", "ParallelMLP",
    "ParallelTransformerBlock", "vocab_parallel_cross_entropy",
]

