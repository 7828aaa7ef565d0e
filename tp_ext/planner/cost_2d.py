"""What one training candidate on a P x Q grid of 2D tensor parallelism (SUMMA) costs per rank:
tp_ext's 2D Qwen2 (:mod:`tp_ext.models.qwen2.model_2d`) run by the Trainer's local loop (no
pipeline: pp = 1) with its DP gradients summed by DDP in the last micro-batch's backward (DDP,
ZeRO-1) or reduce-scattered in buckets during it (ZeRO-2); under ZeRO each DP rank steps its
rows of every grid block and all-gathers the updated rows.

As for 1D (:mod:`tp_ext.planner.cost`), the counts follow tp_ext's code: parameters are grid
rank (0, 0)'s blocks of the model built on the meta device (the shard policy gives the first
row and column the larger blocks), the activation bytes are what the 2D layers save for
backward, the TP bytes what ``tp_ext.comm.track()`` records. Every activation is split over
the whole grid: sequences over the P rows, features over the Q columns."""

from __future__ import annotations

import dataclasses
import functools
import math

from tp_ext.distributed import ResolvedGroup
from tp_ext.distributed.grid import TPGrid
from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.models.qwen2.model_2d import Qwen2ForCausalLM2D
from tp_ext.pipeline.data_parallel import ZERO_STAGES
from tp_ext.planner.candidate import Candidate, Estimate, memory_breakdown, usable_memory
from tp_ext.planner.counts import (
    ZERO2_BUCKET_BYTES,
    op_counts,
    padded_pieces,
    shard_numel,
    zero_step_phases,
)
from tp_ext.planner.hardware import Hardware
from tp_ext.sharding import shard_sizes
from tp_ext.validation import dtype_bytes

__all__ = ["grid_problem", "estimate_2d"]


def grid_problem(config: Qwen2Config, candidate: Candidate) -> str:
    """Why tp_ext cannot train ``config`` with this 2D candidate ("" when it can): the 2D
    model's own limits (no pipeline, no FSDP2, whole KV heads per grid column) and the cost
    model's (no tied embeddings)."""
    dims = candidate.dims
    if dims.grid is None:
        return f"tp={dims.tp!r} is one degree, not a grid (P, Q): the 1D cost model's case"
    rows, cols = dims.grid
    if dims.pp != 1:
        return f"pp={dims.pp}: 2D tensor parallelism runs without pipelining; use pp=1"
    if candidate.data_parallel == "fsdp":
        return (
            "data_parallel='fsdp': a 2D model's DP replicas run under DDP, ZeRO-1 or ZeRO-2 "
            "(FSDP2 does not shard 2D blocks); use 'ddp', 'zero1' or 'zero2'"
        )
    if config.tie_word_embeddings:
        return (
            "tie_word_embeddings=True: the 2D cost model does not count a tied embedding (its "
            "exchange of blocks) yet"
        )
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
    # (dim 0, numel) of each parameter block in the model's order: ZeRO's rows are dim 0's
    rows: tuple


@functools.lru_cache(maxsize=64)
def _grid_shapes(config: Qwen2Config, rows: int, cols: int) -> _GridShapes:
    # rank (0, 0) of a grid with virtual groups: shapes only, nothing is communicated
    virtual = ResolvedGroup.virtual
    grid = TPGrid(rows, cols, 0, 0, virtual(cols, 0), virtual(rows, 0), virtual(rows * cols, 0))
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
        rows=tuple((p.shape[0], p.numel()) for p in params),
    )


@functools.lru_cache(maxsize=256)
def _zero_rows(config: Qwen2Config, rows: int, cols: int, dp: int) -> tuple:
    """Elements of each DP rank's rows (torch.chunk's split of dim 0) of grid rank (0, 0)'s
    blocks: what ZeRO steps there (DP rank 0 holds the most)."""
    shapes = _grid_shapes(config, rows, cols).rows
    return tuple(shard_numel(shapes, dp, rank) for rank in range(dp))


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


