"""What one decoder layer of a Hugging Face model saves for backward, measured: the narrow copy
of the architecture (see :mod:`.shards`) runs forward at a dozen small sizes, the bytes its
decoder layers save (parameters excluded, each storage once) are recorded, and a least-squares
fit over the terms a layer's saved tensors can have (tokens x hidden, tokens x query width,
tokens x KV width, tokens x each MLP width, tokens x experts, sequences x heads x sequence^2,
...) gives the bytes at any size. Saved tensors are products of these sizes, so the fit is
exact when the terms cover them; the planner reads it per TP rank (query, KV and MLP widths and
heads split over TP, the rest whole).

A model whose head_dim follows from its width (GPT-2, OPT: hidden = heads x head_dim) cannot
tell hidden-wide from query-wide tensors apart; both count as hidden-wide, whole on every TP
rank: an over-estimate at TP > 1, never an under-estimate."""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np
import torch

from tp_ext.models.hf.shards import (
    NARROW_HEAD_DIM,
    NARROW_INTERMEDIATE,
    expert_count,
    mlp_widths,
    model_shards,
    narrow_config,
)
from tp_ext.parallelize.modules import fuse_rms_norms

__all__ = ["ActivationFit", "fit_layer_activations"]

# (name, value from the sizes, split over TP); sizes: b, s, h, d, H, KV, E and one per MLP width
_BASE_TERMS: list[tuple[str, Callable[[dict], float], bool]] = [
    ("tokens*hidden", lambda z: z["b"] * z["s"] * z["h"], False),
    ("tokens*q", lambda z: z["b"] * z["s"] * z["H"] * z["d"], True),
    ("tokens*kv", lambda z: z["b"] * z["s"] * z["KV"] * z["d"], True),
    ("tokens*head_dim", lambda z: z["b"] * z["s"] * z["d"], False),
    ("seq*head_dim", lambda z: z["s"] * z["d"], False),
    ("tokens*heads", lambda z: z["b"] * z["s"] * z["H"], True),
    ("batch*heads*seq^2", lambda z: z["b"] * z["H"] * z["s"] ** 2, True),
    ("batch*seq^2", lambda z: z["b"] * z["s"] ** 2, False),  # a [b, 1, s, s] mask
    ("tokens*experts", lambda z: z["b"] * z["s"] * z["E"], False),
    ("tokens", lambda z: z["b"] * z["s"], False),
    ("one", lambda z: 1.0, False),
]


@dataclasses.dataclass(frozen=True)
class ActivationFit:
    """Bytes one decoder layer saves for backward, as a sum of ``coefficients[term] x term``;
    :meth:`bytes` evaluates it for ``b`` sequences of ``s`` tokens on one TP rank."""

    terms: tuple  # (name, split over TP)
    coefficients: tuple
    sizes: dict  # the full model's: h, d, H, KV, E and the MLP widths

    def bytes(self, b: int, s: int, local: dict) -> float:
        """``local``: this TP rank's shares (H, KV and each MLP width); the rest as the
        model's."""
        sizes = dict(self.sizes, b=b, s=s)
        split = dict(sizes, **local)
        total = 0.0
        for (name, sharded), c in zip(self.terms, self.coefficients):
            total += c * _term(name)(split if sharded else sizes)
        return max(total, 0.0)


def _term(name: str) -> Callable[[dict], float]:
    for n, f, _ in _BASE_TERMS:
        if n == name:
            return f
    field = name.split("*", 1)[1]
    return lambda z: z["b"] * z["s"] * z[field]


def _mlp_fields(config) -> list[str]:
    return list(mlp_widths(config))


def _derived_head_dim(config) -> bool:
    """hidden = heads x head_dim by construction (no head_dim field of its own)."""
    return not isinstance(getattr(config, "head_dim", None), int)


def _full_sizes(config, fields) -> dict:
    heads = config.num_attention_heads
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    sizes = {
        "h": hidden,
        "d": head_dim,
        "H": heads,
        "KV": getattr(config, "num_key_value_heads", None) or heads,
        "E": expert_count(config),
    }
    sizes.update({f: getattr(config, f) for f in fields})
    return sizes


def _points(config, fields) -> list[dict]:
    """Narrow sizes to measure at: a base and one change (or two) of each size at a time."""
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    kv = kv or heads
    d0 = NARROW_HEAD_DIM
    derived = _derived_head_dim(config)
    base = {"b": 2, "s": 8, "d": d0, "H": heads, "KV": kv}
    base.update({f: NARROW_INTERMEDIATE for f in fields})
    changes = [
        {},
        {"b": 3},
        {"s": 12},
        {"s": 16},
        {"b": 3, "s": 12},
        {"d": d0 + 4},
        {"d": d0 + 8, "s": 12},
        {"H": 2 * heads},
        {"H": 2 * heads, "b": 1, "s": 16},
        {"b": 1, "s": 20},
        {"d": d0 + 4, "b": 3, "s": 16},
    ]
    if not derived:
        changes.append({"h_extra": 16})
    if kv < heads:
        changes += [{"KV": heads}, {"KV": heads, "H": 2 * heads, "s": 12}]
    changes += [{f: NARROW_INTERMEDIATE + 8 * (i + 1)} for i, f in enumerate(fields)]
    points = []
    for change in changes:
        point = dict(base, **{k: v for k, v in change.items() if k != "h_extra"})
        extra = 0 if derived else 8 + change.get("h_extra", 0)
        point["h"] = point["H"] * point["d"] + extra
        points.append(point)
    return points


