"""Context parallelism: attention over a sequence split along its positions over a CP group.

Ring attention (as Megatron-Core's and torchtitan's rings do it): each rank keeps the queries of
its two chunks of the sequence (:func:`tp_ext.sharding.cp_chunks`, the causal load balance: chunk
r and chunk 2C-1-r of 2C), and the keys and values travel round the ring, one rank's block per
step, sent on to the next rank while this rank computes with the block it holds. The partial
results over key blocks are merged by the online softmax (:func:`tp_ext.ops.attention_merge`,
a C++ op). Backward sends the blocks round again; each carries its key and value gradients,
which every rank adds to as the block passes, and one last hop hands them to their owner.

A block's attention is torch's flash attention on CPU; its backward, given the merged output and
log-sum-exp, is exactly that block's share of the gradients. Elsewhere it is computed with plain
matmuls in fp32 (fp64 for fp64), until a GPU pass gives it flash kernels there; so is a block
whose keys are limited (a padded batch's key mask, which travels with its block; a sliding
window that holds part of the block, where a block it holds none of is skipped) or whose scores
are soft-capped (the cap's slope inside its backward). A query that sees no key at all (left
padding) gets zeros and no gradient, as torch's attention gives a fully masked row.
"""

from __future__ import annotations

import math
import time
from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike, resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.sharding import cp_chunks, shard_sizes
from tp_ext.validation import check_int

__all__ = ["cp_group", "cp_positions", "ring_attention", "all_to_all_attention", "CP_MODES"]

# How attention runs over the CP group: "ring" (keys and values travel round the ring) or
# "all_to_all" (Ulysses: each rank gets every position of a share of the heads)
CP_MODES = ("ring", "all_to_all")
CP_TAG = "cp"  # what tp_ext.comm.track() files both modes' transfers under, forward and backward


def cp_group(group: GroupLike = None, parallel=None):
    """The CP group to use, resolved: ``parallel.cp_group`` when ``parallel`` is given, else
    ``group``, else the CP group of :func:`tp_ext.init_parallel` (the world group when it was not
    called)."""
    if parallel is not None:
        group = parallel.cp_group
    elif group is None:
        state = PROCESS.parallel
        group = None if state is None else state.cp_group
        if group is None:
            group = dist.group.WORLD if dist.is_initialized() else None
    return resolve_group(group)


def cp_positions(seq_len: int, parallel=None, group: GroupLike = None) -> torch.Tensor:
    """The sequence positions this rank of the CP group holds (``parallel.cp_group``, or
    ``group``; see :func:`cp_group`), in the order it holds them (a LongTensor): its two chunks
    of :func:`~tp_ext.sharding.cp_chunks`."""
    g = cp_group(group, parallel)
    return _positions(seq_len, g.size, g.rank)


