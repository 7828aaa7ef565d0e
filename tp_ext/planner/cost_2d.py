"""What one training layout on a P x Q grid of 2D tensor parallelism (SUMMA) costs per rank:
tp_ext's 2D Qwen2 (:mod:`tp_ext.models.qwen2.model_2d`) run by the Trainer's own loop (no
pipeline: pp = 1) with its DP gradients all-reduced once per step.

As for 1D (:mod:`tp_ext.planner.cost`), the counts follow tp_ext's code: parameters are grid
rank (0, 0)'s blocks of the model built on the meta device (the shard policy gives the first
row and column the larger blocks), the activation bytes are what the 2D layers save for
backward, the TP bytes what ``tp_ext.comm.track()`` records. Every activation is split over
the whole grid: sequences over the P rows, features over the Q columns."""

from __future__ import annotations

import dataclasses
import functools

from tp_ext.distributed.grid import TPGrid
from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.planner.hardware import Hardware
from tp_ext.sharding import shard_sizes

__all__ = ["grid_problem", "estimate_2d"]


def grid_problem(config: Qwen2Config, layout) -> str:
    """Why tp_ext cannot train ``config`` with this 2D layout ("" when it can): the 2D model's
    own limits (no pipeline, no FSDP2, no tied embeddings, whole KV heads per grid column)."""
    rows, cols = layout.tp
    if not all(isinstance(n, int) and n >= 1 for n in (rows, cols)):
        return f"layout.tp={layout.tp!r} must be a grid (P, Q) of ints >= 1"
    if layout.pp != 1:
        return f"pp={layout.pp}: 2D tensor parallelism runs without pipelining; use pp=1"
    if layout.data_parallel != "ddp":
        return (
            f"data_parallel={layout.data_parallel!r}: a 2D model's DP replicas synchronise by one "
            "all-reduce of the gradients per step; use 'ddp'"
        )
    if config.tie_word_embeddings:
        return "tie_word_embeddings=True: the 2D model does not support tied embeddings"
    if cols > config.num_key_value_heads:
        return (
            f"a grid of {cols} columns splits {config.num_key_value_heads} KV heads: every column "
            f"needs a whole KV head (Q <= {config.num_key_value_heads})"
        )
    return ""


@dataclasses.dataclass(frozen=True)
class _GridShapes:
    """Grid rank (0, 0)'s share: its parameter blocks and its feature widths."""

    numel: int  # parameters
    tensors: int
    largest: int  # elements of its largest parameter tensor
    hidden: int  # h_j: hidden features of column 0
    q: int  # query features (its heads x head_dim)
    kv: int  # key (= value) features
    heads: int  # query heads
    intermediate: int
    vocab: int  # vocabulary entries of the LM head's column 0
    qkv_bias: int  # q, k and v biases of one layer (its column's pieces)


@functools.lru_cache(maxsize=64)
def _grid_shapes(config: Qwen2Config, rows: int, cols: int) -> _GridShapes:
    from tp_ext.models.qwen2.model_2d import Qwen2ForCausalLM2D

    grid = TPGrid(rows, cols, 0, 0, None, None, None)  # no groups: nothing is communicated
    model = Qwen2ForCausalLM2D(config, grid=grid, device="meta")
    params = list(model.parameters())
    layer = model.model.layers[0]
    attn = layer.self_attn
    return _GridShapes(
        numel=sum(p.numel() for p in params),
        tensors=len(params),
        largest=max(p.numel() for p in params),
        hidden=shard_sizes(config.hidden_size, cols)[0],
        q=attn.q_proj.local_out_features,
        kv=attn.k_proj.local_out_features,
        heads=attn.num_heads_local,
        intermediate=layer.mlp.gate_proj.local_out_features,
        vocab=model.lm_head.local_out_features,
        qkv_bias=sum(p.numel() for p in (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)),
    )


