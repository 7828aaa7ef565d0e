"""A model's footprint: what it costs per rank at a TP degree, computed from the real modules
built on the meta device (nothing is allocated): parameters, bytes, KV cache and communication
per token. :func:`pipeline_footprint` does the same per pipeline stage and per (pp, tp) rank of
one set of TP x PP (x DP) dims: what ``tp-ext plan`` prints. (A "plan" in tp_ext is only
parallelize's map of module names to styles; a "layout" is how one tensor is split.)

A value that does not fit the model raises :class:`~tp_ext.validation.ArgumentError` naming the
argument."""

from __future__ import annotations

import dataclasses
import functools
import re
import types

from tp_ext.dims import ParallelDims
from tp_ext.layers import ResolvedGroup
from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tp_ext.sharding import STAGE_ORDERS, StageSplit
from tp_ext.validation import (
    DTYPE_BYTES,
    ArgumentError,
    as_torch_dtype,
    check_dtype_name,
    check_int,
)

__all__ = [
    "footprint",
    "format_footprint",
    "pipeline_footprint",
    "format_pipeline_footprint",
]


def footprint(config: Qwen2Config, tp: int, dtype: str = "bfloat16") -> dict:
    """Per-rank and total counts for ``config`` split over ``tp`` ranks, in ``dtype``."""
    config.check_tp(tp)
    torch_dtype = as_torch_dtype(check_dtype_name(dtype))
    element = DTYPE_BYTES[dtype]
    ranks = []
    for rank in range(tp):
        model = Qwen2ForCausalLM(
            config, ResolvedGroup.virtual(tp, rank), device="meta", dtype=torch_dtype
        )
        params = sum(p.numel() for p in model.parameters())
        attn = model.model.layers[0].self_attn
        kv_per_token = (
            2 * config.num_hidden_layers * attn.num_kv_heads_local * attn.head_dim * element
        )
        ranks.append(
            {
                "rank": rank,
                "parameters": params,
                "bytes": {dtype: params * element},
                "query_heads": attn.num_heads_local,
                "kv_heads": attn.num_kv_heads_local,
                "kv_cache_bytes_per_token": kv_per_token,
            }
        )
    full = Qwen2ForCausalLM(config, ResolvedGroup.local(), device="meta", dtype=torch_dtype)
    total = sum(p.numel() for p in full.parameters())
    # Forward: one all-reduce of hidden-size activations after attention and one after the MLP.
    all_reduce = 0 if tp == 1 else 2 * config.hidden_size * element
    return {
        "architecture": config.architecture,
        "tp": tp,
        "dtype": dtype,
        "parameters_total": total,
        "bytes_total": total * element,
        "all_reduce_bytes_per_token_per_layer": all_reduce,
        # the unsharded model's (replicated KV heads are not counted twice)
        "kv_cache_bytes_per_token_total": (
            2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
        ),
        "ranks": ranks,
    }


def format_footprint(fp: dict) -> str:
    lines = [
        f"{fp['architecture']} over tp={fp['tp']} ranks, {fp['dtype']}: "
        f"{fp['parameters_total']:,} parameters ({fp['bytes_total']:,} bytes) in all",
        f"all-reduce per token per layer (forward): "
        f"{fp['all_reduce_bytes_per_token_per_layer']:,} bytes",
        f"KV cache per token, whole model: {fp['kv_cache_bytes_per_token_total']:,} bytes",
        f"{'rank':>4} {'parameters':>16} {'bytes':>18} {'q heads':>8} {'kv heads':>9} "
        f"{'KV bytes/token':>15}",
    ]
    for r in fp["ranks"]:
        lines.append(
            f"{r['rank']:>4} {r['parameters']:>16,} {r['bytes'][fp['dtype']]:>18,} "
            f"{r['query_heads']:>8} {r['kv_heads']:>9} "
            f"{r['kv_cache_bytes_per_token']:>15,}"
        )
    return "\n".join(lines)