def _positions(seq_len: int, size: int, rank: int) -> torch.Tensor:
    chunks = cp_chunks(seq_len, size, rank)
    return torch.cat([torch.arange(start, start + n) for _, start, n in chunks])


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    group: GroupLike = None,
    causal: bool = True,
    scale: Optional[float] = None,
    overlap: bool = True,
    *,
    key_mask: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the keys of the whole sequence, whose positions are
    split over the CP ``group`` as :func:`cp_positions` says (``seq_len``: the whole length).

    ``q`` [batch, heads, local, head_dim] and ``k``, ``v`` [batch, kv_heads, local, head_dim] hold
    this rank's positions (GQA: heads a multiple of kv_heads; keys and values travel with their
    own heads). Returns [batch, heads, local, head_dim], equal to the unsplit attention's rows
    at those positions; ``causal``: each query sees the keys at or before its position.
    ``group``: the CP group (default: :func:`cp_group`'s). ``overlap=False`` waits for each
    block to arrive before computing with the one it holds (the benchmark's baseline).
    ``key_mask`` [batch, local] (bool): which of this rank's keys may be attended to (False: a
    padded position, seen by no query of any rank); it travels round the ring with its keys. A
    query that sees no key at all gets zeros (as torch's attention gives a fully masked row).
    ``window`` (causal only): a query at position p sees the keys after p - window (a sliding
    window, as transformers' ``sliding_window``); each pair of chunks is skipped when the window
    holds none of it, masked when it holds part. ``softcap``: the scores soft-capped before the
    softmax, ``softcap * tanh(score / softcap)`` (Gemma 2's attention logit soft-capping),
    inside the online softmax and its backward."""
    g = cp_group(group)
    _check(q, k, v, seq_len, g, key_mask=key_mask, causal=causal, window=window, softcap=softcap)
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    limits = _Limits(window, None if softcap is None else float(softcap))
    with comm.tag(CP_TAG):
        return _RingAttention.apply(
            q, k, v, key_mask, seq_len, g, bool(causal), float(scale), bool(overlap), limits
        )


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    group: GroupLike = None,
    causal: bool = True,
    scale: Optional[float] = None,
    *,
    key_mask: Optional[torch.Tensor] = None,
    window: Optional[int] = None,
    softcap: Optional[float] = None,
) -> torch.Tensor:
    """:func:`ring_attention`'s result by all-to-all (DeepSpeed's Ulysses): each rank sends every
    other rank that rank's share of the heads at its own positions, attends over the whole
    sequence for its share of the heads, and sends the outputs back (one all-to-all each way,
    differentiable). Heads are split whole, unevenly where they do not divide; with grouped-
    query heads, whole KV groups per rank when the KV heads divide by the CP size, else the keys
    and values are repeated to every query head first (fewer KV heads than ranks).
    ``key_mask``: as :func:`ring_attention`'s; every rank's are all-gathered. ``window`` and
    ``softcap``: as :func:`ring_attention`'s (soft-capped scores are attended by matmuls)."""
    g = cp_group(group)
    _check(q, k, v, seq_len, g, "all_to_all_attention", key_mask, causal, window, softcap)
    limits = _Limits(window, None if softcap is None else float(softcap))
    with comm.tag(CP_TAG):
        return _all_to_all_attention(q, k, v, seq_len, g, causal, scale, key_mask, limits)


def _all_to_all_attention(
    q, k, v, seq_len, g, causal, scale, key_mask=None, limits=None
) -> torch.Tensor:
    limits = limits or _Limits()
    groups = q.size(1) // k.size(1)
    if k.size(1) % g.size:  # KV heads do not split whole: give every query head its own
        k, v, groups = _repeat(k, groups), _repeat(v, groups), 1
    kv_heads = shard_sizes(k.size(1), g.size)
    q_heads = [h * groups for h in kv_heads]
    lengths = [sum(n for _, _, n in cp_chunks(seq_len, g.size, r)) for r in range(g.size)]
    held = torch.cat(  # every rank's positions, in rank order: where each arriving row sits
        [_positions(seq_len, g.size, r) for r in range(g.size)]
    ).to(q.device)
    natural = torch.argsort(held)
    qh = _heads_of_every_position(q, q_heads, lengths, g, natural)
    kh = _heads_of_every_position(k, kv_heads, lengths, g, natural)
    vh = _heads_of_every_position(v, kv_heads, lengths, g, natural)
    mask = _window_mask(seq_len, limits.window, q.device)
    if key_mask is not None:  # every position's: [batch, 1, 1, seq_len], with causality
        every = comm.all_gather(key_mask.to(q.dtype), 1, lengths, g).index_select(1, natural)
        mask = every.bool()[:, None, None, :] & (
            torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril(
                0 if causal else seq_len
            )
            if mask is None
            else mask
        )
    if limits.softcap is not None:
        if mask is None and causal:
            mask = torch.ones(seq_len, seq_len, dtype=torch.bool, device=q.device).tril()
        out = _capped_attention(qh, kh, vh, mask, scale, limits.softcap, groups)
    else:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask, is_causal=causal and mask is None, scale=scale,
            enable_gqa=groups > 1,
        )  # fmt: skip
    return _positions_of_every_head(out, q_heads, lengths, g, held)


def _capped_attention(q, k, v, mask, scale, softcap: float, groups: int) -> torch.Tensor:
    """Attention with soft-capped scores (which torch's kernels do not take), by matmuls in fp32
    (fp64 for fp64), differentiated by autograd; ``mask`` (None: every key) as SDPA's; a query
    that sees no key gets zeros."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.size(-1))
    acc = _acc(q.dtype)
    k, v = _repeat(k, groups).to(acc), _repeat(v, groups).to(acc)
    with torch.autocast(q.device.type, enabled=False):
        scores = softcap * torch.tanh((q.to(acc) @ k.transpose(-1, -2)) * scale / softcap)
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        return (torch._safe_softmax(scores, -1) @ v).to(q.dtype)


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all_single`` whose backward (the gradients sent back the same way) is filed
    under the "cp" tag too, whatever the tag is when autograd runs it."""

    @staticmethod
    def forward(ctx, x, send, recv, g):
        ctx.send, ctx.recv, ctx.g = send, recv, g
        return comm.all_to_all_single(x, send, recv, g)

    @staticmethod
    def backward(ctx, grad):
        with comm.tag(CP_TAG):
            return (
                comm.all_to_all_single(grad.contiguous(), ctx.recv, ctx.send, ctx.g),
                None,
                None,
                None,
            )


def _heads_of_every_position(t, heads, lengths, g, natural) -> torch.Tensor:
    """[batch, heads, my positions, dim] -> [batch, my heads, every position, dim]."""
    batch, dim, me = t.size(0), t.size(3), g.rank
    starts = [sum(heads[:j]) for j in range(g.size)]
    send = torch.cat([t[:, starts[j] : starts[j] + heads[j]].reshape(-1) for j in range(g.size)])
    per_head_row = batch * dim
    got = _AllToAll.apply(
        send,
        [heads[j] * per_head_row * t.size(2) for j in range(g.size)],
        [heads[me] * per_head_row * n for n in lengths],
        g,
    )
    pieces = got.split([heads[me] * per_head_row * n for n in lengths])
    rows = torch.cat([p.view(batch, heads[me], n, dim) for p, n in zip(pieces, lengths)], dim=2)
    return rows.index_select(2, natural)


def _positions_of_every_head(out, heads, lengths, g, held) -> torch.Tensor:
    """The inverse: [batch, my heads, every position, dim] -> [batch, heads, my positions, dim]."""
    batch, dim, me = out.size(0), out.size(3), g.rank
    ordered = out.index_select(2, held)  # rank 0's positions, then rank 1's, ...
    send = torch.cat([p.reshape(-1) for p in ordered.split(lengths, dim=2)])
    per_head_row = batch * dim
    got = _AllToAll.apply(
        send,
        [heads[me] * per_head_row * n for n in lengths],
        [heads[j] * per_head_row * lengths[me] for j in range(g.size)],
        g,
    )
    pieces = got.split([heads[j] * per_head_row * lengths[me] for j in range(g.size)])
    return torch.cat(
        [p.view(batch, heads[j], lengths[me], dim) for j, p in enumerate(pieces)], dim=1
    )


def context_attention(mode: str, q, k, v, seq_len: int, group=None) -> torch.Tensor:
    """Causal attention over the CP group by ``mode`` (one of :data:`CP_MODES`)."""
    if mode == "ring":
        return ring_attention(q, k, v, seq_len, group)
    if mode == "all_to_all":
        return all_to_all_attention(q, k, v, seq_len, group)
    raise ValueError(f"cp_mode must be one of {list(CP_MODES)}, got {mode!r}")


def _window_mask(seq_len: int, window: Optional[int], device) -> Optional[torch.Tensor]:
    """[seq, seq]: whom each query sees under causality and a ``window`` (None: no window)."""
    if window is None:
        return None
    pos = torch.arange(seq_len, device=device)
    back = pos[:, None] - pos[None, :]
    return (back >= 0) & (back < window)


class _Limits(NamedTuple):
    """What limits or bends the scores beyond causality: a sliding ``window`` (positions), the
    ``softcap`` of soft-capped scores."""

    window: Optional[int] = None
    softcap: Optional[float] = None


def _check(
    q,
    k,
    v,
    seq_len,
    g,
    fn: str = "ring_attention",
    key_mask=None,
    causal=True,
    window=None,
    softcap=None,
) -> None:
    check_int("seq_len", seq_len, 0)
    local = sum(n for _, _, n in cp_chunks(seq_len, g.size, g.rank))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.size(2) != local:
            raise ValueError(
                f"{fn}: {name} has shape {tuple(t.shape)}; it must be [batch, heads, "
                f"{local}, head_dim]: this rank's {local} positions of seq_len={seq_len} over "
                f"{g.size} CP ranks (tp_ext.cp_positions)"
            )
    if k.shape != v.shape or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} must "
            "share batch and head_dim, and k and v their shape"
        )
    if q.size(1) % k.size(1):
        raise ValueError(
            f"{fn}: {q.size(1)} query heads are not a multiple of {k.size(1)} key/value "
            "heads (grouped-query attention needs whole groups)"
        )
    if window is not None and (not causal or isinstance(window, bool) or window < 1):
        raise ValueError(
            f"{fn}: window={window!r}: a sliding window is a number of positions >= 1, of a "
            "causal attention"
        )
    if softcap is not None and (isinstance(softcap, bool) or not softcap > 0):
        raise ValueError(f"{fn}: softcap={softcap!r}: the cap must be a number > 0")
    if key_mask is not None and (
        key_mask.dtype != torch.bool or tuple(key_mask.shape) != (k.size(0), k.size(2))
    ):
        raise ValueError(
            f"{fn}: key_mask is {key_mask.dtype} of shape {tuple(key_mask.shape)}; it must be "
            f"bool [batch, local] = {(k.size(0), k.size(2))} (this rank's keys)"
        )


