"""The Python face of every tp_ext op: one list of op names, a handle per op, and the fake (meta)
kernels that let torch.compile and torch.export trace them.

Nothing else in tp_ext touches ``torch.ops.tp_ext``: collectives are called through
:mod:`tp_ext.distributed.comm` (which calls the handles here with a resolved group), compute
kernels through the handles below. Schemas and their meaning: ``csrc/schemas.cpp`` and
docs/ops.md; how to add an op: ``csrc/README.md``.

Communicating ops are registered as ORDERED effects: compiled graphs then keep the collectives in
program order. Without it Inductor may schedule independent collectives in a different order on
different ranks (each rank compiles its own graph), which pairs the wrong collectives across ranks.
Output shapes follow from the arguments alone: ops whose result is this rank's piece take
``group_rank``, so no live process group is needed while tracing.
"""

from __future__ import annotations

import functools
import importlib
import sys

import torch

# Loading the extension registers every op (static initialisers of its TORCH_LIBRARY blocks).
# Imported by name: the compiled module is not a Python file the import-layer checker can see.
try:
    _C = importlib.import_module("tp_ext._C")
except ImportError as e:
    raise ImportError(
        f"tp_ext's C++ extension (tp_ext._C) does not load with this torch {torch.__version__}: "
        f"{e}. It is usually built for another torch version; rebuild it (make install, or "
        "pip install -e .)"
    ) from e

try:  # torch >= 2.12
    from torch._library.effects import EffectType
except ImportError:  # torch 2.11 (the GPU image)
    from torch._higher_order_ops.effects import _EffectType as EffectType

__all__ = [
    "COLLECTIVE_OPS",
    "KERNEL_OPS",
    "ALL_OPS",
    "autocast_args",
    "cpu_gemm",
    "linear",
    "set_cpu_gemm",
]

# ---- the one list of op names --------------------------------------------------------------------

COLLECTIVE_OPS = (
    # plain collectives (no autograd)
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    # uneven all-to-all of expert parallelism (autograd in C++: the reverse exchange)
    "all_to_all_single",
    # Megatron pairs (autograd in C++)
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    # the loss that communicates two token-sized all-reduces
    "vocab_parallel_cross_entropy",
    # 2D tensor parallelism: SUMMA matmul (panel broadcasts / reductions; autograd in C++)
    "summa_linear",
    "summa_linear_backward",
    # linear layers fused with their TP communication, overlapped with the GEMMs (autograd in C++)
    "column_linear",
    "column_linear_backward",
    "column_linears",
    "column_linears_backward",
    "all_gather_linear",
    "all_gather_linear_backward",
    "linear_reduce_scatter",
    "linear_reduce_scatter_backward",
)
KERNEL_OPS = (
    # the local GEMM of layers whose communication is a separate op (autograd in C++)
    "linear",
    # ring attention: two partial attention results over disjoint key blocks merged
    "attention_merge",
    "attention_merge_backward",
    "rms_norm",
    "add_rms_norm",
    "rms_norm_backward",
    "swiglu",
    "swiglu_backward",
    "rotary_embedding",
    "vocab_ce_local_stats",
    "vocab_ce_target_logit",
    "vocab_ce_local_grad",
    # gradient compression (tp_ext.compression's hooks): quantise with error feedback, and back
    "quantize_int8_ef",
    "dequantize_int8",
    "quantize_1bit_ef",
    "dequantize_1bit",
    # mixture-of-experts token permutation (tp_ext.layers.moe): routing order, gather, combine
    "moe_route",
    "moe_permute",
    "moe_unpermute",
    "moe_weight_grad",
    # vocab-parallel sampling (temperature, top-k, top-p): the local pieces, no derivatives
    "sampling_candidates",
    "sampling_threshold",
    "sampling_kept_mass",
    "sampling_pick",
    # the serving engine's attention over its paged KV cache (no derivative)
    "paged_attention",
)
ALL_OPS = COLLECTIVE_OPS + KERNEL_OPS

# ---- handles -------------------------------------------------------------------------------------

