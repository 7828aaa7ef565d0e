"""What one training candidate (:class:`~tp_ext.planner.candidate.Candidate`) of tp_ext's Qwen2
costs per rank: memory (parameters, gradients, optimizer state, activations), bytes
communicated per step over TP, CP, PP and DP, the pipeline bubble and the step time on a
:class:`~tp_ext.planner.hardware.Hardware`.

The counts follow tp_ext's own code, not a textbook formula: parameters per rank are those of
the real layers built on the meta device (the one shard policy), the activation bytes are what
tp_ext's decoder layer saves for backward (fused QKV and gate/up, flash-style attention saving
its output and log-sum-exp), and the TP bytes are what ``tp_ext.comm.track()`` records for a
Trainer step. The tests hold the model to the measured numbers."""

from __future__ import annotations

import math
from typing import Optional

from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.candidate import Candidate, Estimate, memory_breakdown, usable_memory
from tp_ext.planner.cost_2d import estimate_2d
from tp_ext.planner.counts import (
    ZERO2_BUCKET_BYTES,
    ZERO_STAGES,
    fsdp_numel,
    head_flops,
    layer_flops,
    op_counts,
    padded_pieces,
    rank_shapes,
    shard_numel,
    zero_step_phases,
)
from tp_ext.planner.hardware import Hardware
from tp_ext.planner.hf_model import (
    HFModel,
    hf_layer_activation_bytes,
    hf_op_counts,
    hf_rank_shapes,
)
from tp_ext.sharding import StageSplit, cp_chunks, shard_sizes
from tp_ext.validation import DTYPE_BYTES, dtype_bytes

__all__ = [
    "Candidate",
    "Estimate",
    "estimate",
    "bubble_fraction",
    "DTYPE_BYTES",
    "usable_memory",
]

V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank in a V: r and 2 pp - 1 - r


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


def _layer_activation_bytes(s, config: Qwen2Config, b: int, seq: int, c: int) -> int:
    """What one tp_ext decoder layer saves for backward for ``b`` sequences of ``seq`` tokens in
    a dtype of ``c`` bytes (counted from its code): the two norms' inputs and outputs (4 x
    [T, hidden], replicated over TP), q / k / v after RoPE, attention's output twice (its own
    copy and o_proj's input), gate/up's output and SwiGLU's, the log-sum-exp (fp32) and RoPE's
    cos / sin."""
    t, h, hd = b * seq, config.hidden_size, s.head_dim
    per_token = 4 * h + s.q_heads * hd + 2 * s.kv_heads * hd + 2 * s.q_heads * hd
    per_token += 3 * s.intermediate
    return t * per_token * c + b * s.q_heads * seq * 4 + 2 * b * seq * hd * c


def _op_counts(config) -> dict:
    return hf_op_counts(config) if isinstance(config, HFModel) else op_counts(config)


def _check_candidate(config: Qwen2Config, candidate: Candidate) -> None:
    if not isinstance(candidate, Candidate):
        raise TypeError(
            f"estimate: candidate must be a tp_ext.planner.Candidate, got "
            f"{type(candidate).__name__}"
        )
    dims = candidate.dims
    if dims.grid is None:
        config.check_tp(dims.tp)
    experts = dims.ep > 1 or getattr(config, "is_moe", False)
    if dims.cp > 1:
        _check_context_parallel(candidate)
    elif candidate.data_parallel in ZERO_STAGES and experts:
        raise ValueError(
            f"estimate: data_parallel={candidate.data_parallel!r} with an expert (MoE) model is "
            "not supported: the Trainer runs it, the planner does not cost it yet; use 'ddp'"
        )
    if dims.stages > config.num_hidden_layers:
        raise ValueError(
            f"pp={dims.pp} x virtual_stages={dims.virtual_stages} = {dims.stages} stages, more "
            f"than the model's {config.num_hidden_layers} decoder layers"
        )


def _check_context_parallel(candidate: Candidate) -> None:
    """What the Trainer runs with cp > 1 (and so what the planner costs)."""
    dims, why = candidate.dims, None
    if dims.grid is not None:
        why = "a 2D grid"
    elif dims.ep > 1:  # the Trainer runs it (ContextExpertStep); its cost is not modelled yet
        why = "expert parallelism (not costed by the planner yet)"
    elif candidate.data_parallel != "ddp":
        # the Trainer runs ZeRO over DP x CP; its cost is not modelled yet
        why = f"data_parallel={candidate.data_parallel!r} (not costed by the planner yet)"
    if why is not None:
        raise ValueError(
            f"estimate: cp={dims.cp} with {why} is not supported; context parallelism runs "
            "with 1D TP, pipelining and DDP-style data parallelism"
        )


