"""Column- and row-parallel linear layers (Megatron's), the merged gate/up projection and the
grouped-query QKV projection.

Conventions: weights are ``[out, in]`` as in torch.nn.Linear; a column-parallel layer holds rows
of the full weight (``[out_local, in]``), a row-parallel layer columns (``[out, in_local]``). Any
size works: uneven splits follow :func:`tp_ext.shard_sizes`, heads are split whole.

Communication per forward (backward in brackets), on TP groups of more than one rank:
    column:  none (all-reduce of dx; column_linear)     | SP: all-gather (reduce-scatter)
    row:     all-reduce of the output (none)            | SP: reduce-scatter (all-gather)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Optional, Union

import torch
from torch import nn

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import ResolvedGroup, resolve_group
from tp_ext.layers.base import (
    SEQUENCE_DIM,
    InitFn,
    ParallelModule,
    check_int,
    default_linear_init,
)
from tp_ext.sharding import HeadLayout, Partition, uneven_sizes

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "MergedColumnParallelLinear",
    "QKVParallelLinear",
    "SharedColumnInput",
]

Output = Union[torch.Tensor, tuple[torch.Tensor, Optional[torch.Tensor]]]


def _check_features(layer: nn.Module, x: torch.Tensor, expected: int, what: str) -> None:
    if x.dim() == 0 or x.size(-1) != expected:
        raise ValueError(
            f"{type(layer).__name__}: input has shape {tuple(x.shape)} but its last dimension must "
            f"be {what} = {expected}"
        )


def _index_buffer(module: nn.Module, name: str, values, device) -> None:
    # values, not weights: on the meta device they would be lost; made on the CPU instead and
    # moved with the module when it is materialised
    if torch.empty(0, device=device).device.type == "meta":
        device = "cpu"
    module.register_buffer(
        name, torch.tensor(values, dtype=torch.long, device=device), persistent=False
    )


# ---- replicated rows (KV heads held by several ranks) --------------------------------------------


def sum_over_replicas(
    local: torch.Tensor,
    dim: int,
    tp: ResolvedGroup,
    replica_rows: tuple[torch.Tensor, torch.Tensor, int],
) -> torch.Tensor:
    """Identity forward; backward sums the gradient of rows held by several ranks (replicated KV
    heads) over those ranks, so replicas get the full gradient and stay equal. Only the replicated
    rows travel: they are packed into a tensor indexed by replicated full row, which is
    all-reduced (copy_to_tp's backward)."""
    local_pos, packed_pos, packed_len = replica_rows
    rows = local.index_select(dim, local_pos)
    shape = list(local.shape)
    shape[dim] = packed_len
    packed = local.new_zeros(shape).index_copy(dim, packed_pos, rows)
    packed = comm.copy_to_tp(packed, tp)
    return local.index_copy(dim, local_pos, packed.index_select(dim, packed_pos))


def replica_rows(partition: Partition, rank: int) -> Optional[tuple[list[int], list[int], int]]:
    """(local positions, packed positions, packed length) of ``rank``'s replicated rows; None when
    no row of the partition is replicated."""
    if not partition.replicated:
        return None
    packed = {i: n for n, i in enumerate(partition.replicated_indices())}
    mine = partition.local_indices(rank)
    local_pos = [p for p, i in enumerate(mine) if i in packed]
    return local_pos, [packed[mine[p]] for p in local_pos], len(packed)


class _ParallelLinear(ParallelModule):
    """What column- and row-parallel layers share: sizes, group and nn.Linear's initialisation."""

    def _setup_linear(self, in_features: int, out_features: int, tp_group) -> None:
        self._setup_tp(tp_group)
        self.in_features = check_int("in_features", in_features)
        self.out_features = check_int("out_features", out_features)

    def reset_parameters(self, init_method: Optional[InitFn] = None) -> None:
        weight_init, bias_init = default_linear_init(self.in_features)
        self._init_from_full("weight", init_method or weight_init)
        if self.bias is not None:
            self._init_from_full("bias", bias_init)


class ColumnParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with W's output rows split over the TP group.

    The input is replicated (or, with ``sequence_parallel``, this rank's sequence shard, gathered
    here). The output is this rank's slice of the output features, or all of them with
    ``gather_output``. ``skip_bias_add`` returns ``(output, bias)`` for the caller to fuse.
    Under sequence parallelism, pass ``seq_len`` to forward when the sequence length does not
    divide by the TP size.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
        partition: Optional[Partition] = None,
        input_is_gathered: bool = False,
    ):
        super().__init__()
        self._setup_linear(in_features, out_features, tp_group)
        # The caller gathered sequence shards already (tp_ext.parallelize's sequence parallelism,
        # one gather shared by q, k and v): that gather's backward sums the input gradient.
        self.input_is_gathered = input_is_gathered
        if input_is_gathered and sequence_parallel:
            raise ValueError(
                "input_is_gathered=True means the input is already the full "
                "sequence; it cannot be combined with sequence_parallel=True"
            )
        if gather_output and sequence_parallel:
            raise ValueError(
                "gather_output=True cannot be combined with sequence_parallel=True: "
                "a sequence-parallel column layer feeds a row-parallel one"
            )
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        self.sequence_parallel = sequence_parallel
        if partition is None:
            partition = Partition.split(out_features, self.tp_size)
        if partition.full != out_features:
            raise ValueError(
                f"partition covers {partition.full} outputs, not out_features={out_features}"
            )
        self.partition = partition
        self.out_features_local = partition.local_size(self.tp_rank)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(self.out_features_local, in_features, **kw))
        self._set_shard("weight", 0, partition)
        if bias:
            self.bias = nn.Parameter(torch.empty(self.out_features_local, **kw))
            self._set_shard("bias", 0, partition)
        else:
            self.register_parameter("bias", None)
        if gather_output and not partition.is_contiguous_split():
            _index_buffer(self, "_gather_index", partition.gather_order(), device)
        rows = replica_rows(partition, self.tp_rank)
        self._replicas = rows is not None
        if rows is not None:
            _index_buffer(self, "_replica_local", rows[0], device)
            _index_buffer(self, "_replica_packed", rows[1], device)
            self._replica_len = rows[2]
        self.reset_parameters(init_method)

    def _replica_summed(self, t: torch.Tensor) -> torch.Tensor:
        if not (self._replicas and torch.is_grad_enabled() and t.requires_grad):
            return t
        return sum_over_replicas(
            t, 0, self.tp, (self._replica_local, self._replica_packed, self._replica_len)
        )

    # Set by SharedColumnInput on the layers that share an input (q, k and v).
    shared_input: Optional["SharedColumnInput"] = None

    def _weight_and_bias(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        weight = self._replica_summed(self.weight)
        return weight, None if self.bias is None else self._replica_summed(self.bias)

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> Output:
        _check_features(self, x, self.in_features, "in_features")
        weight, bias = self._weight_and_bias()
        added = None if self.skip_bias_add else bias
        # the fused ops overlap the communication with the GEMMs (tp_ext.comm.set_overlap),
        # decided from sizes every rank shares
        if self.sequence_parallel and self.tp_size > 1:
            sizes = self._sp_sizes(self._check_sequence_input(x), seq_len)
            positions = sum(sizes) if sizes else x.size(SEQUENCE_DIM) * self.tp_size
            whole = x.numel() // max(1, x.size(SEQUENCE_DIM)) * positions
            fused = comm.overlaps(x, whole, self.tp_size, ring=True)
        else:
            fused = comm.overlaps(x, x.numel(), self.tp_size, ring=False)  # x is replicated
        if self.sequence_parallel and fused:
            y = comm.all_gather_linear(x, weight, added, SEQUENCE_DIM, sizes, self.tp)
        elif self.input_is_gathered:
            y = ops.linear(x, weight, added)
        elif not self.sequence_parallel:
            shared = self.shared_input
            y = None if shared is None else shared.take(self, x, fused)
            if y is None:
                # one op, not copy_to_tp + F.linear: it saves x itself, where the pair would save
                # copy_to_tp's copy (one per sibling projection of the same input)
                y = comm.column_linear(x, weight, added, self.tp, overlap=fused)
        else:
            y = ops.linear(self._gather_sequence(x, seq_len), weight, added)
        if self.gather_output:
            y = self.gather_features(y)
            if self.skip_bias_add and bias is not None:
                bias = self.gather_features(bias)
        return (y, bias) if self.skip_bias_add else y

    def gather_features(self, y: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return y
        y = comm.gather_from_tp(y, -1, uneven_sizes(self.partition.local_sizes()), self.tp)
        if hasattr(self, "_gather_index"):  # rank-major order -> the full layer's order
            y = y.index_select(-1, self._gather_index)
        return y

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features} "
            f"(local {self.out_features_local}), bias={self.bias is not None}, "
            f"tp={self.tp_size}, gather_output={self.gather_output}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class SharedColumnInput:
    """Column-parallel layers that read one tensor (q, k and v read the attention norm's output):
    the first of them called with it computes all their outputs in one op
    (:func:`tp_ext.comm.column_linears`), whose backward all-reduces their summed input gradient
    once, in flight during every layer's weight-gradient GEMM, instead of one all-reduce per layer
    (Megatron gets this from one fused QKV weight; Hugging Face models keep three).

    The module that makes the tensor hands it over with :meth:`offer` (a forward hook); a layer
    called with any other tensor computes alone, as exactly. So does every layer under
    torch.compile, which does not follow this bookkeeping by tensor identity."""

    def __init__(self, layers: Sequence[ColumnParallelLinear]):
        layers = list(layers)
        if len(layers) < 2 or not all(isinstance(m, ColumnParallelLinear) for m in layers):
            kinds = [type(m).__name__ for m in layers]
            raise ValueError(
                f"SharedColumnInput takes two or more ColumnParallelLinear layers, got {kinds}"
            )
        first = layers[0]
        for m in layers:
            if m.sequence_parallel or m.input_is_gathered:
                raise ValueError(
                    "SharedColumnInput: a layer with sequence_parallel or input_is_gathered "
                    "communicates its input elsewhere; share only replicated-input layers"
                )
            if (m.tp.name, m.in_features) != (first.tp.name, first.in_features):
                raise ValueError(
                    f"SharedColumnInput: layers must share the TP group and in_features; got "
                    f"{m.tp.name!r}/{m.in_features} and {first.tp.name!r}/{first.in_features}"
                )
        self.layers = layers
        self._x: Optional[torch.Tensor] = None
        self._outputs: dict[int, torch.Tensor] = {}
        for m in layers:
            m.shared_input = self

    def offer(self, x: torch.Tensor) -> None:
        """``x`` is the tensor the layers will read (from the next forward on)."""
        if torch.compiler.is_compiling():
            return
        self._x, self._outputs = x, {}

    def take(self, layer: ColumnParallelLinear, x: torch.Tensor, overlap: bool):
        """``layer``'s output for input ``x``, or None when ``x`` is not the offered tensor (or it
        was taken already): the layer then computes it alone."""
        if torch.compiler.is_compiling():
            return None
        if x is not self._x:  # read through something else: nothing kept for it any more
            self._x, self._outputs = None, {}
            return None
        if not self._outputs:  # the first layer to read x computes every layer's output
            pairs = [m._weight_and_bias() for m in self.layers]
            added = [None if m.skip_bias_add else b for m, (_, b) in zip(self.layers, pairs)]
            every = all(b is not None for b in added)  # else the biases are added one by one
            ys = comm.column_linears(
                x, [w for w, _ in pairs], added if every else None, layer.tp, overlap
            )
            if not every:
                ys = [y if b is None else y + b for y, b in zip(ys, added)]
            self._outputs = {id(m): y for m, y in zip(self.layers, ys)}
        y = self._outputs.pop(id(layer), None)
        if not self._outputs:
            self._x = None
        return y


class RowParallelLinear(_ParallelLinear):
    """``y = x @ W.T + b`` with W's input columns split over the TP group.

    The input is this rank's slice of the input features (``input_is_parallel=True``, the output
    of a column-parallel layer), or the full input, sliced here. Partial products are all-reduced
    (with ``sequence_parallel``: reduce-scattered into sequence shards), then the bias is added
    once. ``skip_bias_add`` returns ``(output, bias)``. ``reduce_output=False`` leaves the output
    this rank's partial sum, for a caller that reduces it with others (a sparse-MoE block under
    sequence parallelism: its shared and routed experts' sums in one reduce-scatter); the bias
    is then added on TP rank 0 only.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
        partition: Optional[Partition] = None,
        reduce_output: bool = True,
    ):
        super().__init__()
        self._setup_linear(in_features, out_features, tp_group)
        if sequence_parallel and not input_is_parallel:
            raise ValueError(
                "sequence_parallel=True needs input_is_parallel=True (the input "
                "comes from a column-parallel layer)"
            )
        if sequence_parallel and not reduce_output:
            raise ValueError(
                "RowParallelLinear: sequence_parallel=True reduce-scatters the output, "
                "reduce_output=False leaves it unreduced; give one of them"
            )
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        self.sequence_parallel, self.reduce_output = sequence_parallel, reduce_output
        if partition is None:
            partition = Partition.split(in_features, self.tp_size)
        if partition.full != in_features or partition.replicated:
            raise ValueError(
                f"a row-parallel partition must cover in_features={in_features} "
                f"once, got {partition}"
            )
        self.partition = partition
        self.in_features_local = partition.local_size(self.tp_rank)
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_local, **kw))
        self._set_shard("weight", 1, partition)
        if bias:  # replicated: added once, after the reduction
            self.bias = nn.Parameter(torch.empty(out_features, **kw))
        else:
            self.register_parameter("bias", None)
        if not input_is_parallel and not partition.is_contiguous_split():
            raise ValueError("input_is_parallel=False needs a contiguous partition")
        self.reset_parameters(init_method)

    def forward(self, x: torch.Tensor, seq_len: Optional[int] = None) -> Output:
        if self.input_is_parallel:
            _check_features(
                self,
                x,
                self.in_features_local,
                f"this rank's share of in_features={self.in_features}",
            )
        else:
            _check_features(self, x, self.in_features, "in_features")
            x = comm.scatter_to_tp(x, -1, self.partition.local_sizes(), self.tp)
        bias = self.bias
        if self.sequence_parallel:
            # the output's size (tokens x out_features) is the same on every rank
            shared = x.numel() // max(1, x.size(-1)) * self.out_features
            if comm.overlaps(x, shared, self.tp_size, ring=True):  # the ring, behind its GEMMs
                y = comm.linear_reduce_scatter(x, self.weight, SEQUENCE_DIM, None, self.tp)
            else:
                y = self._scatter_sequence(ops.linear(x, self.weight))
            # The bias now meets only this rank's tokens: its gradient is partial.
            if bias is not None:
                bias = comm.copy_to_tp(bias, self.tp)
        elif not self.reduce_output:
            y = ops.linear(x, self.weight)
            if bias is not None:  # counted once in the caller's sum; every rank's gradient
                bias = comm.copy_to_tp(bias, self.tp) * float(self.tp_rank == 0)
        else:
            y = comm.reduce_from_tp(ops.linear(x, self.weight), self.tp)
        if self.skip_bias_add:
            return y, bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features} (local {self.in_features_local}), "
            f"out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp={self.tp_size}, sequence_parallel={self.sequence_parallel}"
            + ("" if self.reduce_output else ", output unreduced")
        )


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections of the same input in one matmul (gate and up).

    Each logical output part is split over the ranks on its own, so rank r holds its slice of
    every part; the full (unsharded) weight is the parts stacked in order, as one torch.nn.Linear
    with ``sum(output_sizes)`` outputs. :meth:`split` cuts a local output into its parts.
    """

    def __init__(
        self,
        in_features: int,
        output_sizes: Sequence[int],
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
    ):
        if not output_sizes:
            raise ValueError("output_sizes must list at least one output size")
        for i, n in enumerate(output_sizes):
            check_int(f"output_sizes[{i}]", n)
        tp = resolve_group(tp_group)
        self.output_sizes = list(output_sizes)
        partition = Partition.merged(self.output_sizes, tp.size)
        super().__init__(
            in_features,
            sum(self.output_sizes),
            bias,
            gather_output,
            skip_bias_add,
            sequence_parallel,
            tp,
            device,
            dtype,
            init_method,
            partition,
        )
        self.output_sizes_local = [n for _, n in partition.segments[self.tp_rank]]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The parts of an output along its last dim (local, or full with gather_output)."""
        sizes = self.output_sizes if self.gather_output else self.output_sizes_local
        return tuple(torch.split(y, sizes, dim=-1))


class QKVParallelLinear(ColumnParallelLinear):
    """The query, key and value projections of grouped-query attention in one matmul.

    Heads are split whole by :class:`tp_ext.sharding.HeadLayout`: uneven head counts give ranks
    different numbers of heads; with fewer KV heads than ranks each rank holds one KV head,
    replicated over the ranks that serve it, and the gradients of replicas are summed. The full
    weight is ``[q; k; v]`` stacked (``(num_heads + 2 * num_kv_heads) * head_dim`` rows), as the
    fused c_attn of the original Qwen. Rank r's output is ``[q_r | k_r | v_r]``; :meth:`split`
    separates them.
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: Optional[int] = None,
        bias: bool = True,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
    ):
        tp = resolve_group(tp_group)
        self.head_dim = check_int("head_dim", head_dim)
        self.num_heads = check_int("num_heads", num_heads)
        self.num_kv_heads = check_int(
            "num_kv_heads", num_heads if num_kv_heads is None else num_kv_heads
        )
        self.layout = HeadLayout(self.num_heads, self.num_kv_heads, tp.size)
        partition = self.layout.qkv_partition(head_dim)
        super().__init__(
            hidden_size,
            partition.full,
            bias,
            False,
            False,
            sequence_parallel,
            tp,
            device,
            dtype,
            init_method,
            partition,
        )
        self.num_heads_local = self.layout.q[self.tp_rank][1]
        self.num_kv_heads_local = self.layout.kv[self.tp_rank][1]
        self.output_sizes_local = [
            self.num_heads_local * head_dim,
            self.num_kv_heads_local * head_dim,
            self.num_kv_heads_local * head_dim,
        ]

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q, k, v)`` of a local output, each ``[..., heads_local * head_dim]``."""
        q, k, v = torch.split(y, self.output_sizes_local, dim=-1)
        return q, k, v

    def extra_repr(self) -> str:
        return (
            f"hidden_size={self.in_features}, head_dim={self.head_dim}, "
            f"heads={self.num_heads} (local {self.num_heads_local}), "
            f"kv_heads={self.num_kv_heads} (local {self.num_kv_heads_local}), "
            f"bias={self.bias is not None}, tp={self.tp_size}"
        )