class _Pair(NamedTuple):
    """One of this rank's query chunks against one chunk of a held key block: local rows
    (``q_off``, ``qn``; ``k_off``, ``kn``), the chunks' first positions in the sequence
    (``q_start``, ``k_start``), and whether it is the causal diagonal (the same chunk)."""

    q_off: int
    qn: int
    k_off: int
    kn: int
    q_start: int
    k_start: int
    diagonal: bool


def _pairs(seq_len: int, size: int, rank: int, held: int, causal: bool, window=None) -> list:
    """Which of this rank's query chunks attend to which chunks of rank ``held``'s block (a
    :class:`_Pair` each); a chunk sees the chunks before it whole and its own causally (the
    chunks after it not at all), and under a ``window`` not the chunks wholly before it."""
    found, q_off = [], 0
    theirs = cp_chunks(seq_len, size, held)
    for qc, q_start, qn in cp_chunks(seq_len, size, rank):
        k_off = 0
        for kc, k_start, kn in theirs:
            seen = window is None or q_start - (k_start + kn - 1) < window  # the nearest pair
            if qn and kn and (not causal or kc <= qc) and seen:
                found.append(_Pair(q_off, qn, k_off, kn, q_start, k_start, causal and kc == qc))
            k_off += kn
        q_off += qn
    return found


