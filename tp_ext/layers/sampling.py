"""Choosing the next token from vocabulary-parallel logits (a ``ParallelLMHead`` left sharded)
without gathering them: greedy (:func:`vocab_parallel_argmax`) or sampled with temperature, top-k
and top-p (:func:`vocab_parallel_sample`). Every rank of the TP group gets the same token. The
token is a function of the full logits and the draw alone, so the same logits and draw give the
same token at any TP size, except where the draw falls within rounding of the boundary between
two tokens (the sums are split differently across ranks).

The sampling rule (what a single-process reference applies to the full logits ``l``):

1. ``s = l.to(acc) / temperature`` (``acc``: float64 for float64 logits, else float32);
2. top-k keeps ``s >= tau_k``, the k-th largest ``s`` (ties at it kept); a token whose ``s``
   is -inf is never kept;
3. top-p keeps, of those, the largest ``s`` down to the first whose cumulative probability
   (``exp(s - max) / sum``, descending order) reaches ``top_p``, and every ``s`` equal to it;
4. with ``u`` uniform in [0, 1), the token is the first kept index ``i`` (vocabulary order)
   whose running sum of ``exp(s - max)`` over kept indices ``<= i`` exceeds ``u`` times their
   total (the inverse of the kept tokens' distribution, in vocabulary order).

Per token the TP ranks exchange their top candidates (all-gather of ``[batch, C]``: top-k's k,
or for top-p alone a first guess of 64 grown until the nucleus lies inside the candidates that
are certain), each rank's kept mass (``[batch, 1]``) and the chosen index (``[batch]``): the
logits never travel. The local pieces are C++ ops (``tp_ext::sampling_*``, docs/ops.md).
"""

from __future__ import annotations

from typing import Optional

import torch

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import resolve_group
from tp_ext.sharding import shard_offsets, shard_sizes

__all__ = ["vocab_parallel_argmax", "vocab_parallel_sample", "check_sampling"]

# top-p without top-k: the first number of candidates each rank sends (grown 4x while the
# nucleus reaches past the candidates whose order is certain)
TOP_P_CANDIDATES = 64


