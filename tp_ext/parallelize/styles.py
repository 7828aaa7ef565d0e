"""The styles: what :func:`tp_ext.parallelize` does to one module of a plan. Each is a
:class:`ParallelStyle` (``Colwise()``, ``Rowwise()``, ``VocabParallel()``, ``Experts()``,
``SequenceParallel()``, ``SharedInput(readers)``, ``Replicate()``, with keyword options) that
applies itself to a module; the plan's strings ("colwise", "rowwise", ...) are aliases of default
instances (:data:`ALIASES`).

A style that swaps the module for a tp_ext layer keeps this rank's slice of the module's weights.
Attention projections are split by whole heads when their parent looks like Hugging Face
attention (:mod:`tp_ext.parallelize.modules`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Optional

import torch
from torch import nn

from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    ParallelMultiheadAttention,
    RowParallelLinear,
    SharedColumnInput,
    VocabParallelEmbedding,
    load_full_state_dict,
    no_init,
)
from tp_ext.parallelize.modules import (
    AttentionHeads,
    attention_heads,
    full_state,
    head_partition,
    is_conv1d,
    is_fused_experts,
    is_norm,
    linear_features,
    localize_attention,
    shard_experts,
)
from tp_ext.parallelize.sequence_parallel import SequenceShards, sum_gradients_over
from tp_ext.sharding import Partition
from tp_ext.validation import check_int

__all__ = [
    "ParallelStyle",
    "StyleTarget",
    "Colwise",
    "Rowwise",
    "VocabParallel",
    "Experts",
    "SequenceParallel",
    "Replicate",
    "Heads",
    "ALIASES",
    "as_style",
    # moved to tp_ext.parallelize.modules; still importable from here
    "AttentionHeads",
    "attention_heads",
    "is_conv1d",
    "full_state",
    "localize_attention",
]


@dataclass(frozen=True)
class StyleTarget:
    """Where a style is applied: the module's full name and parent, the TP group, and what the
    whole :func:`~tp_ext.parallelize` call decided.

    ``sequence_parallel``: the residual stream is split along the sequence (the plan has a
    gathering sequence-parallel norm and TP > 1). ``shards``: the sequence shards' hooks.
    ``tie_to``: the converted embedding an LM head shares its weight with. ``parts``: the widths
    auto traced a column's output being cut into. ``moe_block``: under sequence parallelism, the
    sparse-MoE block the module sits in (None outside one): the block gathers the sequence on
    entry and reduce-scatters once on exit, so row-parallel and expert outputs in it stay
    partial sums."""

    name: str
    parent: nn.Module
    tp: ResolvedGroup
    sequence_parallel: bool = False
    shards: Optional[SequenceShards] = None
    tie_to: Optional[VocabParallelEmbedding] = None
    parts: Optional[tuple[int, ...]] = None
    moe_block: Optional[str] = None


class ParallelStyle(ABC):
    """How one module is parallelised. ``apply(module, target)`` returns the module that takes
    its place (a new tp_ext layer, or ``module`` itself changed in place or left as it is) and a
    line for parallelize's report; parallelize installs it under the module's name.

    ``name`` is the style's string alias, the first word of its report lines.
    ``shards_weights`` is False for styles that keep every parameter whole (parameters shared
    with other modules may then stay shared)."""

    name: ClassVar[str] = ""
    shards_weights: ClassVar[bool] = True

    @abstractmethod
    def apply(self, module: nn.Module, target: StyleTarget) -> tuple[nn.Module, str]: ...

    def finish(self, root: nn.Module) -> None:
        """After every module of the plan is converted: what the style needs of the model
        around it (nothing, by default)."""


class _Swap(ParallelStyle):
    """A style that replaces the module with a tp_ext layer (``build``), loaded with this rank's
    slice of the module's weights; frozen parameters stay frozen, the train/eval mode is kept."""

    @abstractmethod
    def build(self, module: nn.Module, target: StyleTarget) -> tuple[nn.Module, str]: ...

    def apply(self, module: nn.Module, target: StyleTarget) -> tuple[nn.Module, str]:
        full = full_state(module)
        with no_init():  # the weights come from the module: no random init
            new, what = self.build(module, target)
        load_full_state_dict(new, full)
        if is_conv1d(module):  # its full weight stays [in, out]: exports load in transformers
            new.keep_full_transposed("weight")
        for param_name, param in module.named_parameters(recurse=False):
            getattr(new, param_name).requires_grad_(param.requires_grad)
        new.train(module.training)
        return new, what


