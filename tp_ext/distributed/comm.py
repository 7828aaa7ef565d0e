"""Every collective tp_ext calls from Python: plain collectives, the Megatron communication pairs,
the vocab-parallel loss op, and "an error on any rank is an error on every rank".

Every function takes ``group``: a ``ProcessGroup``, a group name, a :class:`ResolvedGroup`
(what layers hold), or ``None`` for the TP group made by :func:`tp_ext.init_parallel` (the
world group if it was not called). Groups are resolved by
:func:`tp_ext.distributed.groups.resolve_group` and the ops take
``(group_name, group_size[, group_rank])``; see docs/ops.md for each op.

The differentiable pairs (Megatron's mappings)::

    copy_to_tp            identity        / all-reduce       enter a TP region
    reduce_from_tp        all-reduce      / identity         leave a row-parallel layer
    scatter_to_tp         split           / all-gather       take this rank's slice
    gather_from_tp        all-gather      / split            gather a column-parallel output
    gather_from_sp        all-gather      / reduce-scatter   sequence parallel: enter TP region
    reduce_scatter_to_sp  reduce-scatter  / all-gather       sequence parallel: leave TP region

The same pairs fused with the linear layer next to them, so the communication hides behind the
GEMMs (:func:`column_linear`, :func:`column_linears` for several layers reading one input,
:func:`all_gather_linear`, :func:`linear_reduce_scatter`); the
layers take them unless :func:`set_overlap` turned them off.

On a group of one the pairs are identities and return their input without calling an op.
Splits follow :func:`tp_ext.shard_sizes`; gathers take ``sizes`` (every rank's size along
``dim``) when pieces differ.

The plain collectives take ``async_op=True``: they then start the transfer and return a
:class:`Pending` handle whose ``wait()`` returns the same result, so this rank can compute in
between, eagerly or under ``torch.compile(fullgraph=True)``. They are not differentiable and are
built on torch's functional collectives; see :mod:`tp_ext.distributed.pending`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Callable, Optional, Union

import torch
import torch.distributed as dist

from tp_ext import ops
from tp_ext.distributed import async_groups, peers, pending
from tp_ext.distributed.accounting import (  # noqa: F401  (tp_ext.comm is the public face)
    CommStats,
    record_transfer,
    set_consistency_checks,
    set_shared_memory,
    set_timeout,
    shared_memory_active,
    tag,
    track,
)
from tp_ext.distributed.groups import GroupLike, ResolvedGroup, device_of, resolve_group
from tp_ext.distributed.pending import Pending
from tp_ext.sharding import shard_sizes, uneven_sizes
from tp_ext.validation import check_int

__all__ = [
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "broadcast",
    "all_to_all",
    "all_to_all_single",
    "Pending",
    "copy_to_tp",
    "reduce_from_tp",
    "scatter_to_tp",
    "gather_from_tp",
    "gather_from_sp",
    "reduce_scatter_to_sp",
    "vocab_parallel_cross_entropy",
    "summa_linear",
    "column_linear",
    "column_linears",
    "all_gather_linear",
    "linear_reduce_scatter",
    "set_overlap",
    "overlaps",
    "everywhere",
    "barrier",
    "prepare_async",
    "resolve_group",
    "ResolvedGroup",
    "track",
    "tag",
    "CommStats",
    "set_timeout",
    "set_consistency_checks",
    "set_shared_memory",
    "shared_memory_active",
]


def _live(group: GroupLike, op: str) -> ResolvedGroup:
    """The resolved group, which must be able to communicate (or be a group of one)."""
    g = resolve_group(group)
    if g.group is None and g.size > 1:
        raise RuntimeError(
            f"tp_ext.comm.{op}: {g} has no process group behind it (a virtual "
            "group for shapes only); build the layer with a real group to run it"
        )
    return g


def _split_sizes(x: torch.Tensor, dim: int, g: ResolvedGroup, sizes) -> Optional[list[int]]:
    """``sizes`` for splitting x's full ``dim`` over the group: as given (the op checks them),
    else the shard_sizes policy (None when even)."""
    if sizes is not None:
        return list(sizes)
    return uneven_sizes(shard_sizes(x.size(dim), g.size))


def _piece_sizes(sizes) -> Optional[list[int]]:
    return None if sizes is None else list(sizes)


# ---- plain collectives --------------------------------------------------------------------------


def all_reduce(
    x: torch.Tensor, reduce: str = "sum", group: GroupLike = None, *, async_op: bool = False
) -> Union[torch.Tensor, Pending]:
    """Reduce ``x`` over the group (``sum``, ``avg``, ``max``, ``min``, ``product``); x is
    unchanged. ``async_op=True``: start it and return a :class:`Pending` whose ``wait()`` returns
    the result (not differentiable; :mod:`tp_ext.distributed.pending`)."""
    g = _live(group, "all_reduce")
    if async_op:
        return pending.all_reduce(x, reduce, g)
    if g.group is None:
        return x.clone()
    return ops.all_reduce(x, reduce, g.name, g.size)


def all_gather(
    x: torch.Tensor,
    dim: int = 0,
    sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[torch.Tensor, Pending]:
    """Concatenate every rank's ``x`` along ``dim``; ``sizes[r]`` is rank r's size there if
    uneven. ``async_op=True``: a :class:`Pending` whose ``wait()`` returns the result (short
    pieces travel padded to the widest and are cut after the wait)."""
    g = _live(group, "all_gather")
    if async_op:
        return pending.all_gather(x, dim, sizes, g)
    if g.group is None:
        return x.clone()
    return ops.all_gather(x, dim, None if sizes is None else list(sizes), g.name, g.size)


def reduce_scatter(
    x: torch.Tensor,
    dim: int = 0,
    sizes: Optional[Sequence[int]] = None,
    reduce: str = "sum",
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[torch.Tensor, Pending]:
    """Reduce ``x`` over the group and keep this rank's piece along ``dim`` (shard_sizes policy).
    ``async_op=True``: a :class:`Pending` whose ``wait()`` returns the piece (uneven pieces travel
    padded to the widest)."""
    g = _live(group, "reduce_scatter")
    if async_op:
        return pending.reduce_scatter(x, dim, _split_sizes(x, dim, g, sizes), reduce, g)
    if g.group is None:
        return x.clone()
    return ops.reduce_scatter(
        x, dim, _split_sizes(x, dim, g, sizes), reduce, g.name, g.size, g.rank
    )


def broadcast(
    x: torch.Tensor, src: int = 0, group: GroupLike = None, *, async_op: bool = False
) -> Union[torch.Tensor, Pending]:
    """Rank ``src``'s ``x`` (``src`` is a rank of the group), on every rank. ``async_op=True``: a
    :class:`Pending` whose ``wait()`` returns it."""
    g = _live(group, "broadcast")
    if async_op:
        return pending.broadcast(x, src, g)
    if g.group is None:
        return x.clone()
    return ops.broadcast(x, src, g.name, g.size)


def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[torch.Tensor, Pending]:
    """Send piece r of ``x`` (split along ``scatter_dim``) to rank r; concatenate what arrives along
    ``gather_dim``. All ranks pass tensors of the same shape. ``async_op=True``: a
    :class:`Pending` whose ``wait()`` returns the result (one uneven all_to_all_single, the pieces
    rearranged after the wait)."""
    g = _live(group, "all_to_all")
    if async_op:
        return pending.all_to_all(
            x, scatter_dim, gather_dim, _split_sizes(x, scatter_dim, g, sizes), g
        )
    if g.group is None:
        return x.clone()
    return ops.all_to_all(
        x, scatter_dim, gather_dim, _split_sizes(x, scatter_dim, g, sizes), g.name, g.size, g.rank
    )


def all_to_all_single(
    x: torch.Tensor,
    send_sizes: Sequence[int],
    recv_sizes: Sequence[int],
    group: GroupLike = None,
    *,
    async_op: bool = False,
) -> Union[torch.Tensor, Pending]:
    """Uneven all-to-all along dim 0, differentiable: rows ``[sum(send_sizes[:r]),
    +send_sizes[r])`` go to rank r, and ``recv_sizes[r]`` rows arrive from rank r, in rank order
    (my ``send_sizes[r]`` is rank r's ``recv_sizes[me]``: exchange the counts first). The backward
    sends the gradients back the same way. ``track()`` records the bytes sent to other ranks
    (collective ``all_to_all_v``). Expert parallelism's token dispatch and combine.
    ``async_op=True``: a :class:`Pending` whose ``wait()`` returns the rows (not differentiable,
    unlike the synchronous call)."""
    g = _live(group, "all_to_all_single")
    send, recv = [int(s) for s in send_sizes], [int(r) for r in recv_sizes]
    if async_op:
        return pending.all_to_all_single(x, send, recv, g)
    if g.group is None:
        if send != recv or len(send) != 1 or send[0] != x.size(0):
            raise ValueError(
                f"tp_ext.comm.all_to_all_single: a group of one keeps its {x.size(0)} rows; "
                f"send_sizes={send} and recv_sizes={recv} must both be [{x.size(0)}]"
            )
        return x
    return ops.all_to_all_single(x, send, recv, g.name, g.size)


# ---- differentiable Megatron pairs --------------------------------------------------------------


def copy_to_tp(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward."""
    g = _live(group, "copy_to_tp")
    return x if g.size == 1 else ops.copy_to_tp(x, g.name, g.size)


def reduce_from_tp(x: torch.Tensor, group: GroupLike = None) -> torch.Tensor:
    """All-reduce (sum) forward, identity backward."""
    g = _live(group, "reduce_from_tp")
    return x if g.size == 1 else ops.reduce_from_tp(x, g.name, g.size)


def scatter_to_tp(
    x: torch.Tensor, dim: int = -1, sizes: Optional[Sequence[int]] = None, group: GroupLike = None
) -> torch.Tensor:
    """This rank's slice of ``x`` along ``dim`` forward, all-gather of the gradient backward."""
    g = _live(group, "scatter_to_tp")
    if g.size == 1:
        return x
    return ops.scatter_to_tp(x, dim, _split_sizes(x, dim, g, sizes), g.name, g.size, g.rank)


def gather_from_tp(
    x: torch.Tensor, dim: int = -1, sizes: Optional[Sequence[int]] = None, group: GroupLike = None
) -> torch.Tensor:
    """All-gather along ``dim`` forward, this rank's slice of the gradient backward."""
    g = _live(group, "gather_from_tp")
    if g.size == 1:
        return x
    return ops.gather_from_tp(x, dim, _piece_sizes(sizes), g.name, g.size, g.rank)


def gather_from_sp(
    x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None, group: GroupLike = None
) -> torch.Tensor:
    """All-gather of sequence shards forward, reduce-scatter of the gradient backward."""
    g = _live(group, "gather_from_sp")
    if g.size == 1:
        return x
    return ops.gather_from_sp(x, dim, _piece_sizes(sizes), g.name, g.size, g.rank)


def reduce_scatter_to_sp(
    x: torch.Tensor, dim: int = 0, sizes: Optional[Sequence[int]] = None, group: GroupLike = None
) -> torch.Tensor:
    """Reduce-scatter into sequence shards forward, all-gather of the gradient backward."""
    g = _live(group, "reduce_scatter_to_sp")
    if g.size == 1:
        return x
    return ops.reduce_scatter_to_sp(x, dim, _split_sizes(x, dim, g, sizes), g.name, g.size, g.rank)


# ---- linear layers fused with their communication (overlapped) ---------------------------------

# (enabled: True, False or None for "auto", smallest input in elements). Auto: on for CUDA
# tensors (the column backward; the rings stay off there, see overlaps()); off for CPU ones,
# where ranks on one host do better with the shared-memory channel's
# blocking collectives (the overlapped transfers take the process group's sockets) and ranks
# share the cores (benchmarks/bench_overlap.py: 0.95-0.98x on loopback, 1.1-1.5x on a
# 300 Mbit/s link). Below min_elements a ring's extra round trips cost more than they hide.
_OVERLAP: list = [None, 1 << 16]


def set_overlap(enabled: Optional[bool], min_elements: Optional[int] = None) -> None:
    """Whether tp_ext's layers take the fused, overlapped linear ops (True), the unfused pairs
    followed by ``F.linear`` (False: the same bytes, all on the critical path), or decide by
    device (None, the default: CUDA yes, CPU no; turn it on for CPU ranks on separate hosts),
    and from which input size (elements of the layer's input on this rank; default 65536)."""
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_overlap: enabled must be True, False or None, got {enabled!r}")
    if min_elements is not None:
        check_int("set_overlap: min_elements", min_elements, 0)
    _OVERLAP[0] = enabled
    if min_elements is not None:
        _OVERLAP[1] = min_elements


def overlaps(x: torch.Tensor, shared_numel: int, group_size: int, ring: bool) -> bool:
    """Whether a layer with input ``x`` on a group of ``group_size`` takes the fused op.
    ``shared_numel``: a size every rank of the group computes alike (uneven shards differ in
    ``x.numel()``, and ranks that chose differently would call different collectives).
    ``ring``: the sequence-parallel rings, whose send/recv pairs are not yet grouped for NCCL
    (ungrouped, NCCL can deadlock them), so they run on gloo only."""
    if ring and x.is_cuda:
        return False
    enabled = x.is_cuda if _OVERLAP[0] is None else _OVERLAP[0]
    return enabled and shared_numel >= _OVERLAP[1] and group_size > 1


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    group: GroupLike = None,
    overlap: bool = True,
) -> torch.Tensor:
    """``copy_to_tp(x)`` then ``F.linear``, in one op that saves ``x`` itself for backward (the
    pair would save copy_to_tp's copy of it). With ``overlap`` its backward starts the
    input-gradient all-reduce before the weight-gradient GEMM and waits after it (Megatron-Core's
    overlap); without, the all-reduce blocks (on one host, the shared-memory channel)."""
    g = _live(group, "column_linear")
    if not isinstance(overlap, bool):
        raise TypeError(f"column_linear: overlap must be True or False, got {overlap!r}")
    if g.size == 1:
        return ops.linear(x, weight, bias)
    x, weight, bias = ops.autocast_args(x, weight, bias)
    return ops.column_linear(x, weight, bias, g.name, g.size, overlap)