def _even_counts(num_layers: int, virtual_stages: int) -> list[int]:
    return [
        p
        for p in range(1, num_layers // virtual_stages + 1)
        if num_layers % (p * virtual_stages) == 0
    ]


def _argument(name: str, check, *args):
    """``check(*args)``, its ValueError raised as an ArgumentError naming ``name``."""
    try:
        return check(*args)
    except ValueError as e:  # ConfigError included
        raise ArgumentError(name, str(e)) from None


def check_dims_arguments(config, tp, pp, dp, virtual_stages, split, order, dtype):
    """Every value checked before anything is built; errors (ArgumentError) name the argument,
    the value and what works. ``config``: anything with ``num_hidden_layers`` and
    ``check_tp(tp)`` (the Hugging Face footprint passes a stand-in)."""
    for name, value in (("tp", tp), ("pp", pp), ("dp", dp), ("virtual_stages", virtual_stages)):
        _argument(name, check_int, name, value)
    _argument("dtype", check_dtype_name, dtype)
    _argument("tp", config.check_tp, tp)
    if order not in STAGE_ORDERS:
        raise ArgumentError(
            "stage_order", f"stage_order must be one of {STAGE_ORDERS}, got {order!r}"
        )
    if order == "v" and virtual_stages != 2:
        raise ArgumentError(
            "virtual_stages",
            f"stage_order='v' puts two stages on each pipeline rank: it needs virtual_stages=2, "
            f"got virtual_stages={virtual_stages}",
        )
    layers = config.num_hidden_layers
    stages = pp * virtual_stages
    if split is None:
        if virtual_stages > layers:
            raise ArgumentError(
                "virtual_stages",
                f"virtual_stages={virtual_stages} gives more stages than the {layers} decoder "
                f"layers; every stage needs at least one layer: use virtual_stages <= {layers}",
            )
        if stages > layers:
            raise ArgumentError(
                "pp",
                f"pp={pp} x virtual_stages={virtual_stages} = {stages} pipeline stages, but the "
                f"model has {layers} decoder layers and every stage needs at least one: use "
                f"pp <= {layers // virtual_stages} (pp that split the layers evenly with "
                f"virtual_stages={virtual_stages}: {_even_counts(layers, virtual_stages)})",
            )
        return
    counts = list(split) if isinstance(split, (list, tuple)) else None
    default = StageSplit(layers, pp, virtual_stages).layer_counts if stages <= layers else None
    hint = f"; the default split would be {default}" if default else ""
    if counts is None or any(isinstance(c, bool) or not isinstance(c, int) for c in counts):
        raise ArgumentError(
            "pipeline_split",
            f"pipeline_split must be a list of layer counts, one per stage, got {split!r}{hint}",
        )
    if len(counts) != stages:
        other = (
            f", or pp={len(counts) // virtual_stages} for {len(counts)} stages"
            if len(counts) % virtual_stages == 0 and len(counts) >= virtual_stages
            else ""
        )
        raise ArgumentError(
            "pipeline_split",
            f"pipeline_split lists {len(counts)} stages ({split!r}) but pp={pp} x "
            f"virtual_stages={virtual_stages} makes {stages}: give {stages} layer counts"
            f"{other}{hint}",
        )
    if min(counts) < 1 or sum(counts) != layers:
        raise ArgumentError(
            "pipeline_split",
            f"pipeline_split must give every stage at least one layer and sum to the model's "
            f"{layers} decoder layers; got {split!r} (sum {sum(counts)}){hint}",
        )


def _reason(config: Qwen2Config, tp: int, why: str, local: int, full: int) -> str:
    if why == "stages":
        return "tied embedding: the last stage keeps its own copy of the first stage's"
    if local == full:
        return "whole tensor on every TP rank"
    kv = config.num_key_value_heads
    if kv < tp:
        return f"KV heads shared by TP ranks (num_key_value_heads={kv} < tp={tp})"
    return "some rows on more than one TP rank"


def layer_pattern(name: str) -> str:
    """A parameter's name with its layer index replaced by ``*``."""
    return re.sub(r"\.layers\.\d+\.", ".layers.*.", name)


def _build(config, tp, tp_rank, pp, pp_rank, virtual_stages, split, order, dtype):
    """One rank's model on the meta device, through the real class (its constructor reads only
    these attributes of ``parallel``)."""
    stand_in = types.SimpleNamespace(
        dims=ParallelDims(tp=tp, pp=pp), tp_group=ResolvedGroup.virtual(tp, tp_rank), pp=pp,
        pp_rank=pp_rank,
    )  # fmt: skip
    return Qwen2ForCausalLM(
        config,
        parallel=stand_in,
        device="meta",
        dtype=dtype,
        virtual_stages=virtual_stages,
        pipeline_split=split,
        stage_order=order,
    )


@functools.lru_cache(maxsize=4)
def _full_counts(config: Qwen2Config) -> tuple[dict[str, int], frozenset, int]:
    """The unsharded model's elements per parameter name (a tied weight's alias included), the
    names of its distinct tensors, and its total."""
    full = Qwen2ForCausalLM(config, ResolvedGroup.local(), device="meta")
    numel = {n: p.numel() for n, p in full.named_parameters(remove_duplicate=False)}
    unique = frozenset(n for n, _ in full.named_parameters())
    return numel, unique, sum(p.numel() for p in full.parameters())


def _tp_shape_classes(config, tp, dtype) -> dict[int, int]:
    """Each TP rank mapped to the first TP rank whose shards have the same shapes. Every decoder
    layer is built from the same arguments, so a one-layer model at full width shows every
    shape a rank's layers, embedding and head take."""
    one_layer = config.replace(num_hidden_layers=1)
    first_of: dict[tuple, int] = {}
    classes = {}
    for rank in range(tp):
        model = Qwen2ForCausalLM(
            one_layer, ResolvedGroup.virtual(tp, rank), device="meta", dtype=dtype
        )
        shapes = tuple((n, tuple(p.shape)) for n, p in model.named_parameters())
        classes[rank] = first_of.setdefault(shapes, rank)
    return classes


def pipeline_footprint(
    config: Qwen2Config,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    virtual_stages: int = 1,
    pipeline_split=None,
    stage_order: str = "loop",
    dtype: str = "bfloat16",
) -> dict:
    """Parameters and bytes (in ``dtype``) of every pipeline stage's TP shard on every TP rank,
    per (pp rank, tp rank), and in total, for ``config`` over ``tp`` x ``pp`` (x ``dp``) ranks.

    Computed from the real :class:`Qwen2ForCausalLM` built on the meta device for one rank per
    pipeline rank and per distinct TP shard shape (:class:`StageSplit` decides which layers
    each stage holds). ``replicated`` counts the elements held more than once within one DP
    replica, against the full model: norms on every TP rank, KV heads shared by TP ranks when
    ``num_key_value_heads < tp``, a tied embedding's copy on the last stage. So
    ``parameters_all_shards == parameters_total + replicated.parameters``. Data parallelism
    replicates all of it ``dp`` times (DDP; FSDP2 shards each replica's tensors over ``dp``).
    """
    check_dims_arguments(config, tp, pp, dp, virtual_stages, pipeline_split, stage_order, dtype)
    split = list(pipeline_split) if pipeline_split is not None else None
    placement = StageSplit(config.num_hidden_layers, pp, virtual_stages, split, stage_order)
    element = DTYPE_BYTES[dtype]
    shards = _stage_shards(config, tp, pp, virtual_stages, split, stage_order, dtype)
    stages, replicated = _stage_rows(config, tp, placement, shards, element)
    ranks = _rank_rows(tp, pp, dp, placement, stages, element)
    full_total = _full_counts(config)[2]
    all_shards = sum(s["parameters"] for s in stages)
    extra = sum(e["parameters"] for e in replicated.values())
    return {
        "architecture": config.architecture,
        "dtype": dtype,
        "bytes_per_element": element,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "virtual_stages": virtual_stages,
        "stage_order": stage_order,
        "num_stages": placement.num_stages,
        "world_size": tp * pp * dp,
        "layer_counts": list(placement.layer_counts),
        # the unsharded model's, as footprint() reports them
        "parameters_total": full_total,
        "bytes_total": full_total * element,
        "all_reduce_bytes_per_token_per_layer": 0 if tp == 1 else 2 * config.hidden_size * element,
        "kv_cache_bytes_per_token_total": (
            2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element
        ),
        "parameters_all_shards": all_shards,
        "bytes_all_shards": all_shards * element,
        "replicated": {"parameters": extra, "bytes": extra * element, "by_tensor": replicated},
        "max_rank_parameters": max(r["parameters"] for r in ranks),
        "max_rank_bytes": max(r["bytes"] for r in ranks),
        # forward: one [tokens, hidden] activation from each stage to the next (and its
        # gradient back), TP-replicated on every TP rank
        "p2p_bytes_per_token": config.hidden_size * element if placement.num_stages > 1 else 0,
        "bytes_all_ranks_with_dp": dp * all_shards * element,
        "stages": stages,
        "ranks": ranks,
    }


@dataclasses.dataclass
class _Shards:
    """What the meta-built models hold, per pipeline stage and representative TP rank (the
    first TP rank of each shard shape): ``held[stage, rep]`` its parameters' elements by name;
    its KV and query heads per layer; each TP rank's representative."""

    held: dict
    kv_heads: dict
    q_heads: dict
    head_dim: int
    rep_of: dict


def _stage_shards(config, tp, pp, virtual_stages, split, order, dtype) -> _Shards:
    """One model per pipeline rank and distinct TP shard shape, built on the meta device."""
    torch_dtype = as_torch_dtype(dtype)
    rep_of = _tp_shape_classes(config, tp, torch_dtype)
    shards = _Shards({}, {}, {}, 0, rep_of)
    for pp_rank in range(pp):
        for rep in sorted(set(rep_of.values())):
            model = _build(config, tp, rep, pp, pp_rank, virtual_stages, split, order, torch_dtype)
            names = {id(p): n for n, p in model.named_parameters()}
            for stage_module in model.stage_modules():
                shards.held[stage_module.stage, rep] = {
                    names[id(p)]: p.numel() for p in stage_module.parameters()
                }
            attn = next(iter(model.model.layers)).self_attn
            shards.kv_heads[rep], shards.q_heads[rep] = (
                attn.num_kv_heads_local,
                attn.num_heads_local,
            )
            shards.head_dim = attn.head_dim
    return shards


def _stage_rows(config, tp, placement, shards: _Shards, element: int) -> tuple[list, dict]:
    """Per stage: each TP rank's shard; and what is replicated, by tensor name pattern."""
    stages, replicated = [], {}
    for stage in range(placement.num_stages):
        layers = placement.layers_of(stage)
        per_tp = []
        for tp_rank in range(tp):
            rep = shards.rep_of[tp_rank]
            count = sum(shards.held[stage, rep].values())
            kv_bytes = 2 * len(layers) * shards.kv_heads[rep] * shards.head_dim * element  # k, v
            per_tp.append(
                {
                    "tp_rank": tp_rank,
                    "parameters": count,
                    "bytes": count * element,
                    "query_heads": shards.q_heads[rep],
                    "kv_heads": shards.kv_heads[rep],
                    "kv_cache_bytes_per_token": kv_bytes,
                }
            )
        stage_extra = _add_replicated(config, tp, stage, shards, element, replicated)
        stages.append(stage_entry(placement, stage, per_tp, stage_extra, element))
    return stages, replicated


def stage_entry(placement: StageSplit, stage: int, tp_rows: list, extra: int, element: int):
    """One stage's row of a footprint: its layers, parts and TP ranks' shards."""
    layers = placement.layers_of(stage)
    total = sum(r["parameters"] for r in tp_rows)
    return {
        "stage": stage,
        "pp_rank": placement.rank_of(stage),
        "first_layer": layers.start,
        "last_layer": layers.stop - 1,
        "num_layers": len(layers),
        "embedding": stage == 0,
        "head": stage == placement.last_stage,
        "parameters": total,
        "bytes": total * element,
        "replicated_parameters": extra,
        "tp_ranks": tp_rows,
    }


def _add_replicated(config, tp, stage, shards: _Shards, element, replicated: dict) -> int:
    """Adds to ``replicated`` the elements ``stage`` holds more than once over its TP ranks (or
    as a tied weight's own copy); returns how many."""
    full_numel, full_unique, _ = _full_counts(config)
    first = shards.held[stage, shards.rep_of[0]]
    stage_extra = 0
    for name in first:
        over_tp = sum(shards.held[stage, shards.rep_of[r]][name] for r in range(tp))
        if name in full_unique:
            extra, why = over_tp - full_numel[name], "TP"
        else:  # a tied weight's own copy on this stage
            extra, why = over_tp, "stages"
        if not extra:
            continue
        stage_extra += extra
        reason = _reason(config, tp, why, first[name], full_numel[name])
        entry = replicated.setdefault(
            layer_pattern(name), {"parameters": 0, "bytes": 0, "reason": reason}
        )
        entry["parameters"] += extra
        entry["bytes"] += extra * element
    return stage_extra


def _rank_rows(tp, pp, dp, placement, stages: list, element: int) -> list:
    """Per (pp rank, tp rank): all its stages, and the global ranks holding it (the mesh is
    (pp, dp, tp), row-major)."""
    ranks = []
    for pp_rank in range(pp):
        mine = placement.stages_of(pp_rank)
        for tp_rank in range(tp):
            count = sum(stages[s]["tp_ranks"][tp_rank]["parameters"] for s in mine)
            glob = [(pp_rank * dp + d) * tp + tp_rank for d in range(dp)]
            ranks.append(rank_entry(stages, mine, pp_rank, tp_rank, count, element, glob))
    return ranks


def rank_entry(stages, mine, pp_rank, tp_rank, count, element, global_ranks) -> dict:
    """One (pp rank, tp rank) row of a footprint: its stages ``mine`` (rows of ``stages``), its
    ``count`` of parameters and the global ranks holding it."""
    return {
        "pp_rank": pp_rank,
        "tp_rank": tp_rank,
        "stages": mine,
        "num_layers": sum(stages[s]["num_layers"] for s in mine),
        "parameters": count,
        "bytes": count * element,
        "kv_cache_bytes_per_token": sum(
            stages[s]["tp_ranks"][tp_rank]["kv_cache_bytes_per_token"] for s in mine
        ),
        "global_ranks": global_ranks,
    }


def _spans(values: list) -> list[tuple[int, int]]:
    """Runs of equal consecutive values as (first index, last index)."""
    runs, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            runs.append((start, i - 1))
            start = i
    return runs


def _span(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


def format_pipeline_footprint(fp: dict) -> str:
    """A readable table: per stage (TP ranks with equal shards on one row), per (pp, tp) rank,
    totals and what is replicated."""
    el = fp["bytes_per_element"]
    lines = [
        f"{fp['architecture']} over tp={fp['tp']} x pp={fp['pp']} x dp={fp['dp']} = "
        f"{fp['world_size']} ranks, {fp['num_stages']} pipeline stages "
        f"(virtual_stages={fp['virtual_stages']}, order {fp['stage_order']}), "
        f"{fp['dtype']} ({el} bytes per element)",
        f"layers per stage: {fp['layer_counts']}",
        "",
        "per stage, each TP rank's shard:",
        f"{'stage':>5} {'pp rank':>7} {'layers':>7} {'parts':>9} {'tp ranks':>8} "
        f"{'parameters':>16} {'bytes':>18} {'KV bytes/token':>14}",
    ]
    for s in fp["stages"]:
        parts = "+".join(p for p, on in (("emb", s["embedding"]), ("head", s["head"])) if on) or "-"
        tp_rows = s["tp_ranks"]
        key = [(r["parameters"], r["kv_cache_bytes_per_token"]) for r in tp_rows]
        for i, (a, b) in enumerate(_spans(key)):
            r = tp_rows[a]
            lead = (
                f"{s['stage']:>5} {s['pp_rank']:>7} "
                f"{_span(s['first_layer'], s['last_layer']):>7} {parts:>9}"
                if i == 0
                else " " * 31
            )
            lines.append(
                f"{lead} {_span(a, b):>8} {r['parameters']:>16,} {r['bytes']:>18,} "
                f"{r['kv_cache_bytes_per_token']:>14,}"
            )
    lines += [
        "",
        "per rank (pp rank, tp rank): all its stages",
        f"{'pp rank':>7} {'tp ranks':>8} {'stages':>8} {'layers':>6} {'parameters':>16} "
        f"{'bytes':>18}  global ranks (one per DP replica)",
    ]
    groups = dict.fromkeys((r["pp_rank"], r.get("ep_rank")) for r in fp["ranks"])
    for pp_rank, ep_rank in groups:  # with EP: each EP rank's TP ranks on their own rows
        rows = [r for r in fp["ranks"] if (r["pp_rank"], r.get("ep_rank")) == (pp_rank, ep_rank)]
        for a, b in _spans([r["parameters"] for r in rows]):
            r = rows[a]
            glob = ", ".join(
                _span(rows[a]["global_ranks"][d], rows[b]["global_ranks"][d])
                for d in range(len(r["global_ranks"]))
            ) + ("" if ep_rank is None else f" (EP rank {ep_rank})")
            lines.append(
                f"{pp_rank:>7} {_span(a, b):>8} {','.join(map(str, r['stages'])):>8} "
                f"{r['num_layers']:>6} {r['parameters']:>16,} {r['bytes']:>18,}  {glob}"
            )
    rep = fp["replicated"]
    lines += [
        "",
        f"{'full model:':<26}{fp['parameters_total']:>16,} parameters "
        f"{fp['bytes_total']:>18,} bytes",
        f"{'all shards (one replica):':<26}{fp['parameters_all_shards']:>16,} parameters "
        f"{fp['bytes_all_shards']:>18,} bytes",
        f"{'replicated (difference):':<26}{rep['parameters']:>16,} parameters "
        f"{rep['bytes']:>18,} bytes",
    ]
    for pattern, e in rep["by_tensor"].items():
        lines.append(
            f"  {pattern}: {e['parameters']:,} parameters, {e['bytes']:,} bytes ({e['reason']})"
        )
    lines += [
        f"largest rank: {fp['max_rank_parameters']:,} parameters, {fp['max_rank_bytes']:,} bytes",
        f"all-reduce per token per layer (forward, per TP group): "
        f"{fp['all_reduce_bytes_per_token_per_layer']:,} bytes",
        f"between stages, per token (forward): {fp['p2p_bytes_per_token']:,} bytes",
        f"KV cache per token, whole model: {fp['kv_cache_bytes_per_token_total']:,} bytes",
        f"all {fp['world_size']} ranks with dp={fp['dp']} replicas (DDP): "
        f"{fp['bytes_all_ranks_with_dp']:,} bytes",
    ]
    return "\n".join(lines)
