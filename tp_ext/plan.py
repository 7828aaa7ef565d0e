"""Tensor-parallelise an existing model in place: swap its nn.Linear and nn.Embedding modules for
tp_ext layers by a plan, keeping each rank's slice of the existing weights.

    model = transformers.Qwen2ForCausalLM(config)       # same weights on every rank
    tp_ext.parallelize(model, "auto")                   # or {"model.layers.*.self_attn.q_proj": "colwise", ...}
    logits = model(input_ids).logits                    # equal to the unsharded model's

Styles:
    colwise     nn.Linear -> ColumnParallelLinear (output features split; output stays split)
    rowwise     nn.Linear -> RowParallelLinear (input features split; output all-reduced)
    vocab       nn.Embedding -> VocabParallelEmbedding; nn.Linear -> ParallelLMHead with full
                logits gathered (the model's own loss and generation keep working)
    replicate   left as it is (every rank computes it in full)

Attention projections are split by whole heads (HeadLayout) whenever their parent module looks
like Hugging Face attention (``q_proj``/``k_proj``/``v_proj``/``o_proj`` and a ``head_dim``, with
head counts in ``config``); the parent's ``num_key_value_groups`` is then set to this rank's
ratio, so its own attention code runs on the local heads.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Mapping
from typing import Optional, Union

import torch
from torch import nn

from tp_ext.layers.base import TPGroup, load_full_state_dict, no_init, resolve_tp_group
from tp_ext.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tp_ext.layers.linear import ColumnParallelLinear, RowParallelLinear
from tp_ext.sharding import HeadLayout

__all__ = ["parallelize", "auto_plan", "STYLES"]

STYLES = ("colwise", "rowwise", "vocab", "sequence_parallel", "replicate")

# Llama/Qwen2 (and Mistral, Qwen3, ...) module names, by their last component.
_AUTO_COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_AUTO_ROWWISE = {"o_proj", "down_proj"}
_AUTO_VOCAB_LINEAR = {"lm_head"}


def auto_plan(module: nn.Module) -> dict[str, str]:
    """The split decided for every nn.Linear and nn.Embedding of a Llama/Qwen-style model:
    column for q/k/v/gate/up, row for o/down, vocabulary for embeddings and the LM head, replicate
    for anything else."""
    plan = {}
    for name, child in module.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(child, nn.Embedding):
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


def _resolve_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Exact module name -> style, from name patterns (fnmatch; the first matching pattern wins)."""
    names = [n for n, _ in module.named_modules() if n]
    decided: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; use one of {STYLES}")
        if style == "sequence_parallel":
            raise ValueError(
                f"plan[{pattern!r}] = 'sequence_parallel': parallelize() does not rewire a foreign "
                "model's activations for sequence parallelism; use tp_ext.layers."
                "ParallelTransformerBlock(sequence_parallel=True) (or tp_ext's models), which do")
        matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not matched:
            example = ", ".join(names[:6])
            raise ValueError(f"plan pattern {pattern!r} matches no module; names look like: "
                             f"{example}, ...")
        for name in matched:
            decided.setdefault(name, style)
    return decided