def _linear_only(module: nn.Module, target: StyleTarget, style: str, also: str = "") -> None:
    if not (isinstance(module, nn.Linear) or is_conv1d(module)):
        raise ValueError(
            f"{target.name}: style {style!r} applies to nn.Linear or Hugging Face Conv1D{also}, "
            f"not {type(module).__name__}"
        )


def _factory(module: nn.Module, target: StyleTarget) -> dict:
    return {"tp_group": target.tp, "device": module.weight.device, "dtype": module.weight.dtype}


@dataclass(frozen=True)
class Colwise(_Swap):
    """nn.Linear (or Conv1D) -> :class:`~tp_ext.layers.ColumnParallelLinear`: output features
    split over the ranks, the output left split for a :class:`Rowwise` after it.

    q/k/v (and fused qkv) projections of Hugging Face attention are split by whole heads.
    ``parts``: the widths the output is cut into downstream (a fused ``[gate | up]``): each part
    is split on its own (default: what auto traced, ``gate_up_proj`` in halves).
    ``gather_output=True`` all-gathers the output (a linear whose consumer needs it whole; not
    for head-split attention projections)."""

    parts: Optional[Sequence[int]] = None
    gather_output: bool = False
    name: ClassVar[str] = "colwise"

    def __post_init__(self):
        if self.parts is not None:
            if isinstance(self.parts, (str, bytes)) or not isinstance(self.parts, Sequence):
                raise ValueError(
                    f"Colwise(parts=...) must be a list of output widths (e.g. [1024, 1024] for "
                    f"[gate | up]), got {self.parts!r}"
                )
            widths = tuple(
                check_int(f"Colwise(parts=...)[{i}]", p) for i, p in enumerate(self.parts)
            )
            object.__setattr__(self, "parts", widths)
        if not isinstance(self.gather_output, bool):
            raise ValueError(
                f"Colwise(gather_output=...) must be True or False, got {self.gather_output!r}"
            )

    def build(self, module, target):
        _linear_only(module, target, self.name)
        in_features, out_features = linear_features(module)
        leaf = target.name.rpartition(".")[2]
        info = attention_heads(target.parent)
        parts = self.parts or target.parts
        partition = None
        if info is not None and leaf in info.inputs:
            if self.gather_output or self.parts is not None:
                raise ValueError(
                    f"{target.name}: {self!r} on an attention projection: it is split by whole "
                    "heads (gather_output=True would hand the attention all heads while it runs "
                    "on this rank's; the head counts give the parts); use Colwise() (and "
                    "Rowwise() for its output projection) or Replicate()"
                )
            partition = head_partition(target.name, info, target.tp)
            parts = None
        elif parts is not None or leaf == "gate_up_proj":  # [gate | up]: each part on its own
            if self.parts is not None and sum(self.parts) != out_features:
                raise ValueError(
                    f"{target.name}: Colwise(parts={list(parts)}) sums to {sum(parts)}, but the "
                    f"linear has {out_features} output features; give widths that add up to it"
                )
            parts = parts or [out_features // 2] * 2
            partition = Partition.merged(list(parts), target.tp.size)
        new = ColumnParallelLinear(
            in_features,
            out_features,
            module.bias is not None,
            gather_output=self.gather_output,
            partition=partition,
            input_is_gathered=target.sequence_parallel,
            **_factory(module, target),
        )
        how = "by rows" if partition is None else f"by parts {list(parts)}" if parts else "by heads"
        gathered = ", output gathered" if self.gather_output else ""
        return new, f"column-parallel {how}, local outputs {new.out_features_local}{gathered}"


@dataclass(frozen=True)
class Rowwise(_Swap):
    """nn.Linear (or Conv1D) -> :class:`~tp_ext.layers.RowParallelLinear`: input features split
    over the ranks, the output all-reduced (reduce-scattered along the sequence under sequence
    parallelism). The output projection of Hugging Face attention is split by whole heads.
    ``input_is_parallel=False`` takes a whole input and keeps this rank's slice of it (a row
    linear with no :class:`Colwise` before it)."""

    input_is_parallel: bool = True
    name: ClassVar[str] = "rowwise"

    def __post_init__(self):
        if not isinstance(self.input_is_parallel, bool):
            raise ValueError(
                f"Rowwise(input_is_parallel=...) must be True or False, got "
                f"{self.input_is_parallel!r}"
            )

    def build(self, module, target):
        _linear_only(module, target, self.name)
        in_features, out_features = linear_features(module)
        info = attention_heads(target.parent)
        partition = None
        if info is not None and target.name.rpartition(".")[2] == info.out:
            partition = info.layout(target.tp).q_partition(info.head_dim)
        partial = target.sequence_parallel and target.moe_block is not None
        new = RowParallelLinear(
            in_features,
            out_features,
            module.bias is not None,
            input_is_parallel=self.input_is_parallel,
            partition=partition,
            sequence_parallel=target.sequence_parallel and not partial,
            reduce_output=not partial,
            **_factory(module, target),
        )
        sp = ", output reduce-scattered" if target.sequence_parallel else ""
        if partial:
            sp = f", output left a partial sum for {target.moe_block}"
        return new, f"row-parallel, local inputs {new.in_features_local}{sp}"


@dataclass(frozen=True)
class VocabParallel(_Swap):
    """Split by vocabulary: nn.Embedding -> :class:`~tp_ext.layers.VocabParallelEmbedding` (its
    output whole; Gemma's ``embed_scale`` kept), an LM head nn.Linear ->
    :class:`~tp_ext.layers.ParallelLMHead`, tied to the embedding when they share a weight.
    ``gather_output`` (heads only): True gathers the full logits, so the model's own loss and
    generation keep working; False leaves each rank its vocabulary slice (for
    :func:`tp_ext.vocab_parallel_cross_entropy`)."""

    gather_output: bool = True
    name: ClassVar[str] = "vocab"

    def __post_init__(self):
        if not isinstance(self.gather_output, bool):
            raise ValueError(
                f"VocabParallel(gather_output=...) must be True or False, got "
                f"{self.gather_output!r}"
            )

    def build(self, module, target):
        if isinstance(module, nn.Embedding):
            return self._embedding(module, target)
        _linear_only(module, target, self.name, " or nn.Embedding")
        in_features, out_features = linear_features(module)
        new = ParallelLMHead(
            out_features,
            in_features,
            module.bias is not None,
            gather_output=self.gather_output,
            input_is_gathered=target.sequence_parallel,
            tie_to=target.tie_to,
            **_factory(module, target),
        )
        tied = ", weight tied to the embedding" if target.tie_to is not None else ""
        logits = "logits gathered" if self.gather_output else "logits left split"
        rows = new.partition.segments[target.tp.rank]
        return new, f"vocab-parallel head, rows {rows}, {logits}{tied}"

    def _embedding(self, module: nn.Embedding, target: StyleTarget):
        if not self.gather_output:
            raise ValueError(
                f"{target.name}: VocabParallel(gather_output=False) is for LM heads; an "
                "embedding's output is always whole. Use VocabParallel() for "
                f"{type(module).__name__}"
            )
        scale = getattr(module, "embed_scale", None)  # Gemma's scaled embedding
        if isinstance(scale, torch.Tensor) and scale.is_meta:  # a model built on the meta device
            scale = getattr(module, "scalar_embed_scale", None)
        scale = None if scale is None else float(scale)
        new = VocabParallelEmbedding(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            output_scale=scale,
            **_factory(module, target),
        )
        scaled = "" if scale is None else f", output scaled by {scale:g}"
        tied = ""
        if target.tie_to is not None:  # one weight for every embedding that shared it
            new.weight = target.tie_to.weight
            tied = ", weight shared with the embedding converted first"
        rows = f"rows {new.vocab_start}:{new.vocab_end}"
        return new, f"vocab-parallel embedding, {rows}{scaled}{tied}"


@dataclass(frozen=True)
class Experts(ParallelStyle):
    """Mixtral-style MoE experts (3D ``gate_up_proj``/``down_proj``), split in place: every
    expert's intermediate dim over the ranks, the output all-reduced (under sequence
    parallelism left a partial sum, which the sparse-MoE block around it reduce-scatters).
    (Expert parallelism, ``parallel.ep > 1``, replaces the whole sparse-MoE block instead: see
    parallelize.)"""

    name: ClassVar[str] = "experts"

    def apply(self, module, target):
        if not is_fused_experts(module):
            raise ValueError(
                f"{target.name}: style 'experts' applies to Mixtral-style experts (3D "
                f"gate_up_proj and down_proj parameters), not {type(module).__name__}"
            )
        if target.sequence_parallel and target.moe_block is None:
            raise ValueError(
                f"{target.name}: under sequence_parallel=True split experts must sit in a "
                "sparse-MoE block (a module with a `gate` router of an [experts, hidden] weight "
                "and these experts), which gathers the sequence for them; "
                f"{type(target.parent).__name__} is not one: use sequence_parallel=False"
            )
        return module, shard_experts(module, target.tp, partial=target.sequence_parallel)


@dataclass(frozen=True)
class SequenceParallel(ParallelStyle):
    """For a norm (RMSNorm/LayerNorm): Megatron's sequence parallelism, by hooks (the norm keeps
    its names in state dicts). The norm runs on this rank's sequence shard, its weight gradient
    all-reduced; the residual stream is split from the first such norm's block on.
    ``gather_output=True`` all-gathers its output once for the column-parallel layers after it;
    False (alias "sequence_parallel_local") leaves it split: a norm of a row-parallel output
    before the residual add (Gemma 2/3's post-norms). ``whole_readers=True``: what reads the
    gathered output computes in full on every rank (ViT's class-token classifier, a pooler, the
    caller), so the backward keeps this rank's rows of the gradient instead of summing the
    ranks' partial ones. At TP 1 the norm is left unchanged."""

    gather_output: bool = True
    whole_readers: bool = False
    shards_weights: ClassVar[bool] = False

    def __post_init__(self):
        for field in ("gather_output", "whole_readers"):
            if not isinstance(getattr(self, field), bool):
                raise ValueError(
                    f"SequenceParallel({field}=...) must be True or False, got "
                    f"{getattr(self, field)!r}"
                )
        if self.whole_readers and not self.gather_output:
            raise ValueError("SequenceParallel(whole_readers=True) needs gather_output=True")

    @property
    def name(self) -> str:
        return "sequence_parallel" if self.gather_output else "sequence_parallel_local"

    def apply(self, module, target):
        if not target.sequence_parallel:
            return module, "unchanged"
        if not is_norm(module):
            raise ValueError(
                f"{target.name}: style {self.name!r} applies to norm modules "
                f"(RMSNorm, LayerNorm), not {type(module).__name__}"
            )
        # Hooks, not a wrapper: the norm keeps its names in state dicts and checkpoints.
        if self.whole_readers:
            module.register_forward_hook(target.shards.gather_output_whole)
        elif self.gather_output:
            module.register_forward_hook(target.shards.gather_output)
        sum_gradients_over(module, target.tp)  # each rank's gradient is from its tokens only
        output = "output all-gathered" if self.gather_output else "output stays split"
        return module, f"runs on this rank's shard, {output}"


@dataclass(frozen=True)
class SharedInput(ParallelStyle):
    """For a norm whose output only column-parallel linears read (``readers``, full module names:
    q, k and v, or gate and up): :func:`~tp_ext.parallelize` joins them in a
    :class:`~tp_ext.layers.SharedColumnInput` fed by the norm, so the first reader computes every
    reader's output in one op whose backward all-reduces their summed input gradient once,
    overlapped with all their weight-gradient GEMMs, instead of once per linear. Megatron gets this
    from one fused QKV linear; Hugging Face models keep separate projections. The "auto" plan
    gives it where its trace shows nothing else reading the norm's output (a replicated reader
    would have its gradient counted once per rank). Not with sequence parallelism, whose norms
    gather once for their readers already. At TP 1 the norm is left unchanged."""

    readers: tuple[str, ...] = ()
    name: ClassVar[str] = "shared_input"
    shards_weights: ClassVar[bool] = False

    def __post_init__(self):
        if (
            isinstance(self.readers, (str, bytes))
            or not isinstance(self.readers, Sequence)
            or len(self.readers) < 2
            or not all(isinstance(r, str) and r for r in self.readers)
        ):
            raise ValueError(
                "SharedInput(readers=...) must name the two or more column-parallel linears that "
                "read the norm's output (full module names, e.g. ['model.layers.0.mlp.gate_proj', "
                f"'model.layers.0.mlp.up_proj']), got {self.readers!r}"
            )
        object.__setattr__(self, "readers", tuple(self.readers))

    def apply(self, module, target):
        if target.sequence_parallel:
            raise ValueError(
                f"{target.name}: SharedInput is not for sequence parallelism (its norms gather "
                "their output once for the linears after them already); drop it from the plan "
                "or use sequence_parallel=False"
            )
        if target.tp.size == 1:
            return module, "unchanged"
        leaves = ", ".join(r.rpartition(".")[2] for r in self.readers)
        return module, f"output read by {leaves} as one input (one gradient all-reduce)"

    def share(self, norm: nn.Module, root: nn.Module) -> None:
        """Once the readers are converted (``root``: the model they are named in): join them and
        feed them ``norm``'s output."""
        group = SharedColumnInput([root.get_submodule(r) for r in self.readers])
        norm.register_forward_hook(lambda module, args, output: group.offer(output))


@dataclass(frozen=True)
class Heads(_Swap):
    """``nn.MultiheadAttention`` -> :class:`~tp_ext.layers.ParallelMultiheadAttention`: its
    packed q, k and v projection column-parallel by whole heads, its output projection
    row-parallel over the same heads (one all-reduce). ``nn.TransformerEncoder``'s nested-tensor
    fast path, which runs torch's fused layer on the whole projections, is turned off in the
    stacks that hold one."""

    name: ClassVar[str] = "heads"

    def build(self, module, target):
        if not isinstance(module, nn.MultiheadAttention):
            raise ValueError(
                f"{target.name}: style 'heads' applies to nn.MultiheadAttention, not "
                f"{type(module).__name__}"
            )
        unsupported = [
            what
            for what, present in (
                ("kdim/vdim other than embed_dim", not module._qkv_same_embed_dim),
                ("add_bias_kv=True", module.bias_k is not None),
                ("add_zero_attn=True", module.add_zero_attn),
            )
            if present
        ]
        if unsupported:
            raise ValueError(
                f"{target.name}: nn.MultiheadAttention with {', '.join(unsupported)} is not "
                "split by heads yet; give it 'replicate' in the plan"
            )
        new = ParallelMultiheadAttention(
            module.embed_dim,
            module.num_heads,
            module.dropout,
            bias=module.in_proj_bias is not None,
            batch_first=module.batch_first,
            tp_group=target.tp,
            device=module.in_proj_weight.device,
            dtype=module.in_proj_weight.dtype,
        )
        return new, f"attention by heads: {new.local_heads} of {module.num_heads} heads here"

    def finish(self, root):
        for stack in root.modules():
            if isinstance(stack, nn.TransformerEncoder) and any(
                isinstance(m, ParallelMultiheadAttention) for m in stack.modules()
            ):
                stack.use_nested_tensor = False


@dataclass(frozen=True)
class Replicate(ParallelStyle):
    """Left as it is: every rank holds and computes the module in full."""

    name: ClassVar[str] = "replicate"
    shards_weights: ClassVar[bool] = False

    def apply(self, module, target):
        return module, "unchanged"


# The plan's strings: each names a default instance.
ALIASES: dict[str, ParallelStyle] = {
    "colwise": Colwise(),
    "rowwise": Rowwise(),
    "vocab": VocabParallel(),
    "experts": Experts(),
    "sequence_parallel": SequenceParallel(),
    "sequence_parallel_local": SequenceParallel(gather_output=False),
    "replicate": Replicate(),
    "heads": Heads(),
}

_CLASSES = (Colwise, Rowwise, VocabParallel, Experts, SequenceParallel, Heads, Replicate)


def as_style(value, where: str) -> ParallelStyle:
    """The style a plan entry names: a :class:`ParallelStyle` instance as it is, a string alias
    as :data:`ALIASES` says; anything else is refused, naming ``where`` (the plan entry and the
    module it is for), the value and what would work."""
    if isinstance(value, ParallelStyle):
        return value
    if isinstance(value, str) and value in ALIASES:
        return ALIASES[value]
    hint = ""
    if isinstance(value, type) and issubclass(value, ParallelStyle):
        hint = f" (a class: write {value.__name__}() for an instance)"
    elif isinstance(value, str) and value.lower() in ALIASES:
        hint = f" (aliases are lower case: {value.lower()!r})"
    classes = ", ".join(f"{c.__name__}()" for c in _CLASSES)
    raise ValueError(
        f"{where} = {value!r} is not a style{hint}; use a string alias "
        f"({', '.join(map(repr, ALIASES))}) or a tp_ext.parallelize.ParallelStyle instance "
        f"({classes}, with keyword options)"
    )
