"""One training step of a candidate as the cost model sees it (:class:`Step`): the quantities an
estimate derives once from its arguments, how the Trainer synchronises the gradients, and what
each pipeline rank r holds (its layers, parameter shards, ZeRO rows, activations). The costs read
it: memory (:mod:`.memory`), bytes (:mod:`.traffic`), time (:mod:`.timing`).

The step is the Trainer's one core (runner, gradient sync, optimizer); what depends on the
model (its shards, what a layer saves, its TP bytes and FLOPs) is a few methods: 1D TP's here,
a 2D grid's in :class:`~tp_ext.planner.cost_2d.GridStep`. The counts follow tp_ext's own code,
not a textbook formula: parameters per rank are those of the real layers built on the meta
device (the one shard policy), the activation bytes are what tp_ext's decoder layer saves for
backward (fused QKV and gate/up, flash-style attention saving its output and log-sum-exp)."""

from __future__ import annotations

from typing import Optional

from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.pipeline.data_parallel import ZERO_STAGES, choose_sync
from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.candidate import Candidate
from tp_ext.planner.counts import (
    RankShapes,
    head_flops,
    layer_flops,
    op_counts,
    padded_pieces,
    rank_shapes,
    shard_numel,
)
from tp_ext.planner.hf_model import (
    HFModel,
    hf_layer_activation_bytes,
    hf_op_counts,
    hf_rank_shapes,
)
from tp_ext.sharding import StageSplit, cp_chunks
from tp_ext.validation import dtype_bytes

__all__ = [
    "Step",
    "V_SCHEDULES",
    "deferred_weight_passes",
    "dualpipev_in_flight",
    "gradient_sync",
    "in_flight",
    "rows_of",
    "split_backwards",
]

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank in a V: r and 2 pp - 1 - r


def gradient_sync(data_parallel: str, replicas: int, experts: bool) -> Optional[str]:
    """How the Trainer finishes a step's gradients: its row of the one sync table
    (:data:`tp_ext.pipeline.data_parallel.SYNCS`), named as the planner costs it: "ddp" or
    "fsdp" (the engine wrapping the stages sums them; ZeRO-1 runs under DDP), "sums" (tp_ext's
    flat all-reduce per replica group: models with experts), "reduce_scatter" (ZeRO-2), None
    (nothing to sum)."""
    row = choose_sync(data_parallel, replicas, replicas, experts)
    if row.sync == "engine":
        return row.engine
    return None if row.sync == "none" else row.sync


def in_flight(schedule: str, pp: int, m: int, v: int, rank: int) -> float:
    """Micro-batches whose activations pipeline rank ``rank`` holds at its peak, in units of
    its whole stage set: one in the local loop (pp = 1); GPipe all of them; 1F1B pp - rank (its
    warm-up forwards); interleaved 1F1B Megatron's (1 + (p-1)/(p v)) x that (a rank runs ahead
    on its later stages); InterleavedZeroBubble holds each until its deferred weight pass
    (:func:`_zero_bubble_in_flight`); the V schedules stay within 1F1B's."""
    if pp == 1:
        return 1
    if schedule == "GPipe":
        return m
    ahead = min(m, pp - rank)
    if schedule == "Interleaved1F1B":
        return ahead * (1 + (pp - 1) / (pp * v))
    if schedule == "InterleavedZeroBubble":
        return _zero_bubble_in_flight(pp, m, v)
    return ahead


def _zero_bubble_in_flight(pp: int, m: int, v: int) -> float:
    """InterleavedZeroBubble's micro-batches in flight on every rank, as torch's generator
    orders them: a stage holds a micro-batch's tensors from its forward to its weight pass; at
    the peak every stage holds all m (m < pp) or pp, and v - 1 of its stages one more per
    micro-batch a round has beyond pp (m // rounds, rounds = max(1, m // pp))."""
    if m < pp:
        return m
    per_round = m // max(1, m // pp)
    return pp + (per_round - pp) * (v - 1) / v


