"""The bytes one pipeline rank of a candidate (:class:`~tp_ext.planner.step.Step`) communicates
per step over CP, PP and DP (over TP: the model's own, ``Step.tp_bytes_on``), counted as the
tests count them: tp_ext's collectives as ``tp_ext.comm.track()`` records them (an all-reduce's
tensor, an all-gather's gathered output, a reduce-scatter's full input), torch's own
(pipelining's sends, DDP's and FSDP2's collectives) by their tensors."""

from __future__ import annotations

from tp_ext.pipeline.schedules import SCHEDULES
from tp_ext.planner.counts import fsdp_numel, shard_numel
from tp_ext.planner.step import Step
from tp_ext.sharding import cp_chunks, shard_sizes

__all__ = ["cp_bytes_on", "pp_bytes_on", "dp_bytes_on", "tied_bytes_on"]


def cp_bytes_on(step: Step, r: int) -> int:
    """What the busiest CP rank sends per step, as ``track()`` files it under "cp"; per layer
    and micro-batch (a recomputed layer runs its forward twice), for each rank's positions
    (``local``, uneven where 2 cp does not divide the sequence):
    ring: the key/value blocks it holds in turn, passed on (cp - 1 hops) forward and again
    backward, and their gradients in fp32 (fp64 for fp64) on every hop (cp);
    all-to-all: its positions of other ranks' heads (q, k, v) and its heads' outputs at other
    ranks' positions, forward; their gradients the other way, backward."""
    if step.cp == 1:
        return 0
    cp, s = step.cp, step.s
    local = [sum(n for _, _, n in cp_chunks(step.seq_len, cp, c)) for c in range(cp)]
    row = step.b * s.head_dim * step.e  # one head at one position
    forwards = 2 if step.recompute else 1
    busiest = 0
    for me in range(cp):
        if step.candidate.cp_mode == "ring":
            held = [local[(me - hop) % cp] for hop in range(cp)]
            kv = 2 * s.kv_heads * row
            gradients = kv * step.flat_bytes // step.e
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
    return step.m * step.layers_on(r) * busiest


def pp_bytes_on(step: Step, r: int) -> int:
    """torch's pipelining sends each micro-batch's [micro_batch, seq, hidden] activation across
    every stage boundary and its gradient back (on every TP rank); a rank counts both for each
    boundary between one of its stages and a neighbour on another rank: two per inner stage,
    so interleaving v stages per rank crosses up to 2 v boundaries, and a V's middle boundary
    (both stages on one rank) is passed locally."""
    if step.pp == 1:
        return 0
    stages = step.stages
    crossed = sum(
        1
        for st in stages.stages_of(r)
        for other in (st - 1, st + 1)
        if 0 <= other < stages.num_stages and stages.rank_of(other) != r
    )
    return step.m * 2 * crossed * step.hidden_bytes


def tied_bytes_on(step: Step, r: int) -> int:
    """A tied embedding split by pipelining has a copy on the first stage and one on the last;
    the Trainer sums their gradients once a step, one all-reduce between the two ranks
    ("train.tied"; under FSDP2 of each rank's shard): none where one rank holds both (a V's
    first and last stage)."""
    if not step.config.tie_word_embeddings or step.pp == 1:
        return 0
    ends = {step.stages.rank_of(0), step.stages.rank_of(step.stages.last_stage)}
    if len(ends) == 1 or r not in ends:
        return 0
    return shard_numel(step.s.embedding_rows, step.shard) * step.e


def fsdp_bytes_on(step: Step, r: int) -> tuple[int, int]:
    """(all-gather bytes, reduce-scatter bytes) of FSDP2 per stage (each its own root unit): a
    unit that is not the root (a decoder layer's dense tensors; the experts', their own units
    on their replicas, none where each rank holds its own) is gathered for each forward that
    finds it resharded (non-root units reshard after forward) and for each backward after a
    forward (accumulating micro-batches keep it unsharded after a backward until the last),
    which for a stage's F...B sequence of m micro-batches is m + 1 times; the root unit
    (embedding, final norm, head; a transformers model run whole at pp = 1: its decoder layers'
    dense tensors too, no unit of their own) keeps its parameters from its first forward to
    the step's end: once. Then one reduce-scatter of every gradient."""
    s, size, stages = step.s, step.shard, step.stages
    dense, experts = (_fsdp_elements(step.fsdp_groups([group])) for group in step.layer_groups())
    gathered = scattered = 0
    for st in stages.stages_of(r):
        layers = len(stages.layers_of(st))
        root = fsdp_numel(s.embedding_rows, size) if st == 0 else 0
        if st == stages.last_stage:
            root += fsdp_numel(s.final_rows, size)
            if step.config.tie_word_embeddings and step.pp == 1:  # one tensor, once
                root -= fsdp_numel(s.embedding_rows, size)
        units = layers * experts + (layers * dense if step.layer_units else 0)
        root += 0 if step.layer_units else layers * dense
        gathered += (step.m + 1) * units + root
        scattered += units + root
    return gathered * step.e, scattered * step.e


def _fsdp_elements(groups) -> int:
    """Elements of FSDP2's unsharded buffers of these replica groups' tensors."""
    return sum(n * fsdp_numel(shapes, size) for parts, size in groups for shapes, n in parts)


def dp_bytes_on(step: Step, r: int) -> tuple[int, int, int]:
    """(DP bytes, ZeRO's or FSDP2's gathered bytes, their scattered bytes) of rank r, per the
    Trainer's gradient sync (:func:`~tp_ext.planner.step.gradient_sync`):
    DDP: one all-reduce of every gradient in the last micro-batch's backward (no_sync before),
    in the parameters' dtype (its buckets, or one per parameter above 2 replicas: the same
    bytes); the weight-split schedules write gradients outside its hooks, which tp_ext
    all-reduces after the step, flattened in fp32 (fp64 for fp64 parameters);
    sums (experts): tp_ext's flat all-reduce of each replica group's gradients, in fp32;
    ZeRO-2: the reduce-scatter of every gradient (in buckets); FSDP2: :func:`fsdp_bytes_on`;
    under ZeRO then the all-gather of every updated row (every parameter, once). ZeRO and the
    sums leave out the experts each rank holds alone (no replicas to sum or gather over)."""
    numel = step.held_params_on(r)[0]
    synced = sum(n for n, size in step.sync_groups(r) if size > 1)
    gathered = synced * step.e if step.zero else 0
    if step.sync is None:
        return 0, 0, 0
    if step.sync == "fsdp":
        gathered, scattered = fsdp_bytes_on(step, r)
        return gathered + scattered, gathered, scattered
    if step.sync == "reduce_scatter":
        return synced * step.e + gathered, gathered, synced * step.e
    if step.sync == "sums":
        return synced * step.flat_bytes + gathered, gathered, 0
    if SCHEDULES[step.candidate.schedule].weight_split:
        return numel * step.flat_bytes + gathered, gathered, 0
    return numel * step.e + gathered, gathered, 0
