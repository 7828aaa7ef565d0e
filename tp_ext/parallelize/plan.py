"""Which style each module of a model gets: "auto" for Llama/Qwen-style names, or a user's plan of
name patterns. The styles themselves are in :mod:`tp_ext.parallelize.styles`."""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Optional

from torch import nn

from tp_ext.parallelize.styles import attention_heads, is_conv1d, is_fused_experts

__all__ = ["STYLES", "auto_plan", "resolve_plan", "is_norm"]

STYLES = ("colwise", "rowwise", "vocab", "experts", "sequence_parallel", "replicate")

# Module names by their last component: Llama/Qwen/Mistral/Gemma, Phi-3 (gate_up_proj), OPT
# (fc1/fc2), Starcoder2 (c_fc/c_proj), GPT-NeoX and Falcon (dense_h_to_4h/dense_4h_to_h,
# embed_out). Attention projections are taken from the attention module itself (styles).
_AUTO_COLWISE = {
    "q_proj",
    "k_proj",
    "v_proj",
    "gate_proj",
    "up_proj",
    "gate_up_proj",
    "fc1",
    "c_fc",
    "dense_h_to_4h",
}
_AUTO_ROWWISE = {"o_proj", "down_proj", "fc2", "c_proj", "dense_4h_to_h"}
_AUTO_VOCAB_LINEAR = {"lm_head", "embed_out"}


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def is_plain(module: nn.Module, base: type) -> bool:
    """``module`` computes exactly what ``base`` computes (its class or a subclass that does not
    override forward): only then may auto swap it for a tp_ext layer."""
    return isinstance(module, base) and type(module).forward is base.forward


def is_linear(module: nn.Module) -> bool:
    """A plain nn.Linear, Falcon's FalconLinear (its forward is ``x @ W.T + b`` too, with the
    bias added separately) or GPT-2's Conv1D (the same with the weight stored transposed)."""
    return (
        is_plain(module, nn.Linear)
        or (isinstance(module, nn.Linear) and type(module).__name__ == "FalconLinear")
        or is_conv1d(module)
    )


def is_scaled_embedding(module: nn.Module) -> bool:
    """An embedding whose only change is multiplying its output by ``embed_scale`` (Gemma 3's
    ``...ScaledWordEmbedding``): converted with that scale."""
    return (
        isinstance(module, nn.Embedding)
        and hasattr(module, "embed_scale")
        and type(module).__name__.endswith("ScaledWordEmbedding")
    )


# Fused projections auto does not split: where q, k and v (or gate and up) meet is model code.
_FUSED = {"qkv_proj", "gate_up_proj", "query_key_value", "c_attn", "W_pack", "Wqkv", "c_fc"}


def auto_plan(
    module: nn.Module, sequence_parallel: bool = False, reasons: Optional[dict] = None
) -> dict[str, str]:
    """The split decided for every nn.Linear and nn.Embedding of a Llama/Qwen-style model:
    column for q/k/v/gate/up, row for o/down, vocabulary for embeddings and the LM head, replicate
    for anything else; with ``sequence_parallel``, every norm too.

    Only modules whose semantics auto knows are converted (plain ``nn.Linear`` and
    ``nn.Embedding``, and Gemma's scaled embedding). A module it would leave whole that holds a
    large weight (a matmul of the model's width: GPT-2's ``Conv1D``, fused ``qkv_proj``, MoE
    experts) is refused with a ValueError naming it, since replicating it silently would leave
    the model unsharded or inconsistent; pass a plan for such models. ``reasons``, when given, is
    filled with why each module got its style."""
    plan = {}
    why = {} if reasons is None else reasons
    width = _width(module)
    for name, child in module.named_modules():
        leaf = name.rpartition(".")[2]
        if sequence_parallel and is_norm(child) and _norms_the_residual_stream(child, width):
            plan[name], why[name] = "sequence_parallel", "a norm over the model's width"
        elif is_fused_experts(child):
            plan[name], why[name] = "experts", "MoE experts as 3D gate_up_proj/down_proj"
        elif is_plain(child, nn.Embedding) or is_scaled_embedding(child):
            plan[name], why[name] = "vocab", "a token embedding"
        elif is_linear(child):
            parent = module.get_submodule(name.rpartition(".")[0]) if "." in name else module
            info = attention_heads(parent)
            kind = type(parent).__name__
            if info is not None and leaf in ("q_proj", "k_proj", "v_proj", info.fused):
                plan[name] = "colwise"
                why[name] = f"an input projection of attention {kind} (reads the residual stream)"
            elif info is not None and leaf == info.out:
                plan[name] = "rowwise"
                why[name] = (
                    f"the output projection of attention {kind} (writes the residual stream)"
                )
            elif leaf in _AUTO_COLWISE:
                plan[name], why[name] = "colwise", f"{leaf!r}: an MLP input projection"
            elif leaf in _AUTO_ROWWISE:
                plan[name], why[name] = "rowwise", f"{leaf!r}: an MLP output projection"
            elif leaf in _AUTO_VOCAB_LINEAR:
                plan[name], why[name] = "vocab", f"{leaf!r}: the LM head"
            else:
                plan[name], why[name] = (
                    "replicate",
                    "a linear auto has no rule for (small: kept whole)",
                )
    _refuse_large_unsplit(module, plan)
    return plan


def _norms_the_residual_stream(norm: nn.Module, width) -> bool:
    """A norm over the model's width (input/post-attention/final norms), not a per-head one
    (Qwen3's q_norm/k_norm run on attention heads, which sequence parallelism does not split)."""
    weight = getattr(norm, "weight", None)
    return width is None or weight is None or weight.numel() == width


def _width(module: nn.Module):
    hidden = getattr(getattr(module, "config", None), "hidden_size", None)
    if isinstance(hidden, int):
        return hidden
    dims = [m.embedding_dim for m in module.modules() if isinstance(m, nn.Embedding)]
    return max(dims, default=None)


def _refuse_large_unsplit(module: nn.Module, plan: dict[str, str]) -> None:
    """Refuse when auto would leave a module with a model-width weight whole (see auto_plan)."""
    hidden = _width(module)
    if hidden is None:
        return
    big = max(2, hidden // 2)
    unsplit = []
    for name, child in module.named_modules():
        if plan.get(name, "replicate") not in ("replicate", "sequence_parallel") or is_norm(child):
            continue
        if isinstance(child, nn.Embedding) and "position" in name:
            continue  # learned positions (OPT): indexed by position, small, kept whole
        for param in child.parameters(recurse=False):
            if sum(1 for d in param.shape if d >= big) >= 2:
                unsplit.append((name, child))
                break
    if unsplit:
        listed = ", ".join(f"{n} ({type(c).__name__})" for n, c in unsplit[:4])
        more = f" and {len(unsplit) - 4} more" if len(unsplit) > 4 else ""
        fused = [n for n, _ in unsplit if n.rpartition(".")[2] in _FUSED]
        why = (
            " (fused projections: where their parts meet is model code auto does not know)"
            if fused
            else ""
        )
        raise ValueError(
            f"parallelize(plan='auto') does not know how to split {listed}{more}{why}; left "
            "whole they would hold the model's large matmuls on every rank. Pass a plan of name "
            "patterns to styles instead, e.g. {'*.q_proj': 'colwise', '*.o_proj': 'rowwise', "
            "...} (styles: colwise, rowwise, vocab, sequence_parallel, replicate; 'replicate' "
            "keeps a module whole on purpose)"
        )


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
