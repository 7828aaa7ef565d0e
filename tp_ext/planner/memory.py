"""What one pipeline rank of a candidate (1D TP or a 2D grid) holds at its peak
(:func:`memory_on`): parameters, gradients, optimizer state, activations and the gradient sync's
buffers, over the phases of a Trainer step (:class:`~tp_ext.planner.step.Step`). The tests hold
it within 5% of the measured peak of a Trainer step, and parameters, gradients and optimizer
state exact."""

from __future__ import annotations

import math

from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.candidate import memory_breakdown
from tp_ext.planner.counts import ZERO2_BUCKET_BYTES, shard_numel, zero_step_phases
from tp_ext.planner.step import Step, rows_of

__all__ = ["memory_on"]


def memory_on(step: Step, r: int) -> tuple[dict, int]:
    """(memory_bytes, parameters) of rank r: its peak over the phases of a step (parameters and
    optimizer state always there; gradients from the first backward on): the backward's
    (:func:`backward_phases`), the optimizer step's (fused AdamW on GPUs: no temporaries;
    torch's per-tensor loop on CPU: two of the largest tensor) or ZeRO's (:func:`zero_phases`),
    and the gradient sync's. AdamW keeps two moments plus a per-tensor fp32 step count; ZeRO
    those of this replica's rows only (and fp32 master rows for non-fp32 parameters), ZeRO-2's
    gradients at the step are its rows too. DDP (ZeRO-1's stages too) keeps a copy of the
    gradients in its buckets; FSDP2 its gathered layers (:func:`fsdp_buffers`)."""
    e = step.e
    numel, tensors = step.held_params_on(r)
    # FSDP2: this rank's shard of every tensor (dim 0 split as torch.chunk splits it, padded to
    # rank 0's rows; the experts' over their own replicas)
    params = (step.zero_rows_on(r) if step.shard > 1 else numel) * e
    optimizer, grads = 2 * params + 4 * tensors, params
    if step.zero:
        rows = step.zero_rows_on(r)
        # the two moments of its rows, in the masters' dtype, and fp32 master rows where
        # the parameters are not fp32 (fp32 ones step their own rows in place)
        masters = rows * step.master_bytes if step.master_bytes != e else 0
        optimizer = 2 * rows * step.master_bytes + 4 * tensors + masters
        grads = rows * e if step.zero == 2 else params
    phases, activations = backward_phases(step, r, params, optimizer)
    # FSDP2's unsharded buffers at the head's backward (phase A) and at a layer's (B, C)
    at_head, at_layer = fsdp_buffers(step, r)
    phases = [phases[0] + at_head] + [phase + at_layer for phase in phases[1:]]
    if step.zero:
        phases += zero_phases(step, r, params, grads, optimizer, max(phases))
    else:
        opt_temp = 0 if step.hardware.fused_optimizer else 2 * step.s.largest * e
        phases.append(2 * params + optimizer + opt_temp)
    if step.sync == "sums":
        phases.append(2 * params + optimizer + sums_buffers(step, r))
    # the weight-split schedules write gradients outside DDP's hooks: not wrapped, no buckets
    weight_split = SCHEDULES[step.candidate.schedule].weight_split
    buckets = params if step.sync == "ddp" and not weight_split else 0
    peak = max(phases) + buckets
    fsdp = max(at_head, at_layer)
    return memory_breakdown(params, optimizer, activations, peak, fsdp, grads), numel


def backward_phases(step: Step, r: int, params: int, optimizer: int) -> tuple[list, int]:
    """([the backward's phases], the most activation bytes in them) of rank r, beside its
    parameters and optimizer state:
    A: the most activations in flight, at the LM head's backward on the last stage (the
       logits' gradient, the head's weight gradient and the hidden states' gradient beside the
       activations; on other stages the embedding's gradient or nothing);
    B: the stage's last decoder layer's backward, every layer's activations still held: inside
       its MLP (:meth:`~tp_ext.planner.step.Step.layer_backward_bytes`), the head's gradients made;
    C: the stage's first layer's backward: every gradient but that layer's and the embedding's
       (they come after it), that layer's activations (with activation checkpointing rebuilt
       from its input) and temporaries; under pipelining also the stage's output and its
       gradient and the other in-flight micro-batches' tensors.
    Gradients are all there from the start when an earlier micro-batch's backward came before
    (the local loop's micro-batches after the first; a pipeline rank's warm-up shorter than m);
    under FSDP2 only those of the experts it leaves alone.
    """
    s, e, last = step.s, step.e, step.last_on(r)
    acts, transient = step.activations_on(r)
    earlier = step.m > math.ceil(step.in_flight(r))
    # under FSDP2 the gradients of what it shards are its unsharded buffers (fsdp_buffers: the
    # head's too); of the experts each rank holds alone, the rank's own
    sharded = earlier and step.shard > 1
    alone = step.alone_numel_on(r) * e if sharded else 0
    whole = earlier and step.shard == 1
    grads = params if whole else alone
    head_grads = s.final * e if last and not sharded else 0
    # B: the head's saved tensors freed by its backward; the layer recomputed for its backward
    rebuilt = step.act_layer if step.recompute else 0
    held_b = acts - (step.head_bytes() if last else 0) + rebuilt + step.layer_backward_bytes()
    grads_b = params if whole else alone + head_grads
    # C: that layer's input, kept by its checkpoint, and its activations (rebuilt)
    held_c = (step.hidden_bytes if step.recompute else 0) + step.act_layer
    held_c += step.layer_backward_bytes() + step.ids_on(r)
    own = s.layer * e + (s.embedding * e if step.first_on(r) else 0)
    grads_c = params if whole else (alone if sharded else params - min(own, params))
    if step.pp > 1:
        # torch's schedule holds each stage's output (the logits on the last stage) until the
        # stage's backward ends, and on the other stages the gradient it received; the
        # micro-batches still in flight keep what they saved
        output = step.tokens * step.logits_vocab * e if last else step.hidden_bytes
        received = 0 if last else step.hidden_bytes
        held_b += (output if last else 0) + received
        per_layer = step.hidden_bytes if step.recompute else step.act_layer
        saved = step.layers_on(r) * per_layer + (0 if last else output)
        held_c += output + received + int(max(0.0, step.in_flight(r) - 1) * saved)
    deferred = step.deferred_on(r)  # beside every phase: the peak is in an input pass
    held = [acts + transient + deferred, held_b + deferred, held_c + deferred]
    phases = [params + optimizer + g + h for g, h in zip((grads, grads_b, grads_c), held)]
    return phases, int(max(held))