def _layer_activation_bytes(
    g: _GridShapes, config: Qwen2Config, rows: int, b: int, seq: int, c: int
) -> int:
    """What one 2D decoder layer saves for backward on grid rank (0, 0), ``b`` of its
    sequences of ``seq`` tokens, in a dtype of ``c`` bytes (counted from its code): each
    RMSNorm2D its input, the normalised input and its output (the next linear's input), its
    fp32 inverse RMS per token, and (P > 1) its weight's copy; q after RoPE, k and v as
    attention sees them (repeated to the query heads), attention's output (o_proj's input, a
    view) and log-sum-exp, RoPE's cos and sin; the residual stream between attention and MLP;
    gate/up's output and SwiGLU's; and the concatenated weight blocks of q/k/v and of gate/up
    (one SUMMA product each, which keeps its weight operand)."""
    t = b * seq
    group = config.num_attention_heads // config.num_key_value_heads
    kv_seen = g.q if group > 1 else g.kv  # k and v as attention sees them
    per_token = 6 * g.hidden + 2 * g.q + 2 * kv_seen + 3 * g.intermediate
    weight_rows = shard_sizes(config.hidden_size, rows)[0]  # the weights' K block of row 0
    weights = (g.q + 2 * g.kv + 2 * g.intermediate) * weight_rows
    norm_weights = 2 * g.hidden if rows > 1 else 0
    rope = 2 * b * seq * config.head_dim
    return (t * per_token + rope + weights + norm_weights) * c + 2 * t * 4 + b * g.heads * seq * 4


