"""Inference dims for ``tp-ext serve --auto``: of the (tp, dp) that use every rank (tp splitting
the heads in whole heads; pp = 1, the engine's), those whose weights and KV cache fit a rank,
ranked by decode throughput.

Per rank: the weights of its shards (:func:`~tp_ext.planner.hf_model.hf_rank_shapes`, as
``parallelize`` splits them) and a KV cache of ``max_num_seqs`` requests at the full context
(each rank its KV heads of every position of every layer, as :class:`tp_ext.serving.Engine`
allocates it). A decode step of a replica reads its rank's weights and, on average, half the
cache, through the memory bandwidth; at tp > 1 each layer adds two all-reduces of the step's
hidden states; every operator costs its dispatch. Throughput: ``dp * max_num_seqs`` tokens a
step. A step reads fewer bytes per rank at a larger tp, and pays for it in all-reduces, which
on CPU ranks over gloo cost far more than on NVLink: the table's hardware decides.
"""

from __future__ import annotations

import dataclasses

from tp_ext.planner.candidate import usable_memory
from tp_ext.planner.hardware import load_hardware
from tp_ext.planner.hf_model import HFModel, hf_rank_shapes
from tp_ext.validation import dtype_bytes

__all__ = ["ServingEstimate", "plan_serving"]

# operators of a decoder layer in one decode step (norms, projections, rotary, attention, MLP)
OPS_PER_LAYER = 20


@dataclasses.dataclass(frozen=True)
class ServingEstimate:
    tp: int
    dp: int
    weight_bytes: int  # per rank
    kv_cache_bytes: int  # per rank, max_num_seqs requests at the full context
    fits: bool
    tokens_per_s: float  # decode, every replica together
    reason: str

    def describe(self) -> str:
        return f"tp={self.tp} dp={self.dp}"


def plan_serving(
    hf_config,
    *,
    world: int,
    memory: int,
    max_num_seqs: int,
    context: int,
    dtype: str = "float32",
    hardware: str = "cpu",
) -> list[ServingEstimate]:
    """Every (tp, dp) of ``world`` ranks, those that fit ``memory`` bytes a rank first, then by
    decode tokens per second."""
    model, hw = HFModel(hf_config), load_hardware(hardware)
    size, layers = dtype_bytes(dtype), model.num_hidden_layers
    usable = usable_memory(memory)
    estimates = []
    for tp in model.valid_tp_sizes():
        if world % tp:
            continue
        s = hf_rank_shapes(model, tp)
        weights = (s.embedding + s.layer * layers + s.final) * size
        per_position = layers * 2 * s.kv_heads * s.head_dim * size
        cache = max_num_seqs * context * per_position
        read = weights + cache / 2
        step = read / hw.memory_bandwidth + layers * OPS_PER_LAYER * hw.op_overhead
        if tp > 1:
            hidden = max_num_seqs * model.hidden_size * size
            step += 2 * layers * (hw.latency + hidden / hw.intra_node)
        fits = weights + cache <= usable
        need = f"{(weights + cache) / 2**30:.2f} GiB a rank (weights {weights / 2**30:.2f}"
        need += f", KV cache {cache / 2**30:.2f}) of {usable / 2**30:.2f} usable"
        reason = f"{need}; decode {world // tp * max_num_seqs / step:.0f} tokens/s estimated"
        estimates.append(
            ServingEstimate(
                tp, world // tp, weights, cache, fits, world // tp * max_num_seqs / step, reason
            )  # fmt: skip
        )
    return sorted(estimates, key=lambda e: (not e.fits, -e.tokens_per_s))