def sums_buffers(step: Step, r: int) -> int:
    """tp_ext's flat all-reduce of each replica group's gradients (a model with experts): the
    group's gradients flattened in fp32 (fp64 for fp64 parameters) and the all-reduce's result
    beside them, one group after the other (the dense ones over DP x CP, then the experts'
    over theirs), the previous group's result still held (the sync's loop variable) while the
    next is summed."""
    held = peak = 0
    for numel, size in step.sync_groups(r):
        if size > 1:
            peak, held = max(peak, held + 2 * numel), numel
    return peak * step.flat_bytes


def fsdp_buffers(step: Step, r: int) -> tuple[int, int]:
    """FSDP2's unsharded buffers beside the shards (of the tensors it shards: not the experts
    each rank holds alone) in rank r's backward: (at the head's backward, at a layer's). The
    stage's own unit (embedding, final norm, head; a model run whole: all its dense tensors)
    stays gathered from its forward to the end of its backward (FSDP2 does not reshard the root
    after its forward), a layer's unit from its all-gather until its forward or backward ends;
    the backward prefetches the next layer's all-gather (the head's: the last layer's)."""
    if step.shard == 1:
        return 0, 0
    dense, experts = step.layer_groups()
    units = step.fsdp_groups([dense, experts] if step.layer_units else [experts])
    unit = sum(rows_of(parts, 1) for parts, _ in units)
    numel = sum(rows_of(parts, 1) for parts, _ in step.fsdp_groups(step.replica_groups(r)))
    root = numel - step.layers_on(r) * unit
    # accumulating without syncing (the local loop, and torch's pipelining) keeps every
    # gradient unsharded until the last backward
    whole = numel if step.m > 1 else 0
    e = step.e
    at_head, at_layer = (root + unit + whole) * e, (root + 2 * unit + whole) * e
    if step.m == 1 and unit:
        # from the second-to-last layer on, the later layer's reduce-scatter too (its flat
        # gradients and this rank's rows of the sum, which FSDP2 holds until the next one),
        # while that later layer's saved tensors are freed
        scatter = (unit + sum(rows_of(parts, size) for parts, size in units)) * e
        at_layer += max(0, scatter - (step.hidden_bytes if step.recompute else step.act_layer))
    return at_head, at_layer


def zero_phases(step: Step, r: int, params: int, grads: int, optimizer: int, backward: int):
    """ZeRO's phases of rank r after (or at the end of) its backward, beside the parameters
    and its optimizer state (``grads``: the gradients at the step, ``backward``: the
    backward's peak with whole gradients):
    the step: the fp32 copies of the gradients' rows (none for fp32 parameters: views) and,
       on CPU, two of the largest rows tensor (torch's per-tensor AdamW);
    the all-gather: this rank's rows flattened and every rank's gathered, both in the
       parameters' dtype;
    ZeRO-2's reduce-scatter: each bucket of whole gradients flattened, with this rank's rows
       of the sum. A rank with one bucket (at most 25 MiB of gradients) sends it when the
       last gradient is final, at the end of the last micro-batch's backward (measured: no
       temporary of the embedding's backward left then); with more, the first buckets go
       during the backward, beside its activations."""
    e, master = step.e, step.master_bytes
    rows = step.zero_rows_on(r)
    groups = step.replica_groups(r)
    tensors = [(t, size) for parts, size in groups for shapes, _ in parts for t in shapes]
    largest = max(shard_numel((t,), size) for t, size in tensors)
    numel = params // e
    held = params + grads + optimizer
    fused = step.hardware.fused_optimizer
    phases = zero_step_phases(held, rows, numel, e, master, largest, fused)
    if step.zero == 2:
        if params <= ZERO2_BUCKET_BYTES:  # one bucket per replica group
            # the first stage's input ids; a later stage's input gradient
            last = step.ids_on(r) if step.first_on(r) else step.hidden_bytes
            phases.append(params + optimizer + _zero2_sends(step, groups) * e + last)
        else:
            # a bucket holds one parameter at least
            bucket = max(ZERO2_BUCKET_BYTES, max(n for (_, n), _ in tensors) * e)
            phases.append(backward + bucket + math.ceil(bucket / step.replicas))
    return phases


def _zero2_sends(step: Step, groups) -> int:
    """Elements beside the parameters and the optimizer state while ZeRO-2 sends its buckets
    (one per replica group, in the groups' order, once the last gradient is final): at each
    send the whole gradients of the groups not sent yet and, of those sent, their flat copy
    (padded) and this rank's rows of the sum, in flight until received after the backward."""
    whole = sum(rows_of(parts, 1) for parts, _ in groups)
    sent = peak = 0
    for parts, size in groups:
        if not parts:
            continue
        numel = rows_of(parts, 1)
        sent += numel + rows_of(parts, size) + step.padded_rows(parts, size)
        peak = max(peak, sent + whole)
        whole -= numel  # sent: its whole gradients freed
    return peak