def _attention_layout(parent: nn.Module, tp: TPGroup) -> Optional[tuple[HeadLayout, int]]:
    config = getattr(parent, "config", None)
    head_dim = getattr(parent, "head_dim", None)
    if config is None or head_dim is None or not all(
            hasattr(parent, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return None
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return HeadLayout(heads, kv, tp.size), head_dim


def _convert(name: str, child: nn.Module, style: str, parent: nn.Module, tp: TPGroup):
    """The tp_ext layer replacing ``child``, and a line saying what was done."""
    leaf = name.rpartition(".")[2]
    kw = {"tp_group": tp, "device": None, "dtype": None}
    if style == "vocab" and isinstance(child, nn.Embedding):
        kw.update(device=child.weight.device, dtype=child.weight.dtype)
        new = VocabParallelEmbedding(child.num_embeddings, child.embedding_dim, child.padding_idx,
                                     **kw)
        return new, f"vocab-parallel embedding, rows {new.vocab_start}:{new.vocab_end}"
    if not isinstance(child, nn.Linear):
        raise ValueError(f"{name}: style {style!r} applies to nn.Linear"
                         f"{' or nn.Embedding' if style == 'vocab' else ''}, not "
                         f"{type(child).__name__}")
    kw.update(device=child.weight.device, dtype=child.weight.dtype)
    bias = child.bias is not None
    layout = _attention_layout(parent, tp)
    if style == "vocab":
        new = ParallelLMHead(child.out_features, child.in_features, bias, gather_output=True, **kw)
        return new, f"vocab-parallel head, rows {new.partition.segments[tp.rank]}, logits gathered"
    if style == "colwise":
        partition = None
        if layout is not None and leaf in ("q_proj", "k_proj", "v_proj"):
            heads, head_dim = layout
            partition = (heads.q_partition(head_dim) if leaf == "q_proj"
                         else heads.kv_partition(head_dim))
        new = ColumnParallelLinear(child.in_features, child.out_features, bias,
                                   partition=partition, **kw)
        how = "by heads" if partition is not None else "by rows"
        return new, f"column-parallel {how}, local outputs {new.out_features_local}"
    if style == "rowwise":
        partition = None
        if layout is not None and leaf == "o_proj":
            heads, head_dim = layout
            partition = heads.q_partition(head_dim)
        new = RowParallelLinear(child.in_features, child.out_features, bias, partition=partition,
                                **kw)
        return new, f"row-parallel, local inputs {new.in_features_local}"
    raise AssertionError(style)


def parallelize(module: nn.Module, plan: Union[str, Mapping[str, str]] = "auto",
                tp_group=None, verbose: bool = False) -> nn.Module:
    """Tensor-parallelise ``module`` in place (every rank holds the same full model on entry) and
    return it. ``module.tp_ext_plan`` records each converted module's style and shard.

    ``plan``: "auto" (:func:`auto_plan`) or ``{name pattern: style}``. ``tp_group``: the TP group
    (default: the one from :func:`tp_ext.init_parallel`). ``verbose`` prints the decisions on
    TP rank 0.
    """
    tp = resolve_tp_group(tp_group)
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be 'auto' or a dict of name pattern -> style, got {plan!r}")
        decided = auto_plan(module)
    elif isinstance(plan, Mapping):
        decided = _resolve_plan(module, plan)
    else:
        raise TypeError(f"plan must be 'auto' or a dict, got {type(plan).__name__}")

    report: dict[str, str] = {}
    for name, style in decided.items():
        if style == "replicate":
            report[name] = "replicate: unchanged"
            continue
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        child = getattr(parent, leaf)
        full = {k: v.detach() for k, v in child.state_dict().items()}
        with no_init():
            new, what = _convert(name, child, style, parent, tp)
        load_full_state_dict(new, full)
        new.train(child.training)
        setattr(parent, leaf, new)
        report[name] = f"{style}: {what}"

    # Hugging Face attention: run its own code on this rank's heads.
    for name, child in module.named_modules():
        layout = _attention_layout(child, tp) if hasattr(child, "num_key_value_groups") else None
        if layout is not None and isinstance(child.q_proj, ColumnParallelLinear):
            heads = layout[0]
            child.num_key_value_groups = heads.q[tp.rank][1] // heads.kv[tp.rank][1]
            report[name] = (f"attention: {heads.q[tp.rank][1]} query heads, "
                            f"{heads.kv[tp.rank][1]} KV heads on this rank")
    module.tp_ext_plan = report
    if verbose and tp.rank == 0:
        width = max((len(n) for n in report), default=0)
        print(f"tp_ext.parallelize over {tp.size} ranks (rank 0's shards):")
        for name, what in report.items():
            print(f"  {name:<{width}}  {what}")
    return module
