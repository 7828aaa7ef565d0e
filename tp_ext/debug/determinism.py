"""check_determinism: forward twice and compare every module's output, run against run and, for the
outputs that must be replicated, rank against rank of the TP group; report the first that differs.

Which outputs are replicated over the TP ranks: everything but what a layer shards on purpose:
column-parallel outputs without ``gather_output`` (heads, gate/up units), the LM head's local
logits, and the sequence shards of sequence parallelism (every module that runs it, and every
container of one but the model itself, unless the model runs it). A ``replicated(name,
module)`` predicate overrides the rule.
Ranks are compared by a SHA-256 of each output's bytes (one small all-gather of text per
forward), run-to-run bitwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
from typing import Callable, Optional

import torch
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike, resolve_group

__all__ = ["check_determinism", "DeterminismReport"]


@dataclasses.dataclass
class DeterminismReport:
    """``ok``: no difference found. ``first_run_difference``: the first module (forward order)
    whose output differed between the two forwards on this rank, with the largest difference;
    ``first_rank_difference``: the first replicated output whose bytes differ between TP ranks,
    with the ranks that agree with rank 0 and those that do not. ``compared_runs`` /
    ``compared_ranks``: how many outputs each check covered."""

    ok: bool
    first_run_difference: Optional[str]
    first_rank_difference: Optional[str]
    compared_runs: int
    compared_ranks: int

    def __str__(self) -> str:
        if self.ok:
            return (
                f"deterministic: {self.compared_runs} module outputs equal run to run, "
                f"{self.compared_ranks} replicated outputs equal on every TP rank"
            )
        lines = ["NOT deterministic:"]
        if self.first_run_difference:
            lines.append(f"  run to run: {self.first_run_difference}")
        if self.first_rank_difference:
            lines.append(f"  across TP ranks: {self.first_rank_difference}")
        return "\n".join(lines)


def _sharded_on_purpose(module: nn.Module) -> bool:
    if getattr(module, "sequence_parallel", False):
        return True
    if hasattr(module, "gather_output"):  # column-parallel family (the LM head included)
        return not module.gather_output
    return False


def _default_replicated(model: nn.Module) -> Callable[[str, nn.Module], bool]:
    sp_prefixes = [
        name for name, m in model.named_modules() if name and getattr(m, "sequence_parallel", False)
    ]

    def replicated(name: str, module: nn.Module) -> bool:
        if _sharded_on_purpose(module):
            return False
        if not name:
            return True  # the model's own output (full logits unless asked otherwise)
        # a container of a sequence-parallel module passes its sequence shards on
        return not any(p == name or p.startswith(name + ".") for p in sp_prefixes)

    return replicated


def _tensors(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, (tuple, list)):
        return [t for o in output for t in _tensors(o)]
    if isinstance(output, dict):
        return [t for o in output.values() for t in _tensors(o)]
    logits = getattr(output, "logits", None)  # transformers' ModelOutput and friends
    return [logits] if isinstance(logits, torch.Tensor) else []


def _digest(t: torch.Tensor) -> str:
    data = t.detach().reshape(-1).contiguous().cpu()  # (a 0-d tensor has no byte view)
    return hashlib.sha256(data.view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


@contextlib.contextmanager
def _recording(model: nn.Module, into: list):
    handles = [
        m.register_forward_hook(
            lambda mod, args, out, name=name: into.append(
                (name, mod, [t.detach().clone() for t in _tensors(out)])
            )
        )
        for name, m in model.named_modules()
    ]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def check_determinism(
    model: nn.Module,
    inputs,
    group: GroupLike = None,
    replicated: Optional[Callable[[str, nn.Module], bool]] = None,
) -> DeterminismReport:
    """Forward ``model(*inputs)`` (a tensor, a tuple of arguments or a dict of keyword arguments)
    twice from the same random state and compare every module's outputs (see the module doc).
    ``group``: the TP group (default: tp_ext's). Every rank of the group calls it."""
    if isinstance(inputs, dict):
        call = lambda: model(**inputs)  # noqa: E731
    elif isinstance(inputs, (tuple, list)):
        call = lambda: model(*inputs)  # noqa: E731
    else:
        call = lambda: model(inputs)  # noqa: E731
    runs: list[list] = [[], []]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    for record in runs:
        torch.set_rng_state(cpu_rng)  # dropout draws the same numbers both times
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        with _recording(model, record):
            call()
    first, second = runs
    if [n for n, _, _ in first] != [n for n, _, _ in second]:
        raise RuntimeError(
            "check_determinism: the two forwards ran different modules (data-dependent control "
            "flow); the check needs the same module order"
        )
    run_diff, compared_runs = None, 0
    for (name, _, a), (_, _, b) in zip(first, second):
        compared_runs += len(a)
        for k, (x, y) in enumerate(zip(a, b)):
            if run_diff is None and not torch.equal(x, y):
                worst = (x.double() - y.double()).abs().max().item() if x.is_floating_point() else 0
                run_diff = f"{name or '<model>'} output {k}: max |difference| {worst:.3g}"
    is_replicated = replicated or _default_replicated(model)
    g = resolve_group(group)
    mine = [
        f"{name or '<model>'}#{k}:{tuple(t.shape)}:{_digest(t)}"
        for name, module, outs in first
        if is_replicated(name, module)
        for k, t in enumerate(outs)
    ]
    rank_diff = None
    if g.size > 1:
        everyone = [text.split("\n") for text in comm.all_gather_text("\n".join(mine), g)]
        for i, entry in enumerate(mine):
            label = entry.rsplit(":", 2)[0]
            differ = [r for r, rows in enumerate(everyone) if i >= len(rows) or rows[i] != entry]
            if differ:
                rank_diff = f"{label}: ranks {differ} differ from rank {g.rank}"
                break
    return DeterminismReport(
        ok=run_diff is None and rank_diff is None,
        first_run_difference=run_diff,
        first_rank_difference=rank_diff,
        compared_runs=compared_runs,
        compared_ranks=len(mine),
    )
