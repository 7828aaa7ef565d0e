"""What a model declares so that the Trainer, the pipeline runner, generation and checkpoints
can run it under any combination of parallel forms: the model contract.

A model built for parallel training says what it is instead of being recognised by probes:
which pipeline stages it holds and what each computes, which weights are tied across stages,
what its last stage gives the loss (its :class:`LossKind`) and which positions of a sequence
this rank holds under context parallelism. tp_ext's native Qwen2 (1D and 2D) and the
transformers stages that ``tp_ext.parallelize(model, "auto", parallel=state)`` returns
implement it (they name :class:`ParallelModel` among their bases); the Trainer adapts any
other module (a plain or 1D tensor-parallel one) to it once, at construction.

Modelled on torchtitan's ``ModelSpec`` protocol: one declaration read by every consumer.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, Optional, Protocol, runtime_checkable

import torch
from torch import nn

if TYPE_CHECKING:
    from tp_ext.distributed.mesh import ParallelState
    from tp_ext.sharding import StageSplit

__all__ = ["LossKind", "ParallelModel"]


class LossKind(enum.Enum):
    """What the last stage's output is, for the loss.

    - ``VOCAB_SHARD``: this TP rank's vocabulary shard of the logits ``[batch, seq, vocab/tp]``
      (the vocabulary-parallel cross-entropy; the native model's ``local_logits=True``);
    - ``GRID_BLOCK``: a 2D model's logits block (grid row i's sequences, column j's
      vocabulary), scored by the model's own ``summed_loss``;
    - ``FULL_LOGITS``: a transformers-style output with whole ``logits`` (and, for a
      mixture-of-experts model, its router ``aux_loss``);
    - ``MODEL_OUTPUT``: whatever the model returns for a dict micro-batch, scored by the
      Trainer's ``loss_fn`` (or the model's own ``loss``): masked LM, classification, seq2seq.
    """

    VOCAB_SHARD = "vocab_shard"
    GRID_BLOCK = "grid_block"
    FULL_LOGITS = "full_logits"
    MODEL_OUTPUT = "model_output"


@runtime_checkable
class ParallelModel(Protocol):
    """The contract. Attributes:

    - ``parallel``: the :class:`~tp_ext.ParallelState` the model was built with (None: a model
      without one, e.g. 1D tensor parallelism from a ``tp_group`` alone);
    - ``stage_split``: which pipeline stage holds which decoder layers (one stage without
      pipelining); ``stage_ids``: the stages this rank holds, in order;
    - ``loss_kind``: what the last stage's output is (:class:`LossKind`);
    - ``activation_checkpointing``: recompute each decoder layer in backward;
    - ``sequence_length``: the whole sequence's length while a step runs (set by the runner),
      which a stage after the first cannot see under sequence or context parallelism;
    - ``takes_attention_mask``: whether every stage module's forward takes a padding mask,
      ``forward(x, attention_mask=mask)`` (``mask`` [batch, seq] of the micro-batch's whole
      sequence, 0 at padding), which the runner passes with a padded micro-batch (default:
      False, and a padded micro-batch is refused);
    - ``input_name``: the model input its first stage takes from a dict micro-batch
      (``input_ids``, or an image encoder's ``pixel_values``).
    """

    parallel: Optional["ParallelState"]
    stage_split: "StageSplit"
    stage_ids: list
    loss_kind: LossKind
    activation_checkpointing: bool
    sequence_length: Optional[int]
    takes_attention_mask: bool = False
    input_name: str = "input_ids"  # what its first stage takes (an encoder's: pixel_values too)

    def stage_modules(self) -> list[nn.Module]:
        """One module per stage this rank holds, in order, owning that stage's parameters (what
        torch's PipelineStage, DDP and FSDP2 wrap); its forward is :meth:`stage_forward`."""
        ...

    def stage_forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        """Stage ``stage``: token ids (the first stage) or hidden states in; hidden states, or
        the loss kind's output (the last stage), out."""
        ...

    def tied_weights(self) -> list[torch.Tensor]:
        """The copies of a tied embedding this rank holds when pipelining splits the tie (the
        embedding's on the first stage, the head's on the last); [] otherwise."""
        ...

    def tied_group(self):
        """The group over which those copies sum their gradients (None: none, or both on
        this rank)."""
        ...

    def local_sequence(self, length: int) -> int:
        """How many positions of a ``length``-token sequence a stage of this rank sends on
        (its context-parallel positions, its sequence-parallel shard of them)."""
        ...

    def loss_positions(self, length: int) -> Optional[torch.Tensor]:
        """The positions of a ``length``-token sequence whose outputs the last stage gives on
        this rank, in order (context parallelism); None: all of them, in order."""
        ...

    def activation_shape(self, batch: int, length: int) -> tuple:
        """The shape of the hidden states a stage of this rank passes on, for a micro-batch of
        ``batch`` sequences of ``length`` tokens (what the pipeline sends between stages)."""
        ...

    def output_shape(self, batch: int, length: int) -> tuple:
        """The shape of the last stage's output on this rank for such a micro-batch."""
        ...