def column_linears(
    x: torch.Tensor,
    weights: Sequence[torch.Tensor],
    biases: Optional[Sequence[torch.Tensor]],
    group: GroupLike = None,
    overlap: bool = True,
) -> list[torch.Tensor]:
    """:func:`column_linear` for several column-parallel layers that read the same ``x`` (q, k
    and v; gate and up): ``[x W_i^T + b_i]``. Backward sums their input gradients and all-reduces
    that once (with ``overlap``, in flight during every weight-gradient GEMM), where one
    column_linear each would all-reduce one gradient per layer. ``biases``: one per weight, or
    None for none."""
    g = _live(group, "column_linears")
    if not isinstance(overlap, bool):
        raise TypeError(f"column_linears: overlap must be True or False, got {overlap!r}")
    weights = list(weights)
    biases = [] if biases is None else list(biases)
    if biases and len(biases) != len(weights):
        raise ValueError(
            f"column_linears: {len(biases)} biases for {len(weights)} weights; pass one bias "
            "per weight, or None"
        )
    if g.size == 1:
        return [ops.linear(x, w, biases[i] if biases else None) for i, w in enumerate(weights)]
    x, *rest = ops.autocast_args(x, *weights, *biases)
    weights, biases = rest[: len(weights)], rest[len(weights) :]
    return list(ops.column_linears(x, weights, biases, g.name, g.size, overlap))


