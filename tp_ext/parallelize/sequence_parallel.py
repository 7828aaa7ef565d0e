"""Megatron's sequence parallelism on an existing model, by hooks (the model's modules keep their
names in state dicts and checkpoints): the residual stream is split along the sequence where the
first sequence-parallel norm's block begins (:class:`~tp_ext.layers.sequence.SequenceShards`),
each such norm runs on this rank's shard, and its output is all-gathered once for the
column-parallel layers after it."""

from __future__ import annotations

from tp_ext.layers.sequence import SequenceShards, sum_gradients_over

__all__ = ["SequenceShards", "sum_gradients_over"]
