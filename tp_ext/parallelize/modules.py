"""What parallelize recognises in a model's modules (Hugging Face attention and its heads, GPT-2's
Conv1D, Mixtral-style fused experts, norms) and the in-place edits it makes to them (attention run
on this rank's heads, experts split by their intermediate dim). The styles that use them are in
:mod:`tp_ext.parallelize.styles`."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers import FusedRMSNorm, HeadParallelEmbedding, ParallelModule
from tp_ext.layers.base import no_init
from tp_ext.sharding import HeadLayout, Partition

__all__ = [
    "AttentionHeads",
    "attention_heads",
    "fuse_rms_norms",
    "head_partition",
    "is_conv1d",
    "is_fused_experts",
    "is_norm",
    "full_state",
    "linear_features",
    "localize_attention",
    "shard_experts",
]


@dataclass(frozen=True)
class AttentionHeads:
    """What auto knows about a Hugging Face attention module: its head counts and how its input
    projections lay out q, k and v.

    ``qkv``: "separate" (q_proj, k_proj, v_proj), "concat" (one projection: all q heads, then
    all k, then all v: Phi-3, Falcon's multi_query) or "grouped" (one projection laid out per KV
    group as [its q heads, k, v]: GPT-NeoX and classic Falcon with one query head per group,
    Falcon's new_decoder_architecture with several). ``fused``/``out``: the fused input and the
    output projection's attribute names; ``separate``: the q, k and v projections' (T5's are
    ``q``, ``k``, ``v``)."""

    heads: int
    kv: int
    head_dim: int
    qkv: str
    fused: Optional[str]
    out: str
    separate: tuple = ("q_proj", "k_proj", "v_proj")

    @property
    def inputs(self) -> tuple:
        """The attribute names of its input projections."""
        return (self.fused,) if self.fused else self.separate

    def layout(self, tp: ResolvedGroup) -> HeadLayout:
        return HeadLayout(self.heads, self.kv, tp.size)


def attention_heads(parent: nn.Module) -> Optional[AttentionHeads]:
    """The heads of ``parent`` when it is an attention module auto understands, else None."""
    has = lambda *names: all(hasattr(parent, n) for n in names)  # noqa: E731
    if has("query_proj", "key_proj", "value_proj", "num_attention_heads", "attention_head_size"):
        # DeBERTa-v2's disentangled attention: its relative-position projections are per head
        # too; its output projection is its parent's (attention.output.dense)
        heads, size = parent.num_attention_heads, parent.attention_head_size
        separate = ("query_proj", "key_proj", "value_proj", "pos_key_proj", "pos_query_proj")
        return AttentionHeads(heads, heads, size, "separate", None, "", separate)
    config = getattr(parent, "config", None)
    if config is None:
        return None
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        return None
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(parent, "head_dim", None)
    own = getattr(parent, "num_heads", None)  # BART's decoder may have other counts than config
    if isinstance(own, int) and kv == heads:
        heads = kv = own
    if has("q", "k", "v", "o", "n_heads", "key_value_proj_dim"):  # T5
        t5 = ("q", "k", "v")
        return AttentionHeads(
            parent.n_heads, parent.n_heads, parent.key_value_proj_dim, "separate", None, "o", t5
        )
    if head_dim is not None and has("q_proj", "k_proj", "v_proj"):
        out = "o_proj" if has("o_proj") else "out_proj" if has("out_proj") else None
        return AttentionHeads(heads, kv, head_dim, "separate", None, out) if out else None
    if head_dim is not None and has("c_attn", "c_proj", "split_size"):  # GPT-2, [q | k | v]
        if getattr(parent, "is_cross_attention", False):
            return None  # c_attn is [k | v] there and q_attn separate: not known here
        return AttentionHeads(heads, heads, head_dim, "concat", "c_attn", "c_proj")
    if head_dim is not None and has("qkv_proj", "o_proj"):  # Phi-3
        return AttentionHeads(heads, kv, head_dim, "concat", "qkv_proj", "o_proj")
    if has("query_key_value", "dense", "head_size"):  # GPT-NeoX: per head [q, k, v]
        return AttentionHeads(heads, heads, parent.head_size, "grouped", "query_key_value", "dense")
    if has("query_key_value", "dense", "new_decoder_architecture", "multi_query"):  # Falcon
        if getattr(config, "alibi", False):
            raise ValueError(
                f"{type(parent).__name__}: Falcon with alibi=True is not split by "
                "parallelize(plan='auto') (its ALiBi slopes are built for all heads outside the "
                "attention module). Pass a plan, or use a rotary Falcon (alibi=False)"
            )
        if parent.new_decoder_architecture:
            kv = config.num_kv_heads
            return AttentionHeads(heads, kv, head_dim, "grouped", "query_key_value", "dense")
        if parent.multi_query:
            return AttentionHeads(heads, 1, head_dim, "concat", "query_key_value", "dense")
        return AttentionHeads(heads, heads, head_dim, "grouped", "query_key_value", "dense")
    return None


def _split_by_heads(table: nn.Embedding, layout, tp: ResolvedGroup) -> HeadParallelEmbedding:
    """T5's relative position bias (one column per head) as this rank's heads' columns."""
    weight = table.weight
    with no_init():
        new = HeadParallelEmbedding(
            table.num_embeddings, layout.q_partition(1), tp, weight.device, weight.dtype
        )
    new.load_full_state_dict({"weight": weight.detach()})
    new.weight.requires_grad_(weight.requires_grad)
    return new


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's Conv1D (GPT-2): a linear layer storing its weight as [in, out]."""
    return (
        type(module).__name__ == "Conv1D"
        and hasattr(module, "nf")
        and getattr(module, "weight", None) is not None
        and module.weight.dim() == 2
    )


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def full_state(module: nn.Module) -> dict:
    """The module's full state as the tp_ext layers load it: a Conv1D's [in, out] weight
    transposed to nn.Linear's [out, in]."""
    state = {k: v.detach() for k, v in module.state_dict().items()}
    if is_conv1d(module):
        state["weight"] = state["weight"].t()
    return state


def is_norm(module: nn.Module) -> bool:
    return type(module).__name__.endswith(("RMSNorm", "LayerNorm"))


def fuse_rms_norms(model: nn.Module, keep=()) -> list[str]:
    """Swap every RMSNorm that computes what the fused ``rms_norm`` op computes for a
    :class:`~tp_ext.layers.FusedRMSNorm` holding the same weight; returns their names. A norm
    qualifies when its only state is a 1-D ``weight`` (plus ``variance_epsilon`` or ``eps``), not
    float64, and its own forward gives the op's result on a probe with a random weight (float32,
    and bitwise in bfloat16); anything else (Gemma's ``1 + weight``, OLMo 2's single rounding, a
    norm with a bias) is left as it is, and so are the norms named in ``keep``."""
    swapped = []
    for name, norm in list(model.named_modules()):
        if name and name not in keep and _computes_rms_norm(norm):
            parent_name, _, leaf = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, leaf, FusedRMSNorm(norm.weight, _norm_eps(norm)))
            swapped.append(name)
    return swapped