def estimate_2d(config, layout, *, seq_len, hardware: Hardware, gpu_memory, gpus_per_node):
    """The :class:`~tp_ext.planner.cost.Estimate` of a 2D layout (``layout.tp`` = (P, Q))."""
    from tp_ext.planner.cost import (
        DTYPE_BYTES,
        Estimate,
        _op_counts,
        memory_breakdown,
        usable_memory,
    )

    problem = grid_problem(config, layout)
    if problem:
        raise ValueError(problem)
    rows, cols = layout.tp
    tp, dp, m = rows * cols, layout.dp, layout.num_micro_batches
    e = DTYPE_BYTES[layout.dtype]
    c = e  # activations in the parameters' dtype
    g = _grid_shapes(config, rows, cols)
    b = shard_sizes(layout.micro_batch, rows)[0]  # grid row 0's sequences (the most)
    tokens = b * seq_len
    h, layers = config.hidden_size, config.num_hidden_layers
    heads_dim = config.num_attention_heads * config.head_dim

    # -- memory: as the 1D model at pp = 1 (phases A, C, D), and E: the DP all-reduce of the
    # gradients flattened in fp32 (fp64 for fp64 parameters)
    params = g.numel * e
    optimizer = 2 * params + 4 * g.tensors
    block = tokens * g.hidden * c  # one [b, seq, h_j] block of the residual stream
    act_layer = _layer_activation_bytes(g, config, rows, b, seq_len, c)
    held = layers * (block if layout.recompute else act_layer)
    ids = layout.micro_batch * seq_len * 8  # whole on every rank
    head = 2 * block + tokens * g.vocab * c + 8 * b * (seq_len - 1) + 4 * cols
    acts = held + head + ids
    transient = (tokens * g.vocab + g.vocab * h // rows + block // c) * c
    grads_before = params if m > 1 else 0
    phase_a = params + optimizer + grads_before + acts + transient
    rebuilt = layers * block if layout.recompute else 0
    phase_c = 2 * params + optimizer + rebuilt + act_layer + block + ids
    opt_temp = 0 if hardware.fused_optimizer else 2 * g.largest * e
    phase_d = 2 * params + optimizer + opt_temp
    flat = (g.numel + 2) * (8 if e == 8 else 4) if dp > 1 else 0
    phase_e = 2 * params + optimizer + 2 * flat  # the flat gradients and all_reduce's result
    memory = memory_breakdown(
        params,
        optimizer,
        max(acts + transient, rebuilt + act_layer + block),
        max(phase_a, phase_c, phase_d, phase_e),
    )

    # -- bytes per step, as track() counts them, on grid rank (0, 0)
    def summa(k, n):
        """summa_linear forward + backward: per panel of K, x's panel broadcast along the
        grid row and the weight's along the grid column (forward, again in backward), and
        the two gradients' panels reduced back (backward): 3 x ([T, K] + [N, K])."""
        return 3 * ((tokens * k if cols > 1 else 0) + (n * k if rows > 1 else 0)) * c

    def norm():
        """RMSNorm2D: the sum of squares (fp32, a value per token) all-reduced along the
        row forward and backward; the weight's gradient summed along the column."""
        return (2 * tokens * 4 if cols > 1 else 0) + (g.hidden * e if rows > 1 else 0)

    products = summa(h, g.q + 2 * g.kv) + summa(heads_dim, g.hidden)
    products += summa(h, 2 * g.intermediate) + summa(config.intermediate_size, g.hidden)
    per_layer = 2 * norm() + products
    per_layer += g.qkv_bias * e if rows > 1 else 0  # the biases' gradients along the column
    if layout.recompute:  # the layer's forward runs again in backward, its collectives too
        per_layer += products // 3 + (2 * tokens * 4 if cols > 1 else 0)
    whole = layout.micro_batch * seq_len * g.hidden * c
    embedding = 2 * whole if rows > 1 else 0  # reduce-scatter forward, all-gather backward
    n = b * (seq_len - 1)  # the loss's tokens on this grid row
    loss = ((n + cols) * 4 + 3 * n * 4 if cols > 1 else 0) + (4 if rows > 1 else 0)
    per_micro_batch = layers * per_layer + embedding + norm() + summa(h, g.vocab) + loss
    tp_bytes = m * per_micro_batch if tp > 1 else 0
    dp_bytes = flat
    comm = {"tp": tp_bytes, "pp": 0, "dp": dp_bytes}

    # -- time: FLOPs of this rank's blocks (each linear multiplies its [T, K] panels by the
    # column's [N, K] weight rows), operators as the 1D model's, SUMMA's panels
    nodes_span = gpus_per_node or tp * dp
    tp_cross = tp > nodes_span
    dp_cross = dp > 1 and tp * dp > nodes_span
    weights = h * (g.q + 2 * g.kv) + heads_dim * g.hidden + 2 * h * g.intermediate
    weights += config.intermediate_size * g.hidden
    layer_flops = 6 * tokens * weights + 12 * b * seq_len * seq_len * g.heads * config.head_dim
    head_flops = 6 * tokens * h * g.vocab
    recompute = 1 if layout.recompute else 0
    ops = _op_counts(config)
    flops = layers * layer_flops * (4 / 3 if recompute else 1) + head_flops
    n_ops = layers * (ops["layer"] + recompute * ops["layer_forward"]) + ops["head"]
    compute = flops / hardware.flops + (n_ops + ops["embedding"]) * hardware.op_overhead
    # each SUMMA product runs about P + Q - 1 panels, two broadcasts each forward and four
    # collectives backward; the norms' and the loss's all-reduces on top
    panels = rows + cols - 1
    collectives = (layers * (4 * 6 * panels + 6) + 6 * panels + 6) if tp > 1 else 0
    tp_time = (tp_bytes / m) / hardware.link(tp_cross) + collectives * hardware.latency
    micro = compute + tp_time
    hide = 1.0 if hardware.overlap else 0.0
    if dp > 1:
        dp_time = 2 * (dp - 1) / dp * dp_bytes / hardware.link(dp_cross) + hardware.latency
        dp_exposed = max(0.0, dp_time - hide * compute * 2 / 3)
    else:
        dp_time = dp_exposed = 0.0
    if hardware.optimizer_seconds_per_param is not None:
        optimizer_time = g.numel * hardware.optimizer_seconds_per_param
    else:
        optimizer_time = 4 * (3 * params + optimizer) / hardware.memory_bandwidth
    step = m * micro + dp_exposed + optimizer_time

    fits = gpu_memory is None or memory["total"] <= usable_memory(gpu_memory)
    detail = {
        "layers_per_rank": layers,
        "in_flight_micro_batches": 1,
        "compute_s": m * compute,
        "tp_s": m * tp_time,
        "pp_s": 0.0,
        "dp_s": dp_time,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer_time,
        "pp_runtime_s": 0.0,
        "tp_crosses_nodes": tp_cross,
        "pp_crosses_nodes": False,
        "dp_crosses_nodes": dp_cross,
        "parameters_per_rank": g.numel,
        "parameters_by_pp_rank": [g.numel],
        "busiest_pp_rank": 0,
    }
    return Estimate(layout, memory, comm, 0.0, step, fits, gpu_memory, "", detail)