class _GridStep:
    """One training step of a 2D candidate on grid rank (0, 0): the quantities the estimate
    derives once, and one method per cost."""

    def __init__(self, config, candidate: Candidate, seq_len, hardware, gpus_per_node):
        self.config, self.candidate, self.hardware = config, candidate, hardware
        self.seq_len, self.gpus_per_node = seq_len, gpus_per_node
        self.rows, self.cols = candidate.dims.grid
        self.tp, self.dp = self.rows * self.cols, candidate.dims.dp
        self.m = candidate.num_micro_batches
        self.recompute = candidate.activation_checkpointing
        self.e = dtype_bytes(candidate.dtype)  # activations take the parameters' dtype too
        self.g = _grid_shapes(config, self.rows, self.cols)
        self.b = shard_sizes(candidate.micro_batch, self.rows)[0]  # grid row 0's (the most)
        self.tokens = self.b * seq_len
        self.block = self.tokens * self.g.hidden * self.e  # a [b, seq, h_j] residual block
        self.act_layer = _layer_activation_bytes(self.g, config, self.rows, self.b, seq_len, self.e)
        # ZeRO (dp > 1; at dp = 1 the Trainer steps a plain optimizer): 1 or 2, else 0; its
        # master rows and AdamW state are fp32 (fp64 for fp64 parameters)
        self.zero = ZERO_STAGES.get(candidate.data_parallel, 0) if self.dp > 1 else 0
        self.master_bytes = 8 if self.e == 8 else 4
        self.zero_rows = _zero_rows(config, self.rows, self.cols, self.dp)[0] if self.zero else 0

    def memory(self) -> dict:
        """As the 1D model at pp = 1 (phases A, C, D); DDP (ZeRO-1's too) keeps a copy of the
        gradients in its buckets. ZeRO keeps AdamW state (and fp32 master rows for non-fp32
        parameters) for DP rank 0's rows only, and ZeRO-2 gradients of those rows at the step;
        its phases after the backward are :meth:`zero_phases`."""
        g, c, e, config = self.g, self.e, self.e, self.config
        layers = config.num_hidden_layers
        params = g.numel * e
        optimizer, grads = 2 * params + 4 * g.tensors, params
        if self.zero:
            rows = self.zero_rows
            masters = rows * self.master_bytes if self.master_bytes != e else 0
            optimizer = 2 * rows * self.master_bytes + 4 * g.tensors + masters
            grads = rows * e if self.zero == 2 else params
        held = layers * (self.block if self.recompute else self.act_layer)
        ids = self.candidate.micro_batch * self.seq_len * 8  # whole on every rank
        head = 2 * self.block + self.tokens * g.vocab * c + 8 * self.b * (self.seq_len - 1)
        acts = held + head + 4 * self.cols + ids
        # the logits' gradient beside the logits, then (the logits freed by the loss's backward)
        # the head's weight gradient and the hidden states' gradient
        logits = self.tokens * g.vocab * c
        head_grads = g.vocab * config.hidden_size // self.rows * c + self.block
        transient = logits + max(0, head_grads - logits)
        # whole gradients from the first backward on (ZeRO-2's too: its buckets go in the last)
        grads_before = params if self.m > 1 else 0
        rebuilt = layers * self.block if self.recompute else 0
        backward = (
            params + optimizer + grads_before + acts + transient,
            2 * params + optimizer + rebuilt + self.act_layer + self.block + ids,
        )
        if self.zero:
            after = self.zero_phases(params, grads, optimizer, max(backward), ids)
        else:
            opt_temp = 0 if self.hardware.fused_optimizer else 2 * g.largest * e
            after = [2 * params + optimizer + opt_temp]
        buckets = params if self.zero != 2 and self.dp > 1 else 0  # DDP's (DDP, ZeRO-1)
        return memory_breakdown(
            params,
            optimizer,
            max(acts + transient, rebuilt + self.act_layer + self.block),
            max(*backward, *after) + buckets,
            grads=grads,
        )

    def zero_phases(self, params: int, grads: int, optimizer: int, backward: int, ids: int):
        """ZeRO's phases after (or at the end of) the backward, beside the parameters and the
        optimizer state (``grads``: the gradients at the step, ``backward``: the backward's peak
        with whole gradients): the step (fp32 copies of the gradients' rows for non-fp32
        parameters; on CPU torch's per-tensor AdamW, two of the largest rows tensor); the
        all-gather (this rank's rows flattened and every rank's gathered, in the parameters'
        dtype); ZeRO-2's reduce-scatter: each bucket of whole gradients flattened beside this
        rank's rows of the sum. With one bucket (at most 25 MiB of gradients) it goes when the
        embedding's gradient, the last, is final (measured: no temporary of the embedding's
        backward left then, unlike 1D's; the ids still held); with more, the first ones go
        during the backward, beside its activations."""
        e, master, rows = self.e, self.master_bytes, self.zero_rows
        numel = self.g.numel
        largest = max(shard_numel((t,), self.dp) for t in self.g.rows)
        held = params + grads + optimizer
        fused = self.hardware.fused_optimizer
        phases = zero_step_phases(held, rows, numel, e, master, largest, fused)
        if self.zero == 2:
            if params <= ZERO2_BUCKET_BYTES:
                padding = padded_pieces(_zero_rows(self.config, self.rows, self.cols, self.dp))
                sent = (numel + rows + padding) * e
                phases.append(2 * params + optimizer + sent + ids)
            else:  # a bucket holds one parameter at least
                bucket = max(ZERO2_BUCKET_BYTES, max(n for _, n in self.g.rows) * e)
                phases.append(backward + bucket + math.ceil(bucket / self.dp))
        return phases

    def dp_bytes(self) -> int:
        """DP bytes per step: DDP's all-reduce of every gradient (DDP, ZeRO-1) or ZeRO-2's
        reduce-scatter (in buckets), in the parameters' dtype; under ZeRO the updated rows'
        all-gather."""
        if self.dp == 1:
            return 0
        gathered = self.g.numel * self.e if self.zero else 0
        return self.g.numel * self.e + gathered

    def summa(self, k: int, n: int) -> int:
        """summa_linear forward + backward: per panel of K, x's panel broadcast along the
        grid row and the weight's along the grid column (forward, again in backward), and
        the two gradients' panels reduced back (backward): 3 x ([T, K] + [N, K])."""
        x = self.tokens * k if self.cols > 1 else 0
        w = n * k if self.rows > 1 else 0
        return 3 * (x + w) * self.e

    def norm(self) -> int:
        """RMSNorm2D: the sum of squares (fp32, a value per token) all-reduced along the
        row forward and backward; the weight's gradient summed along the column."""
        row = 2 * self.tokens * 4 if self.cols > 1 else 0
        return row + (self.g.hidden * self.e if self.rows > 1 else 0)

    def tp_bytes(self) -> int:
        """Bytes per step, as track() counts them, on grid rank (0, 0)."""
        if self.tp == 1:
            return 0
        g, config, h, e = self.g, self.config, self.config.hidden_size, self.e
        heads_dim = config.num_attention_heads * config.head_dim
        products = self.summa(h, g.q + 2 * g.kv) + self.summa(heads_dim, g.hidden)
        products += self.summa(h, 2 * g.intermediate)
        products += self.summa(config.intermediate_size, g.hidden)
        per_layer = 2 * self.norm() + products
        per_layer += g.qkv_bias * e if self.rows > 1 else 0  # the biases' gradients (column)
        if self.recompute:  # the layer's forward runs again in backward, its collectives too
            per_layer += products // 3 + (2 * self.tokens * 4 if self.cols > 1 else 0)
        whole = self.candidate.micro_batch * self.seq_len * g.hidden * e
        embedding = 2 * whole if self.rows > 1 else 0  # reduce-scatter fwd, all-gather bwd
        n = self.b * (self.seq_len - 1)  # the loss's tokens on this grid row
        loss = (n + self.cols) * 4 + 3 * n * 4 if self.cols > 1 else 0
        loss += 4 if self.rows > 1 else 0
        layers = config.num_hidden_layers
        per_micro_batch = layers * per_layer + embedding + self.norm() + self.summa(h, g.vocab)
        return self.m * (per_micro_batch + loss)

    def dp_seconds(self, dp_bytes: int, crosses: bool, compute: float) -> tuple[float, float]:
        """(DP seconds, the part not hidden): DDP's all-reduce (DDP, ZeRO-1; one call per 25 MB
        bucket, per parameter above 2 replicas) and ZeRO-2's reduce-scatter (one per 25 MiB
        bucket), both in the last backward, hidden behind it where collectives overlap
        compute; ZeRO's all-gather of the updated rows after the optimizer step, with nothing
        to hide behind."""
        hw, dp = self.hardware, self.dp
        if dp == 1:
            return 0.0, 0.0
        link = hw.link(crosses)
        hide = (1.0 if hw.overlap else 0.0) * compute * 2 / 3
        gathered = self.g.numel * self.e if self.zero else 0
        gather = (dp - 1) / dp * gathered / link + hw.latency if self.zero else 0.0
        nbytes = self.g.numel * self.e
        if self.zero == 2:
            buckets = math.ceil(nbytes / ZERO2_BUCKET_BYTES)
            reduce = (dp - 1) / dp * nbytes / (hw.reduce_scatter or link)
        else:
            buckets = self.g.tensors if dp > 2 else math.ceil(nbytes / (25 * 2**20))
            reduce = 2 * (dp - 1) / dp * nbytes / link
        reduce += buckets * hw.latency
        return reduce + gather, max(0.0, reduce - hide) + gather

    def compute(self) -> float:
        """Seconds of one micro-batch's forward + backward: FLOPs of this rank's blocks (each
        linear multiplies its [T, K] panels by the column's [N, K] weight rows), operators as
        the 1D model's."""
        g, config, h, hw = self.g, self.config, self.config.hidden_size, self.hardware
        heads_dim = config.num_attention_heads * config.head_dim
        weights = h * (g.q + 2 * g.kv) + heads_dim * g.hidden + 2 * h * g.intermediate
        weights += config.intermediate_size * g.hidden
        attention = 12 * self.b * self.seq_len * self.seq_len * g.heads * config.head_dim
        layer_flops = 6 * self.tokens * weights + attention
        head_flops = 6 * self.tokens * h * g.vocab
        recompute, ops, layers = int(self.recompute), op_counts(config), config.num_hidden_layers
        flops = layers * layer_flops * (4 / 3 if recompute else 1) + head_flops
        n_ops = layers * (ops["layer"] + recompute * ops["layer_forward"]) + ops["head"]
        return flops / hw.flops + (n_ops + ops["embedding"]) * hw.op_overhead

    def timing(self, comm: dict, memory: dict) -> dict:
        """The estimate's ``detail`` on time and ``step_s``: each SUMMA product runs about
        P + Q - 1 panels, two broadcasts each forward and four collectives backward; the norms'
        and the loss's all-reduces on top; DP as :meth:`dp_seconds`."""
        hw, tp, dp, m = self.hardware, self.tp, self.dp, self.m
        span = self.gpus_per_node or tp * dp
        tp_cross, dp_cross = tp > span, dp > 1 and tp * dp > span
        compute = self.compute()
        panels = self.rows + self.cols - 1
        layers = self.config.num_hidden_layers
        collectives = (layers * (4 * 6 * panels + 6) + 6 * panels + 6) if tp > 1 else 0
        tp_time = (comm["tp"] / m) / hw.link(tp_cross) + collectives * hw.latency
        dp_time, dp_exposed = self.dp_seconds(comm["dp"], dp_cross, compute)
        stepped = self.zero_rows if self.zero else self.g.numel  # ZeRO: this DP rank's rows
        if hw.optimizer_seconds_per_param is not None:
            optimizer_time = stepped * hw.optimizer_seconds_per_param
        else:  # a fused AdamW reads and writes parameters, gradients and moments about twice
            moved = 3 * stepped * self.e + memory["optimizer"]
            optimizer_time = 4 * moved / hw.memory_bandwidth
        return {
            "step_s": m * (compute + tp_time) + dp_exposed + optimizer_time,
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
        }


def estimate_2d(
    config, candidate: Candidate, *, seq_len, hardware: Hardware, gpu_memory, gpus_per_node
) -> Estimate:
    """The :class:`~tp_ext.planner.candidate.Estimate` of a 2D candidate (``dims.tp`` =
    (P, Q))."""
    problem = grid_problem(config, candidate)
    if problem:
        raise ValueError(problem)
    step = _GridStep(config, candidate, seq_len, hardware, gpus_per_node)
    memory = step.memory()
    comm = {"tp": step.tp_bytes(), "cp": 0, "pp": 0, "dp": step.dp_bytes()}
    detail = step.timing(comm, memory)
    numel = step.g.numel
    detail.update(parameters_per_rank=numel, parameters_by_pp_rank=[numel], busiest_pp_rank=0)
    step_time = detail.pop("step_s")
    fits = gpu_memory is None or memory["total"] <= usable_memory(gpu_memory)
    return Estimate(candidate, memory, comm, 0.0, step_time, fits, gpu_memory, "", detail)
