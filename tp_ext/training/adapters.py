"""The model a Trainer trains, as a :class:`~tp_ext.contract.ParallelModel`.

tp_ext's native Qwen2 (1D and 2D) and the transformers stages ``parallelize`` returns at
pp > 1 declare the contract themselves. Two other kinds of model are adapted, once:

- a transformers causal LM that ``tp_ext.parallelize(model, "auto", parallel=state)``
  converted at pp = 1 becomes its one pipeline stage (``single_stage``), so DDP or FSDP2,
  recompute, compression and resharding checkpoints apply as at pp > 1; with expert
  parallelism, or a router loss to add, it runs whole (:class:`WholeModel`: full logits, its
  router logits);
- any other module (plain, or 1D tensor parallel through a ``tp_group``) runs whole;
- with a ``loss_fn`` (dict micro-batches: masked LM, classification, seq2seq), any model runs
  whole, its output scored by the loss (``LossKind.MODEL_OUTPUT``).
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from torch import nn

from tp_ext.contract import LossKind, ParallelModel
from tp_ext.layers import ParallelModule, expert_parameters
from tp_ext.layers.context import cp_positions
from tp_ext.parallelize.stages import is_transformers_model, single_stage
from tp_ext.sharding import StageSplit
from tp_ext.training.losses import router_loss_of

__all__ = ["WholeModel", "trained_model"]


class _LocalLogits(nn.Module):
    """A tp_ext causal LM called for this rank's vocabulary shard of the logits."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(ids, local_logits=True)


class WholeModel(ParallelModel):
    """``module`` as the one stage of a :class:`~tp_ext.contract.ParallelModel`: its forward
    gives ``loss_kind``'s output (``VOCAB_SHARD``: ``module(ids, local_logits=True)``;
    ``FULL_LOGITS``: ``module(ids)``). ``cp_group``: under context parallelism (a transformers
    model converted with ``parallel=``), the group whose positions its logits are."""

    stage_ids = [0]
    sequence_length = None
    activation_checkpointing = False

    def __init__(self, module: nn.Module, parallel, loss_kind: LossKind, cp_group=None) -> None:
        self.module, self.parallel, self.loss_kind, self.cp_group = (
            module,
            parallel,
            loss_kind,
            cp_group,
        )
        self.stage_split = StageSplit(1)
        whole = loss_kind in (LossKind.FULL_LOGITS, LossKind.MODEL_OUTPUT)
        self._stage = module if whole else _LocalLogits(module)
        # a padded batch's mask goes to the module's own forward when it takes one
        self.takes_attention_mask = whole and (
            "attention_mask" in inspect.signature(module.forward).parameters
        )

    def stage_modules(self) -> list[nn.Module]:
        return [self._stage]

    def stage_forward(self, stage: int, x: torch.Tensor):
        return self._stage(x)

    def tied_weights(self) -> list:
        return []

    def tied_group(self):
        return None

    def loss_positions(self, length: int) -> Optional[torch.Tensor]:
        return None if self.cp_group is None else cp_positions(length, group=self.cp_group)

    def local_sequence(self, length: int) -> int:
        return length if self.cp_group is None else len(self.loss_positions(length))

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.module.named_parameters(*args, **kwargs)

    def activation_shape(self, batch: int, length: int) -> tuple:
        raise NotImplementedError("a whole model runs without a pipeline")

    def output_shape(self, batch: int, length: int) -> tuple:
        raise NotImplementedError("a whole model runs without a pipeline")