def _norm_eps(norm: nn.Module):
    eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
    return eps if isinstance(eps, float) and eps > 0 else None


def _computes_rms_norm(norm: nn.Module) -> bool:
    params = dict(norm.named_parameters())
    weight = params.get("weight")
    if (
        not type(norm).__name__.endswith("RMSNorm")
        or list(params) != ["weight"]
        or weight.dim() != 1
        or list(norm.buffers())
        or list(norm.children())
        or _norm_eps(norm) is None
        # the op's math is fp32; Hugging Face's multiplies an fp64 weight in fp64
        or weight.dtype == torch.float64
    ):
        return False
    gen = torch.Generator().manual_seed(0)
    width = weight.shape[0]
    probe_weight = torch.randn(width, generator=gen) + 1.0
    # bf16 shows the rounding between the fp32 math and the weight: Llama's formula rounds there
    # (and so does the op), a norm that rounds once (OLMo 2's) does not, and is left alone
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(3, width, generator=gen).to(dtype)
        w = probe_weight.to(dtype)
        with torch.no_grad():
            try:
                theirs = torch.func.functional_call(norm, {"weight": w}, (x,))
            except Exception:  # a forward that needs more than a tensor is not this norm
                return False
            ours = ops.rms_norm(x, w, _norm_eps(norm))
        if not isinstance(theirs, torch.Tensor) or theirs.dtype != ours.dtype:
            return False
        same = (
            torch.allclose(theirs, ours, rtol=1e-5, atol=1e-6)  # fp32: summation order apart
            if dtype == torch.float32
            else torch.equal(theirs, ours)
        )
        if not same:
            return False
    return True


