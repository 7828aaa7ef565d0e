"""shard_balance: what each rank of a group holds (parameters, bytes) and, when given a step to
run, its measured peak memory; ranks more than 10% above the mean are flagged."""

from __future__ import annotations

import dataclasses
import json
from typing import Callable, Optional

import torch
from torch import nn

from tp_ext.debug.memory import PeakMemory
from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike, resolve_group

__all__ = ["shard_balance", "BalanceReport", "RankShare"]

TOLERANCE = 0.10  # a rank this far above the mean is flagged


@dataclasses.dataclass(frozen=True)
class RankShare:
    rank: int
    parameters: int
    bytes: int
    peak_bytes: Optional[int]  # None: no step was run


@dataclasses.dataclass
class BalanceReport:
    ranks: list[RankShare]
    flagged: list[str]  # "rank 2: parameters 12% above the mean", one per rank and measure

    @property
    def balanced(self) -> bool:
        return not self.flagged

    def table(self) -> str:
        lines = [f"{'rank':>4} {'parameters':>14} {'bytes':>16} {'peak bytes':>16}"]
        for r in self.ranks:
            peak = "-" if r.peak_bytes is None else f"{r.peak_bytes:,}"
            lines.append(f"{r.rank:>4} {r.parameters:>14,} {r.bytes:>16,} {peak:>16}")
        lines += [f"! {f}" for f in self.flagged] or [
            "balanced (every rank within 10% of the mean)"
        ]
        return "\n".join(lines)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _peak(model: nn.Module, step: Callable[[], object]) -> int:
    device = next(model.parameters()).device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    with PeakMemory(model.parameters()) as mem:  # CPU: torch keeps no allocator statistics
        step()
    return mem.peak


def shard_balance(
    model: nn.Module, step: Optional[Callable[[], object]] = None, group: GroupLike = None
) -> BalanceReport:
    """Per rank of ``group`` (default: tp_ext's TP group): the parameters and bytes ``model``
    holds there and, if ``step`` is given (e.g. a forward and backward), the peak memory while it
    runs (CUDA: the allocator's peak; CPU: the peak of live tensor storages). Every rank of the
    group calls it."""
    params = [_local(p) for p in model.parameters()]
    mine = {
        "parameters": sum(p.numel() for p in params),
        "bytes": sum(p.numel() * p.element_size() for p in params),
        "peak_bytes": None if step is None else _peak(model, step),
    }
    g = resolve_group(group)
    rows = [json.loads(text) for text in comm.all_gather_text(json.dumps(mine), g)]
    ranks = [RankShare(r, **row) for r, row in enumerate(rows)]
    flagged = []
    for measure in ("parameters", "bytes", "peak_bytes"):
        values = [getattr(r, measure) for r in ranks]
        if None in values or not values:
            continue
        mean = sum(values) / len(values)
        for r, v in zip(ranks, values):
            if mean > 0 and v > (1 + TOLERANCE) * mean:
                flagged.append(
                    f"rank {r.rank}: {measure.replace('_', ' ')} {v:,} is "
                    f"{(v / mean - 1) * 100:.0f}% above the mean {mean:,.0f}"
                )
    return BalanceReport(ranks, flagged)
