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
    sequence_parallel
                for norms (RMSNorm/LayerNorm): Megatron's sequence parallelism. The residual
                stream is split along the sequence from the first norm's decoder layer on;
                each such norm runs on this rank's shard (its weight gradient all-reduced) and
                its output is all-gathered once for the column-parallel layers after it, and
                row-parallel layers reduce-scatter instead of all-reducing. Same bytes as plain
                TP, 1/tp of the norm work and residual activations.

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
from tp_ext.sharding import HeadLayout, shard_sizes

__all__ = ["parallelize", "auto_plan", "STYLES"]

STYLES = ("colwise", "rowwise", "vocab", "sequence_parallel", "replicate")

# Llama/Qwen2 (and Mistral, Qwen3, ...) module names, by their last component.
_AUTO_COLWISE = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}
_AUTO_ROWWISE = {"o_proj", "down_proj"}
_AUTO_VOCAB_LINEAR = {"lm_head"}


def _is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def auto_plan(module: nn.Module, sequence_parallel: bool = False) -> dict[str, str]:
    """The split decided for every nn.Linear and nn.Embedding of a Llama/Qwen-style model:
    column for q/k/v/gate/up, row for o/down, vocabulary for embeddings and the LM head, replicate
    for anything else; with ``sequence_parallel``, every norm too."""
    plan = {}
    for name, child in module.named_modules():
        leaf = name.rpartition(".")[2]
        if sequence_parallel and _is_norm(child):
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


def _resolve_plan(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """Exact module name -> style, from name patterns (fnmatch; the first matching pattern wins)."""
    names = [n for n, _ in module.named_modules() if n]
    decided: dict[str, str] = {}
    for pattern, style in plan.items():
        if style not in STYLES:
            raise ValueError(f"plan[{pattern!r}] = {style!r} is not a style; use one of {STYLES}")
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


class _SequenceShards:
    """Every rank's sequence-shard length for the current forward, set where the residual stream
    is split and read where it is gathered (uneven lengths need all ranks' sizes)."""

    def __init__(self, tp: TPGroup) -> None:
        self.tp = tp
        self.sizes: Optional[list[int]] = None

    def split(self, module, args, kwargs):
        """Forward pre-hook of the first sequence-parallel decoder layer: keep this rank's shard
        of its hidden states (the gradient is all-gathered back)."""
        x = args[0] if args else kwargs["hidden_states"]
        n, size = x.size(-2), self.tp.size
        self.sizes = None if n % size == 0 else shard_sizes(n, size)
        x = torch.ops.tp_ext.scatter_to_tp(x, -2, self.sizes, self.tp.name, size, self.tp.rank)
        if args:
            return (x, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": x}

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.tp_ext.gather_from_sp(x, -2, self.sizes, self.tp.name, self.tp.size,
                                               self.tp.rank)


    def gather_output(self, module, args, output):
        """Forward hook of a sequence-parallel norm: all-gather its output for the
        column-parallel layers that follow (one gather shared by q, k and v)."""
        return self.gather(output)

    def all_reduce_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """Gradient hook of a sequence-parallel norm's parameter: each rank saw only its tokens."""
        return torch.ops.tp_ext.all_reduce(grad, "sum", self.tp.name, self.tp.size)


def _convert(name: str, child: nn.Module, style: str, parent: nn.Module, tp: TPGroup,
             sp: bool):
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
        new = ParallelLMHead(child.out_features, child.in_features, bias, gather_output=True,
                             input_is_gathered=sp, **kw)
        return new, f"vocab-parallel head, rows {new.partition.segments[tp.rank]}, logits gathered"
    if style == "colwise":
        partition = None
        if layout is not None and leaf in ("q_proj", "k_proj", "v_proj"):
            heads, head_dim = layout
            partition = (heads.q_partition(head_dim) if leaf == "q_proj"
                         else heads.kv_partition(head_dim))
        new = ColumnParallelLinear(child.in_features, child.out_features, bias,
                                   partition=partition, input_is_gathered=sp, **kw)
        how = "by heads" if partition is not None else "by rows"
        return new, f"column-parallel {how}, local outputs {new.out_features_local}"
    if style == "rowwise":
        partition = None
        if layout is not None and leaf == "o_proj":
            heads, head_dim = layout
            partition = heads.q_partition(head_dim)
        new = RowParallelLinear(child.in_features, child.out_features, bias, partition=partition,
                                sequence_parallel=sp, **kw)
        return new, (f"row-parallel, local inputs {new.in_features_local}"
                     f"{', output reduce-scattered' if sp else ''}")
    raise AssertionError(style)


def parallelize(module: nn.Module, plan: Union[str, Mapping[str, str]] = "auto",
                tp_group=None, verbose: bool = False, sequence_parallel: bool = False) -> nn.Module:
    """Tensor-parallelise ``module`` in place (every rank holds the same full model on entry) and
    return it. ``module.tp_ext_plan`` records each converted module's style and shard.

    ``plan``: "auto" (:func:`auto_plan`) or ``{name pattern: style}``. ``tp_group``: the TP group
    (default: the one from :func:`tp_ext.init_parallel`). ``verbose`` prints the decisions on
    TP rank 0. ``sequence_parallel=True`` with "auto" adds the "sequence_parallel" style for every
    norm.
    """
    tp = resolve_tp_group(tp_group)
    if isinstance(plan, str):
        if plan != "auto":
            raise ValueError(f"plan must be 'auto' or a dict of name pattern -> style, got {plan!r}")
        decided = auto_plan(module, sequence_parallel)
    elif isinstance(plan, Mapping):
        decided = _resolve_plan(module, plan)
    else:
        raise TypeError(f"plan must be 'auto' or a dict, got {type(plan).__name__}")

    report: dict[str, str] = {}
    sp_norms = [n for n, style in decided.items() if style == "sequence_parallel"]
    sp = bool(sp_norms) and tp.size > 1
    shards = _SequenceShards(tp)
    if sp:
        # The residual stream is split where the first norm's block (decoder layer) begins.
        first_block = sp_norms[0].rpartition(".")[0]
        if not first_block:
            raise ValueError(f"sequence-parallel norm {sp_norms[0]!r} must sit inside a block")
        module.get_submodule(first_block).register_forward_pre_hook(shards.split,
                                                                    with_kwargs=True)
        report[first_block] = "sequence parallel from here: hidden states split along the sequence"
    for name, style in decided.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        child = getattr(parent, leaf)
        if style == "replicate" or (style == "sequence_parallel" and not sp):
            report[name] = f"{style}: unchanged"
            continue
        if style == "sequence_parallel":
            if not _is_norm(child):
                raise ValueError(f"{name}: style 'sequence_parallel' applies to norm modules "
                                 f"(RMSNorm, LayerNorm), not {type(child).__name__}")
            # Hooks, not a wrapper: the norm keeps its names in state dicts and checkpoints.
            child.register_forward_hook(shards.gather_output)
            for p in child.parameters():
                p.register_hook(shards.all_reduce_grad)
            report[name] = "sequence_parallel: runs on this rank's shard, output all-gathered"
            continue
        full = {k: v.detach() for k, v in child.state_dict().items()}
        with no_init():
            new, what = _convert(name, child, style, parent, tp, sp)
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
