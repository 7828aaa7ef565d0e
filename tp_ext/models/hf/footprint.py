"""The footprint of a Hugging Face decoder over TP x PP (x DP, x EP): what ``tp-ext plan --model``
prints, in the fields of the native model's :func:`tp_ext.models.footprint.pipeline_footprint`
(so :func:`~tp_ext.models.footprint.format_pipeline_footprint` prints it), counted from the
model converted rank by rank on the meta device (:mod:`.shards`). With ``ep > 1`` (MoE models)
the rank rows are per (pp rank, EP rank, TP rank): an EP rank holds its share of the experts."""

from __future__ import annotations

import types

from tp_ext.models.footprint import (
    check_dims_arguments,
    layer_pattern,
    rank_entry,
    stage_entry,
)
from tp_ext.models.hf.shards import HFModelShards, model_shards
from tp_ext.sharding import StageSplit
from tp_ext.validation import DTYPE_BYTES, ArgumentError

__all__ = ["hf_pipeline_footprint"]


def _check_ep(shards: HFModelShards, ep: int, pp: int, dp: int) -> None:
    if ep == 1:
        return
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ArgumentError("ep", f"ep must be an int >= 1, got {ep!r}")
    if not shards.moe:
        raise ArgumentError(
            "ep", f"ep={ep} splits MoE experts, and {shards.architecture} has none: use ep=1"
        )
    if dp % ep:
        raise ArgumentError(
            "ep",
            f"ep={ep} must divide dp={dp}: the footprint counts expert groups taken from the DP "
            "ranks (ep dividing dp)",
        )


def _stage_holdings(shards: HFModelShards, held: dict, placement: StageSplit) -> dict:
    """``{stage: {name: numel}}`` of one rank's converted model: layers by their stage, the
    modules before them on the first stage, after them on the last (a tied head's weight is
    the last stage's own copy under pipelining), anything else on every stage; a tensor
    under two names counts once per stage."""
    out: dict = {s: {} for s in range(placement.num_stages)}
    seen: dict = {s: set() for s in out}
    stage_of_layer = {i: s for s in out for i in placement.layers_of(s)}
    for name, (numel, tensor, _) in held.items():
        part = shards.part_of(name)
        if part == "layer":
            stages = [stage_of_layer[shards.layer_of(name)]]
        elif part == "first":
            stages = [0]
        elif part == "last":
            stages = [placement.last_stage]
        else:
            stages = list(out)
        for s in stages:
            if tensor not in seen[s]:
                seen[s].add(tensor)
                out[s][name] = numel
    return out


def _stage_rows(shards, placement, per_rank, tp, ep, element) -> tuple[list, dict]:
    """Per stage: each TP rank's shard (EP rank 0's, the largest share of experts) and, over
    the tp x ep ranks holding one copy of the model, what is held more than once."""
    stages, replicated = [], {}
    for stage in range(placement.num_stages):
        layers = placement.layers_of(stage)
        rows = []
        for tp_rank in range(tp):
            count = sum(per_rank[tp_rank, 0][stage].values())
            q, kv, head_dim = shards.heads_on(tp, tp_rank)
            rows.append(
                {
                    "tp_rank": tp_rank,
                    "parameters": count,
                    "bytes": count * element,
                    "query_heads": q,
                    "kv_heads": kv,
                    "kv_cache_bytes_per_token": 2 * len(layers) * kv * head_dim * element,
                }
            )
        extra = _add_replicated(shards, stage, per_rank, tp, ep, element, replicated)
        stages.append(stage_entry(placement, stage, rows, extra, element))
    return stages, replicated


def _add_replicated(shards, stage, per_rank, tp, ep, element, replicated: dict) -> int:
    held = [per_rank[t, e][stage] for t in range(tp) for e in range(ep)]
    stage_extra = 0
    for name in held[0]:
        over = sum(h.get(name, 0) for h in held)
        full = shards.numel[name]
        extra = over - full if name in shards.unique else over
        if not extra:
            continue
        stage_extra += extra
        if name not in shards.unique:
            reason = "tied embedding: the last stage keeps its own copy of the first stage's"
        elif held[0][name] == full:
            reason = "whole tensor on every TP" + (" and EP" if ep > 1 else "") + " rank"
        elif sum(h.get(name, 0) for h in held[::ep]) == full:  # EP rank 0's TP ranks
            reason = "split over TP, repeated on every EP rank"
        else:
            reason = "some rows on more than one TP rank (e.g. KV heads shared by TP ranks)"
        entry = replicated.setdefault(
            layer_pattern(name), {"parameters": 0, "bytes": 0, "reason": reason}
        )
        entry["parameters"] += extra
        entry["bytes"] += extra * element
    return stage_extra