def deferred_weight_passes(pp: int, m: int, v: int, rank: int) -> int:
    """Input passes whose weight passes wait on ``rank`` at its peak of micro-batches in flight
    under InterleavedZeroBubble (torch's generator): one per rank before it, at most every
    micro-batch of its v stages but the one running."""
    return min(rank, m * v - 1)


def dualpipev_in_flight(pp: int, m: int, rank: int) -> tuple[int, int]:
    """Micro-batches whose activations DualPipeV's pipeline rank ``rank`` holds on its two
    stages (rank and 2 pp - 1 - rank) at its peak, once both have made their gradients (torch's
    ScheduleDualPipeV; the tests count them from its generator): 2 pp - rank on the first (its
    warm-up forwards, and each overlapped F&B step's forward runs before its backward) and
    rank + 1 on the second; at m = 2 pp rank 0's first backward comes after its last forward
    (one fewer by then). m >= 2 pp (tp_ext's check)."""
    return 2 * pp - rank - (1 if rank == 0 and m == 2 * pp else 0), rank + 1


def split_backwards(schedule: str, pp: int, m: int, stage: int) -> int:
    """Micro-batches whose backward on ``stage`` torch's schedule splits into an input pass and
    a weight pass: none outside the weight-split (zero-bubble) schedules; all m in
    InterleavedZeroBubble and ZBVZeroBubble (every backward action an input one); in DualPipeV
    (torch's ScheduleDualPipeV, rank r holding stages r and 2 pp - 1 - r) only its zero-bubble
    steps': r // 2 + 1 (step 6) and pp - r - 1 (step 7) of stage r, pp - r - 1 (step 3) and
    (r + 1) // 2 (step 6) of stage 2 pp - 1 - r; the rest are full backwards (the overlapped
    F&B steps). The first stage's split runs as one backward (its input takes no gradient)."""
    if not SCHEDULES[schedule].weight_split or stage == 0:
        return 0
    if schedule != "DualPipeV":
        return m
    rank = min(stage, 2 * pp - 1 - stage)
    if stage == rank:
        return rank // 2 + 1 + pp - rank - 1
    return pp - rank - 1 + (rank + 1) // 2


def layer_activation_bytes(s, config: Qwen2Config, b: int, seq: int, c: int) -> int:
    """What one tp_ext decoder layer saves for backward for ``b`` sequences of ``seq`` tokens in
    a dtype of ``c`` bytes (counted from its code): the two norms' inputs and outputs (4 x
    [T, hidden], replicated over TP), q / k / v after RoPE, attention's output twice (its own
    copy and o_proj's input), gate/up's output and SwiGLU's, the log-sum-exp (fp32) and RoPE's
    cos / sin."""
    t, h, hd = b * seq, config.hidden_size, s.head_dim
    per_token = 4 * h + s.q_heads * hd + 2 * s.kv_heads * hd + 2 * s.q_heads * hd
    per_token += 3 * s.intermediate
    return t * per_token * c + b * s.q_heads * seq * 4 + 2 * b * seq * hd * c


def _expert_replicas(dims) -> int:
    """Ranks holding the same experts (tp_ext.distributed.mesh.expert_groups): the DP ranks of
    a stage not in this rank's EP group (ep dividing dp), or the TP ranks it leaves (ep = dp x a
    divisor of tp); at every CP position."""
    per_position = dims.dp // dims.ep if dims.dp % dims.ep == 0 else dims.tp * dims.dp // dims.ep
    return per_position * dims.cp


