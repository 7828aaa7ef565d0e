"""The styles: the tp_ext layer that replaces a module of a given style, keeping its slice of
the module's weights. Attention projections are split by whole heads when their parent looks like
Hugging Face attention."""

from __future__ import annotations

from typing import Optional

from torch import nn

from tp_ext.distributed.groups import TPGroup
from tp_ext.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from tp_ext.sharding import HeadLayout

__all__ = ["convert", "attention_layout"]


def attention_layout(parent: nn.Module, tp: TPGroup) -> Optional[tuple[HeadLayout, int]]:
    config = getattr(parent, "config", None)
    head_dim = getattr(parent, "head_dim", None)
    if (
        config is None
        or head_dim is None
        or not all(hasattr(parent, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    ):
        return None
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return HeadLayout(heads, kv, tp.size), head_dim


def convert(
    name: str,
    child: nn.Module,
    style: str,
    parent: nn.Module,
    tp: TPGroup,
    sp: bool,
    tie_to: Optional[VocabParallelEmbedding] = None,
):
    """The tp_ext layer replacing ``child``, and a line saying what was done. ``tie_to``: the
    converted embedding an LM head shares its weight with."""
    leaf = name.rpartition(".")[2]
    kw = {"tp_group": tp, "device": None, "dtype": None}
    if style == "vocab" and isinstance(child, nn.Embedding):
        kw.update(device=child.weight.device, dtype=child.weight.dtype)
        scale = getattr(child, "embed_scale", None)  # Gemma's scaled embedding
        scale = None if scale is None else float(scale)
        new = VocabParallelEmbedding(
            child.num_embeddings, child.embedding_dim, child.padding_idx, output_scale=scale, **kw
        )
        scaled = "" if scale is None else f", output scaled by {scale:g}"
        return new, f"vocab-parallel embedding, rows {new.vocab_start}:{new.vocab_end}{scaled}"
    if not isinstance(child, nn.Linear):
        raise ValueError(
            f"{name}: style {style!r} applies to nn.Linear"
            f"{' or nn.Embedding' if style == 'vocab' else ''}, not "
            f"{type(child).__name__}"
        )
    kw.update(device=child.weight.device, dtype=child.weight.dtype)
    bias = child.bias is not None
    layout = attention_layout(parent, tp)
    if style == "vocab":
        new = ParallelLMHead(
            child.out_features,
            child.in_features,
            bias,
            gather_output=True,
            input_is_gathered=sp,
            tie_to=tie_to,
            **kw,
        )
        tied = ", weight tied to the embedding" if tie_to is not None else ""
        rows = new.partition.segments[tp.rank]
        return new, f"vocab-parallel head, rows {rows}, logits gathered{tied}"
    if style == "colwise":
        partition = None
        if layout is not None and leaf in ("q_proj", "k_proj", "v_proj"):
            heads, head_dim = layout
            partition = (
                heads.q_partition(head_dim) if leaf == "q_proj" else heads.kv_partition(head_dim)
            )
        new = ColumnParallelLinear(
            child.in_features,
            child.out_features,
            bias,
            partition=partition,
            input_is_gathered=sp,
            **kw,
        )
        how = "by heads" if partition is not None else "by rows"
        return new, f"column-parallel {how}, local outputs {new.out_features_local}"
    if style == "rowwise":
        partition = None
        if layout is not None and leaf == "o_proj":
            heads, head_dim = layout
            partition = heads.q_partition(head_dim)
        new = RowParallelLinear(
            child.in_features,
            child.out_features,
            bias,
            partition=partition,
            sequence_parallel=sp,
            **kw,
        )
        return new, (
            f"row-parallel, local inputs {new.in_features_local}"
            f"{', output reduce-scattered' if sp else ''}"
        )
    raise AssertionError(style)