_lib = torch.ops.tp_ext
all_reduce = _lib.all_reduce
all_gather = _lib.all_gather
reduce_scatter = _lib.reduce_scatter
broadcast = _lib.broadcast
all_to_all = _lib.all_to_all
# (x [R, ...], send_sizes, recv_sizes, group_name, group_size) -> [sum(recv_sizes), ...]
all_to_all_single = _lib.all_to_all_single
copy_to_tp = _lib.copy_to_tp
reduce_from_tp = _lib.reduce_from_tp
scatter_to_tp = _lib.scatter_to_tp
gather_from_tp = _lib.gather_from_tp
gather_from_sp = _lib.gather_from_sp
reduce_scatter_to_sp = _lib.reduce_scatter_to_sp
vocab_parallel_cross_entropy = _lib.vocab_parallel_cross_entropy
# (x, weight, x_in_sizes, w_in_sizes, row_group_name, grid_cols, grid_col, col_group_name,
#  grid_rows, grid_row) -> [..., weight.size(0)]: this grid rank's block of X W^T (SUMMA)
summa_linear = _lib.summa_linear
summa_linear_backward = _lib.summa_linear_backward  # (grad, x, weight, <the same>) -> (gx, gw)
# (x, weight, bias, group_name, group_size) -> x W^T + b; backward overlaps its all-reduce
column_linear = _lib.column_linear
column_linear_backward = _lib.column_linear_backward
# (x, [weight_i], [bias_i] or [], group_name, group_size) -> [x W_i^T + b_i]; backward all-reduces
# the summed input gradient once, overlapped with every weight-gradient GEMM
column_linears = _lib.column_linears
column_linears_backward = _lib.column_linears_backward
# (x shard, weight, bias, dim, sizes, group_name, group_size, group_rank) -> (y, gathered x)
all_gather_linear = _lib.all_gather_linear
all_gather_linear_backward = _lib.all_gather_linear_backward
# (x, weight, dim, sizes, group_name, group_size, group_rank) -> this rank's shard of x W^T summed
linear_reduce_scatter = _lib.linear_reduce_scatter
linear_reduce_scatter_backward = _lib.linear_reduce_scatter_backward
rms_norm = _lib.rms_norm  # (x, weight, eps): weight * x / rms(x), fp32 math, one rounding
add_rms_norm = (
    _lib.add_rms_norm
)  # (x, residual, weight, eps) -> (rms_norm(x + residual), x + residual)
swiglu = _lib.swiglu  # ([..., 2I] gate | up) -> silu(gate) * up
rotary_embedding = _lib.rotary_embedding  # (q, k, cos, sin) -> rotated (q, k), RoPE half-rotation
# (grad [n], residual fp32 [n] (updated), chunk_size) -> (int8 codes [n], fp32 scales [chunks])
quantize_int8_ef = _lib.quantize_int8_ef
dequantize_int8 = _lib.dequantize_int8  # (codes, scales, chunk_size) -> fp32 [n]
# (grad [n], residual, chunk_size % 8 == 0) -> (sign bits uint8 [ceil(n / 8)], scales: mean |v|)
quantize_1bit_ef = _lib.quantize_1bit_ef
dequantize_1bit = _lib.dequantize_1bit  # (bits, scales, chunk_size, numel) -> fp32 [numel]
# (expert_ids [T, k], num_experts) -> (row_map [T, k]: row in expert order, -1 dropped; counts [E])
# (out_a, lse_a, out_b, lse_b) -> (out, lse): the attention over both key blocks (online softmax)
attention_merge = _lib.attention_merge
moe_route = _lib.moe_route
moe_permute = _lib.moe_permute  # (x [T, H], row_map, weights?, num_rows) -> [num_rows, H]
moe_unpermute = _lib.moe_unpermute  # (y [R, H], row_map, weights?) -> [T, H], weighted sum
moe_weight_grad = _lib.moe_weight_grad  # (tokens [T, H], rows [R, H], row_map) -> [T, k]
# Vocab-parallel sampling, logits [B, V_local] scaled as s = logits.to(acc) / temperature (acc:
# fp64 for fp64 logits, else fp32); kept: s >= threshold and s > -inf (docs/ops.md, "Sampling").
# (logits, temperature, count) -> (values [B, count] acc, indices [B, count] int64): the count
# largest s per row, descending (ties: smaller index first), padded with (-inf, -1)
sampling_candidates = _lib.sampling_candidates
# (candidates [B, N] acc, top_k, top_p, total_mass [B], row_max [B], exact_count)
#   -> (threshold [B] acc, resolved [B] bool)
sampling_threshold = _lib.sampling_threshold
# (logits, temperature, threshold [B], row_max [B]) -> [B] acc: sum of exp(s - row_max) kept
sampling_kept_mass = _lib.sampling_kept_mass
# (logits, temperature, threshold [B], row_max [B], target [B]) -> [B] int64: the first kept
# token whose running sum of exp(s - row_max) exceeds target (else the last kept; -1: none kept)
sampling_pick = _lib.sampling_pick
# (q [R, Hq, S, D], k_cache, v_cache [N, Hkv, D], slots [R, L], key_mask [R, L], past, scale)
#   -> [R, Hq, S, D]: attention over the keys in the slots, causal from column past
paged_attention = _lib.paged_attention