def check_sampling(temperature: float, top_k: Optional[int], top_p: Optional[float]) -> None:
    """A clear error for a bad sampling argument (the same on every rank)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ValueError(f"temperature must be a number > 0, got {temperature!r}")
    if not 1e-5 <= temperature <= 1e5:  # beyond, fp32 logits over it overflow or vanish
        raise ValueError(
            f"temperature must be in [1e-5, 1e5] (1.0 leaves the logits as they are; for greedy "
            f"decoding do not sample), got {temperature!r}"
        )
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be an int >= 1 (or None: no top-k), got {top_k!r}")
    if top_p is not None and (
        isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1
    ):
        raise ValueError(f"top_p must be in (0, 1] (or None: no top-p), got {top_p!r}")


def _shard(logits_shard: torch.Tensor, vocab_size: int, group, what: str):
    """``(group, this rank's first vocabulary index, every rank's shard size)``."""
    g = resolve_group(group)
    sizes = shard_sizes(vocab_size, g.size)
    if logits_shard.dim() != 2 or logits_shard.size(1) != sizes[g.rank]:
        raise ValueError(
            f"{what}: logits_shard must be [batch, {sizes[g.rank]}] (rank {g.rank}'s shard of a "
            f"{vocab_size}-token vocabulary over {g.size} ranks), got {tuple(logits_shard.shape)}"
        )
    return g, shard_offsets(vocab_size, g.size)[g.rank], sizes


def vocab_parallel_argmax(
    logits_shard: torch.Tensor, vocab_size: int, tp_group=None
) -> torch.Tensor:
    """``full_logits.argmax(-1)`` ([batch] int64, the first index of the maximum) from this
    rank's shard ``[batch, V_r]``: one all-gather of each rank's maximum and its index."""
    g, offset, _ = _shard(logits_shard, vocab_size, tp_group, "vocab_parallel_argmax")
    if logits_shard.size(1) == 0:  # more ranks than tokens: this rank offers nothing
        best = torch.full((logits_shard.size(0), 2), float("-inf"), dtype=torch.float64)
        best = best.to(logits_shard.device)
    else:
        value, index = logits_shard.max(dim=-1)  # the first maximum of this shard
        best = torch.stack([value.double(), (index + offset).double()], dim=-1)
    everyone = comm.all_gather(best.unsqueeze(1), dim=1, group=g)  # [batch, ranks, 2]
    # the first rank with the largest value holds the first maximum (shards in vocabulary order)
    rank = everyone[..., 0].argmax(dim=1, keepdim=True)
    return everyone[..., 1].gather(1, rank).squeeze(1).long()


def vocab_parallel_sample(
    logits_shard: torch.Tensor,
    uniform: torch.Tensor,
    vocab_size: int,
    temperature: float = 1.0,
    top_k: Optional[int] = None,
    top_p: Optional[float] = None,
    tp_group=None,
) -> torch.Tensor:
    """One token per row ([batch] int64, global vocabulary indices) drawn by the module's rule
    from this rank's shard ``[batch, V_r]`` of the logits; ``uniform`` ([batch], in [0, 1), the
    same on every rank) is each row's draw."""
    check_sampling(temperature, top_k, top_p)
    g, offset, sizes = _shard(logits_shard, vocab_size, tp_group, "vocab_parallel_sample")
    batch = logits_shard.size(0)
    if tuple(uniform.shape) != (batch,):
        raise ValueError(f"uniform must be [batch] = [{batch}], got {tuple(uniform.shape)}")
    temperature = float(temperature)
    acc = torch.float64 if logits_shard.dtype == torch.float64 else torch.float32
    k = 0 if top_k is None else min(top_k, vocab_size)
    p = 1.0 if top_p is None else float(top_p)
    largest = max(sizes)
    count = k if k else (min(TOP_P_CANDIDATES, largest) if p < 1 else 1)
    while True:
        values, _ = ops.sampling_candidates(logits_shard, temperature, max(count, 1))
        merged = comm.all_gather(values, dim=1, group=g)  # [batch, ranks x count]
        row_max = merged.max(dim=1).values
        # the leading sorted candidates certain to be the vocabulary's largest; all of them
        # (the op's sign that the candidates are the whole vocabulary) only when every rank
        # sent every token it holds
        whole = count >= largest
        exact = merged.size(1) if whole else min(count, merged.size(1) - 1)
        threshold, _ = ops.sampling_threshold(merged, k, 1.0, row_max, row_max, exact)
        if p >= 1.0:
            break
        total = _rank_masses(logits_shard, temperature, threshold, row_max, g).sum(dim=1)
        threshold, resolved = ops.sampling_threshold(merged, k, p, total, row_max, exact)
        # the same on every rank: computed from gathered tensors only
        if bool(resolved.all()) or count >= largest:
            break
        count = min(count * 4, largest)
    masses = _rank_masses(logits_shard, temperature, threshold, row_max, g)  # [batch, ranks]
    before = masses.cumsum(dim=1) - masses
    target = uniform.to(acc) * masses.sum(dim=1)
    # the rank whose interval holds the target: the first with before + mass > target, else
    # (rounding put the target at the very end) the last rank with any mass
    holds = ((before + masses) > target.unsqueeze(1)) & (masses > 0)
    last = (masses > 0).long() * torch.arange(1, masses.size(1) + 1, device=masses.device)
    owner = torch.where(holds.any(dim=1), holds.long().argmax(dim=1), last.argmax(dim=1))
    local = ops.sampling_pick(
        logits_shard, temperature, threshold, row_max, target - before[:, g.rank]
    )
    mine = (owner == g.rank) & (local >= 0)
    index = torch.where(mine, local + offset, torch.full_like(local, -1))
    return comm.all_reduce(index, "max", group=g)


def _rank_masses(logits_shard, temperature, threshold, row_max, group) -> torch.Tensor:
    """``[batch, ranks]``: each rank's sum of ``exp(s - max)`` over its kept tokens, gathered
    (summed in rank order by the caller: the same bits on every rank, as an all-reduce's need
    not be)."""
    mass = ops.sampling_kept_mass(logits_shard, temperature, threshold, row_max)
    return comm.all_gather(mass.unsqueeze(1), dim=1, group=group)