def all_gather_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    dim: int,
    sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
) -> torch.Tensor:
    """``gather_from_sp(x, dim, sizes)`` then ``F.linear``, as a ring: each sequence shard is
    multiplied while the next one travels; backward, the input gradient's reduce-scatter is a
    ring of accumulators behind its GEMMs."""
    g = _live(group, "all_gather_linear")
    if g.size == 1:
        return ops.linear(x, weight, bias)
    x, weight, bias = ops.autocast_args(x, weight, bias)
    return ops.all_gather_linear(x, weight, bias, dim, _piece_sizes(sizes), g.name, g.size, g.rank)[
        0
    ]


def linear_reduce_scatter(
    x: torch.Tensor,
    weight: torch.Tensor,
    dim: int,
    sizes: Optional[Sequence[int]] = None,
    group: GroupLike = None,
) -> torch.Tensor:
    """``F.linear`` (no bias) then ``reduce_scatter_to_sp(.., dim, sizes)``, as a ring of
    accumulators: each shard's partial product is computed while another shard's sum travels;
    backward, the gradient's all-gather goes round the ring behind its GEMMs."""
    g = _live(group, "linear_reduce_scatter")
    if g.size == 1:
        return ops.linear(x, weight)
    sizes = _split_sizes(x, dim, g, sizes)
    x, weight = ops.autocast_args(x, weight)
    return ops.linear_reduce_scatter(x, weight, dim, sizes, g.name, g.size, g.rank)


