"""What tp_ext's own Qwen2 is made of, counted on the meta device (no memory, no time): rank 0's
parameter shards at a TP degree, and the operators a forward + backward dispatches. The cost
model (:mod:`.step`, :mod:`.cost_2d`) and the calibration (:mod:`.hardware`) read these counts;
this module imports none of them."""

from __future__ import annotations

import collections
import dataclasses
import functools

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tp_ext.layers import ResolvedGroup
from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM

__all__ = [
    "zero_step_phases",
    "RankShapes",
    "rank_shapes",
    "op_counts",
    "layer_flops",
    "head_flops",
    "forward_backward_work",
    "fsdp_numel",
    "shard_numel",
    "padded_pieces",
    "ZERO2_BUCKET_BYTES",
]

# tp_ext.training.zero's stages (the planner may not import the trainer: one floor) and its
# ZeRO-2 gradient bucket cap (DEFAULT_BUCKET_BYTES there)
ZERO2_BUCKET_BYTES = 25 * 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RankShapes:
    """Rank 0's shard of one decoder layer and of the embedding / head at a TP degree (the
    shard policy gives the first ranks the larger shards, so rank 0 is the busiest)."""

    embedding: int  # parameters
    layer: int
    final: int  # final norm + LM head
    layer_tensors: int
    embedding_tensors: int
    final_tensors: int
    largest: int  # elements of the largest parameter tensor
    # (dim 0, numel) of each tensor, for FSDP2's shards (dim 0 padded to a multiple of dp)
    layer_rows: tuple
    embedding_rows: tuple
    final_rows: tuple
    q_heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # parameters each token's matmuls run through, where not all of ``layer`` (an MoE layer:
    # the dense part and its top-k experts); 0: all of them
    layer_flop_params: int = 0
    # (dim 0, numel) of the layer's expert tensors (among ``layer_rows``): their replicas are
    # the ranks holding the same experts, not the DP ranks
    expert_rows: tuple = ()

    @functools.cached_property
    def dense_layer_rows(self) -> tuple:
        """``layer_rows`` without the expert tensors."""
        experts = collections.Counter(self.expert_rows)
        dense = []
        for row in self.layer_rows:
            if experts[row]:
                experts[row] -= 1
            else:
                dense.append(row)
        return tuple(dense)


@functools.lru_cache(maxsize=64)
def rank_shapes(config: Qwen2Config, tp: int) -> RankShapes:
    one = Qwen2ForCausalLM(
        config.replace(num_hidden_layers=1), ResolvedGroup.virtual(tp, 0), device="meta"
    )
    named = list(one.named_parameters(remove_duplicate=False))

    def part(prefix):
        ps = [p for n, p in named if n.startswith(prefix)]
        return sum(p.numel() for p in ps), len(ps)

    def rows(*prefixes):
        return tuple((p.shape[0], p.numel()) for n, p in named if n.startswith(prefixes))

    emb, emb_n = part("model.embed_tokens")
    layer, layer_n = part("model.layers.0.")
    norm, norm_n = part("model.norm")
    head, head_n = part("lm_head")
    attn = one.model.layers[0].self_attn
    mlp = one.model.layers[0].mlp
    return RankShapes(
        embedding=emb,
        layer=layer,
        final=norm + head,
        layer_tensors=layer_n,
        embedding_tensors=emb_n,
        final_tensors=norm_n + head_n,
        largest=max(p.numel() for _, p in named),
        layer_rows=rows("model.layers.0."),
        embedding_rows=rows("model.embed_tokens"),
        final_rows=rows("model.norm", "lm_head"),
        q_heads=attn.num_heads_local,
        kv_heads=attn.num_kv_heads_local,
        head_dim=attn.head_dim,
        intermediate=mlp.down_proj.weight.shape[1],
        vocab=one.lm_head.weight.shape[0],
    )


