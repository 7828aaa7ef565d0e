"""What one training layout of tp_ext's Qwen2 costs per rank: memory (parameters, gradients,
optimizer state, activations), bytes communicated per step over TP, PP and DP, the pipeline
bubble and the step time on a :class:`~tp_ext.planner.hardware.Hardware`.

The counts follow tp_ext's own code, not a textbook formula: parameters per rank are those of
the real layers built on the meta device (the one shard policy), the activation bytes are what
tp_ext's decoder layer saves for backward (fused QKV and gate/up, flash-style attention saving
its output and log-sum-exp), and the TP bytes are what ``tp_ext.comm.track()`` records for a
Trainer step. The tests hold the model to the measured numbers."""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Optional, Union

import torch

from tp_ext.layers import TPGroup
from tp_ext.models.qwen2 import Qwen2Config, Qwen2ForCausalLM
from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.hardware import Hardware
from tp_ext.sharding import StageLayout

__all__ = ["Layout", "Estimate", "estimate", "bubble_fraction", "DTYPE_BYTES", "usable_memory"]

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank in a V: r and 2 pp - 1 - r
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
# Of a device's memory, what tensors may take: 5% goes to the caching allocator's fragmentation
# and kernels' workspaces, and 1 GiB to the CUDA context and NCCL's buffers.
USABLE_FRACTION, RESERVED_BYTES = 0.95, 1024**3


def usable_memory(device_bytes: int) -> int:
    return int(device_bytes * USABLE_FRACTION) - RESERVED_BYTES


@dataclasses.dataclass(frozen=True)
class Layout:
    """One way to run training: ``tp`` ranks per TP group (an int; a ``(P, Q)`` grid is 2D TP),
    ``pp`` pipeline ranks of ``virtual_stages`` stages each, ``dp`` replicas synchronised by
    ``data_parallel`` ("ddp" or "fsdp"), ``num_micro_batches`` of ``micro_batch`` sequences per
    DP rank and step under ``schedule``, ``recompute``: activation checkpointing per decoder
    layer; ``dtype``: the parameters' dtype (gradients and AdamW state take it too)."""

    tp: Union[int, tuple[int, int]]
    pp: int
    dp: int
    micro_batch: int
    num_micro_batches: int
    schedule: str = "1F1B"
    virtual_stages: int = 1
    recompute: bool = False
    data_parallel: str = "ddp"
    dtype: str = "bfloat16"

    @property
    def tp_size(self) -> int:
        return self.tp if isinstance(self.tp, int) else self.tp[0] * self.tp[1]

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp * self.dp

    def describe(self) -> str:
        tp = self.tp if isinstance(self.tp, int) else f"{self.tp[0]}x{self.tp[1]}"
        parts = [f"tp={tp}", f"pp={self.pp}", f"dp={self.dp}"]
        if self.pp > 1:
            v = f" v={self.virtual_stages}" if self.virtual_stages > 1 else ""
            parts.append(f"{self.schedule}{v}")
        if self.dp > 1:
            parts.append(self.data_parallel)
        parts.append(f"{self.num_micro_batches}x{self.micro_batch} seq")
        if self.recompute:
            parts.append("recompute")
        return " ".join(parts)


@dataclasses.dataclass
class Estimate:
    layout: Layout
    memory_bytes: dict  # params, grads, optimizer, activations, kv_cache, total (busiest rank)
    # tp, pp, dp: payload bytes per step of the busiest rank, counted as tp_ext.comm.track() does:
    # an all-reduce's tensor, an all-gather's gathered output, a reduce-scatter's full input, and
    # each pipeline send or receive's tensor on the rank that sends or receives it
    comm_bytes: dict
    bubble: float
    step_time_s: float
    fits: bool
    memory_limit: Optional[int]
    reason: str = ""
    detail: dict = dataclasses.field(default_factory=dict)

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["layout"] = dataclasses.asdict(self.layout)
        return out


@dataclasses.dataclass(frozen=True)
class _RankShapes:
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


