"""What each rank holds of a Hugging Face causal LM that ``parallelize(model, "auto")`` would
convert, counted without allocating it: the model is built on the meta device from its config
and converted there, rank by rank, by the plan "auto" decides.

"auto" decides from one traced forward, which a model on the meta device cannot run (its mask
and MoE routing code read tensor values), so the plan is traced on a *narrow* copy of the
architecture (:func:`narrow_config`: the same layers, heads, experts and options, every width
small, built on the CPU in milliseconds) and applied by module name to the full-size meta model.
Pipeline stages are read the same way: which modules run before and after the decoder layers
(:func:`tp_ext.parallelize.decoder_parts.find_decoder_parts` on the narrow copy)."""

from __future__ import annotations

import copy
import dataclasses
import types
from typing import Optional

import torch
from torch import nn

from tp_ext.dims import ParallelDims
from tp_ext.layers import ResolvedGroup
from tp_ext.layers.moe import expert_count
from tp_ext.parallelize import Colwise, parallelize
from tp_ext.parallelize.dataflow import example_token_inputs
from tp_ext.parallelize.decoder_parts import find_decoder_parts, pipeline_costs
from tp_ext.parallelize.modules import AttentionHeads, attention_heads, linear_features
from tp_ext.parallelize.plan import auto_plan
from tp_ext.sharding import HeadLayout, balanced_layer_split, shard_sizes
from tp_ext.validation import ArgumentError

__all__ = [
    "HFModelShards",
    "full_plan",
    "narrow_config",
    "small_config",
    "meta_model",
    "model_shards",
    "expert_count",
    "mlp_widths",
]

# The narrow copy's widths: a head of 8 (even, so partial rotary fractions stay whole), MLPs of
# 16, a vocabulary of 64. Counts (layers, heads, experts) stay the model's.
NARROW_HEAD_DIM, NARROW_INTERMEDIATE, NARROW_VOCAB = 8, 16, 64
_INTERMEDIATE_FIELDS = (
    "intermediate_size",
    "moe_intermediate_size",
    "shared_expert_intermediate_size",
    "ffn_dim",
    "n_inner",
)


def mlp_widths(config) -> dict:
    """The config's MLP widths (intermediate_size, moe_intermediate_size, ...) it sets."""
    return {
        f: getattr(config, f)
        for f in _INTERMEDIATE_FIELDS
        if isinstance(getattr(config, f, None), int)
    }