class Step:
    """One training step of a candidate (1D TP): the estimate's quantities derived once from its
    arguments, and what each pipeline rank r holds."""

    def __init__(self, config, candidate: Candidate, seq_len, hardware, gpus_per_node):
        dims = candidate.dims
        self.config, self.candidate, self.hardware = config, candidate, hardware
        self.seq_len, self.gpus_per_node = seq_len, gpus_per_node
        # tp: the ranks of the TP group (a grid's P x Q)
        self.tp, self.pp, self.dp, self.v = dims.tp_size, dims.pp, dims.dp, dims.virtual_stages
        self.ep = dims.ep
        # context parallelism: each rank holds two of 2 cp chunks of every sequence; the
        # busiest holds the most positions (tp_ext.sharding.cp_chunks)
        self.cp = dims.cp
        self.local_seq = max(
            sum(n for _, _, n in cp_chunks(seq_len, self.cp, r)) for r in range(self.cp)
        )
        # the ranks holding the same dense weights (DP x CP: each CP rank scores its own
        # positions of the same sequences), which the gradient sync sums over; the experts'
        self.replicas = dims.replicas
        self.expert_replicas = _expert_replicas(dims)  # (at ep = 1: the dense weights')
        self.sync = gradient_sync(candidate.data_parallel, self.replicas, dims.ep > 1)
        self.m, self.micro_batch = candidate.num_micro_batches, candidate.micro_batch
        self.b = self._sequences()  # the sequences of a micro-batch this rank computes
        self.recompute = candidate.activation_checkpointing
        self.e = dtype_bytes(candidate.dtype)  # activations take the parameters' dtype too
        # what tp_ext's own flat gradient buffers take per element (fp32; fp64 for fp64)
        self.flat_bytes = 8 if self.e == 8 else 4
        self.s = self._shapes()
        # a model with experts runs whole at pp = 1: its loss on full logits (a pipeline: on its
        # vocabulary shard)
        self.logits_vocab = config.vocab_size if dims.ep > 1 and self.pp == 1 else self.s.vocab
        order = "v" if candidate.schedule in V_SCHEDULES else "loop"
        # the layers placed as the model places them (a transformers model: by cost)
        default_split = getattr(config, "default_pipeline_split", None)
        split = default_split(self.pp * self.v) if default_split else None
        self.stages = StageSplit(config.num_hidden_layers, self.pp, self.v, split, order)
        # (decoder layers, the first stage, the last stage) of each pipeline rank (asked by
        # every cost; the search builds thousands of steps)
        self._held = [self._holds(self.stages.stages_of(r)) for r in range(self.pp)]
        # FSDP2 shards every tensor along dim 0 over its replicas (the experts' over theirs)
        self.shard = self.replicas if self.sync == "fsdp" else 1
        # its units: each decoder layer and the stage (a transformers model with experts run
        # whole at pp = 1, tp_ext.training.adapters.WholeModel: the stage alone)
        self.layer_units = not (dims.ep > 1 and self.pp == 1)
        # ZeRO (over more than one replica; else the Trainer steps a plain optimizer): 1 or 2,
        # else 0; its master rows and AdamW state are fp32 (fp64 for fp64 parameters)
        self.zero = ZERO_STAGES.get(candidate.data_parallel, 0) if self.replicas > 1 else 0
        self.master_bytes = 8 if self.e == 8 else 4
        self._zero_rows: dict = {}
        self.tokens = self.b * self.local_seq
        # the tokens the loss scores on this rank (each CP rank its positions: the last
        # position's target is ignored, on the rank holding it)
        self.loss_tokens = self.b * (seq_len - 1) if self.cp == 1 else self.tokens
        # one hidden state of a micro-batch on this rank ([sequences, positions, features]): a
        # layer's input, a stage boundary's send
        self.hidden_bytes = self.tokens * self._hidden_features() * self.e
        self.act_layer = self._layer_activations()

    # ---- the model: what the 1D layers hold and do (a 2D grid's: cost_2d.GridStep) ---------

    def _sequences(self) -> int:
        """The sequences of a micro-batch each rank computes (1D TP: all of them)."""
        return self.micro_batch

    def _shapes(self) -> RankShapes:
        dims, config = self.candidate.dims, self.config
        if isinstance(config, HFModel):
            return hf_rank_shapes(config, self.tp, dims.ep)
        return rank_shapes(config, self.tp)

    def _hidden_features(self) -> int:
        """The features of a hidden state each rank holds (1D TP: all of them)."""
        return self.config.hidden_size

    def _layer_activations(self) -> int:
        """What one decoder layer saves for backward per micro-batch."""
        if isinstance(self.config, HFModel):  # measured on the architecture itself
            c = self.candidate
            return hf_layer_activation_bytes(self.s, self.config, self.b, self.local_seq, self.e,
                                             self.tp, self.ep, c.dtype, self.dp,
                                             c.routing_imbalance)  # fmt: skip
        return layer_activation_bytes(self.s, self.config, self.b, self.local_seq, self.e)

    def head_bytes(self) -> int:
        """What the head saves for backward per micro-batch on the last stage: the final norm's
        input and output, the logits, the loss's per-token statistics."""
        logits = self.tokens * self.logits_vocab * self.e
        return 2 * self.hidden_bytes + logits + 8 * self.loss_tokens + 4 * self.tp

    def head_weight_numel(self) -> int:
        """Elements of this rank's LM head weight (its gradient is made in the head's
        backward)."""
        return self.s.vocab * self.config.hidden_size

    def head_gradient_bytes(self) -> int:
        """The LM head weight's gradient, made in the head's backward."""
        return self.head_weight_numel() * self.e

    def layer_backward_bytes(self) -> int:
        """The temporaries of a decoder layer's backward at its peak, inside the MLP: the
        gradient of SwiGLU's input ([T, 2 x intermediate]) made beside the gradient of its
        output (which replaces the output down_proj saved), and the hidden states' gradient
        flowing back."""
        return 2 * self.tokens * self.s.intermediate * self.e + self.hidden_bytes

    def weight_pass_bytes(self) -> int:
        """What a decoder layer's input pass keeps for its deferred weight pass (torch's
        stage_backward_input: the gradients at the nodes where the input's and the weights'
        paths meet): the gradients of each linear's and each norm's output."""
        s, h = self.s, self._hidden_features()
        per_token = s.q_heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 2 * s.intermediate
        return self.tokens * (per_token + 4 * h) * self.e

    def ids_on(self, r: int) -> int:
        """The input ids (every CP rank gets whole sequences, and keeps its positions)."""
        if not self.first_on(r):
            return 0
        return self.b * self.seq_len * 8 + (self.tokens * 8 if self.cp > 1 else 0)

    def tp_bytes_on(self, r: int) -> int:
        """TP bytes per step of rank r. Forward: each layer's two row-parallel all-reduces and
        the vocab-parallel embedding's; backward: the column-parallel inputs' gradients and the
        LM head's (non-reentrant checkpointing stops recomputing after the last saved tensor it
        needs, before the MLP's all-reduce: one more per layer); the loss's max and shard
        sizes, then 3 sums per token."""
        if self.tp == 1:
            return 0
        layers, last = self.layers_on(r), self.last_on(r)
        fwd = (3 if self.recompute else 2) * layers + self.first_on(r)
        bwd = 2 * layers + last
        n = self.loss_tokens
        loss = (n + self.tp) * 4 + 3 * n * 4 if last else 0
        return self.m * ((fwd + bwd) * self.hidden_bytes + loss)

    def flops_on(self, r: int) -> float:
        """FLOPs of one micro-batch's forward + backward on rank r (each CP rank: its share of
        the positions and, balanced chunks, of attention's pairs)."""
        recompute = 4 / 3 if self.recompute else 1
        flops = self.layers_on(r) * layer_flops(self.s, self.b, self.seq_len) * recompute
        if self.last_on(r):
            flops += head_flops(self.s, self.config, self.b, self.seq_len)
        return flops / self.cp

    def op_counts(self) -> dict:
        """Operators a micro-batch dispatches (per layer, its forward, embedding, head)."""
        config = self.config
        return hf_op_counts(config) if isinstance(config, HFModel) else op_counts(config)

    def tp_seconds(self, tp_bytes: float, layers: int, crosses: bool) -> float:
        """Seconds of one micro-batch's TP collectives (``tp_bytes`` of them, ``layers``
        decoder layers): a ring's bus bytes at the link's rate and each collective's
        latency."""
        if self.tp == 1:
            return 0.0
        hw, recompute = self.hardware, 1 if self.recompute else 0
        collectives = (4 + recompute) * layers + 2
        bus = 2 * (self.tp - 1) / self.tp
        return tp_bytes * bus / hw.link(crosses) + collectives * hw.latency

    # ---- what rank r holds ---------------------------------------------------------------

    def _holds(self, stages: list) -> tuple[int, bool, bool]:
        layers = sum(len(self.stages.layers_of(st)) for st in stages)
        return layers, 0 in stages, self.stages.last_stage in stages

    def layers_on(self, r: int) -> int:
        return self._held[r][0]

    def first_on(self, r: int) -> bool:
        return self._held[r][1]

    def last_on(self, r: int) -> bool:
        return self._held[r][2]

    def params_on(self, r: int) -> tuple[int, int]:
        """(parameters, tensors) of rank r's TP-rank-0 shards (exact: rank 0's are the
        largest); with tied embeddings the head is the last stage's own copy."""
        s, layers = self.s, self.layers_on(r)
        n, t = layers * s.layer, layers * s.layer_tensors
        if self.first_on(r):
            n, t = n + s.embedding, t + s.embedding_tensors
        if self.last_on(r):
            n, t = n + s.final, t + s.final_tensors
        return n, t

    def held_params_on(self, r: int) -> tuple[int, int]:
        """(parameters, tensors) rank r trains: :meth:`params_on`, a tied embedding at pp = 1
        counted once (one tensor)."""
        numel, tensors = self.params_on(r)
        if self.config.tie_word_embeddings and self.pp == 1:
            return numel - self.s.embedding, tensors - self.s.embedding_tensors
        return numel, tensors

    def row_shapes_on(self, r: int) -> list[tuple[tuple, int]]:
        """Rank r's TP-rank-0 dense parameter tensors (the experts' are :meth:`expert_shapes_on`)
        as (their (dim 0, numel) pairs, how many times they occur): a layer's per decoder
        layer, the embedding's (tied at pp = 1: one tensor, the head's) and the final norm and
        head's."""
        s = self.s
        parts = [(s.dense_layer_rows, self.layers_on(r))]
        if self.first_on(r) and not (self.config.tie_word_embeddings and self.pp == 1):
            parts.append((s.embedding_rows, 1))
        if self.last_on(r):
            parts.append((s.final_rows, 1))
        return [(shapes, times) for shapes, times in parts if times]

    def expert_shapes_on(self, r: int) -> list[tuple[tuple, int]]:
        """Rank r's expert tensors, as :meth:`row_shapes_on` gives the dense ones."""
        if not self.s.expert_rows or not self.layers_on(r):
            return []
        return [(self.s.expert_rows, self.layers_on(r))]

    def replica_groups(self, r: int) -> list[tuple[list, int]]:
        """Rank r's parameter tensors by replica group, in the order the Trainer sums and
        buckets them: (the dense ones, the DP x CP ranks), then (the experts', their
        replicas); the tensors as :meth:`row_shapes_on` gives them."""
        return [
            (self.row_shapes_on(r), self.replicas),
            (self.expert_shapes_on(r), self.expert_replicas),
        ]

    def layer_groups(self) -> list[tuple[list, int]]:
        """One decoder layer's tensors by replica group, as :meth:`replica_groups` gives a
        rank's."""
        experts = [(self.s.expert_rows, 1)] if self.s.expert_rows else []
        return [([(self.s.dense_layer_rows, 1)], self.replicas), (experts, self.expert_replicas)]

    @staticmethod
    def fsdp_groups(groups) -> list[tuple[list, int]]:
        """Those of ``groups`` (as :meth:`replica_groups` gives them) that FSDP2 shards: every
        one with replicas (where each rank holds its own experts, they stay out of FSDP2)."""
        return [(parts, size) for parts, size in groups if parts and size > 1]

    def alone_numel_on(self, r: int) -> int:
        """Elements of rank r's tensors that no other rank holds (experts left out of FSDP2)."""
        return sum(rows_of(parts, 1) for parts, size in self.replica_groups(r) if size == 1)

    def sync_groups(self, r: int) -> list[tuple[int, int]]:
        """(parameters, replicas) of each of rank r's :meth:`replica_groups`."""
        return [(rows_of(parts, 1), size) for parts, size in self.replica_groups(r)]

    def zero_rows_on(self, r: int, rank: int = 0) -> int:
        """Elements of replica ``rank``'s rows of rank r's parameters: what ZeRO steps there
        (each group's split over its replicas; rank 0 holds the most)."""
        key = (r, rank)  # asked by several costs; the search builds thousands of steps
        if key not in self._zero_rows:
            groups = self.replica_groups(r)
            self._zero_rows[key] = sum(rows_of(parts, size, rank) for parts, size in groups)
        return self._zero_rows[key]

    def padded_rows(self, parts, size: int) -> int:
        """Elements the asynchronous reduce-scatter of these tensors' whole gradients adds when
        the ``size`` replicas' rows differ in size
        (:func:`~tp_ext.planner.counts.padded_pieces`)."""
        if not parts or size == 1:
            return 0
        return padded_pieces([rows_of(parts, size, q) for q in range(size)])

    def in_flight(self, r: int) -> float:
        """Micro-batches in flight on rank r, in units of its whole stage set."""
        counts = self.stage_in_flight(r)
        return sum(n for _, n in counts) / len(counts)

    def stage_in_flight(self, r: int) -> list[tuple[int, float]]:
        """(stage, micro-batches whose activations it holds at rank r's peak) of each of rank
        r's stages: DualPipeV's own per stage (a V's two stages differ), else
        :func:`in_flight` on each."""
        stages = self.stages.stages_of(r)
        if self.candidate.schedule == "DualPipeV" and self.pp > 1:
            return list(zip(stages, dualpipev_in_flight(self.pp, self.m, r)))
        return [
            (st, in_flight(self.candidate.schedule, self.pp, self.m, self.v, r)) for st in stages
        ]

    def deferred_on(self, r: int) -> int:
        """Bytes rank r's deferred weight passes wait on at its peak under InterleavedZeroBubble
        (:func:`deferred_weight_passes`, and the input pass running): each its stage's layers'
        :meth:`weight_pass_bytes`, its output's gradient received and its input's."""
        if self.candidate.schedule != "InterleavedZeroBubble" or self.pp == 1:
            return 0
        layers = max(len(self.stages.layers_of(st)) for st in self.stages.stages_of(r))
        waiting = deferred_weight_passes(self.pp, self.m, self.v, r) + 1
        return waiting * (layers * self.weight_pass_bytes() + 2 * self.hidden_bytes)

    def activations_on(self, r: int) -> tuple[int, int]:
        """(activations held at rank r's peak, the transient tensors of the backward that
        starts there): each stage's in-flight micro-batches' saved tensors (with activation
        checkpointing: each layer's input only) and the input ids; on the last stage the head's
        (:meth:`head_bytes`), the logits' gradient, then the head's weight gradient and the
        hidden states' gradient; on the first the embedding's weight gradient; under pipelining
        the other stages' outputs."""
        counts = self.stage_in_flight(r)
        per_layer = self.hidden_bytes if self.recompute else self.act_layer
        layers = sum(n * len(self.stages.layers_of(st)) for st, n in counts)
        acts = layers * per_layer + self.ids_on(r)
        last = self.stages.last_stage
        # each stage's output (not the logits) kept until its gradient arrives: per stage where
        # the counts are (DualPipeV's), else per in-flight micro-batch of a rank without the head
        if self.candidate.schedule == "DualPipeV" and self.pp > 1:
            acts += sum(n for st, n in counts if st != last) * self.hidden_bytes
        elif self.pp > 1 and not self.last_on(r):
            acts += self.in_flight(r) * self.hidden_bytes
        if self.last_on(r):
            acts += dict(counts)[last] * self.head_bytes()
            logits = self.tokens * self.logits_vocab * self.e
            head = self.head_gradient_bytes() + self.hidden_bytes
            # torch's schedule keeps its stage's output (the logits) until the stage's backward
            # ends; the local loop frees them with the loss's backward, before the head's
            if self.pp == 1:
                return acts, logits + max(0, head - logits)
            return acts, logits + head
        transient = self.s.embedding * self.e + self.hidden_bytes if self.first_on(r) else 0
        return acts, transient


def rows_of(parts, size: int, rank: int = 0) -> int:
    """Elements of replica ``rank``'s rows (of ``size`` replicas; size 1: all of them) of
    ``parts`` ((shapes, times) pairs)."""
    return sum(times * shard_numel(shapes, size, rank) for shapes, times in parts)