def is_fused_experts(module: nn.Module) -> bool:
    """Mixtral-style experts: ``gate_up_proj`` [experts, 2 * inter, hidden] and ``down_proj``
    [experts, hidden, inter] as 3D parameters, the forward looping over experts."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter)
        and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3
        and down.dim() == 3
        and gate_up.shape[1] == 2 * down.shape[2]
    )


def shard_experts(experts: nn.Module, tp: ResolvedGroup, partial: bool = False) -> str:
    """Split every expert's MLP in place: gate and up rows, down columns (the intermediate dim
    over the TP group). The module's own forward runs on the local slices; its output is
    all-reduced, or with ``partial`` left this rank's partial sum (under sequence parallelism
    the sparse-MoE block around it gathers its input and reduce-scatters its output). Its class
    becomes a ParallelModule subclass of the original, so state dicts, checkpoints and
    local_shards see the shard specs under the same names."""
    cls = type(experts)
    inter = experts.down_proj.shape[2]
    gate_up, down = Partition.merged([inter, inter], tp.size), Partition.split(inter, tp.size)
    for attr, dim, partition in (("gate_up_proj", 1, gate_up), ("down_proj", 2, down)):
        full = getattr(experts, attr)
        local = partition.local(full.detach(), dim, tp.rank).clone()
        setattr(experts, attr, nn.Parameter(local, requires_grad=full.requires_grad))

    config = getattr(experts, "config", None)
    local_bytes = down.local_size(tp.rank) * experts.down_proj.element_size()
    if getattr(config, "_experts_implementation", None) == "grouped_mm" and local_bytes % 16:
        # torch's grouped_mm needs 16-byte strides, which this rank's slice may not have: the
        # experts' own loop instead, on a copy of the config (the model's stays as it is)
        config = copy.copy(config)
        config._experts_implementation = "eager"
        experts.config = config

    def forward(self, hidden_states, top_k_index, top_k_weights):
        if partial:  # the block's gather and reduce-scatter sum the gradients and outputs
            return cls.forward(self, hidden_states, top_k_index, top_k_weights)
        # Both inputs are replicated: their gradients are summed over the ranks' slices.
        hidden_states = comm.copy_to_tp(hidden_states, self.tp)
        top_k_weights = comm.copy_to_tp(top_k_weights, self.tp)
        out = cls.forward(self, hidden_states, top_k_index, top_k_weights)
        return comm.reduce_from_tp(out, self.tp)

    experts.__class__ = type(
        f"TensorParallel{cls.__name__}", (ParallelModule, cls), {"forward": forward}
    )
    experts._setup_tp(tp)
    experts._set_shard("gate_up_proj", 1, gate_up)
    experts._set_shard("down_proj", 2, down)
    local = down.local_size(tp.rank)
    output = "output left a partial sum for its block" if partial else "output all-reduced"
    return f"experts split by intermediate dim, local {local} of {inter}, {output}"


def head_partition(name: str, info: AttentionHeads, tp: ResolvedGroup) -> Partition:
    """The head-aligned rows of an attention input projection (q, k, v or fused) each rank holds."""
    leaf = name.rpartition(".")[2]
    layout, hd = info.layout(tp), info.head_dim
    if info.fused is None and leaf == info.separate[0]:
        return layout.q_partition(hd)
    if info.fused is None and leaf in info.separate[1:]:
        return layout.kv_partition(hd)
    if info.qkv == "concat":
        return layout.qkv_partition(hd)
    # grouped: whole KV groups per rank (a replicated KV head would sit inside another rank's
    # block of the fused rows, which no contiguous layout gives).
    if info.kv < tp.size:
        raise ValueError(
            f"{name}: its {info.kv} KV head groups (fused per group as [q heads, k, v]) cannot "
            f"be split over {tp.size} ranks; use a TP size of at most {info.kv}"
        )
    group = info.heads // info.kv
    return Partition.split(info.kv * (group + 2) * hd, tp.size, unit=(group + 2) * hd)


def localize_attention(
    attention: nn.Module, info: AttentionHeads, tp: ResolvedGroup
) -> tuple[int, int, list]:
    """Make ``attention``'s own forward run on this rank's heads: set the head counts it reads,
    split its per-head tables (T5's relative position bias). Returns this rank's (query heads,
    KV heads, what else was split)."""
    layout = info.layout(tp)
    q, kv = layout.q[tp.rank][1], layout.kv[tp.rank][1]
    local = {
        "num_key_value_groups": q // kv,
        "num_heads": q,  # OPT, Falcon
        "num_key_value_heads": kv,  # Phi-3
        "num_kv_heads": kv,  # Falcon
    }
    if info.fused == "c_attn":
        local["split_size"] = q * info.head_dim  # GPT-2 splits c_attn's output by this width
    local["n_heads"], local["inner_dim"] = q, q * info.head_dim  # T5
    local["num_attention_heads"], local["all_head_size"] = q, q * info.head_dim  # DeBERTa-v2
    for attr, value in local.items():
        if hasattr(attention, attr):
            setattr(attention, attr, value)
    split = []
    bias = getattr(attention, "relative_attention_bias", None)
    if isinstance(bias, nn.Embedding) and bias.embedding_dim == info.heads:
        attention.relative_attention_bias = _split_by_heads(bias, layout, tp)
        split.append("relative position bias split by heads")
    if info.qkv == "concat" and info.fused == "qkv_proj":
        # Phi-3 finds where k begins in the fused output from config.num_attention_heads: give
        # this module its own config with the local count (the model's config stays whole).
        config = copy.copy(attention.config)
        config.num_attention_heads, config.num_key_value_heads = q, kv
        attention.config = config
    return q, kv, split