# ---- the loss that communicates -----------------------------------------------------------------


def vocab_parallel_cross_entropy(
    logits_shard: torch.Tensor,
    target: torch.Tensor,
    ignore_index: int,
    label_smoothing: float,
    group: GroupLike = None,
) -> torch.Tensor:
    """Per-token cross-entropy of logits split along the vocabulary over the group (the op; the
    layer-level function with reductions is :func:`tp_ext.layers.vocab_parallel_cross_entropy`).
    Two token-sized all-reduces forward, none backward."""
    g = _live(group, "vocab_parallel_cross_entropy")
    return ops.vocab_parallel_cross_entropy(
        logits_shard, target, int(ignore_index), float(label_smoothing), g.name, g.size, g.rank
    )


def summa_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    x_in_sizes: Sequence[int],
    w_in_sizes: Sequence[int],
    row_group: GroupLike,
    col_group: GroupLike,
) -> torch.Tensor:
    """This grid rank's block of ``X @ W.T`` by SUMMA on a P x Q grid (no bias; the op's schema
    in csrc/schemas.cpp). ``row_group``: the Q ranks of this rank's grid row (this rank is grid
    column j in it); ``col_group``: the P ranks of its grid column (grid row i). ``x`` is
    ``[..., x_in_sizes[j]]`` (this row's tokens), ``weight`` ``[N_j, w_in_sizes[i]]``; the result
    is ``[..., N_j]``. Differentiable in both (autograd in C++)."""
    row, col = _live(row_group, "summa_linear"), _live(col_group, "summa_linear")
    if row.group is None or col.group is None:  # a group of one without a process group
        if row.size == 1 and col.size == 1:
            return ops.linear(x, weight)
        raise RuntimeError(
            "tp_ext.comm.summa_linear: the row and column groups must both be process groups "
            f"unless both are groups of one; got row={row}, col={col}"
        )
    return ops.summa_linear(
        x,
        weight,
        [int(s) for s in x_in_sizes],
        [int(s) for s in w_in_sizes],
        row.name,
        row.size,
        row.rank,
        col.name,
        col.size,
        col.rank,
    )