def _narrow_at(config, point: dict, fields):
    narrow = narrow_config(config)
    if _uniform_layers(config):  # one layer says what each saves
        narrow.num_hidden_layers = 1
        if isinstance(getattr(narrow, "layer_types", None), (list, tuple)):
            narrow.layer_types = list(narrow.layer_types[:1])
    narrow.num_attention_heads = point["H"]
    if hasattr(narrow, "num_key_value_heads"):
        narrow.num_key_value_heads = point["KV"]
    for name in ("hidden_size", "n_embd", "word_embed_proj_dim"):
        if isinstance(getattr(narrow, name, None), int):
            setattr(narrow, name, point["h"])
    if not _derived_head_dim(config):
        narrow.head_dim = point["d"]
    for f in fields:
        setattr(narrow, f, point[f])
    # the attention the model trains with (sdpa by default), not the trace's eager one
    narrow._attn_implementation = getattr(config, "_attn_implementation", None)
    return narrow


def _SEED() -> torch.Generator:
    return torch.Generator().manual_seed(0)


def _uniform_layers(config) -> bool:
    """Every decoder layer built alike (same modules, same shapes) and run alike (no per-layer
    attention kinds): measuring one layer is measuring each."""
    shards = model_shards(config)
    kinds = getattr(config, "layer_types", None)
    if isinstance(kinds, (list, tuple)) and len(set(kinds)) > 1:
        return False
    per_layer: dict = {}
    for name, numel in shards.numel.items():
        layer = shards.layer_of(name)
        if layer is not None:
            suffix = name.split(".", shards.structure.layers_path.count(".") + 2)[-1]
            per_layer.setdefault(layer, set()).add((suffix, numel))
    return len({frozenset(v) for v in per_layer.values()}) <= 1


def _saved_bytes_per_layer(config, point: dict, fields, dtype: torch.dtype) -> float:
    """The average bytes a decoder layer of the narrow model at ``point`` saves for backward
    (its parameters and buffers excluded, every storage counted once)."""
    from transformers import AutoModelForCausalLM

    narrow = _narrow_at(config, point, fields)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(narrow, dtype=dtype)
    model = model.to_empty(device="cpu")  # values do not change what is saved, only sizes do
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        for buf in model.buffers():
            if buf.is_floating_point():
                buf.zero_()
    fuse_rms_norms(model)  # the norms as parallelize runs them (the fused op saves less)
    layers = model.get_submodule(model_shards(config).structure.layers_path)
    # parameters and buffers (a causal-mask table) are the model's, not activations
    params = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    saved: dict = {}
    inside = [False]

    def pack(t):
        storage = t.untyped_storage()
        if inside[0] and storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    handles = []
    for layer in layers:
        handles.append(layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True)))
        handles.append(layer.register_forward_hook(lambda *_: inside.__setitem__(0, False)))
    # tokens spread over the experts (routing decides which expert saves what; in all, every
    # token goes to its top k)
    ids = torch.randint(0, narrow.vocab_size, (point["b"], point["s"]), generator=_SEED())
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return sum(saved.values()) / len(layers)


def fit_layer_activations(config, dtype: torch.dtype) -> ActivationFit:
    """The fit of one decoder layer's saved bytes for ``config`` in ``dtype`` (a dozen forwards
    of the narrow copy; about a second)."""
    fields = _mlp_fields(config)
    terms = [(n, sharded) for n, _, sharded in _BASE_TERMS]
    if _derived_head_dim(config):  # hidden = heads x head_dim: q-wide is hidden-wide
        terms = [t for t in terms if t[0] != "tokens*q"]
    kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    if kv == config.num_attention_heads:  # KV-wide tensors are as wide as queries' then
        terms = [t for t in terms if t[0] != "tokens*kv"]
    if not expert_count(config):
        terms = [t for t in terms if t[0] != "tokens*experts"]
    terms += [(f"tokens*{f}", True) for f in fields]
    points = _points(config, fields)
    for p in points:
        p["E"] = expert_count(config)
    rows = np.array([[_term(n)(p) for n, _ in terms] for p in points], dtype=np.float64)
    measured = np.array([_saved_bytes_per_layer(config, p, fields, dtype) for p in points])
    coefficients, *_ = np.linalg.lstsq(rows, measured, rcond=None)
    sizes = _full_sizes(config, fields)
    return ActivationFit(tuple(terms), tuple(float(c) for c in coefficients), sizes)