def shard_numel(rows, dp: int, rank: int = 0) -> int:
    """Elements of DP rank ``rank``'s rows of these tensors ((dim 0, numel) each): dim 0 split as
    torch.chunk splits it (FSDP2's and ZeRO's shards), ceil(dim0 / dp) rows to each rank until
    they run out, so rank 0 holds the most and the last ranks may get fewer, or none."""
    total = 0
    for d0, n in rows:
        chunk = -(-d0 // dp)
        total += max(0, min(d0, (rank + 1) * chunk) - rank * chunk) * (n // d0)
    return total


def padded_pieces(sizes) -> int:
    """Elements the asynchronous reduce-scatter of a flat of DP ranks' pieces (``sizes``, rank 0's
    the largest) adds when they differ (tp_ext.comm pads each piece to rank 0's): every rank's
    slot in one flat, the short ranks' pieces copied out to that width, and the last one's
    zeros."""
    short = sum(n < sizes[0] for n in sizes)
    return 0 if not short else (len(sizes) + short + 1) * sizes[0] - sizes[-1]


def zero_step_phases(held: int, rows: int, numel: int, e: int, master: int, largest: int,
                     fused: bool) -> list:  # fmt: skip
    """ZeRO's step and all-gather phases beside ``held`` bytes (parameters, gradients, state),
    with the step's fp32 copies of the gradients' ``rows`` (for non-fp32 parameters, ``e``
    bytes an element against the masters' ``master``): the step (on CPU torch's per-tensor
    AdamW: two of the ``largest`` rows tensor in ``master``'s bytes); the all-gather (this
    rank's rows flattened and every rank's ``numel`` gathered, ``e`` bytes each)."""
    held += rows * master if master != e else 0
    opt_temp = 0 if fused else 2 * largest * master
    return [held + opt_temp, held + (rows + numel) * e]


def fsdp_numel(rows, dp: int) -> int:
    """Elements of FSDP2's unsharded buffers for these tensors: each tensor's dim 0 padded to a
    multiple of ``dp`` (every rank's shard padded to rank 0's)."""
    return dp * shard_numel(rows, dp)


class CountOps(TorchDispatchMode):
    """Counts the operators dispatched under it."""

    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def _count_ops(config: Qwen2Config, layers: int, backward: bool) -> tuple[int, int]:
    """(operators of the whole step, operators of the embedding alone) of a ``layers``-layer
    model's forward (and backward) of one sequence of 8 tokens."""
    model = Qwen2ForCausalLM(
        config.replace(num_hidden_layers=layers), ResolvedGroup.local(), device="meta"
    )
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with CountOps() as counter:
        h = model.model.embed_tokens(ids)
        embedding = counter.n
        for layer in model.model.layers:
            h = layer(h, None, None)
        logits = model.lm_head(model.model.norm(h))
        loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], reduction="sum")
        if backward:
            loss.backward()
    return counter.n, embedding


@functools.lru_cache(maxsize=16)
def op_counts(config: Qwen2Config) -> dict:
    """Operators a forward + backward dispatches, counted by running tp_ext's model on the
    meta device: per decoder layer (and its forward alone, what activation checkpointing
    repeats), for the embedding and for the final norm, head and loss."""
    one, embedding = _count_ops(config, 1, True)
    two, _ = _count_ops(config, 2, True)
    one_fwd, _ = _count_ops(config, 1, False)
    two_fwd, _ = _count_ops(config, 2, False)
    layer, layer_forward = two - one, two_fwd - one_fwd
    return {
        "layer": layer,
        "layer_forward": layer_forward,
        "embedding": embedding,
        "head": one - layer - embedding,
    }


def layer_flops(s: RankShapes, b: int, seq: int) -> float:
    """One decoder layer's forward + backward FLOPs on one TP rank for ``b`` sequences of
    ``seq`` tokens: 6 per parameter and token, and attention's scores and values."""
    params = s.layer_flop_params or s.layer
    return 6 * params * b * seq + 12 * b * seq * seq * s.q_heads * s.head_dim


def head_flops(s: RankShapes, config: Qwen2Config, b: int, seq: int) -> float:
    return 6 * s.vocab * config.hidden_size * b * seq


def forward_backward_work(config: Qwen2Config, micro_batch: int, seq_len: int) -> tuple:
    """(FLOPs, dispatched operators) of one forward + backward of ``micro_batch`` sequences of
    ``seq_len`` tokens through the whole model on one rank, as the cost model charges them:
    what :func:`~tp_ext.planner.hardware.calibrate` fits this machine's rate and per-operator
    cost to."""
    s, ops = rank_shapes(config, 1), op_counts(config)
    layers = config.num_hidden_layers
    flops = layers * layer_flops(s, micro_batch, seq_len)
    flops += head_flops(s, config, micro_batch, seq_len)
    return flops, layers * ops["layer"] + ops["head"] + ops["embedding"]
