"""Megatron's sequence parallelism on an existing model, by hooks (the model's modules keep their
names in state dicts and checkpoints): the residual stream is split along the sequence where the
first sequence-parallel norm's block begins (:class:`~tp_ext.layers.sequence.SequenceShards`),
each such norm runs on this rank's shard, and its output is all-gathered once for the
column-parallel layers after it; a sparse-MoE block gathers and reduce-scatters its own
(:func:`gather_in_moe_blocks`)."""

from __future__ import annotations

from torch import nn

from tp_ext.layers import ParallelModule
from tp_ext.layers.moe import ExpertParallelMoE, sequence_parallel_router
from tp_ext.layers.sequence import SequenceShards, sum_gradients_over

__all__ = ["SequenceShards", "sum_gradients_over", "gather_in_moe_blocks"]


def gather_in_moe_blocks(model: nn.Module, blocks: list[str], shards: SequenceShards, report):
    """Sequence parallelism through ``model``'s sparse-MoE blocks (``blocks``: their names): each
    takes and returns this rank's sequence shard (the norm before it leaves its output split).
    An ExpertParallelMoE does so itself. A Hugging Face block keeps its own forward, on the
    whole sequence gathered on entry (one all-gather for its router, split experts and shared
    expert); what it returns, the TP ranks' partial sums, is reduce-scattered on exit (one
    reduce-scatter for both kinds of expert, where without sequence parallelism each is
    all-reduced). What was done goes to ``report``."""
    for name in blocks:
        block = model.get_submodule(name)
        if isinstance(block, ExpertParallelMoE):
            report[name] += f"; sequence shard in and out ({_shard_path(block)})"
            continue
        _check_split(name, block)
        where = f"{name} ({type(block).__name__})"

        def gather_input(module, args, kwargs, where=where):
            if args:
                return (shards.gather(args[0], where), *args[1:]), kwargs
            x = shards.gather(kwargs["hidden_states"], where)
            return args, {**kwargs, "hidden_states": x}

        def scatter_output(module, args, output):
            if isinstance(output, tuple):  # (hidden states, router logits): older blocks
                return (shards.scatter(output[0]), *output[1:])
            return shards.scatter(output)

        block.register_forward_pre_hook(gather_input, with_kwargs=True)
        block.register_forward_hook(scatter_output)
        sequence_parallel_router(block, shards, routes_shard=False)
        report[name] = (
            "sparse-MoE block: the sequence gathered on entry, its experts' partial sums "
            "reduce-scattered on exit; router on every token, its gradients summed over TP"
        )


def _shard_path(layer: ExpertParallelMoE) -> str:
    if not layer.tokens_split_over_tp:
        return "the sequence gathered, the experts' partial sums reduce-scattered"
    if getattr(layer, "shared_expert", None) is not None:
        return "its shard routed; the shared expert's partial sums reduce-scattered"
    return "its shard routed, no TP collective"


def _check_split(name: str, block: nn.Module) -> None:
    """Under sequence parallelism a Hugging Face sparse-MoE block's outputs must be partial sums
    over TP: its experts split, and its shared expert (if any) too."""
    parts = [("experts", block.experts), ("shared_expert", getattr(block, "shared_expert", None))]
    for attr, part in parts:
        if part is not None and not any(isinstance(m, ParallelModule) for m in part.modules()):
            style = "'experts'" if attr == "experts" else "'colwise' / 'rowwise'"
            raise ValueError(
                f"parallelize: under sequence_parallel=True the sparse-MoE block {name} runs "
                f"on the whole sequence and reduce-scatters its output, so {name}.{attr} must "
                f"be split over TP (style {style}), but the plan keeps it whole; split it or use "
                "sequence_parallel=False"
            )
