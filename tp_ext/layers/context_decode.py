"""Decoding under context parallelism: attention of new queries over a KV cache whose positions
are split over the CP group.

Each CP rank keeps its own positions' keys and values (the prompt's :func:`cp_positions` after the
prefill, then each new token on one rank). Every rank holds the same new queries; each attends
its own keys (a partial result and its log-sum-exp), the partials are all-gathered over the
group and merged by the online softmax (:func:`tp_ext.ops.attention_merge`) in rank order, so
every rank gets the same, exact result. One all-gather of ``[batch, heads, new, head_dim + 1]``
per layer and token; the cache's memory stays split (as long-context serving does it, e.g.
vLLM's decode context parallelism).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike
from tp_ext.layers.context import CP_TAG, _acc, _block_by_matmuls, _repeat, cp_group
from tp_ext.sharding import cp_chunks

__all__ = ["split_kv_attention", "position_owner", "decode_owner"]


def split_kv_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    group: GroupLike = None,
    scale: Optional[float] = None,
    *,
    key_mask: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Causal attention of ``q`` [batch, heads, new, head_dim] (the same on every rank of the CP
    ``group``) over every rank's keys: ``k``, ``v`` [batch, kv_heads, held, head_dim] are this
    rank's (any number, none too), at the sequence positions ``key_positions`` [held];
    ``query_positions`` [new] are the queries'. A query sees the keys at or before its position,
    less than ``window`` positions back (a sliding window; None: all), whose ``key_mask``
    [batch, held] (bool; None: all) is True; ``softcap`` caps the scores as
    :func:`~tp_ext.layers.ring_attention`'s. Returns [batch, heads, new, head_dim], the same on
    every rank; a query that sees no key gets zeros. Inference only (no autograd)."""
    g = cp_group(group)
    _check(q, k, v, query_positions, key_positions, key_mask)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    groups = q.size(1) // k.size(1)
    allowed = _allowed(query_positions, key_positions, key_mask, window)
    with torch.no_grad(), torch.autocast(q.device.type, enabled=False):
        out, lse = _block_by_matmuls(
            q, _repeat(k, groups), _repeat(v, groups), False, scale, allowed, softcap
        )
        if g.size == 1:
            return out
        acc = _acc(q.dtype)
        packed = torch.cat([out.to(acc), lse.to(acc).unsqueeze(-1)], -1).unsqueeze(0)
        with comm.tag(CP_TAG):
            every = comm.all_gather(packed.contiguous(), 0, group=g)
        out, lse = every[0, ..., :-1], every[0, ..., -1]
        for r in range(1, g.size):  # in rank order: the same rounding on every rank
            out, lse = ops.attention_merge(out, lse, every[r, ..., :-1], every[r, ..., -1])
        return out.to(q.dtype)


def _allowed(query_positions, key_positions, key_mask, window) -> torch.Tensor:
    """Which keys each query sees, broadcast to [batch or 1, 1, new, held]."""
    back = query_positions[:, None] - key_positions[None, :]
    allowed = back >= 0
    if window is not None:
        allowed &= back < window
    allowed = allowed[None, None]
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :]
    return allowed


def _check(q, k, v, query_positions, key_positions, key_mask) -> None:
    fn = "split_kv_attention"
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must be "
            "[batch, heads, positions, head_dim], k and v of one shape"
        )
    if q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or q.size(1) % k.size(1):
        raise ValueError(
            f"{fn}: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim, "
            "q's heads a multiple of k's"
        )
    if tuple(query_positions.shape) != (q.size(2),) or tuple(key_positions.shape) != (k.size(2),):
        raise ValueError(
            f"{fn}: query_positions {tuple(query_positions.shape)} and key_positions "
            f"{tuple(key_positions.shape)} must be [{q.size(2)}] and [{k.size(2)}] (one position "
            "per query and per key of this rank)"
        )
    if key_mask is not None and tuple(key_mask.shape) != (k.size(0), k.size(2)):
        raise ValueError(
            f"{fn}: key_mask has shape {tuple(key_mask.shape)}; it must be [batch, held] = "
            f"{(k.size(0), k.size(2))} (this rank's keys)"
        )


def position_owner(position: int, seq_len: int, size: int) -> tuple:
    """``(rank, index)``: the CP rank among ``size`` holding ``position`` of a ``seq_len``-long
    sequence split as :func:`cp_positions` says, and its index among that rank's positions."""
    for rank in range(size):
        index = 0
        for _, start, n in cp_chunks(seq_len, size, rank):
            if start <= position < start + n:
                return rank, index + position - start
            index += n
    raise ValueError(f"position {position} is not in a sequence of {seq_len}")


def decode_owner(position: int, size: int) -> int:
    """The CP rank that keeps the keys and values of a token decoded at ``position``: round-robin
    (``position % size``), so each rank's share of the cache grows alike."""
    return position % size
