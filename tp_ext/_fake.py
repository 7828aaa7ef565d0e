"""Fake (meta) kernels of every tp_ext op, so torch.compile and torch.export can trace them.

Every communicating op is also registered as an ORDERED effect: compiled graphs then keep the
collectives in program order. Without it Inductor may schedule independent collectives in a
different order on different ranks (each rank compiles its own graph), which pairs the wrong
collectives across ranks.

Output shapes follow from the arguments alone: ops whose result is this rank's piece take
``group_rank``, so no live process group is needed while tracing.
"""

from __future__ import annotations

import torch

try:  # torch >= 2.12
    from torch._library.effects import EffectType
except ImportError:  # torch 2.11 (the GPU image)
    from torch._higher_order_ops.effects import _EffectType as EffectType


def _wrap(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _piece_size(x, dim, sizes, group_size, group_rank):
    """Size along ``dim`` of this rank's piece of a full ``x``."""
    if sizes is None:
        return x.size(dim) // group_size
    return sizes[group_rank]


def _with(x, dim, size):
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


def _same(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gathered(x, dim, sizes, group_name, group_size, group_rank=None):
    dim = _wrap(dim, x.dim())
    total = sum(sizes) if sizes is not None else x.size(dim) * group_size
    return _with(x, dim, total)


def _scattered(x, dim, sizes, group_name, group_size, group_rank):
    dim = _wrap(dim, x.dim())
    return _with(x, dim, _piece_size(x, dim, sizes, group_size, group_rank))


def _reduce_scattered(x, dim, sizes, reduce, group_name, group_size, group_rank):
    return _scattered(x, dim, sizes, group_name, group_size, group_rank)


def _all_to_all(x, scatter_dim, gather_dim, sizes, group_name, group_size, group_rank):
    scatter_dim, gather_dim = _wrap(scatter_dim, x.dim()), _wrap(gather_dim, x.dim())
    mine = _piece_size(x, scatter_dim, sizes, group_size, group_rank)
    shape = list(x.shape)
    shape[scatter_dim] = mine
    shape[gather_dim] = shape[gather_dim] * group_size
    return x.new_empty(shape)


def _gathered_dim0(x, group_name, group_size):
    return _with(x, 0, x.size(0) * group_size)


def _scattered_dim0(x, reduce, group_name, group_size):
    return _with(x, 0, x.size(0) // group_size)


_FAKES = {
    "all_reduce": _same,
    "all_gather": _gathered,
    "reduce_scatter": _reduce_scattered,
    "broadcast": _same,
    "all_to_all": _all_to_all,
    "all_reduce_async": _same,
    "all_gather_async": _gathered_dim0,
    "reduce_scatter_async": _scattered_dim0,
    "copy_to_tp": _same,
    "reduce_from_tp": _same,
    "scatter_to_tp": _scattered,
    "gather_from_tp": _gathered,
    "gather_from_sp": _gathered,
    "reduce_scatter_to_sp": _scattered,
}


# ---- vocab-parallel cross-entropy ---------------------------------------------------------------

def _stats_dtype(logits):
    """Loss and statistics dtype: fp64 for fp64 logits, else fp32 (bf16/half accumulate in fp32)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _tokens(logits):
    n = 1
    for s in logits.shape[:-1]:  # not numel // V: a rank's vocabulary shard may be empty
        n = n * s
    return n


def _vocab_parallel_cross_entropy(logits, target, ignore_index, label_smoothing, group_name,
                                  group_size, group_rank):
    return logits.new_empty(target.shape, dtype=_stats_dtype(logits))


def _vocab_ce_local_max(logits, group_size, group_rank):
    return logits.new_empty((_tokens(logits) + group_size,), dtype=_stats_dtype(logits))


def _vocab_ce_local_stats(logits, target, max_sizes, ignore_index, group_rank):
    return logits.new_empty((_tokens(logits), 3), dtype=_stats_dtype(logits))


def _vocab_ce_local_grad(grad_loss, logits, target, max_sizes, lse, ignore_index,
                         label_smoothing, group_rank):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


_FAKES["vocab_parallel_cross_entropy"] = _vocab_parallel_cross_entropy

# Local pieces: no communication, so no effect (the compiler may reorder them freely).
_LOCAL_FAKES = {
    "vocab_ce_local_max": _vocab_ce_local_max,
    "vocab_ce_local_stats": _vocab_ce_local_stats,
    "vocab_ce_local_grad": _vocab_ce_local_grad,
}

for _name, _fn in _FAKES.items():
    torch.library.register_fake(f"tp_ext::{_name}")(_fn)
    torch.library._register_effectful_op(f"tp_ext::{_name}", EffectType.ORDERED)

for _name, _fn in _LOCAL_FAKES.items():
    torch.library.register_fake(f"tp_ext::{_name}")(_fn)