class _Step:
    """One training step of a 1D candidate, and what each pipeline rank r of it costs: the
    estimate's quantities derived once from its arguments, and one method per cost."""

    def __init__(self, config, candidate: Candidate, seq_len, hardware, gpus_per_node):
        dims = candidate.dims
        self.config, self.candidate, self.hardware = config, candidate, hardware
        self.seq_len, self.gpus_per_node = seq_len, gpus_per_node
        self.tp, self.pp, self.dp, self.v = dims.tp, dims.pp, dims.dp, dims.virtual_stages
        # context parallelism: each rank holds two of 2 cp chunks of every sequence; the
        # busiest holds the most positions (tp_ext.sharding.cp_chunks)
        self.cp = dims.cp
        self.local_seq = max(
            sum(n for _, _, n in cp_chunks(seq_len, self.cp, r)) for r in range(self.cp)
        )
        self.m, self.b = candidate.num_micro_batches, candidate.micro_batch
        self.recompute = candidate.activation_checkpointing
        self.e = dtype_bytes(candidate.dtype)  # activations take the parameters' dtype too
        # what the Trainer's own flat gradient buffers take per element (EP, CP)
        self.flat_bytes = 8 if self.e == 8 else 4
        hf = isinstance(config, HFModel)
        self.s = hf_rank_shapes(config, self.tp, dims.ep) if hf else rank_shapes(config, self.tp)
        # the Trainer's EP loop at pp = 1 computes the loss on full logits (a pipeline: on its
        # vocabulary shard)
        self.logits_vocab = config.vocab_size if dims.ep > 1 and self.pp == 1 else self.s.vocab
        order = "v" if candidate.schedule in V_SCHEDULES else "loop"
        # the layers placed as the model places them (a transformers model: by cost)
        default_split = getattr(config, "default_pipeline_split", None)
        split = default_split(self.pp * self.v) if default_split else None
        self.stages = StageSplit(config.num_hidden_layers, self.pp, self.v, split, order)
        self.shard = self.dp if candidate.data_parallel == "fsdp" else 1
        # ZeRO (dp > 1; at dp = 1 the Trainer steps a plain optimizer): 1 or 2, else 0; its
        # master rows and AdamW state are fp32 (fp64 for fp64 parameters)
        self.zero = ZERO_STAGES.get(candidate.data_parallel, 0) if self.dp > 1 else 0
        self.master_bytes = 8 if self.e == 8 else 4
        self._zero_rows: dict = {}
        self.tokens = self.b * self.local_seq
        # the tokens the loss scores on this rank (each CP rank its positions: the last
        # position's target is ignored, on the rank holding it)
        self.loss_tokens = self.b * (seq_len - 1) if self.cp == 1 else self.tokens
        # one [micro_batch, seq, hidden] activation: a layer's input, a stage boundary's send
        self.hidden_bytes = self.tokens * config.hidden_size * self.e
        if hf:  # measured on the architecture itself
            self.act_layer = hf_layer_activation_bytes(
                self.s, config, self.b, self.local_seq, self.e, self.tp, dims.ep, candidate.dtype
            )
        else:
            self.act_layer = _layer_activation_bytes(self.s, config, self.b, self.local_seq, self.e)

    # ---- what rank r holds ---------------------------------------------------------------

    def layers_on(self, r: int) -> int:
        return sum(len(self.stages.layers_of(st)) for st in self.stages.stages_of(r))

    def params_on(self, r: int) -> tuple[int, int]:
        """(parameters, tensors) of rank r's TP-rank-0 shards (exact: rank 0's are the
        largest); with tied embeddings the head is the last stage's own copy."""
        mine, s = self.stages.stages_of(r), self.s
        n, t = self.layers_on(r) * s.layer, self.layers_on(r) * s.layer_tensors
        if 0 in mine:
            n, t = n + s.embedding, t + s.embedding_tensors
        if self.stages.last_stage in mine:
            n, t = n + s.final, t + s.final_tensors
        return n, t

    def row_shapes_on(self, r: int) -> list[tuple[tuple, int]]:
        """Rank r's TP-rank-0 parameter tensors, the ones :meth:`params_on` counts, as (their
        (dim 0, numel) pairs, how many times they occur): a layer's per decoder layer, the
        embedding's (tied at pp = 1: one tensor, the head's) and the final norm and head's."""
        mine, s = self.stages.stages_of(r), self.s
        parts = [(s.layer_rows, self.layers_on(r))]
        if 0 in mine and not (self.config.tie_word_embeddings and self.pp == 1):
            parts.append((s.embedding_rows, 1))
        if self.stages.last_stage in mine:
            parts.append((s.final_rows, 1))
        return [(shapes, times) for shapes, times in parts if times]

    def zero_rows_on(self, r: int, dp_rank: int = 0) -> int:
        """Elements of DP rank ``dp_rank``'s rows of rank r's parameters: what ZeRO steps there
        (DP rank 0 holds the most)."""
        key = (r, dp_rank)  # asked by several costs; the search builds thousands of steps
        if key not in self._zero_rows:
            parts = self.row_shapes_on(r)
            rows = sum(times * shard_numel(shapes, self.dp, dp_rank) for shapes, times in parts)
            self._zero_rows[key] = rows
        return self._zero_rows[key]

    def padded_rows(self, r: int) -> int:
        """Elements the asynchronous reduce-scatter of rank r's whole gradients adds when DP ranks'
        rows differ in size (:func:`~tp_ext.planner.counts.padded_pieces`)."""
        return padded_pieces([self.zero_rows_on(r, q) for q in range(self.dp)])

    def in_flight(self, r: int) -> float:
        return _in_flight(self.candidate.schedule, self.pp, self.m, self.v, r)

    def activations_on(self, r: int) -> tuple[int, int]:
        """(activations held at rank r's peak, the transient tensors of the backward that
        starts there): every in-flight micro-batch's saved tensors (with activation
        checkpointing: each layer's input only) and the input ids; on the last stage the head's
        (final norm in / out, logits, the loss's per-token stats) and the logits' gradient;
        on the first the embedding's weight gradient; on every other stage each in-flight
        micro-batch's output, kept until its gradient arrives."""
        mine, s, config, c = self.stages.stages_of(r), self.s, self.config, self.e
        held = self.layers_on(r) * (self.hidden_bytes if self.recompute else self.act_layer)
        in_flight = self.in_flight(r)
        acts = in_flight * held + self.ids_on(r)
        if self.stages.last_stage in mine:
            head = 2 * self.hidden_bytes + self.tokens * self.logits_vocab * c
            acts += in_flight * (head + 8 * self.loss_tokens + 4 * self.tp)
            transient = self.tokens * self.logits_vocab + s.vocab * config.hidden_size
            return acts, (transient + self.hidden_bytes // c) * c
        transient = s.embedding * self.e + self.hidden_bytes if 0 in mine else 0
        if self.pp > 1:
            acts += in_flight * self.hidden_bytes
        return acts, transient

    def ids_on(self, r: int) -> int:
        """The input ids (every CP rank gets whole sequences, and keeps its positions)."""
        if 0 not in self.stages.stages_of(r):
            return 0
        return self.b * self.seq_len * 8 + (self.tokens * 8 if self.cp > 1 else 0)

    def fsdp_buffers(self, numel: int) -> int:
        if self.shard == 1:
            return 0
        if self.m > 1:
            # torch's pipelining keeps FSDP2's parameters unsharded between micro-batches and
            # accumulates unsharded gradients (no reduce-scatter until the last): both in full
            return 2 * numel * self.e
        # one layer gathered, the next prefetched, and one layer's gradient to scatter
        return 3 * self.s.layer * self.e

    def memory_on(self, r: int) -> tuple[dict, int]:
        """(memory_bytes, parameters) of rank r: its peak over the phases of a step
        (parameters and optimizer state always there; gradients from the first backward on):
        A: the most activations in flight, at the LM head's backward on the last stage (the
           logits' gradient, the head's weight gradient and the hidden states' gradient beside
           the activations); with gradients already there when a backward came before it;
        C: the first layer's backward, every gradient allocated, that layer's activations (with
           activation checkpointing: rebuilt from its input, the other inputs still held) and
           its temporaries (the hidden state's gradient flowing back); in a pipeline also the
           stage's output and its gradient, and the other in-flight micro-batches' tensors;
        D: the optimizer step (fused AdamW on GPUs: no temporaries; torch's per-tensor loop on
           CPU: two of the largest tensor).
        AdamW keeps two moments plus a per-tensor fp32 step count; DDP a copy of the gradients
        in its buckets. ZeRO (:meth:`zero_phases`) keeps optimizer state for this DP rank's rows
        only; ZeRO-1's stages are DDP-wrapped (the bucket copy), ZeRO-2's are not, and its
        gradients at the step are this rank's rows."""
        numel, tensors = self.params_on(r)
        if self.config.tie_word_embeddings and self.pp == 1:  # one tensor
            numel, tensors = numel - self.s.embedding, tensors - self.s.embedding_tensors
        params = math.ceil(numel / self.shard) * self.e
        optimizer, grads = 2 * params + 4 * tensors, params
        if self.zero:
            rows = self.zero_rows_on(r)
            # the two moments of its rows, in the masters' dtype, and fp32 master rows where
            # the parameters are not fp32 (fp32 ones step their own rows in place)
            masters = rows * self.master_bytes if self.master_bytes != self.e else 0
            optimizer = 2 * rows * self.master_bytes + 4 * tensors + masters
            grads = rows * self.e if self.zero == 2 else params
        acts, transient = self.activations_on(r)
        rebuilt = self.layers_on(r) * self.hidden_bytes if self.recompute else 0
        layer_backward = rebuilt + self.act_layer + self.hidden_bytes
        if self.pp > 1:
            # torch's schedule holds the stage's output and its gradient through the stage's
            # backward (the logits on the last stage), and the micro-batches still in flight
            # keep what they saved (measured: 6-10% of a pp=2 rank's peak with recompute)
            last = self.stages.last_stage in self.stages.stages_of(r)
            out = self.tokens * self.logits_vocab * self.e if last else self.hidden_bytes
            held = self.layers_on(r) * (self.hidden_bytes if self.recompute else self.act_layer)
            others = max(0.0, self.in_flight(r) - 1) * (held + (0 if last else out))
            layer_backward += 2 * out + int(others)
        # a backward ran before this peak when the first rank's warm-up is shorter than m
        ran_backward = self.m > math.ceil(self.in_flight(r)) and self.shard == 1
        opt_temp = 0 if self.hardware.fused_optimizer else 2 * self.s.largest * self.e
        # with EP the Trainer syncs DP itself (its own loop, or after the pipeline's schedule):
        # every gradient flattened into one buffer for one all-reduce at the step's end (no DDP
        # buckets kept beside the gradients)
        flat_sync = self.candidate.dims.ep > 1 and self.dp > 1
        # context parallelism's step too, over DP x CP: the flat copy, and the all-reduce's
        # result beside it (tp_ext's all_reduce is out of place)
        flat_copies = 2 if self.cp > 1 else (1 if flat_sync else 0)
        flat = numel * self.flat_bytes  # those buffers are fp32 (fp64 for fp64 parameters)
        phases = [
            params + optimizer + (params if ran_backward else 0) + acts + transient,
            2 * params + optimizer + layer_backward + self.ids_on(r),
            2 * params + optimizer + opt_temp,
            2 * params + flat_copies * flat + optimizer if flat_copies else 0,
        ]
        if self.zero:
            phases[2:] = self.zero_phases(r, params, grads, optimizer, max(phases[:2]))
        # ZeRO-1's stages are DDP-wrapped as DDP's; neither is under the weight-split schedules
        # (tp_ext averages after the step: no buckets)
        ddp_like = self.candidate.data_parallel in ("ddp", "zero1")
        weight_split = SCHEDULES[self.candidate.schedule].weight_split
        ddp = ddp_like and self.dp > 1 and not flat_copies and not weight_split
        fsdp = self.fsdp_buffers(numel)
        peak = max(phases) + (params if ddp else 0) + fsdp
        memory = memory_breakdown(
            params, optimizer, max(acts + transient, layer_backward), peak, fsdp, grads
        )
        return memory, numel

    def zero_phases(self, r: int, params: int, grads: int, optimizer: int, backward: int):
        """ZeRO's phases of rank r after (or at the end of) its backward, beside the parameters
        and its optimizer state (``grads``: the gradients at the step, ``backward``: the
        backward's peak with whole gradients):
        the step: the fp32 copies of the gradients' rows (none for fp32 parameters: views) and,
           on CPU, two of the largest rows tensor (torch's per-tensor AdamW);
        the all-gather: this rank's rows flattened and every rank's gathered, both in the
           parameters' dtype;
        ZeRO-2's reduce-scatter: each bucket of whole gradients flattened, with this rank's rows
           of the sum. A rank with one bucket (at most 25 MiB of gradients) sends it when the
           last gradient is final, at the end of the last micro-batch's backward (on the first
           stage the embedding's gradient still held, and the input ids); with more, the first
           buckets go during the backward, beside its activations."""
        e, master = self.e, self.master_bytes
        rows, parts = self.zero_rows_on(r), self.row_shapes_on(r)
        largest = max(shard_numel((t,), self.dp) for shapes, _ in parts for t in shapes)
        numel = params // e
        held = params + grads + optimizer
        fused = self.hardware.fused_optimizer
        phases = zero_step_phases(held, rows, numel, e, master, largest, fused)
        if self.zero == 2:
            if params <= ZERO2_BUCKET_BYTES:
                first = 0 in self.stages.stages_of(r)
                last = self.s.embedding * e + self.ids_on(r) if first else self.hidden_bytes
                sent = (numel + rows + self.padded_rows(r)) * e
                phases.append(2 * params + optimizer + sent + last)
            else:
                # a bucket holds one parameter at least
                largest_tensor = max(n for shapes, _ in parts for _, n in shapes) * e
                bucket = max(ZERO2_BUCKET_BYTES, largest_tensor)
                phases.append(backward + bucket + math.ceil(bucket / self.dp))
        return phases

    # ---- bytes per step (payloads, as track() counts them) --------------------------------

    def tp_bytes_on(self, r: int) -> int:
        """Forward: each layer's two row-parallel all-reduces and the vocab-parallel
        embedding's; backward: the column-parallel inputs' gradients and the LM head's
        (non-reentrant checkpointing stops recomputing after the last saved tensor it needs,
        before the MLP's all-reduce: one more per layer); the loss's max and shard sizes, then
        3 sums per token."""
        if self.tp == 1:
            return 0
        mine, layers = self.stages.stages_of(r), self.layers_on(r)
        last = self.stages.last_stage in mine
        fwd = (3 if self.recompute else 2) * layers + (0 in mine)
        bwd = 2 * layers + last
        n = self.loss_tokens
        loss = (n + self.tp) * 4 + 3 * n * 4 if last else 0
        return self.m * ((fwd + bwd) * self.hidden_bytes + loss)

    def cp_bytes_on(self, r: int) -> int:
        """What the busiest CP rank sends per step, as ``track()`` files it under "cp"; per
        layer and micro-batch (a recomputed layer runs its forward twice), for each rank's
        positions (``local``, uneven where 2 cp does not divide the sequence):
        ring: the key/value blocks it holds in turn, passed on (cp - 1 hops) forward and again
        backward, and their gradients in fp32 (fp64 for fp64) on every hop (cp);
        all-to-all: its positions of other ranks' heads (q, k, v) and its heads' outputs at other
        ranks' positions, forward; their gradients the other way, backward."""
        if self.cp == 1:
            return 0
        cp, s = self.cp, self.s
        local = [sum(n for _, _, n in cp_chunks(self.seq_len, cp, c)) for c in range(cp)]
        row = self.b * s.head_dim * self.e  # one head at one position
        forwards = 2 if self.recompute else 1
        busiest = 0
        for me in range(cp):
            if self.candidate.cp_mode == "ring":
                held = [local[(me - step) % cp] for step in range(cp)]
                kv = 2 * s.kv_heads * row
                gradients = kv * (8 if self.e == 8 else 4) // self.e
                sent = (forwards + 1) * sum(held[:-1]) * kv + sum(held) * gradients
            else:
                kv_heads = s.kv_heads if s.kv_heads % cp == 0 else s.q_heads  # else repeated
                kvh = shard_sizes(kv_heads, cp)
                qh = [h * (s.q_heads // kv_heads) for h in kvh]
                others = [j for j in range(cp) if j != me]
                mine_out = sum((qh[j] + 2 * kvh[j]) * local[me] for j in others)
                back_in = sum(qh[me] * local[j] for j in others)
                forward = mine_out + back_in
                backward = sum(qh[j] * local[me] for j in others)
                backward += sum((qh[me] + 2 * kvh[me]) * local[j] for j in others)
                sent = (forwards * forward + backward) * row
            busiest = max(busiest, sent)
        return self.m * self.layers_on(r) * busiest

    def pp_bytes_on(self, r: int) -> int:
        """torch's pipelining sends each micro-batch's [micro_batch, seq, hidden] activation
        across every stage boundary and its gradient back (on every TP rank); a rank counts both
        for each boundary between one of its stages and a neighbour on another rank: two per
        inner stage, so interleaving v stages per rank crosses up to 2 v boundaries, and a V's
        middle boundary (both stages on one rank) is passed locally."""
        stages = self.stages
        crossed = sum(
            1
            for st in stages.stages_of(r)
            for other in (st - 1, st + 1)
            if 0 <= other < stages.num_stages and stages.rank_of(other) != r
        )
        return self.m * 2 * crossed * self.hidden_bytes

    def fsdp_bytes_on(self, r: int) -> tuple[int, int]:
        """(all-gather bytes, reduce-scatter bytes) of FSDP2 under torch's pipelining, per stage
        (each its own root unit): a layer is gathered for each forward that finds it resharded
        (non-root units reshard after forward) and for each backward after a forward
        (pipelining keeps it unsharded after a backward until the last), which for a stage's
        F...B sequence of m micro-batches is m + 1 times; the root unit (embedding, final norm,
        head) keeps its parameters from its first forward to the step's end: once. Then one
        reduce-scatter of every gradient."""
        s, dp, stages = self.s, self.dp, self.stages
        gathered = scattered = 0
        for st in stages.stages_of(r):
            layers = len(stages.layers_of(st)) * fsdp_numel(s.layer_rows, dp)
            root = fsdp_numel(s.embedding_rows, dp) if st == 0 else 0
            if st == stages.last_stage:
                root += fsdp_numel(s.final_rows, dp)
                if self.config.tie_word_embeddings and self.pp == 1:  # one tensor, once
                    root -= fsdp_numel(s.embedding_rows, dp)
            gathered += (self.m + 1) * layers + root
            scattered += layers + root
        return gathered * self.e, scattered * self.e

    def dp_bytes(self, numel: int) -> tuple[int, int, int]:
        """(DP bytes, FSDP2's or ZeRO's gathered bytes, their scattered bytes) of the busiest
        rank. ZeRO all-gathers every rank's updated rows after the step (every parameter, once);
        ZeRO-2 reduce-scatters the gradients (all of them, once, in buckets), ZeRO-1 sums them
        as DDP does."""
        weight_split = self.candidate.schedule in ("InterleavedZeroBubble", *V_SCHEDULES)
        if self.dp * self.cp == 1:
            return 0, 0, 0
        gathered = numel * self.e if self.zero else 0
        if self.zero == 2:
            return 2 * numel * self.e, gathered, numel * self.e
        if self.shard == 1 and weight_split:
            # these schedules write weight gradients outside DDP's hooks: tp_ext all-reduces
            # them once after the step, flattened in float32 (float64 for float64 parameters)
            return numel * (8 if self.e == 8 else 4) + gathered, gathered, 0
        if self.shard == 1:
            # one all-reduce of every gradient, in the last micro-batch's backward (no_sync
            # before): DDP's buckets, or one per parameter with tp_ext's comm hook (dp > 2); with
            # cp, one flat all-reduce over DP x CP after the step (at pp = 1 the loss and the
            # token count with it)
            if self.cp > 1 or self.candidate.dims.ep > 1:  # tp_ext's flat fp32 buffer
                extra = 2 * self.flat_bytes if self.cp > 1 and self.pp == 1 else 0
                return numel * self.flat_bytes + extra, 0, 0
            return numel * self.e + gathered, gathered, 0
        gathered, scattered = max((self.fsdp_bytes_on(r) for r in range(self.pp)), key=sum)
        return gathered + scattered, gathered, scattered

    # ---- time ------------------------------------------------------------------------------

    def crosses_nodes(self) -> tuple[bool, bool, bool]:
        """Whether the TP, PP and DP groups span nodes (ranks (pp, dp, cp, tp) row-major; the
        DP group here is the one gradients are summed over: DP x CP)."""
        tp, pp, dp = self.tp, self.pp, self.dp
        inner = tp * self.cp
        span = self.gpus_per_node or inner * pp * dp
        sync = dp * self.cp > 1
        return tp > span, pp > 1 and inner * dp * pp > span, sync and tp * dp * self.cp > span

    def cp_crosses_nodes(self) -> bool:
        return self.cp > 1 and self.tp * self.cp > (self.gpus_per_node or self.tp * self.cp)

    def compute_on(self, r: int) -> float:
        """Seconds of one micro-batch's forward + backward on pipeline rank r: its FLOPs at the
        device's rate, and its operators' fixed cost (dispatch, launch: what dominates small
        shapes)."""
        mine, layers, hw = self.stages.stages_of(r), self.layers_on(r), self.hardware
        ops, recompute = _op_counts(self.config), 1 if self.recompute else 0
        # each CP rank: its share of the positions and (balanced chunks) of attention's pairs
        flops = layers * layer_flops(self.s, self.b, self.seq_len) * (4 / 3 if recompute else 1)
        flops /= self.cp
        n_ops = layers * (ops["layer"] + recompute * ops["layer_forward"])
        if self.stages.last_stage in mine:
            flops += head_flops(self.s, self.config, self.b, self.seq_len) / self.cp
            n_ops += ops["head"]
        if 0 in mine:
            n_ops += ops["embedding"]
        return flops / hw.flops + n_ops * hw.op_overhead

    def cp_seconds(self, comm: dict, layers_max: int, compute: float) -> float:
        """CP seconds of one micro-batch not hidden: the bytes at the link's rate and a latency
        per hop (the ring: cp - 1 forward, 2 cp - 1 backward; the all-to-all: 4 each way per
        layer); the ring's hops travel while blocks are computed where collectives run beside
        compute (a GPU), so only what outlasts the compute shows."""
        if self.cp == 1:
            return 0.0
        hw, cp = self.hardware, self.cp
        hops = (3 * cp - 2) if self.candidate.cp_mode == "ring" else 8
        seconds = (comm["cp"] / self.m) / hw.link(self.cp_crosses_nodes())
        seconds += layers_max * hops * hw.latency
        if self.candidate.cp_mode == "ring" and hw.overlap:
            return max(0.0, seconds - compute)
        return seconds

    def micro_batch_seconds(self, comm: dict, layers_max: int) -> tuple:
        """(TP seconds, PP seconds) of one micro-batch: a ring's bus bytes at the link's rate
        and each collective's latency; each stage boundary a rank crosses: a send and a receive
        forward, the same backward."""
        hw, tp, pp, m = self.hardware, self.tp, self.pp, self.m
        tp_cross, pp_cross, _ = self.crosses_nodes()
        recompute = 1 if self.recompute else 0
        bus = 2 * (tp - 1) / tp if tp > 1 else 0
        collectives = ((4 + recompute) * layers_max + 2) if tp > 1 else 0
        tp_time = (comm["tp"] / m) * bus / hw.link(tp_cross) + collectives * hw.latency
        if pp == 1:
            return tp_time, 0.0
        boundaries = 2 * self.v
        pp_time = (comm["pp"] / m) / hw.link(pp_cross) + 2 * boundaries * hw.latency
        return tp_time, pp_time

    def dp_seconds(self, dp_traffic: tuple, numel: int, tensors: int, compute: float) -> tuple:
        """(DP seconds, the part not hidden behind compute). Where collectives cannot run
        beside compute (CPU ranks over gloo share their cores), nothing is hidden."""
        hw, m, e = self.hardware, self.m, self.e
        dp = self.dp * self.cp  # the ranks whose gradients are summed
        dp_bytes, gathered, scattered = dp_traffic
        link = hw.link(self.crosses_nodes()[2])
        hide = 1.0 if hw.overlap else 0.0
        if dp == 1:
            return 0.0, 0.0
        if self.cp > 1:  # one flat all-reduce after the step's backward: nothing to hide behind
            dp_time = 2 * (dp - 1) / dp * dp_bytes / link + hw.latency
            return dp_time, dp_time
        if self.zero:
            # the gradients' sum goes in the last micro-batch's backward (ZeRO-1: DDP's
            # all-reduce; ZeRO-2: a reduce-scatter per 25 MiB bucket), after the schedule under
            # the weight-split ones; the rows' all-gather after the optimizer step: neither of
            # those has compute to hide behind
            after_step = SCHEDULES[self.candidate.schedule].weight_split
            gather = (dp - 1) / dp * gathered / link + hw.latency
            if self.zero == 1:
                reduce, _ = self.all_reduce_seconds(dp_bytes - gathered, numel, tensors, 0.0)
            else:
                buckets = math.ceil(numel * e / ZERO2_BUCKET_BYTES)
                rate = hw.reduce_scatter or link
                reduce = (dp - 1) / dp * scattered / rate + buckets * hw.latency
            hidden = 0.0 if after_step else min(reduce, hide * compute * 2 / 3)
            return reduce + gather, reduce + gather - hidden
        if self.shard == 1:
            return self.all_reduce_seconds(dp_bytes, numel, tensors, hide * compute)
        # all-gathers and the reduce-scatter move (dp-1)/dp of their payload (the reduce-scatter
        # at its own rate where measured: gloo's is slower than its gathers); the gathers come
        # in every micro-batch, prefetching hides each behind its micro-batch's compute, up to
        # it; each unit (a decoder layer, and the stage's root) costs FSDP2's own work (hooks,
        # copies in and out of the flat buffers, the calls) in every micro-batch on top
        units = max(self.layers_on(r) for r in range(self.pp)) + 1
        dp_time = (dp - 1) / dp * (gathered / link + scattered / (hw.reduce_scatter or link))
        overhead = m * units * hw.fsdp_unit_overhead
        return dp_time, max(0.0, dp_time - hide * m * compute) + overhead

    def all_reduce_seconds(self, nbytes: int, numel: int, tensors: int, hide: float) -> tuple:
        """(seconds, the part not hidden) of DDP's gradient all-reduce: a ring, overlapped only
        with the last micro-batch's backward (``hide``: its compute, where collectives run beside
        it); one call per 25 MB bucket (DDP's default), per parameter above 2 ranks (the
        reproducible hook)."""
        hw, dp = self.hardware, self.dp * self.cp
        link = hw.link(self.crosses_nodes()[2])
        calls = tensors if dp > 2 else math.ceil(numel * self.e / (25 * 2**20))
        dp_time = 2 * (dp - 1) / dp * nbytes / link + calls * hw.latency
        return dp_time, max(0.0, dp_time - hide * 2 / 3)

    def runtime_seconds(self, memory: dict) -> tuple[float, float]:
        """(torch's pipelining runtime, the optimizer step): per schedule action (a stage's
        forward or backward of a micro-batch; the zero-bubble schedules split the backward in
        two; the Trainer runs a schedule at pp=1 too: one stage); a fused AdamW reads and
        writes parameters, gradients and moments about twice, where not measured."""
        hw = self.hardware
        split_backward = SCHEDULES[self.candidate.schedule].weight_split
        actions = self.m * self.v * (3 if split_backward else 2)
        if hw.optimizer_seconds_per_param is not None:
            stepped = memory["params"] / self.e
            if self.zero:  # ZeRO steps this DP rank's rows only
                stepped = max(self.zero_rows_on(r) for r in range(self.pp))
            optimizer = stepped * hw.optimizer_seconds_per_param
        else:
            moved = memory["params"] + memory["grads"] + memory["optimizer"]
            optimizer = 4 * moved / hw.memory_bandwidth
        return actions * hw.pp_action_overhead, optimizer


def estimate(
    config: Qwen2Config,
    candidate: Candidate,
    *,
    seq_len: int,
    hardware: Hardware,
    gpu_memory: Optional[int] = None,
    gpus_per_node: Optional[int] = None,
) -> Estimate:
    """The cost of training ``config`` with ``candidate`` on ``hardware`` (a step of
    ``dp x num_micro_batches x micro_batch`` sequences of ``seq_len`` tokens)."""
    _check_candidate(config, candidate)
    if candidate.dims.grid is not None:  # a 2D grid: its own model
        return estimate_2d(
            config,
            candidate,
            seq_len=seq_len,
            hardware=hardware,
            gpu_memory=gpu_memory,
            gpus_per_node=gpus_per_node,
        )
    step = _Step(config, candidate, seq_len, hardware, gpus_per_node)
    ranks = [step.memory_on(r) for r in range(step.pp)]
    busiest = max(range(step.pp), key=lambda r: ranks[r][0]["total"])
    memory = ranks[busiest][0]
    numel = max(n for _, n in ranks)
    dp_traffic = step.dp_bytes(numel)
    comm = {
        "tp": max(step.tp_bytes_on(r) for r in range(step.pp)),
        "cp": max(step.cp_bytes_on(r) for r in range(step.pp)),
        "pp": max(step.pp_bytes_on(r) for r in range(step.pp)) if step.pp > 1 else 0,
        "dp": dp_traffic[0],
    }
    detail = _timing(step, comm, dp_traffic, memory, numel)
    detail.update(
        parameters_per_rank=numel,
        parameters_by_pp_rank=[n for _, n in ranks],
        busiest_pp_rank=busiest,
    )
    bubble = bubble_fraction(candidate.schedule, step.pp, step.m, step.v)
    fits = gpu_memory is None or memory["total"] <= usable_memory(gpu_memory)
    step_time = detail.pop("step_s")
    return Estimate(candidate, memory, comm, bubble, step_time, fits, gpu_memory, "", detail)


def _timing(step: _Step, comm: dict, dp_traffic: tuple, memory: dict, numel: int) -> dict:
    """The estimate's ``detail`` on time (and ``step_s``, the step's seconds): the pipeline's
    micro-batches stretched by its bubble, then torch's pipelining runtime, the DP traffic not
    hidden and the optimizer step."""
    pp, m = step.pp, step.m
    compute = max(step.compute_on(r) for r in range(pp))
    layers_max = max(step.layers_on(r) for r in range(pp))
    tp_time, pp_time = step.micro_batch_seconds(comm, layers_max)
    cp_time = step.cp_seconds(comm, layers_max, compute)
    bubble = bubble_fraction(step.candidate.schedule, pp, m, step.v)
    pipeline = m * (compute + tp_time + cp_time + pp_time) / (1 - bubble)
    tensors = max(step.params_on(r)[1] for r in range(pp))
    dp_time, dp_exposed = step.dp_seconds(dp_traffic, numel, tensors, compute)
    pp_runtime, optimizer_time = step.runtime_seconds(memory)
    tp_cross, pp_cross, dp_cross = step.crosses_nodes()
    return {
        "step_s": pipeline + pp_runtime + dp_exposed + optimizer_time,
        "layers_per_rank": layers_max,
        "in_flight_micro_batches": step.in_flight(0),
        "compute_s": m * compute,
        "tp_s": m * tp_time,
        "cp_s": m * cp_time,
        "pp_s": m * pp_time,
        "dp_s": dp_time,
        "dp_exposed_s": dp_exposed,
        "optimizer_s": optimizer_time,
        "pp_runtime_s": pp_runtime,
        "tp_crosses_nodes": tp_cross,
        "pp_crosses_nodes": pp_cross,
        "dp_crosses_nodes": dp_cross,
    }