def _allowed(pair: _Pair, key_mask, window: Optional[int], device) -> Optional[torch.Tensor]:
    """Which keys of ``pair``'s block each query may see beyond causality (None: all): inside
    the ``window`` (where the farthest pair is outside it), and the held block's key mask;
    broadcast to [batch, 1, qn, kn]."""
    allowed = None
    if window is not None and pair.q_start + pair.qn - 1 - pair.k_start >= window:
        q = torch.arange(pair.q_start, pair.q_start + pair.qn, device=device)
        k = torch.arange(pair.k_start, pair.k_start + pair.kn, device=device)
        allowed = (q[:, None] - k[None, :]) < window
    if key_mask is not None:
        keys = key_mask[:, None, None, pair.k_off : pair.k_off + pair.kn]
        allowed = keys if allowed is None else keys & allowed
    return allowed


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _repeat(t: torch.Tensor, groups: int) -> torch.Tensor:
    return t if groups == 1 else t.repeat_interleave(groups, dim=1)


def _fold(t: torch.Tensor, groups: int) -> torch.Tensor:
    """A gradient over repeated key/value heads summed back onto each head."""
    return t if groups == 1 else t.unflatten(1, (-1, groups)).sum(2)


def _block(q, k, v, diagonal: bool, scale: float, allowed=None, softcap=None):
    """(out, lse) of q over one key block: flash attention on CPU, matmuls elsewhere and where
    ``allowed`` (a bool mask broadcast to [batch, heads, q, k]) limits the keys or ``softcap``
    caps the scores."""
    if q.device.type == "cpu" and allowed is None and softcap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, diagonal, scale=scale
        )
        return out, lse
    with torch.autocast(q.device.type, enabled=False):  # fp32 scores, as backward recomputes
        return _block_by_matmuls(q, k, v, diagonal, scale, allowed, softcap)