def _rank_rows(placement, per_rank, stages, tp, pp, dp, ep, element) -> list:
    """Per (pp rank, [EP rank,] tp rank): all its stages, and the global ranks holding it (the
    mesh is (pp, dp, tp) row-major; EP rank j takes the DP indices d with d % ep == j)."""
    ranks = []
    for pp_rank in range(pp):
        mine = placement.stages_of(pp_rank)
        for ep_rank in range(ep):
            for tp_rank in range(tp):
                count = sum(sum(per_rank[tp_rank, ep_rank][s].values()) for s in mine)
                glob = [(pp_rank * dp + d) * tp + tp_rank for d in range(dp) if d % ep == ep_rank]
                row = rank_entry(stages, mine, pp_rank, tp_rank, count, element, glob)
                if ep > 1:
                    row["ep_rank"] = ep_rank
                ranks.append(row)
    return ranks


def hf_pipeline_footprint(
    config,
    tp: int,
    pp: int = 1,
    dp: int = 1,
    ep: int = 1,
    virtual_stages: int = 1,
    pipeline_split=None,
    stage_order: str = "loop",
    dtype: str = "bfloat16",
) -> dict:
    """Parameters and bytes of every stage and rank of the Hugging Face model of ``config`` (a
    transformers config) converted by ``parallelize(model, "auto")`` over ``tp`` x ``pp`` x
    ``dp`` ranks (``ep`` of the DP ranks splitting the experts), in ``dtype``; the fields of
    :func:`tp_ext.models.footprint.pipeline_footprint`, and ``ep``."""
    shards = model_shards(config)
    stand_in = types.SimpleNamespace(
        num_hidden_layers=shards.num_layers, check_tp=lambda tp: None
    )  # TP sizes are checked by converting (parallelize names what does not split)
    check_dims_arguments(stand_in, tp, pp, dp, virtual_stages, pipeline_split, stage_order, dtype)
    _check_ep(shards, ep, pp, dp)
    split = list(pipeline_split) if pipeline_split is not None else None
    stages = pp * virtual_stages
    if split is None and shards.num_layers >= stages:  # parallelize's default split
        split = shards.default_split(stages)
    placement = StageSplit(shards.num_layers, pp, virtual_stages, split, stage_order)
    element = DTYPE_BYTES[dtype]
    per_rank = {
        (t, e): _stage_holdings(shards, shards.shards(tp, t, ep, e), placement)
        for t in range(tp)
        for e in range(ep)
    }
    stages, replicated = _stage_rows(shards, placement, per_rank, tp, ep, element)
    ranks = _rank_rows(placement, per_rank, stages, tp, pp, dp, ep, element)
    all_shards = sum(sum(sum(h.values()) for h in held.values()) for held in per_rank.values())
    extra = sum(e["parameters"] for e in replicated.values())
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0)
    _, kv, head_dim = shards.heads_on(1, 0)
    return {
        "architecture": shards.architecture,
        "dtype": dtype,
        "bytes_per_element": element,
        "tp": tp,
        "pp": pp,
        "dp": dp,
        "ep": ep,
        "virtual_stages": virtual_stages,
        "stage_order": stage_order,
        "num_stages": placement.num_stages,
        "world_size": tp * pp * dp,
        "layer_counts": list(placement.layer_counts),
        "parameters_total": shards.total,
        "bytes_total": shards.total * element,
        "all_reduce_bytes_per_token_per_layer": 0 if tp == 1 else 2 * hidden * element,
        "kv_cache_bytes_per_token_total": 2 * shards.num_layers * kv * head_dim * element,
        "parameters_all_shards": all_shards,
        "bytes_all_shards": all_shards * element,
        "replicated": {"parameters": extra, "bytes": extra * element, "by_tensor": replicated},
        "max_rank_parameters": max(r["parameters"] for r in ranks),
        "max_rank_bytes": max(r["bytes"] for r in ranks),
        "p2p_bytes_per_token": hidden * element if placement.num_stages > 1 else 0,
        "bytes_all_ranks_with_dp": dp // ep * all_shards * element,
        "stages": stages,
        "ranks": ranks,
    }