def meta_model(config, dtype: torch.dtype = torch.float32) -> nn.Module:
    """transformers' causal LM of ``config`` on the meta device (no memory, no initialisation)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def narrow_config(config):
    """``config`` with every width small and every count kept: a model of the same structure
    (modules, names, layer kinds, heads, experts) that runs on the CPU in milliseconds."""
    narrow = copy.deepcopy(config)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int):
        raise ValueError(
            f"{type(config).__name__} has no num_attention_heads: not a decoder whose shards "
            "tp_ext can count"
        )
    hidden = heads * NARROW_HEAD_DIM
    for name in ("hidden_size", "n_embd", "word_embed_proj_dim"):
        if isinstance(getattr(config, name, None), int):
            setattr(narrow, name, hidden)
    if isinstance(getattr(config, "head_dim", None), int):
        narrow.head_dim = NARROW_HEAD_DIM
    for name in _INTERMEDIATE_FIELDS:
        if isinstance(getattr(config, name, None), int):
            setattr(narrow, name, NARROW_INTERMEDIATE)
    narrow.vocab_size = NARROW_VOCAB
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if hasattr(narrow, name):
            setattr(narrow, name, None)
    narrow._attn_implementation = "eager"
    return narrow


_DROPOUT_FIELDS = (
    "attention_dropout",
    "hidden_dropout",
    "dropout",
    "activation_dropout",
    "resid_pdrop",
    "embd_pdrop",
    "attn_pdrop",
)


def small_config(config, num_layers: int):
    """A model of ``config``'s family small enough for any machine (``tp-ext run --model``): the
    narrow copy's widths and counts, but ``num_layers`` decoder layers (per-layer lists cut to
    them), no dropout (the job compares against a single process) and the attention ``config``
    asks for."""
    small = narrow_config(config)
    small._attn_implementation = getattr(config, "_attn_implementation", None)
    small.num_hidden_layers = num_layers
    if isinstance(getattr(small, "layer_types", None), list):
        small.layer_types = small.layer_types[:num_layers]
    for name in _DROPOUT_FIELDS:
        if isinstance(getattr(small, name, None), float):
            setattr(small, name, 0.0)
    return small


@dataclasses.dataclass(frozen=True)
class _Structure:
    """What the narrow copy's trace says of the architecture, by module name: the plan of
    "auto" (with fused columns' part widths as fractions of their width), where the decoder
    layers are and which modules run before (first stage) and after them (last stage)."""

    styles: dict
    part_fractions: dict
    layers_path: str
    first: tuple
    last: tuple


def _structure(config) -> _Structure:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)  # the narrow copy's values are never used; keep the stream reproducible
    narrow = AutoModelForCausalLM.from_config(narrow_config(config))
    narrow.eval()
    parts: dict = {}
    decided = auto_plan(narrow, parts=parts)
    fractions = {}
    for name, widths in parts.items():
        total = sum(widths)
        fractions[name] = tuple(w / total for w in widths)
    found = find_decoder_parts(narrow, example_token_inputs(narrow))
    names = {id(m): n for n, m in narrow.named_modules()}

    def name_of(parent, attr):
        return f"{names[id(parent)]}.{attr}" if names[id(parent)] else attr

    return _Structure(
        styles=decided,
        part_fractions=fractions,
        layers_path=name_of(found.layers_owner, found.layers_name),
        first=tuple(name_of(p, a) for p, a in found.before),
        last=tuple(name_of(p, a) for p, a in found.after),
    )


def full_plan(structure: _Structure, model: nn.Module) -> dict:
    """The traced styles for the full-size model: a fused column's parts at its own widths."""
    plan = dict(structure.styles)
    for name, fractions in structure.part_fractions.items():
        out = linear_features(model.get_submodule(name))[1]
        widths = [round(f * out) for f in fractions]
        if sum(widths) != out or any(abs(w - f * out) > 1e-6 for w, f in zip(widths, fractions)):
            raise ValueError(f"{name}: cannot scale the traced parts {fractions} to width {out}")
        plan[name] = Colwise(parts=widths)
    return plan


class HFModelShards:
    """One Hugging Face causal LM config's full size and per-rank shards (see the module doc).

    ``shards(tp, tp_rank, ep, ep_rank)`` maps each parameter name (a tied weight under both its
    names) to ``(numel, tensor id, dim 0)`` on that rank; :meth:`stage_of` says which pipeline stage
    a name belongs to."""

    def __init__(self, config) -> None:
        self.config = config
        self.architecture = type(config).__name__.removesuffix("Config")
        self.num_layers = config.num_hidden_layers
        full = meta_model(config)
        self.total = sum(p.numel() for p in full.parameters())
        self.numel = {n: p.numel() for n, p in full.named_parameters(remove_duplicate=False)}
        self.unique = frozenset(n for n, _ in full.named_parameters())
        self.heads = next((h for h in map(attention_heads, full.modules()) if h is not None), None)
        self.moe = any(n.endswith("experts") for n, _ in full.named_modules())
        self.num_experts = expert_count(config)
        self._stage_costs = pipeline_costs(full)
        try:
            self.structure = _structure(config)
        except Exception as e:  # noqa: BLE001  (any failure of the trace is the same refusal)
            raise ValueError(
                f"{self.architecture}: tp_ext traces a narrow copy of the model to plan its "
                f"shards, and that failed: {type(e).__name__}: {e}"
            ) from e
        self._cache: dict = {}
        parts = [
            round(f * linear_features(full.get_submodule(name))[1])
            for name, fractions in self.structure.part_fractions.items()
            for f in fractions
        ]
        self.widths = tuple(sorted({d for p in full.parameters() for d in p.shape} | set(parts)))

    def default_split(self, num_stages: int) -> list[int]:
        """Decoder layers per pipeline stage as ``parallelize`` splits them by default
        (:func:`~tp_ext.parallelize.decoder_parts.default_pipeline_split`)."""
        layer_costs, first, last = self._stage_costs
        return balanced_layer_split(layer_costs, num_stages, first, last)

    # -- where a parameter lives --------------------------------------------------------------

    def layer_of(self, name: str) -> Optional[int]:
        prefix = self.structure.layers_path + "."
        if not name.startswith(prefix):
            return None
        return int(name[len(prefix) :].split(".", 1)[0])

    def part_of(self, name: str) -> str:
        """ "layer", "first" (before the layers), "last" (after them) or "every" (a module
        outside both that every stage keeps)."""
        if self.layer_of(name) is not None:
            return "layer"
        for part, modules in (("first", self.structure.first), ("last", self.structure.last)):
            if any(name.startswith(m + ".") for m in modules):
                return part
        return "every"

    # -- per-rank shards ----------------------------------------------------------------------

    def shards(self, tp: int, tp_rank: int = 0, ep: int = 1, ep_rank: int = 0) -> dict:
        key = self._shape_class(tp, tp_rank, ep, ep_rank)
        if key not in self._cache:
            self._cache[key] = self._convert(tp, tp_rank, ep, ep_rank)
        return self._cache[key]

    def _shape_class(self, tp, tp_rank, ep, ep_rank) -> tuple:
        """Ranks whose shards have the same shapes share one conversion: every split size is
        the shard policy's share of some width of the model (a dim of a parameter, a fused
        column's part, a head count), so equal shares of all of them mean equal shards."""
        q, kv, _ = self.heads_on(tp, tp_rank)
        tp_share = tuple(shard_sizes(d, tp)[tp_rank] for d in self.widths)
        ep_share = tuple(shard_sizes(d, ep)[ep_rank] for d in self.widths)
        return tp, ep, q, kv, tp_share, ep_share

    def _convert(self, tp, tp_rank, ep, ep_rank) -> dict:
        model = meta_model(self.config)
        parallel = types.SimpleNamespace(  # what parallelize reads of a ParallelState
            dims=ParallelDims(tp=tp, ep=ep),
            tp_group=ResolvedGroup.virtual(tp, tp_rank),
            ep=ep,
            ep_group=ResolvedGroup.virtual(ep, ep_rank),
            pp=1,
        )
        try:
            parallelize(model, full_plan(self.structure, model), parallel=parallel)
        except ValueError as e:
            raise ArgumentError("tp" if ep == 1 else "ep", str(e)) from None
        return {
            n: (p.numel(), id(p), p.shape[0] if p.dim() else 1)
            for n, p in model.named_parameters(remove_duplicate=False)
        }

    def heads_on(self, tp: int, tp_rank: int) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim) of one attention layer on ``tp_rank``."""
        h: Optional[AttentionHeads] = self.heads
        if h is None:
            return 0, 0, 0
        layout = HeadLayout(h.heads, h.kv, tp)
        return layout.q[tp_rank][1], layout.kv[tp_rank][1], h.head_dim


_BUILT: dict = {}  # a config's JSON -> its HFModelShards (a few; the planner asks many times)


def model_shards(config) -> HFModelShards:
    """The :class:`HFModelShards` of ``config``, built once per distinct config."""
    key = f"{config.model_type}:{config.to_json_string(use_diff=False)}"
    if key not in _BUILT:
        if len(_BUILT) >= 8:
            _BUILT.pop(next(iter(_BUILT)))
        _BUILT[key] = HFModelShards(config)
        _BUILT[key].key = key  # what tells configs apart (the planner's HFModel hashes by it)
    return _BUILT[key]