def _block_by_matmuls(q, k, v, diagonal: bool, scale: float, allowed=None, softcap=None):
    scores, _ = _scores(q, k, diagonal, scale, allowed, softcap)
    lse = torch.logsumexp(scores, -1)
    out = torch.exp(scores - _finite(lse).unsqueeze(-1)) @ v.to(scores.dtype)
    return out.to(q.dtype), lse


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with a row that sees no key (-inf) at 0: its probabilities exp(-inf - 0) are 0."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _scores(q, k, diagonal: bool, scale: float, allowed=None, softcap=None) -> tuple:
    """(scores, slope): the block's scores in fp32 (fp64 for fp64), soft-capped by ``softcap``
    (``softcap * tanh(s / softcap)``), -inf where a key is not seen; ``slope``: the capping's
    derivative, 1 - tanh^2 (None without a cap)."""
    acc = _acc(q.dtype)
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    slope = None
    if softcap is not None:
        tanh = torch.tanh(scores / softcap)
        scores, slope = softcap * tanh, 1 - tanh * tanh
    if diagonal:
        n = scores.size(-1)
        scores = scores.masked_fill(
            torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores, slope


def _block_backward(
    grad, q, k, v, out, lse, diagonal: bool, scale: float, allowed=None, softcap=None
):
    """(dq, dk, dv): one key block's share of the gradients, given the attention's merged output
    and log-sum-exp over every block."""
    if q.device.type == "cpu" and allowed is None and softcap is None:
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad, q, k, v, out, lse, 0.0, diagonal, scale=scale
        )
    with torch.autocast(q.device.type, enabled=False):  # the forward's fp32 scores again
        return _block_backward_by_matmuls(
            grad, q, k, v, out, lse, diagonal, scale, allowed, softcap
        )


def _block_backward_by_matmuls(
    grad, q, k, v, out, lse, diagonal: bool, scale: float, allowed=None, softcap=None
):
    acc = _acc(q.dtype)
    scores, slope = _scores(q, k, diagonal, scale, allowed, softcap)
    probs = torch.exp(scores - _finite(lse.to(acc)).unsqueeze(-1))
    grad, out, v_acc = grad.to(acc), out.to(acc), v.to(acc)
    dv = probs.transpose(-1, -2) @ grad
    ds = probs * (grad @ v_acc.transpose(-1, -2) - (grad * out).sum(-1, keepdim=True))
    if slope is not None:  # through the cap: d(c tanh(s / c)) = (1 - tanh^2) ds
        ds = ds * slope
    dq = (ds @ k.to(acc)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc)) * scale
    return dq, dk, dv


class _Shift:
    """Tensors sent to the next rank of the ring while the previous rank's arrive (one packed
    buffer each way, started now, taken by :meth:`finish`; ``wait``: done before returning).
    ``tp_ext.comm.track()`` counts the bytes sent (collective "send_recv", op ``op``), and the
    time from the start to the end of the wait."""

    def __init__(self, tensors, incoming_shapes, g, op: str, wait: bool = False) -> None:
        self.shapes, self.op, self.started = incoming_shapes, op, time.perf_counter()
        send = torch.cat([t.reshape(-1) for t in tensors])
        self.recv = send.new_empty(sum(math.prod(s) for s in incoming_shapes))
        group = g.group
        nxt = dist.get_global_rank(group, (g.rank + 1) % g.size)
        prev = dist.get_global_rank(group, (g.rank - 1) % g.size)
        self.send = send  # alive until the transfer is done
        self.work = dist.batch_isend_irecv(
            [
                dist.P2POp(dist.isend, send, nxt, group),
                dist.P2POp(dist.irecv, self.recv, prev, group),
            ]
        )
        if wait:
            self._wait()

    def _wait(self) -> None:
        if not self.work:
            return
        for w in self.work:
            w.wait()
        self.work = []
        sent = self.send.numel() * self.send.element_size()
        comm.record_transfer(self.op, "send_recv", sent, time.perf_counter() - self.started)

    def finish(self) -> list[torch.Tensor]:
        self._wait()
        out, at = [], 0
        for s in self.shapes:
            n = math.prod(s)
            out.append(self.recv[at : at + n].view(s))
            at += n
        return out


def _block_shape(t: torch.Tensor, seq_len: int, size: int, held: int) -> tuple:
    rows = sum(n for _, _, n in cp_chunks(seq_len, size, held))
    return (t.size(0), t.size(1), rows, t.size(3))


def _travelling(k, v, key_mask) -> tuple:
    """What a block carries round the ring: its keys, values and (when given) key mask, the
    mask in the keys' dtype so that one buffer holds all three."""
    block = (k.detach(), v.detach())
    return block if key_mask is None else (*block, key_mask.to(k.dtype))


