"""Tensor-parallel layers: each equals its torch.nn equivalent at any TP size (1D: over a TP
group; 2D, the ``*2D`` layers: over a P x Q grid, :mod:`tp_ext.layers.summa`).

Every layer is a :class:`ParallelModule`: it takes ``tp_group`` (a ProcessGroup, a group name, a
:class:`ResolvedGroup`, or None for the group made by :func:`tp_ext.init_parallel`; 2D layers take
``grid``), records each sharded parameter's :class:`tp_ext.sharding.ShardSpec`, can
``load_full_state_dict(full)`` and ``full_state_dict()``, and initialises itself so that the
gathered weights do not depend on the TP size. Layers communicate only through
:mod:`tp_ext.distributed.comm` and run kernels only through :mod:`tp_ext.ops`.
"""

from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers.attention import KVCache, ParallelAttention
from tp_ext.layers.base import SEQUENCE_DIM, ParallelModule, no_init
from tp_ext.layers.block import ParallelTransformerBlock
from tp_ext.layers.context import all_to_all_attention, cp_positions, ring_attention
from tp_ext.layers.embedding import HeadParallelEmbedding, ParallelLMHead, VocabParallelEmbedding
from tp_ext.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
    SharedColumnInput,
)
from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.layers.mlp import ParallelMLP
from tp_ext.layers.moe import ExpertParallelMoE, ParallelExperts, expert_parameters
from tp_ext.layers.multihead import ParallelMultiheadAttention
from tp_ext.layers.norm import FusedRMSNorm, RMSNorm
from tp_ext.layers.rotary import RotaryEmbedding, apply_rotary, rotary_embedding
from tp_ext.layers.sampling import vocab_parallel_argmax, vocab_parallel_sample
from tp_ext.layers.state_dict import (
    expert_rows,
    full_shapes,
    full_state_dict,
    init_from_full_tensors,
    is_full_transposed,
    iter_full_tensors,
    load_full_state_dict,
    local_shards,
    state_entries,
    tensor_specs,
)
from tp_ext.layers.summa import GridModule, Linear2D, gather_2d, regrid, split_2d
from tp_ext.layers.summa_blocks import (
    MLP2D,
    Attention2D,
    DecoderLayer2D,
    Embedding2D,
    RMSNorm2D,
    TiedLMHead2D,
    cross_entropy_2d,
)

__all__ = [
    "ParallelModule",
    "ParallelMultiheadAttention",
    "ResolvedGroup",
    "SEQUENCE_DIM",
    "no_init",
    "load_full_state_dict",
    "full_state_dict",
    "iter_full_tensors",
    "init_from_full_tensors",
    "is_full_transposed",
    "local_shards",
    "state_entries",
    "tensor_specs",
    "full_shapes",
    "expert_rows",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "SharedColumnInput",
    "VocabParallelEmbedding",
    "HeadParallelEmbedding",
    "ParallelLMHead",
    "FusedRMSNorm",
    "RMSNorm",
    "RotaryEmbedding",
    "apply_rotary",
    "rotary_embedding",
    "KVCache",
    "ParallelAttention",
    "ParallelMLP",
    "ExpertParallelMoE",
    "ParallelExperts",
    "expert_parameters",
    "ParallelTransformerBlock",
    "ring_attention",
    "all_to_all_attention",
    "cp_positions",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_argmax",
    "vocab_parallel_sample",
    "GridModule",
    "Linear2D",
    "split_2d",
    "gather_2d",
    "regrid",
    "Embedding2D",
    "TiedLMHead2D",
    "RMSNorm2D",
    "cross_entropy_2d",
    "Attention2D",
    "MLP2D",
    "DecoderLayer2D",
]
