"""Where a Hugging Face causal LM's decoder layers are and what runs around them: the decoder
parts a pipeline split keeps per stage (:class:`DecoderParts`, found by running the model once or
given by name) and what each layer costs, for placing layers on stages by cost. The stages
(:mod:`tp_ext.parallelize.stages`) build on it; ``parallelize``'s pipeline checks and
:mod:`tp_ext.models.hf` read it before any stage exists.
"""

from __future__ import annotations

import torch
from torch import nn

from tp_ext.layers.moe import expert_count, experts_per_token
from tp_ext.sharding import balanced_layer_split

__all__ = [
    "DecoderParts",
    "find_decoder_parts",
    "decoder_parts_by_name",
    "pipeline_costs",
    "default_pipeline_split",
]


class DecoderParts:
    """Where a Hugging Face causal LM keeps its decoder layers (``owner.<name>``, a ModuleList
    of ``num_hidden_layers``) and which of its modules with parameters run before them
    (``before``: embeddings) and after them (``after``: final norm, LM head), as
    ``(parent, attribute)`` pairs, found by running the model once on a few tokens."""

    def __init__(self, model: nn.Module, layers_owner: nn.Module, layers_name: str, order):
        self.model, self.layers_owner, self.layers_name = model, layers_owner, layers_name
        self.before, self.after = order

    @property
    def layers(self) -> nn.ModuleList:
        return getattr(self.layers_owner, self.layers_name)


def find_decoder_parts(model: nn.Module, example_inputs) -> DecoderParts:
    """The :class:`DecoderParts` of ``model``, or an error naming what is missing."""
    base, path = _decoder_layers_path(model)
    owner_path, _, layers_name = path.rpartition(".")
    route = [model, base]  # down to the layers' owner
    for attr in owner_path.split(".") if owner_path else []:
        route.append(getattr(route[-1], attr))
    order = _call_order(model, route, layers_name, example_inputs)
    return DecoderParts(model, route[-1], layers_name, order)


def decoder_parts_by_name(model: nn.Module, layers: str, before, after) -> DecoderParts:
    """The :class:`DecoderParts` of ``model`` from module names (``layers``: the decoder-layer
    list's; ``before`` / ``after``: the modules run before / after them), as a trace of another
    model of the same structure found them: a model on the meta device cannot run its own trace.
    """

    def parent_and_attr(name: str):
        parent, _, attr = name.rpartition(".")
        return model.get_submodule(parent) if parent else model, attr

    owner, layers_name = parent_and_attr(layers)
    order = ([parent_and_attr(n) for n in before], [parent_and_attr(n) for n in after])
    return DecoderParts(model, owner, layers_name, order)


def _decoder_layers_path(model: nn.Module) -> tuple[nn.Module, str]:
    """``(base model, path of its decoder-layer ModuleList under it)``, or an error naming what
    is missing."""
    name = type(model).__name__
    config = getattr(model, "config", None)
    if getattr(config, "is_encoder_decoder", False):  # two stacks: not one list of layers
        raise ValueError(
            f"pipeline parallelism (pp > 1) splits one stack of layers (a causal LM's, an "
            f"encoder's); {name} is an encoder-decoder: use pp=1 for it (TP, DDP, FSDP2 and "
            "ZeRO apply)"
        )
    layers_count = getattr(config, "num_hidden_layers", None)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(layers_count, int) or not isinstance(base, nn.Module) or base is model:
        raise ValueError(
            f"pipeline parallelism (pp > 1) splits a Hugging Face causal LM or encoder (a model "
            f"with config.num_hidden_layers and a base model under its base_model_prefix); "
            f"{name} is not one: use pp=1"
        )
    lists = [
        (n, m)
        for n, m in base.named_modules()
        if isinstance(m, nn.ModuleList) and len(m) == layers_count and n
    ]
    if not lists:
        raise ValueError(
            f"pipeline parallelism: {name} has no list of its {layers_count} decoder layers "
            "(an nn.ModuleList of config.num_hidden_layers modules) to split over stages; use pp=1"
        )
    return base, min((n for n, _ in lists), key=lambda n: n.count("."))


def pipeline_costs(model: nn.Module) -> tuple[list[int], int, int]:
    """``(each decoder layer's cost, the embedding's, the LM head's)`` of a Hugging Face causal
    LM, for balancing pipeline stages: multiply-adds per token of its weight matrices (every
    parameter of two or more dims; the routed experts of an MoE layer by the share of them a
    token visits, ``num_experts_per_tok / experts``). Embeddings are lookups (0). The attention
    scores' sequence-long term weighs every layer alike and is left out. Reads shapes only, so a
    model on the meta device works."""
    base, path = _decoder_layers_path(model)
    experts, visited = expert_count(model.config), experts_per_token(model.config)

    def cost(module: nn.Module) -> int:
        total = 0
        for name, param in module.named_parameters():
            if param.dim() < 2:
                continue
            if experts and visited and "experts" in name.split("."):
                total += param.numel() * visited // experts
            else:
                total += param.numel()
        return total

    layers = base.get_submodule(path)
    head = model.get_output_embeddings()
    return [cost(layer) for layer in layers], 0, 0 if head is None else cost(head)


def default_pipeline_split(model: nn.Module, num_stages: int) -> list[int]:
    """Decoder layers per stage when ``pipeline_split`` is not given: the split whose costliest
    stage is cheapest by :func:`pipeline_costs` (:func:`~tp_ext.sharding.balanced_layer_split`;
    the LM head weighs on the last stage). The planner and ``tp-ext plan`` place layers by the
    same function."""
    layer_costs, first, last = pipeline_costs(model)
    return balanced_layer_split(layer_costs, num_stages, first, last)


def _call_order(model, route, layers_name, example_inputs):
    """``(before, after)``: the (parent, attribute) of each module holding parameters outside the
    decoder layers (a child of a module on the ``route`` from the model down to the layers' owner,
    itself off the route), by whether the model's forward calls it before the last layer has run
    or after."""
    owner = route[-1]
    layers = getattr(owner, layers_name)
    candidates = []
    for parent in dict.fromkeys(route):
        for attr, child in parent.named_children():
            if child in route or child is layers:
                continue
            if any(True for _ in child.parameters()):
                candidates.append((parent, attr, child))
    seen: dict = {"layers": 0, "order": {}}  # order: 0 before the last layer ran, 1 after

    def after_layer(*_):
        seen["layers"] += 1

    def called(key):
        def hook(*_):
            seen["order"].setdefault(key, seen["layers"])

        return hook

    handles = [layers[-1].register_forward_hook(after_layer)]
    handles += [c.register_forward_pre_hook(called(i)) for i, (_, _, c) in enumerate(candidates)]
    args, kwargs = example_inputs
    try:
        with torch.no_grad():
            outputs = model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    if not isinstance(getattr(outputs, "logits", None), torch.Tensor):
        raise ValueError(
            f"pipeline parallelism: {type(model).__name__}'s forward returns no .logits; "
            "pp > 1 splits causal LMs (…ForCausalLM); use pp=1"
        )
    before = [(p, a) for i, (p, a, _) in enumerate(candidates) if seen["order"].get(i) == 0]
    after = [(p, a) for i, (p, a, _) in enumerate(candidates) if seen["order"].get(i, 0) > 0]
    return before, after
