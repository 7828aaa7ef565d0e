"""The planner's view of a Hugging Face decoder (any architecture ``parallelize(model, "auto")``
converts): :class:`HFModel` answers what the cost model asks of tp_ext's own Qwen2Config (layers,
widths, the TP sizes it takes), and :func:`hf_rank_shapes`, :func:`hf_op_counts` and
:func:`hf_layer_activation_bytes` give its per-rank counts:

- parameters: rank 0's shards of the model converted on the meta device
  (:mod:`tp_ext.models.hf.shards`), exact;
- what a decoder layer saves for backward: measured on the narrow copy of the architecture and
  fitted (:mod:`tp_ext.models.hf.activations`);
- dispatched operators: counted on the narrow copy's forward and backward (the backward's split
  between embedding, layers and head taken as the forward's).

The training step it costs is the Trainer's for a converted model: at pp = 1 the local loop over
one stage (vocabulary-parallel loss), or with EP the whole model (full logits); pipeline stages
under torch's schedule at pp > 1."""

from __future__ import annotations

import functools

import torch

from tp_ext.layers.moe import experts_per_token
from tp_ext.models.hf.activations import fit_layer_activations
from tp_ext.models.hf.config import max_positions, tp_problem
from tp_ext.models.hf.shards import mlp_widths, model_shards, narrow_config
from tp_ext.planner.counts import CountOps, RankShapes
from tp_ext.sharding import shard_sizes
from tp_ext.validation import as_torch_dtype

__all__ = [
    "HFModel",
    "hf_rank_shapes",
    "hf_op_counts",
    "hf_layer_activation_bytes",
    "routed_rows_bytes",
]

MAX_TP = 64


class HFModel:
    """A transformers config as the planner reads it (hashable by its JSON, so the counts of
    one model are built once)."""

    def __init__(self, config) -> None:
        self.config = config
        self.shards = shards = model_shards(config)
        self._key = shards.key
        self.architecture = shards.architecture
        self.num_hidden_layers = shards.num_layers
        self.hidden_size = getattr(config, "hidden_size", None) or config.n_embd
        self.vocab_size = config.vocab_size
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.max_position_embeddings = max_positions(config)
        self.is_moe = shards.moe
        self.experts_per_token = experts_per_token(config)

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, HFModel) and other._key == self._key

    def default_pipeline_split(self, num_stages: int) -> list[int]:
        """Decoder layers per stage as ``parallelize`` places them by default (by cost)."""
        return self.shards.default_split(num_stages)

    def valid_tp_sizes(self) -> list[int]:
        """TP sizes whose heads split in whole heads (KV heads shared where fewer than TP)."""
        return list(self._tp_sizes)

    @functools.cached_property
    def _tp_sizes(self) -> tuple:
        return tuple(t for t in range(1, MAX_TP + 1) if tp_problem(self.config, t) is None)

    def check_tp(self, tp: int) -> None:
        if tp not in self.valid_tp_sizes():
            raise ValueError(
                f"tp={tp} does not split {self.architecture}'s attention heads in whole heads; "
                f"TP sizes it takes: {self.valid_tp_sizes()}"
            )


def _rows(held: dict, names) -> tuple:
    seen, rows = set(), []
    for n in names:
        numel, tensor, dim0 = held[n]
        if tensor not in seen:
            seen.add(tensor)
            rows.append((dim0, numel))
    return tuple(rows)


@functools.lru_cache(maxsize=64)
def hf_rank_shapes(model: HFModel, tp: int, ep: int = 1) -> RankShapes:
    """Rank 0's shards (the largest, by the shard policy) of one decoder layer (the largest
    layer), the embedding and the final norm and head at TP ``tp`` and EP ``ep``."""
    shards = model.shards
    held = shards.shards(tp, 0, ep, 0)
    by_layer: dict = {}
    first, last = [], []
    for name in held:
        part = shards.part_of(name)
        if part == "layer":
            by_layer.setdefault(shards.layer_of(name), []).append(name)
        elif part == "last":
            last.append(name)
        else:
            first.append(name)
    layer_names = max(by_layer.values(), key=lambda ns: sum(held[n][0] for n in ns))
    layer_rows, emb_rows = _rows(held, layer_names), _rows(held, first)
    # a tied head is its own tensor on the last stage: counted there as the native model does
    final_rows = tuple((held[n][2], held[n][0]) for n in last)
    q, kv, head_dim = shards.heads_on(tp, 0)
    head = [n for n in last if held[n][2] and n.endswith("weight")]
    vocab = max((held[n][2] for n in head), default=model.vocab_size)
    inter = [shard_sizes(width, tp)[0] for width in mlp_widths(model.config).values()]
    return RankShapes(
        embedding=sum(n for _, n in emb_rows),
        layer=sum(n for _, n in layer_rows),
        final=sum(n for _, n in final_rows),
        layer_tensors=len(layer_rows),
        embedding_tensors=len(emb_rows),
        final_tensors=len(final_rows),
        largest=max(numel for numel, _, _ in held.values()),
        layer_rows=layer_rows,
        embedding_rows=emb_rows,
        final_rows=final_rows,
        q_heads=q,
        kv_heads=kv,
        head_dim=head_dim,
        intermediate=max(inter, default=0),
        vocab=vocab,
        layer_flop_params=_active_layer_params(model, held, layer_names, ep),
        expert_rows=_rows(held, [n for n in layer_names if ".experts." in n]),
    )