# ---- small texts (paths, digests), as bytes in tensors: torch's object collectives pickle ------


def all_gather_text(text: str, group: GroupLike = None) -> list[str]:
    """Every rank's ``text``, in rank order (a collective of the group; no pickle)."""
    g = _live(group, "all_gather_text")
    if g.group is None or g.size == 1:
        return [text]
    data = text.encode() + b"\0"  # never empty: every rank sends at least one byte
    device = device_of(g)
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = all_gather(length, group=g).tolist()
    mine = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    everyone = all_gather(mine, 0, lengths, g).cpu()
    texts, start = [], 0
    for n in lengths:
        texts.append(bytes(everyone[start : start + n - 1].tolist()).decode())
        start += n
    return texts


def broadcast_text(text: str, src: int = 0, group: GroupLike = None) -> str:
    """Rank ``src``'s ``text`` on every rank (the others pass anything, e.g. "")."""
    return all_gather_text(text, group)[src]


# ---- agreement across ranks ---------------------------------------------------------------------


def everywhere(
    group: GroupLike, what: str, fn: Callable[[], Any], error: type[Exception] = RuntimeError
) -> Any:
    """Run ``fn`` on every rank of ``group``; if it raised on any rank, raise on all of them (the
    failing rank re-raises its own exception, the others ``error`` naming the first failing
    rank), so no rank goes on into a collective the others left. One small all-gather."""
    g = resolve_group(group)
    try:
        peers.record(g)  # once per group: lets later errors name a rank that died
    except RuntimeError as e:
        raise error(f"{what}: {e}{peers.explain(g)}") from e
    result, failure = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
        failure = e
    if g.group is None or g.size == 1:
        if failure is not None:
            raise failure
        return result
    message = b"" if failure is None else f"{type(failure).__name__}: {failure}".encode()[:4000]
    device = device_of(g)
    mine = torch.zeros(4096, dtype=torch.uint8, device=device)
    mine[0] = 1 if failure is not None else 0
    if message:
        mine[1 : 1 + len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(g.size)]
    try:
        dist.all_gather(everyone, mine, group=g.group)
    except RuntimeError as e:  # a rank died: say which, if it was on this host
        raise error(f"{what}: {e}{peers.explain(g)}") from (failure or e)
    for rank, row in enumerate(everyone):
        if row[0].item():
            if failure is not None:
                raise failure
            text = bytes(row[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            raise error(f"{what} failed on rank {rank} of the group: {text}")
    return result


def prepare_async(group: GroupLike = None) -> None:
    """Set up now what the group's asynchronous collectives (``async_op=True``) need, rather
    than at the first one: on gloo, a companion group of the same ranks with one worker thread
    (:mod:`tp_ext.distributed.async_groups`). A collective: every rank of the group calls it."""
    g = _live(group, "prepare_async")
    if g.group is not None and g.size > 1:
        async_groups.prepare(g)


def barrier(group: GroupLike) -> None:
    """Wait for every rank of ``group`` (nothing on a group of one)."""
    g = resolve_group(group)
    if g.group is not None and g.size > 1:
        dist.barrier(group=g.group)
