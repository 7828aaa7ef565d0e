"""A model's footprint: what it costs per rank at a TP degree, computed from the real modules
built on the meta device (nothing is allocated): parameters, bytes, KV cache and communication
per token. (A "plan" in tp_ext is only parallelize's map of module names to styles; a
"layout" is where tensors live in a checkpoint.)"""

from __future__ import annotations

import torch

from tp_ext.layers import TPGroup
from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

__all__ = ["footprint", "format_footprint"]

_DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def footprint(config: Qwen2Config, tp: int, dtype: str = "bfloat16") -> dict:
    """Per-rank and total counts for ``config`` split over ``tp`` ranks, in ``dtype``."""
    config.check_tp(tp)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    torch_dtype = _DTYPES[dtype]
    element = torch.empty((), dtype=torch_dtype).element_size()
    ranks = []
    for rank in range(tp):
        model = Qwen2ForCausalLM(
            config, TPGroup.virtual(tp, rank), device="meta", dtype=torch_dtype
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
    full = Qwen2ForCausalLM(config, TPGroup.local(), device="meta", dtype=torch_dtype)
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