def _active_layer_params(model: HFModel, held: dict, layer_names, ep: int) -> int:
    """The layer parameters every token's matmuls run through: all of a dense layer; of an MoE
    layer, the dense part and its top-k experts' share (a rank computes as many token-expert
    pairs with EP as without: its experts' tokens from every EP rank)."""
    expert_names = [n for n in layer_names if ".experts." in n]
    total = sum(held[n][0] for n in layer_names)
    if not expert_names or not model.experts_per_token:
        return total
    experts = sum(held[n][0] for n in expert_names)
    local = shard_sizes(model.shards.num_experts, ep)[0]
    return total - experts + model.experts_per_token * experts // max(local, 1) // ep


@functools.lru_cache(maxsize=16)
def hf_activation_fit(model: HFModel, dtype: str):
    return fit_layer_activations(model.config, as_torch_dtype(dtype))


def hf_layer_activation_bytes(s: RankShapes, model: HFModel, b, seq, c, tp, ep, dtype,
                              dp=1, imbalance=1.0) -> int:  # fmt: skip
    """What one converted decoder layer saves for backward on TP rank 0 (the fit, with this
    rank's query and KV heads and MLP widths, and what tp_ext's EP layer saves instead of the
    block's routed rows: :func:`routed_rows_bytes`)."""
    fit = hf_activation_fit(model, dtype)
    local = {"H": s.q_heads, "KV": s.kv_heads}
    local.update({f: shard_sizes(v, tp)[0] for f, v in mlp_widths(model.config).items()})
    saved = fit.bytes(b, seq, local)
    if ep > 1:
        saved += routed_rows_bytes(s, model, b * seq, c, tp, dp, ep, imbalance)
    return int(round(saved))


def routed_rows_bytes(s: RankShapes, model: HFModel, tokens, c, tp, dp, ep, imbalance) -> float:
    """What ExpertParallelMoE saves for the rows its experts receive, beyond what the fit (the
    block unconverted, every routed row of this rank's tokens through its experts) counts.

    The rank's experts (L of E) get ``imbalance`` x their even share of the EP group's routed
    rows: tokens x top-k x L x ep / E (the busiest rank's over its share; a capacity factor
    bounds it). Per row its experts save their input, gate/up's output and the activation's
    tensors (with a fused SiLU one, else two of [row, inter]) and down_proj's input; with more
    than one local expert the regroup's permute and unpermute save the received rows and the
    experts' output too, and its int64 row map. EP across TP ranks (ep > dp): each TP rank
    routes its share of the tokens through whole experts."""
    experts, k, h = model.shards.num_experts, model.experts_per_token, model.hidden_size
    local = shard_sizes(experts, ep)[0]
    across_tp = dp % ep != 0
    routed = tokens / tp if across_tp else tokens
    rows = imbalance * routed * k * local * ep / experts
    acts = 3 if _fused_swiglu(model.config) else 4
    inter = max(mlp_widths(model.config).values()) if across_tp else s.intermediate
    extra = rows * (h + acts * inter) * c - tokens * k * (h + acts * s.intermediate) * c
    if local > 1:
        extra += rows * (2 * h * c + 8)
    return extra


def _fused_swiglu(config) -> bool:
    """ParallelExperts runs SiLU fused with the product (saving gate/up's output alone) when
    the block's activation is torch's nn.SiLU."""
    from transformers.activations import ACT2FN

    return isinstance(ACT2FN[getattr(config, "hidden_act", "silu")], torch.nn.SiLU)


@functools.lru_cache(maxsize=16)
def hf_op_counts(model: HFModel) -> dict:
    """Operators one micro-batch dispatches: per decoder layer (forward + backward, and forward
    alone), for the embedding and for the head and loss; counted on the narrow copy."""
    from transformers import AutoModelForCausalLM

    shards = model.shards
    with torch.device("meta"):
        narrow = AutoModelForCausalLM.from_config(narrow_config(model.config))
    narrow = narrow.to_empty(device="cpu")
    with torch.no_grad():
        for p in narrow.parameters():
            p.normal_(0.0, 0.02, generator=torch.Generator().manual_seed(0))
    layers = narrow.get_submodule(shards.structure.layers_path)
    marks = {}
    counter = CountOps()

    def mark(key):
        def hook(*_):  # returns None: the layer's inputs and outputs stay as they are
            marks.setdefault(key, counter.n)

        return hook

    hooks = [
        layers[0].register_forward_pre_hook(mark("start")),
        layers[-1].register_forward_hook(mark("end")),
    ]
    ids = torch.randint(0, narrow.config.vocab_size, (1, 8), generator=torch.Generator())
    try:
        with counter:
            logits = narrow(input_ids=ids, use_cache=False).logits
            loss = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:])
            forward = counter.n
            loss.backward()
    finally:
        for h in hooks:
            h.remove()
    n_layers = len(layers)
    layer_forward = (marks["end"] - marks["start"]) / n_layers
    scale = counter.n / forward  # the backward in the forward's proportions
    return {
        "layer": round(layer_forward * scale),
        "layer_forward": round(layer_forward),
        "embedding": round(marks["start"] * scale),
        "head": round((forward - marks["end"]) * scale),
    }