def autocast_args(*tensors):
    """The tensors in autocast's dtype where F.linear would run in it (tp_ext's linear ops are not
    in autocast's lists, so it would not cast them). As autocast: only floating tensors on its
    device, float64 never; None stays None."""
    device = tensors[0].device.type
    # the meta device (models sized without memory) has no autocast
    if not torch.amp.is_autocast_available(device) or not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)

    def cast(t):
        eligible = (
            t is not None
            and t.is_floating_point()
            and t.dtype != torch.float64
            and t.device.type == device
        )
        return t.to(dtype) if eligible else t

    return tuple(cast(t) for t in tensors)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` through tp_ext's GEMMs (the op ``tp_ext::linear``: oneDNN for float32 on CPU,
    csrc/common/gemm.h), in autocast's dtype where F.linear would run in it."""
    return _lib.linear(*autocast_args(x, weight, bias))


def cpu_gemm() -> str:
    """The GEMM kernel of tp_ext's linear ops on float32 CPU tensors: ``"onednn"`` (oneDNN's
    matmul, the default where torch is built with it) or ``"aten"`` (aten::mm: MKL). Set by
    ``TP_EXT_CPU_GEMM`` or :func:`set_cpu_gemm`; csrc/common/gemm.h says why."""
    return _C._cpu_gemm()


def set_cpu_gemm(name: str) -> None:
    """Choose the float32 CPU GEMM of tp_ext's linear ops, ``"onednn"`` or ``"aten"`` (every rank
    the same: they run the same kernels). CUDA and other dtypes always take aten's."""
    if name not in ("onednn", "aten"):
        raise ValueError(
            f"set_cpu_gemm: name={name!r} is not a CPU GEMM; use 'onednn' (oneDNN's matmul, the "
            "default) or 'aten' (aten::mm, MKL)"
        )
    _C._set_cpu_gemm(name)


# ---- fake kernels: collectives -------------------------------------------------------------------


def _wrap(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


def _with(x, dim, size):
    shape = list(x.shape)
    shape[dim] = size
    return x.new_empty(shape)


def _same(x, *args):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _piece_size(x, dim, sizes, group_size, group_rank):
    """Size along ``dim`` of this rank's piece of a full ``x``."""
    return x.size(dim) // group_size if sizes is None else sizes[group_rank]


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
    shape = list(x.shape)
    shape[scatter_dim] = _piece_size(x, scatter_dim, sizes, group_size, group_rank)
    shape[gather_dim] = shape[gather_dim] * group_size
    return x.new_empty(shape)


def _all_to_all_single(x, send_sizes, recv_sizes, group_name, group_size):
    total = 0
    for size in recv_sizes:
        total = total + size
    return x.new_empty((total, *x.shape[1:]))


# ---- fake kernels: vocab-parallel cross-entropy --------------------------------------------------


def _stats_dtype(logits):
    """Loss and statistics dtype: fp64 for fp64 logits, else fp32 (bf16/half accumulate in fp32)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _tokens(logits):
    n = 1
    for s in logits.shape[:-1]:  # not numel // V: a rank's vocabulary shard may be empty
        n = n * s
    return n


def _vocab_parallel_cross_entropy(
    logits, target, ignore_index, label_smoothing, group_name, group_size, group_rank
):
    return logits.new_empty(target.shape, dtype=_stats_dtype(logits))


def _vocab_ce_local_stats(logits, group_size, group_rank):
    n, dtype = _tokens(logits), _stats_dtype(logits)
    return logits.new_empty((n + group_size,), dtype=dtype), logits.new_empty((n, 2), dtype=dtype)


def _vocab_ce_target_logit(logits, target, max_sizes, ignore_index, group_rank):
    return logits.new_empty((_tokens(logits),), dtype=_stats_dtype(logits))


def _vocab_ce_local_grad(
    grad_loss, logits, target, max_sizes, lse, ignore_index, label_smoothing, group_rank
):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


# ---- fake kernels: SUMMA (2D tensor parallelism) -------------------------------------------------


def _summa_linear(x, weight, x_in_sizes, w_in_sizes, *grid):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _summa_linear_backward(grad, x, weight, x_in_sizes, w_in_sizes, *grid):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# ---- fake kernels: linear layers fused with their communication ---------------------------------


def _features(x, n):
    return x.new_empty((*x.shape[:-1], n))


def _linear(x, weight, bias=None):
    torch._check(
        weight.dim() == 2 and x.dim() >= 1 and x.shape[-1] == weight.shape[1],
        lambda: f"tp_ext.linear: x has shape {tuple(x.shape)} but weight has shape "
        f"{tuple(weight.shape)} (x.shape[-1] must equal weight.shape[1])",
    )
    return _features(x, weight.shape[0])


def _column_linear(x, weight, bias, group_name, group_size, overlap=True):
    return _features(x, weight.shape[0])


def _column_linear_backward(grad, x, weight, group_name, group_size, overlap=True):
    return x.new_empty(x.shape), weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


def _column_linears(x, weights, biases, group_name, group_size, overlap=True):
    return [_features(x, w.shape[0]) for w in weights]


def _column_linears_backward(grads, x, weights, bias, group_name, group_size, overlap=True):
    grad_w = [w.new_empty(w.shape) for w in weights]
    grad_b = [w.new_empty(w.shape[0]) for w in weights] if bias else []
    return x.new_empty(x.shape), grad_w, grad_b


def _all_gather_linear(x, weight, bias, dim, sizes, group_name, group_size, group_rank):
    full = _gathered(x, dim, sizes, group_name, group_size)
    return _features(full, weight.shape[0]), full


def _all_gather_linear_backward(grad, x_full, weight, dim, sizes, group_name, group_size, rank):
    grad_x = _scattered(x_full, dim, sizes, group_name, group_size, rank)
    return grad_x, weight.new_empty(weight.shape), weight.new_empty(weight.shape[0])


def _linear_reduce_scatter(x, weight, dim, sizes, group_name, group_size, group_rank):
    return _scattered(_features(x, weight.shape[0]), dim, sizes, group_name, group_size, group_rank)


def _linear_reduce_scatter_backward(grad, x, weight, dim, sizes, group_name, group_size, rank):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


# ---- fake kernels: fused compute ops (outputs contiguous, as the real kernels') -----------------


def _norm_out(x, weight):
    return x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype))


def _rms_norm(x, weight, eps):
    return _norm_out(x, weight)


def _add_rms_norm(x, residual, weight, eps):
    return _norm_out(x, weight), x.new_empty(x.shape)


def _rms_norm_backward(grad, x, weight, eps):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _attention_merge(out_a, lse_a, out_b, lse_b):
    return out_a.new_empty(out_a.shape), lse_a.new_empty(lse_a.shape)


def _attention_merge_backward(grad_out, grad_lse, out_a, lse_a, out_b, lse_b, out, lse):
    return (
        out_a.new_empty(out_a.shape),
        lse_a.new_empty(lse_a.shape),
        out_a.new_empty(out_a.shape),
        lse_a.new_empty(lse_a.shape),
    )


def _swiglu(gate_up):
    torch._check(
        gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0,
        lambda: f"tp_ext.swiglu: gate_up has shape {tuple(gate_up.shape)}; its last "
        "dimension must be even (gate and up stacked: [..., 2 * I]).",
    )
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


def _swiglu_backward(grad, gate_up):
    return gate_up.new_empty(gate_up.shape)


def _rotary_embedding(q, k, cos, sin):
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(
            f"tp_ext.rotary_embedding: q and k must be 4-d, got shapes "
            f"{tuple(q.shape)} and {tuple(k.shape)}."
        )
    want = (q.shape[0], q.shape[2], q.shape[3])
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != want:
            raise ValueError(
                f"tp_ext.rotary_embedding: {name} has shape {tuple(t.shape)} but q "
                f"has shape {tuple(q.shape)}; {name} must be [batch, seq, head_dim]"
                f" = {list(want)}."
            )
    return _strided_like(q), _strided_like(k)


def _quantized(grad, residual, chunk_size, one_bit):
    n = grad.numel()
    codes = grad.new_empty(
        (n + 7) // 8 if one_bit else n, dtype=torch.uint8 if one_bit else torch.int8
    )
    return codes, grad.new_empty(-(-n // chunk_size), dtype=torch.float32)


def _quantize_int8_ef(grad, residual, chunk_size):
    return _quantized(grad, residual, chunk_size, False)


def _quantize_1bit_ef(grad, residual, chunk_size):
    return _quantized(grad, residual, chunk_size, True)


def _dequantize_int8(codes, scales, chunk_size):
    return scales.new_empty(codes.numel())


def _dequantize_1bit(bits, scales, chunk_size, numel):
    return scales.new_empty(numel)


def _moe_route(expert_ids, num_experts):
    return (
        expert_ids.new_empty(expert_ids.shape, dtype=torch.int64),
        expert_ids.new_empty((num_experts,), dtype=torch.int64),
    )


def _moe_permute(x, row_map, weights, num_rows):
    return x.new_empty((num_rows, x.shape[1]))


def _moe_unpermute(y, row_map, weights):
    return y.new_empty((row_map.shape[0], y.shape[1]))


def _moe_weight_grad(tokens, rows, row_map):
    dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    return tokens.new_empty(row_map.shape, dtype=dtype)


def _sampling_acc(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _sampling_candidates(logits, temperature, count):
    torch._check(
        count >= 1,
        lambda: f"tp_ext.sampling_candidates: count={count} must be >= 1.",
    )
    rows = logits.shape[0]
    return (
        logits.new_empty((rows, count), dtype=_sampling_acc(logits)),
        logits.new_empty((rows, count), dtype=torch.int64),
    )


def _sampling_threshold(candidates, top_k, top_p, total_mass, row_max, exact_count):
    rows = candidates.shape[0]
    return candidates.new_empty((rows,)), candidates.new_empty((rows,), dtype=torch.bool)


def _sampling_kept_mass(logits, temperature, threshold, row_max):
    return logits.new_empty((logits.shape[0],), dtype=_sampling_acc(logits))


def _sampling_pick(logits, temperature, threshold, row_max, target):
    return logits.new_empty((logits.shape[0],), dtype=torch.int64)


def _paged_attention(q, k_cache, v_cache, slots, key_mask, past, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def _strided_like(x):
    # As the kernel: x's strides when head_dim has unit stride, else contiguous.
    out = torch.empty_like(x)
    return out if out.stride(-1) == 1 else torch.empty(x.shape, dtype=x.dtype, device=x.device)


_FAKES = {
    "all_reduce": _same,
    "all_gather": _gathered,
    "reduce_scatter": _reduce_scattered,
    "broadcast": _same,
    "all_to_all": _all_to_all,
    "all_to_all_single": _all_to_all_single,
    "copy_to_tp": _same,
    "reduce_from_tp": _same,
    "scatter_to_tp": _scattered,
    "gather_from_tp": _gathered,
    "gather_from_sp": _gathered,
    "reduce_scatter_to_sp": _scattered,
    "vocab_parallel_cross_entropy": _vocab_parallel_cross_entropy,
    "summa_linear": _summa_linear,
    "summa_linear_backward": _summa_linear_backward,
    "linear": _linear,
    "column_linear": _column_linear,
    "column_linear_backward": _column_linear_backward,
    "column_linears": _column_linears,
    "column_linears_backward": _column_linears_backward,
    "all_gather_linear": _all_gather_linear,
    "all_gather_linear_backward": _all_gather_linear_backward,
    "linear_reduce_scatter": _linear_reduce_scatter,
    "linear_reduce_scatter_backward": _linear_reduce_scatter_backward,
    "vocab_ce_local_stats": _vocab_ce_local_stats,
    "vocab_ce_target_logit": _vocab_ce_target_logit,
    "vocab_ce_local_grad": _vocab_ce_local_grad,
    "rms_norm": _rms_norm,
    "add_rms_norm": _add_rms_norm,
    "rms_norm_backward": _rms_norm_backward,
    "attention_merge": _attention_merge,
    "attention_merge_backward": _attention_merge_backward,
    "swiglu": _swiglu,
    "swiglu_backward": _swiglu_backward,
    "rotary_embedding": _rotary_embedding,
    "quantize_int8_ef": _quantize_int8_ef,
    "dequantize_int8": _dequantize_int8,
    "quantize_1bit_ef": _quantize_1bit_ef,
    "dequantize_1bit": _dequantize_1bit,
    "moe_route": _moe_route,
    "moe_permute": _moe_permute,
    "moe_unpermute": _moe_unpermute,
    "moe_weight_grad": _moe_weight_grad,
    "sampling_candidates": _sampling_candidates,
    "sampling_threshold": _sampling_threshold,
    "sampling_kept_mass": _sampling_kept_mass,
    "sampling_pick": _sampling_pick,
    "paged_attention": _paged_attention,
}
assert set(_FAKES) == set(ALL_OPS), "every op in the list has exactly one fake kernel"


def _keep_inductor_from_reordering_collectives() -> None:
    """Inductor before torch 2.14 records the ordering edge between two ORDERED-effect ops under
    the buffer's name but reads it back under the operation's name, so the edge is lost
    (pytorch/pytorch#188301 fixes it). Its peak-memory reordering pass then moves collectives
    of a compiled backward into a different order on different ranks (seen at TP=3, where ranks
    hold different head counts), and the ranks pair the wrong collectives. Until the fix, that
    pass is turned off once a graph with a tp_ext collective is traced for Inductor (the fake
    kernels below call this; Inductor's config is loaded by then). Everything else Inductor does
    is unchanged, and importing tp_ext alone leaves the compiler's settings alone."""
    config = sys.modules.get("torch._inductor.config")
    if config is not None and _INDUCTOR_LOSES_EFFECT_ORDER and config.reorder_for_peak_memory:
        config.reorder_for_peak_memory = False


_INDUCTOR_LOSES_EFFECT_ORDER = tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 14)


def _ordered(fake):
    """A collective's fake kernel: also keeps Inductor from reordering collectives (above)."""

    @functools.wraps(fake)
    def traced(*args):
        _keep_inductor_from_reordering_collectives()
        return fake(*args)

    return traced


for _name in ALL_OPS:
    fake = _FAKES[_name]
    torch.library.register_fake(f"tp_ext::{_name}")(
        _ordered(fake) if _name in COLLECTIVE_OPS else fake
    )
for _name in COLLECTIVE_OPS:
    # Local pieces have no effect: the compiler may reorder them freely.
    torch.library._register_effectful_op(f"tp_ext::{_name}", EffectType.ORDERED)