@functools.lru_cache(maxsize=64)
def _rank_shapes(config: Qwen2Config, tp: int) -> _RankShapes:
    one = Qwen2ForCausalLM(
        config.replace(num_hidden_layers=1), TPGroup.virtual(tp, 0), device="meta"
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
    return _RankShapes(
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


def _fsdp_numel(rows, dp: int) -> int:
    """Elements of FSDP2's unsharded buffers for these tensors: each tensor's dim 0 padded to a
    multiple of ``dp`` (every rank's shard has ceil(dim0 / dp) rows)."""
    return sum(-(-d0 // dp) * dp * (n // d0) for d0, n in rows)


def bubble_fraction(schedule: str, pp: int, m: int, v: int = 1) -> float:
    """The idle share of a pipeline step: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v m+p-1)
    interleaved; the zero-bubble schedules fill most of it with deferred weight gradients
    (modelled as a third of 1F1B's, what their papers report at these sizes)."""
    if pp == 1:
        return 0.0
    if schedule in ("GPipe", "1F1B"):
        return (pp - 1) / (m + pp - 1)
    if schedule == "Interleaved1F1B":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (3 * v * m + pp - 1)


def _in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of
    its whole stage set: GPipe all of them; 1F1B pp - rank (its warm-up forwards); interleaved
    1F1B Megatron's (1 + (p-1)/(p v)) x that (a rank runs ahead on its later stages); the
    zero-bubble schedules hold inputs for the weight gradients they defer (measured: two
    micro-batches more for InterleavedZeroBubble; the V schedules stay within 1F1B's)."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return m
    ahead = min(m, pp - rank)
    if schedule == "Interleaved1F1B":
        return ahead * (1 + (pp - 1) / (pp * v))
    if schedule == "InterleavedZeroBubble":  # and two more, whose weight gradients wait
        return ahead * (1 + (pp - 1) / (pp * v)) + 2
    return ahead


@functools.lru_cache(maxsize=16)
def _op_counts(config: Qwen2Config) -> dict:
    """Operators a forward + backward dispatches, counted by running tp_ext's model on the
    meta device (no memory, no time): per decoder layer (and its forward alone, what recompute
    repeats), for the embedding and for the final norm, head and loss."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tp_ext.layers.loss import vocab_parallel_cross_entropy

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += 1
            return func(*args, **(kwargs or {}))

    def count(layers: int, backward: bool) -> int:
        model = Qwen2ForCausalLM(
            config.replace(num_hidden_layers=layers), TPGroup.local(), device="meta"
        )
        ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
        with Count() as counter:
            h = model.model.embed_tokens(ids)
            embedding = counter.n
            for layer in model.model.layers:
                h = layer(h, None, None)
            logits = model.lm_head(model.model.norm(h))
            loss = vocab_parallel_cross_entropy(logits[:, :-1], ids[:, 1:], reduction="sum")
            if backward:
                loss.backward()
        return counter.n, embedding

    one, embedding = count(1, True)
    two, _ = count(2, True)
    one_fwd, _ = count(1, False)
    two_fwd, _ = count(2, False)
    layer, layer_forward = two - one, two_fwd - one_fwd
    return {
        "layer": layer,
        "layer_forward": layer_forward,
        "embedding": embedding,
        "head": one - layer - embedding,
    }


def _layer_flops(s: _RankShapes, b: int, seq: int) -> float:
    """One decoder layer's forward + backward FLOPs on one TP rank for ``b`` sequences of
    ``seq`` tokens: 6 per parameter and token, and attention's scores and values."""
    return 6 * s.layer * b * seq + 12 * b * seq * seq * s.q_heads * s.head_dim


def _head_flops(s: _RankShapes, config: Qwen2Config, b: int, seq: int) -> float:
    return 6 * s.vocab * config.hidden_size * b * seq


def forward_backward_work(config: Qwen2Config, micro_batch: int, seq_len: int) -> tuple:
    """(FLOPs, dispatched operators) of one forward + backward of ``micro_batch`` sequences of
    ``seq_len`` tokens through the whole model on one rank, as :func:`estimate` charges them:
    what :func:`~tp_ext.planner.hardware.calibrate` fits this machine's rate and per-operator
    cost to."""
    s, ops = _rank_shapes(config, 1), _op_counts(config)
    layers = config.num_hidden_layers
    flops = layers * _layer_flops(s, micro_batch, seq_len)
    flops += _head_flops(s, config, micro_batch, seq_len)
    return flops, layers * ops["layer"] + ops["head"] + ops["embedding"]


def _layer_activation_bytes(s: _RankShapes, config: Qwen2Config, b: int, seq: int, c: int) -> int:
    """What one tp_ext decoder layer saves for backward for ``b`` sequences of ``seq`` tokens in
    a dtype of ``c`` bytes (counted from its code): the two norms' inputs and outputs (4 x
    [T, hidden], replicated over TP), q / k / v after RoPE, attention's output twice (its own
    copy and o_proj's input), gate/up's output and SwiGLU's, the log-sum-exp (fp32) and RoPE's
    cos / sin."""
    t, h, hd = b * seq, config.hidden_size, s.head_dim
    per_token = 4 * h + s.q_heads * hd + 2 * s.kv_heads * hd + 2 * s.q_heads * hd
    per_token += 3 * s.intermediate
    return t * per_token * c + b * s.q_heads * seq * 4 + 2 * b * seq * hd * c


def memory_breakdown(params, optimizer, activations, total, fsdp_buffers=0) -> dict:
    """An estimate's ``memory_bytes``: gradients as large as the parameters (their dtype);
    training keeps no KV cache."""
    return {
        "params": int(params),
        "grads": int(params),
        "optimizer": int(optimizer),
        "activations": int(activations),
        "kv_cache": 0,
        "fsdp_buffers": int(fsdp_buffers),
        "total": int(total),
    }


def _check_layout(config: Qwen2Config, layout: Layout) -> None:
    if isinstance(layout.tp, int):
        config.check_tp(layout.tp)
    elif not (isinstance(layout.tp, tuple) and len(layout.tp) == 2):
        raise ValueError(f"layout.tp must be an int or a grid (P, Q), got {layout.tp!r}")
    if layout.dtype not in DTYPE_BYTES:
        raise ValueError(f"layout.dtype must be one of {sorted(DTYPE_BYTES)}, got {layout.dtype!r}")
    if layout.data_parallel not in ("ddp", "fsdp"):
        raise ValueError(
            f"layout.data_parallel must be 'ddp' or 'fsdp', got {layout.data_parallel!r}"
        )
    stages = layout.pp * layout.virtual_stages
    if stages > config.num_hidden_layers:
        raise ValueError(
            f"pp={layout.pp} x virtual_stages={layout.virtual_stages} = {stages} stages, more "
            f"than the model's {config.num_hidden_layers} decoder layers"
        )


def estimate(
    config: Qwen2Config,
    layout: Layout,
    *,
    seq_len: int,
    hardware: Hardware,
    gpu_memory: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
) -> Estimate:
    """The cost of training ``config`` with ``layout`` on ``hardware`` (a step of
    ``dp x num_micro_batches x micro_batch`` sequences of ``seq_len`` tokens)."""
    _check_layout(config, layout)
    if isinstance(layout.tp, tuple):  # a 2D grid: its own model
        from tp_ext.planner.cost_2d import estimate_2d

        return estimate_2d(
            config,
            layout,
            seq_len=seq_len,
            hardware=hardware,
            gpu_memory=gpu_memory,
            gpus_per_node=gpus_per_node,
        )
    tp, pp, dp, v = layout.tp, layout.pp, layout.dp, layout.virtual_stages
    m, b = layout.num_micro_batches, layout.micro_batch
    e = DTYPE_BYTES[layout.dtype]
    s = _rank_shapes(config, tp)
    order = "v" if layout.schedule in V_SCHEDULES else "loop"
    stages = StageLayout(config.num_hidden_layers, pp, v, None, order)

    # -- memory of the busiest rank: parameters (exact, rank 0's shards), gradients in the same
    # dtype, AdamW's two moments plus its per-tensor fp32 step count
    def rank_params(r):
        mine = stages.stages_of(r)
        n = sum(len(stages.layers_of(st)) for st in mine) * s.layer
        t = sum(len(stages.layers_of(st)) for st in mine) * s.layer_tensors
        if 0 in mine:
            n, t = n + s.embedding, t + s.embedding_tensors
        if stages.last_stage in mine:  # with tied embeddings the head is the last stage's copy
            n, t = n + s.final, t + s.final_tensors
        return n, t

    shard = dp if layout.data_parallel == "fsdp" else 1
    c = e  # activations in the parameters' dtype
    act_layer = _layer_activation_bytes(s, config, b, seq_len, c)
    tokens = b * seq_len
    layer_input = tokens * config.hidden_size * c

    def rank_memory(r):
        """The rank's peak over the phases of a step (parameters and optimizer state always
        there; gradients from the first backward on):
        A: the most activations in flight, at the LM head's backward on the last stage (the
           logits' gradient, the head's weight gradient and the hidden states' gradient beside
           the activations); with gradients already there when a backward came before it;
        C: the first layer's backward, every gradient allocated, that layer's activations (with
           recompute: rebuilt from its input, the other inputs still held) and its temporaries;
        D: the optimizer step (fused AdamW on GPUs: no temporaries; torch's per-tensor loop on
           CPU: two of the largest tensor)."""
        mine = stages.stages_of(r)
        numel, tensors = rank_params(r)
        if config.tie_word_embeddings and pp == 1:
            numel, tensors = numel - s.embedding, tensors - s.embedding_tensors  # one tensor
        params = math.ceil(numel / shard) * e
        optimizer = 2 * params + 4 * tensors
        if shard == 1:
            fsdp_buffers = 0
        elif m > 1:
            # torch's pipelining keeps FSDP2's parameters unsharded between micro-batches and
            # accumulates unsharded gradients (no reduce-scatter until the last): both in full
            fsdp_buffers = 2 * numel * e
        else:  # one layer gathered, the next prefetched, and one layer's gradient to scatter
            fsdp_buffers = 3 * s.layer * e
        layers = sum(len(stages.layers_of(st)) for st in mine)
        held = layers * (layer_input if layout.recompute else act_layer)
        in_flight = _in_flight(layout.schedule, pp, m, v, r)
        ids = tokens * 8 if 0 in mine else 0
        acts = in_flight * held + ids
        transient = 0
        if stages.last_stage in mine:
            # final norm in / out, the logits and the loss's per-token stats, for every
            # micro-batch in flight (GPipe: all of them)
            head = 2 * tokens * config.hidden_size * c + tokens * s.vocab * c
            acts += in_flight * (head + 8 * b * (seq_len - 1) + 4 * tp)
            transient = (tokens * s.vocab + s.vocab * config.hidden_size + layer_input // c) * c
        elif 0 in mine:
            # the embedding's backward ends each backward of the first stage: its weight
            # gradient (a new tensor, then accumulated) and the hidden state's gradient
            transient = s.embedding * e + layer_input
        # a backward ran before this peak when the first rank's warm-up is shorter than m
        grads_before = params if m > math.ceil(in_flight) and shard == 1 else 0
        phase_a = params + optimizer + grads_before + acts + transient
        layer_temps = layer_input  # the hidden state's gradient flowing back
        rebuilt = layers * layer_input if layout.recompute else 0
        phase_c = 2 * params + optimizer + rebuilt + act_layer + layer_temps + ids
        # pipeline stages keep each in-flight micro-batch's output until its gradient arrives
        # (the last layer's output, which autograd itself does not save)
        if pp > 1 and stages.last_stage not in mine:
            acts += in_flight * layer_input
            phase_a += in_flight * layer_input
        opt_temp = 0 if hardware.fused_optimizer else 2 * s.largest * e
        phase_d = 2 * params + optimizer + opt_temp
        if layout.data_parallel == "ddp" and dp > 1:  # DDP's gradient buckets: a copy of them
            phase_a, phase_c, phase_d = (x + params for x in (phase_a, phase_c, phase_d))
        memory = memory_breakdown(
            params,
            optimizer,
            max(acts + transient, rebuilt + act_layer + layer_temps),
            max(phase_a, phase_c, phase_d) + fsdp_buffers,
            fsdp_buffers,
        )
        return memory, numel

    ranks = [rank_memory(r) for r in range(pp)]
    busiest = max(range(pp), key=lambda r: ranks[r][0]["total"])
    memory = ranks[busiest][0]
    numel = max(n for _, n in ranks)
    params = memory["params"]
    grads, optimizer = memory["grads"], memory["optimizer"]
    layers_max = max(
        sum(len(stages.layers_of(st)) for st in stages.stages_of(r)) for r in range(pp)
    )

    # -- bytes per step (payloads, as track() counts them) of the busiest rank
    hidden_bytes = tokens * config.hidden_size * c

    def rank_tp_bytes(r):
        if tp == 1:
            return 0
        mine = stages.stages_of(r)
        layers = sum(len(stages.layers_of(st)) for st in mine)
        # forward: each layer's two row-parallel all-reduces and the vocab-parallel embedding's;
        # backward: the column-parallel inputs' gradients and the LM head's
        # (non-reentrant checkpointing stops recomputing after the last saved tensor it
        # needs, before the MLP's all-reduce: one more per layer)
        fwd = (3 if layout.recompute else 2) * layers + (0 in mine)
        bwd = 2 * layers + (stages.last_stage in mine)
        n = b * (seq_len - 1)  # the loss's tokens: max and shard sizes, then 3 sums per token
        loss = (n + tp) * 4 + 3 * n * 4 if stages.last_stage in mine else 0
        return m * ((fwd + bwd) * hidden_bytes + loss)

    tp_bytes = max(rank_tp_bytes(r) for r in range(pp))

    # PP: torch's pipelining sends each micro-batch's [micro_batch, seq, hidden] activation across
    # every stage boundary and its gradient back (on every TP rank); a rank counts both for each
    # boundary between one of its stages and a neighbour on another rank: two per inner stage,
    # so interleaving v stages per rank crosses up to 2 v boundaries, and a V's middle boundary
    # (both stages on one rank) is passed locally
    def rank_pp_bytes(r):
        crossed = sum(
            1
            for st in stages.stages_of(r)
            for other in (st - 1, st + 1)
            if 0 <= other < stages.num_stages and stages.rank_of(other) != r
        )
        return m * 2 * crossed * hidden_bytes

    pp_bytes = max(rank_pp_bytes(r) for r in range(pp)) if pp > 1 else 0
    boundaries = 2 * v if pp > 1 else 0

    def rank_fsdp_bytes(r):
        """(all-gather bytes, reduce-scatter bytes) of FSDP2 under torch's pipelining, per stage
        (each its own root unit): a layer is gathered for each forward that finds it resharded
        (non-root units reshard after forward) and for each backward after a forward
        (pipelining keeps it unsharded after a backward until the last), which for a stage's
        F...B sequence of m micro-batches is m + 1 times; the root unit (embedding, final norm,
        head) keeps its parameters from its first forward to the step's end: once. Then one
        reduce-scatter of every gradient."""
        gathered = scattered = 0
        for st in stages.stages_of(r):
            layers = len(stages.layers_of(st)) * _fsdp_numel(s.layer_rows, dp)
            root = 0
            if st == 0:
                root += _fsdp_numel(s.embedding_rows, dp)
            if st == stages.last_stage:
                root += _fsdp_numel(s.final_rows, dp)
                if config.tie_word_embeddings and pp == 1:  # one tensor, gathered once
                    root -= _fsdp_numel(s.embedding_rows, dp)
            gathered += (m + 1) * layers + root
            scattered += layers + root
        return gathered * e, scattered * e

    weight_split = layout.schedule in ("InterleavedZeroBubble", *V_SCHEDULES)
    if dp == 1:
        dp_bytes = 0
    elif layout.data_parallel == "ddp" and weight_split:
        # these schedules write weight gradients outside DDP's hooks: tp_ext all-reduces them
        # once after the step, flattened in float32 (float64 for float64 parameters)
        dp_bytes = numel * (8 if e == 8 else 4)
    elif layout.data_parallel == "ddp":
        # one all-reduce of every gradient, in the last micro-batch's backward (no_sync before):
        # DDP's buckets, or one per parameter with tp_ext's comm hook (dp > 2): the same bytes
        dp_bytes = numel * e
    else:
        gathered, scattered = max((rank_fsdp_bytes(r) for r in range(pp)), key=sum)
        dp_bytes = gathered + scattered
    comm = {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes}

    # -- time
    nodes_span = gpus_per_node or tp * pp * dp
    tp_cross = tp > nodes_span
    pp_cross = pp > 1 and tp * dp * pp > nodes_span
    dp_cross = dp > 1 and tp * dp > nodes_span
    layer_flops = _layer_flops(s, b, seq_len)
    head_flops = _head_flops(s, config, b, seq_len)
    ops = _op_counts(config)
    recompute = 1 if layout.recompute else 0

    def rank_compute(r):
        """Seconds of one micro-batch's forward + backward on pipeline rank r: its FLOPs at the
        device's rate, and its operators' fixed cost (dispatch, launch: what dominates small
        shapes)."""
        mine = stages.stages_of(r)
        layers = sum(len(stages.layers_of(st)) for st in mine)
        flops = layers * layer_flops * (4 / 3 if recompute else 1)
        n_ops = layers * (ops["layer"] + recompute * ops["layer_forward"])
        if stages.last_stage in mine:
            flops += head_flops
            n_ops += ops["head"]
        if 0 in mine:
            n_ops += ops["embedding"]
        return flops / hardware.flops + n_ops * hardware.op_overhead

    compute = max(rank_compute(r) for r in range(pp))
    bus = 2 * (tp - 1) / tp if tp > 1 else 0
    collectives = ((4 + recompute) * layers_max + 2) if tp > 1 else 0
    tp_time = (tp_bytes / m) * bus / hardware.link(tp_cross) + collectives * hardware.latency
    # each stage boundary a rank crosses: a send and a receive forward, the same backward
    pp_time = (
        (pp_bytes / m) / hardware.link(pp_cross) + 2 * boundaries * hardware.latency
        if pp > 1
        else 0.0
    )
    micro = compute + tp_time + pp_time
    bubble = bubble_fraction(layout.schedule, pp, m, v)
    pipeline = m * micro / (1 - bubble)
    # where collectives cannot run beside compute (CPU ranks over gloo share their cores),
    # nothing of the DP traffic is hidden
    hide = 1.0 if hardware.overlap else 0.0
    tensors = max(rank_params(r)[1] for r in range(pp))
    if dp > 1 and shard == 1:
        # a ring all-reduce, overlapped only with the last micro-batch's backward; one call per
        # 25 MB bucket (DDP's default), per parameter above 2 ranks (the reproducible hook)
        calls = tensors if dp > 2 else math.ceil(numel * e / (25 * 2**20))
        dp_time = 2 * (dp - 1) / dp * dp_bytes / hardware.link(dp_cross)
        dp_time += calls * hardware.latency
        dp_exposed = max(0.0, dp_time - hide * compute * 2 / 3)
    elif dp > 1:
        # all-gathers and the reduce-scatter move (dp-1)/dp of their payload (the reduce-scatter
        # at its own rate where measured: gloo's is slower than its gathers); the gathers come in
        # every micro-batch, prefetching hides each behind its micro-batch's compute, up to it;
        # each unit (a decoder layer, and the stage's root) costs FSDP2's own work (hooks, copies
        # in and out of the flat buffers, the calls) in every micro-batch on top
        units = layers_max + 1
        link = hardware.link(dp_cross)
        dp_time = (dp - 1) / dp * (gathered / link + scattered / (hardware.reduce_scatter or link))
        overhead = m * units * hardware.fsdp_unit_overhead
        dp_exposed = max(0.0, dp_time - hide * m * compute) + overhead
    else:
        dp_time = dp_exposed = 0.0
    # torch's pipelining runtime: per schedule action (a stage's forward or backward of a
    # micro-batch; the zero-bubble schedules split the backward in two)
    split_backward = SCHEDULES[layout.schedule].weight_split
    # (the Trainer runs a schedule at pp=1 too: one stage)
    actions = m * v * (3 if split_backward else 2)
    pp_runtime = actions * hardware.pp_action_overhead
    if hardware.optimizer_seconds_per_param is not None:
        optimizer_time = params / e * hardware.optimizer_seconds_per_param
    else:  # a fused AdamW reads and writes parameters, gradients and moments about twice
        optimizer_time = 4 * (params + grads + optimizer) / hardware.memory_bandwidth
    step = pipeline + pp_runtime + dp_exposed + optimizer_time

    limit = gpu_memory
    fits = limit is None or memory["total"] <= usable_memory(limit)
    detail = {
        "layers_per_rank": layers_max,
        "in_flight_micro_batches": _in_flight(layout.schedule, pp, m, v, 0),
        "compute_s": m * compute,
        "tp_s": m * tp_time,
        "pp_s": m * pp_time,
        "dp_s": dp_time,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer_time,
        "pp_runtime_s": pp_runtime,
        "tp_crosses_nodes": tp_cross,
        "pp_crosses_nodes": pp_cross,
        "dp_crosses_nodes": dp_cross,
        "parameters_per_rank": numel,
        "parameters_by_pp_rank": [n for _, n in ranks],
        "busiest_pp_rank": busiest,
    }
    return Estimate(layout, memory, comm, bubble, step, fits, limit, "", detail)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64}[name]  # fmt: skip
