"""Which style each module of a model gets: "auto" for Llama/Qwen-style names, or a user's plan of
name patterns. The styles themselves are in :mod:`tp_ext.parallelize.styles`."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping

from torch import nn

__all__ = ["STYLES", "auto_plan", "resolve_plan", "is_norm"]

STYLES = ("colwise", "rowwise", "vocab", "sequence_parallel", "replicate")

# Llama/Qwen2 (and Mistral, Qwen3, ...) module names, by their last component.
_AUTO_COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_AUTO_ROWWISE = {"o_proj", "down_proj"}
_AUTO_VOCAB_LINEAR = {"lm_head"}


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def auto_plan(module: nn.Module, sequence_parallel: bool = False) -> dict[str, str]:
    """The split decided for every nn.Linear and nn.Embedding of a Llama/Qwen-style model:
    column for q/k/v/gate/up, row for o/down, vocabulary for embeddings and the LM head, replicate
    for anything else; with ``sequence_parallel``, every norm too."""
    plan = {}
    for name, child in module.named_modules():
        leaf = name.rpartition(".")[2]
        if sequence_parallel and is_norm(child):
            plan[name] = "sequence_parallel"
        elif isinstance(child, nn.Embedding):
            plan[name] = "vocab"
        elif isinstance(child, nn.Linear):
            if leaf in _AUTO_COLWISE:
                plan[name] = "colwise"
            elif leaf in _AUTO_ROWWISE:
                plan[name] = "rowwise"
            elif leaf in _AUTO_VOCAB_LINEAR:
                plan[name] = "vocab"
            else:
                plan[name] = "replicate"
    return plan


def resolve_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Exact module name -> style, from name patterns (fnmatch; the first matching pattern wins)."""
    names = [n for n, _ in module.named_modules() if n]
    decided: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; use one of {STYLES}")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            example = ", ".join(names[:6])
            raise ValueError(
                f"plan pattern {pattern!r} matches no module; names look like: {example}, ..."
            )
        for name in matched:
            decided.setdefault(name, style)
    return decided