def trained_model(model: nn.Module, parallel, loss_fn=None) -> tuple[ParallelModel, nn.Module]:
    """``(contract, module)``: the ParallelModel the Trainer runs for ``model`` and the module
    whose parameters it trains (the same object, unless adapted); with ``loss_fn``, the model
    whole (its stages are a causal LM's next-token machinery)."""
    if loss_fn is not None:
        scored = _scored_by(model, parallel, loss_fn)
        return scored, scored if scored is model else model
    if isinstance(model, ParallelModel) and model.loss_kind is LossKind.MODEL_OUTPUT:
        raise ValueError(
            f"{type(model).__name__} gives its head's output, which a loss of yours scores: "
            "pass Trainer(..., loss_fn=callable(output, batch)) and dict micro-batches"
        )
    if isinstance(model, ParallelModel):
        if model.parallel is not parallel:
            how = "without parallel=" if model.parallel is None else "with another state"
            given = "none" if parallel is None else "a ParallelState"
            raise ValueError(
                f"Trainer(parallel=...) needs the model built with the same ParallelState "
                f"({type(model).__name__}(config, parallel=state)); this one was built {how}, "
                f"and the Trainer was given {given}"
            )
        return model, model
    if parallel is None:
        takes = "local_logits" in inspect.signature(model.forward).parameters
        kind = LossKind.VOCAB_SHARD if takes else LossKind.FULL_LOGITS
        return WholeModel(model, None, kind), model
    return _converted(model, parallel)


def _converted(model: nn.Module, parallel) -> tuple[ParallelModel, nn.Module]:
    """A transformers causal LM converted by ``parallelize(..., parallel=state)`` at pp = 1."""
    if not is_transformers_model(model) or parallel.dims.pp_enabled:
        raise ValueError(
            f"Trainer(parallel=...): {type(model).__name__} is neither a tp_ext model built with "
            "parallel=state nor a transformers causal LM converted with tp_ext.parallelize("
            "model, 'auto', parallel=state) (at pp > 1, pass the stages it returns)"
        )
    if parallel.tp > 1:
        _check_converted(model, parallel)
    # experts run as the model runs them, whole, and a router loss needs its router logits
    if expert_parameters(model)[0] or router_loss_of(model) is not None:
        cp = parallel.cp_group if parallel.dims.cp_enabled else None
        return WholeModel(model, parallel, LossKind.FULL_LOGITS, cp), model
    staged = single_stage(model, parallel)
    return staged, staged


def _scored_by(model: nn.Module, parallel, loss_fn) -> ParallelModel:
    """``model`` whole, its output scored by ``loss_fn`` (a callable, or "model"); or an
    encoder's pipeline stages (``parallelize`` at pp > 1), which declare that loss kind."""
    if not (callable(loss_fn) or loss_fn == "model"):
        raise ValueError(
            f"loss_fn must be a callable (output, batch) -> loss, 'model' (the model's own "
            f"output.loss) or None (next-token loss over token batches), got {loss_fn!r}"
        )
    staged = isinstance(model, ParallelModel) and model.loss_kind is LossKind.MODEL_OUTPUT
    if staged and model.parallel is not parallel:
        raise ValueError(
            f"Trainer(parallel=...) needs {type(model).__name__} built with the same ParallelState"
        )
    if staged and callable(loss_fn):
        return model
    if staged and loss_fn == "model":
        raise ValueError(
            "loss_fn='model' with pipeline stages: the last stage gives the head's logits, not "
            "the model's loss; pass loss_fn=callable(output, batch) scoring output.logits"
        )
    if parallel is not None and parallel.dims.pp_enabled:
        raise ValueError(
            f"Trainer(loss_fn=...) at pp={parallel.pp} trains an encoder's pipeline stages "
            f"(tp_ext.parallelize(model, 'auto', parallel=state) returns them); "
            f"{type(model).__name__} is not one: build the ParallelState with pp=1"
        )
    if parallel is not None and parallel.dims.cp_enabled:
        raise ValueError(
            f"Trainer(loss_fn=...) at cp={parallel.dims.cp}: context parallelism splits a causal "
            "LM's sequence for its next-token loss; build the ParallelState with cp=1"
        )
    if isinstance(model, ParallelModel) and model.parallel is not parallel:
        raise ValueError(
            f"Trainer(parallel=...) needs {type(model).__name__} built with the same ParallelState"
        )
    if parallel is not None and parallel.tp > 1:
        _check_converted(model, parallel)
    return WholeModel(model, parallel, LossKind.MODEL_OUTPUT)


def _check_converted(model: nn.Module, parallel) -> None:
    if not any(isinstance(m, ParallelModule) for m in model.modules()):
        raise ValueError(
            f"Trainer(parallel=...) with tp={parallel.tp}: {type(model).__name__} holds no "
            "tp_ext layers; convert it first with tp_ext.parallelize(model, 'auto', "
            "parallel=state)"
        )