def _shapes(k, seq_len: int, size: int, held: int, masked: bool) -> list:
    shape = _block_shape(k, seq_len, size, held)
    return [shape, shape] + ([shape[:1] + shape[2:3]] if masked else [])


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, key_mask, seq_len, g, causal, scale, overlap, limits):
        size, rank = g.size, g.rank
        groups = q.size(1) // k.size(1)
        masked = key_mask is not None
        out = torch.zeros_like(q)
        lse = torch.full(q.shape[:-1], float("-inf"), dtype=_acc(q.dtype), device=q.device)
        block = _travelling(k, v, key_mask)
        masks = {}  # each held block's key mask, kept for backward (the blocks travel again)
        for step in range(size):
            held = (rank - step) % size
            shift = None
            if step + 1 < size:  # the next block travels while this one is computed
                shapes = _shapes(k, seq_len, size, (held - 1) % size, masked)
                shift = _Shift(block, shapes, g, "ring_attention", wait=not overlap)
            kr, vr = _repeat(block[0], groups), _repeat(block[1], groups)
            masks[held] = block[2].bool() if masked else None
            for pair in _pairs(seq_len, size, rank, held, causal, limits.window):
                rows = slice(pair.q_off, pair.q_off + pair.qn)
                keys = slice(pair.k_off, pair.k_off + pair.kn)
                o_b, l_b = _block(
                    q[:, :, rows].contiguous(),
                    kr[:, :, keys].contiguous(),
                    vr[:, :, keys].contiguous(),
                    pair.diagonal,
                    scale,
                    _allowed(pair, masks[held], limits.window, q.device),
                    limits.softcap,
                )
                out[:, :, rows], lse[..., rows] = ops.attention_merge(
                    out[:, :, rows], lse[..., rows], o_b, l_b.to(lse.dtype)
                )
            if shift is not None:
                block = tuple(shift.finish())
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.seq_len, ctx.g, ctx.causal, ctx.scale = seq_len, g, causal, scale
        ctx.overlap, ctx.masks, ctx.limits = overlap, masks, limits
        return out

    @staticmethod
    def backward(ctx, grad):
        with comm.tag(CP_TAG):
            return _RingAttention._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        seq_len, g, causal, scale, wait = ctx.seq_len, ctx.g, ctx.causal, ctx.scale, not ctx.overlap
        size, rank = g.size, g.rank
        groups = q.size(1) // k.size(1)
        acc = _acc(q.dtype)
        grad = grad.contiguous()
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = (k, v)
        travelling = None  # the key/value gradients of the block held next, on their way here
        for step in range(size):
            held = (rank - step) % size
            shift = None
            if step + 1 < size:
                shape = _block_shape(k, seq_len, size, (held - 1) % size)
                shift = _Shift(kv, [shape, shape], g, "ring_attention_backward", wait=wait)
            kr, vr = _repeat(kv[0], groups), _repeat(kv[1], groups)
            dk = torch.zeros(kr.shape, dtype=acc, device=q.device)
            dv = torch.zeros(vr.shape, dtype=acc, device=q.device)
            for pair in _pairs(seq_len, size, rank, held, causal, ctx.limits.window):
                rows = slice(pair.q_off, pair.q_off + pair.qn)
                keys = slice(pair.k_off, pair.k_off + pair.kn)
                gq, gk, gv = _block_backward(
                    grad[:, :, rows].contiguous(),
                    q[:, :, rows].contiguous(),
                    kr[:, :, keys].contiguous(),
                    vr[:, :, keys].contiguous(),
                    out[:, :, rows].contiguous(),
                    lse[..., rows].contiguous(),
                    pair.diagonal,
                    scale,
                    _allowed(pair, ctx.masks[held], ctx.limits.window, q.device),
                    ctx.limits.softcap,
                )
                dq[:, :, rows] += gq
                dk[:, :, keys] += gk
                dv[:, :, keys] += gv
            dk, dv = _fold(dk, groups), _fold(dv, groups)
            if travelling is not None:  # what the ranks before added to this block
                got_k, got_v = travelling.finish()
                dk, dv = dk + got_k, dv + got_v
            if shift is not None:
                kv = tuple(shift.finish())
            # on to the rank that holds this block next (after the last step: its owner); in
            # comes the block held next here (after the last step: this rank's own)
            if size > 1:
                incoming = (held - 1) % size if step + 1 < size else rank
                shape = _block_shape(k, seq_len, size, incoming)
                travelling = _Shift((dk, dv), [shape, shape], g, "ring_attention_backward", wait)
        if size > 1:
            dk, dv = travelling.finish()
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)) + (None,) * 7
