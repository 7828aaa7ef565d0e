"""The runner of a training step: how the micro-batches go forward and backward through the
stage modules this rank holds. This is the only place the parallel form decides how a step
runs, and it has two cases (as torchtitan's ``pp_enabled``):

- :class:`LocalRunner`: one stage (no pipeline): each micro-batch's forward, loss and backward
  in turn, the gradient sync's engine told which backward is the last;
- :class:`PipelinedRunner`: torch.distributed.pipelining's schedule over the stages.

Both call ``loss_fn(output, target)`` on the last stage's output of each micro-batch (its
labels, or a dict batch's whole dict) and backpropagate what it returns. A padded micro-batch's
mask goes to every stage module's forward as ``attention_mask=`` (the model's
``takes_attention_mask``).
"""

from __future__ import annotations

from typing import Callable

import torch

from tp_ext.contract import LossKind
from tp_ext.pipeline import PipelineRunner
from tp_ext.training.micro_batches import MicroBatch

__all__ = ["LocalRunner", "PipelinedRunner"]


class LocalRunner:
    """The one stage module of ``sync`` (wrapped by its engine, if any), micro-batch after
    micro-batch; the forward under ``precision``'s autocast, the backward outside it."""

    schedule_name = None
    pipeline = None

    def __init__(self, model, sync) -> None:
        self.model, self.sync = model, sync
        (self.module,) = sync.modules

    def run(self, batches: list[MicroBatch], loss_fn: Callable, precision) -> None:
        last = len(batches) - 1
        for i, batch in enumerate(batches):
            with self.sync.accumulating(self.module, last=i == last):
                with precision.autocast(batch.device):
                    loss = loss_fn(self.module(*batch.args, **batch.kwargs), batch.target)
                loss.backward()


class PipelinedRunner:
    """torch's schedule ``schedule`` over the stage modules of ``sync``; every micro-batch of a
    step has one shape (the stages exchange fixed-size activations)."""

    def __init__(self, model, sync, schedule: str) -> None:
        self.model = model
        self.pipeline = PipelineRunner(model, schedule, sync.stages)

    @property
    def schedule_name(self) -> str:
        return self.pipeline.schedule.name

    def run(self, batches: list[MicroBatch], loss_fn: Callable, precision) -> None:
        if self.model.loss_kind is LossKind.MODEL_OUTPUT:
            self._run_scored(batches, loss_fn, precision)
            return
        shapes = {tuple(b.input_ids.shape) for b in batches}
        if len(shapes) > 1:
            raise ValueError(
                f"under pipelining every micro-batch must have one shape (the stages exchange "
                f"fixed-size activations); got {sorted(shapes)}"
            )
        ids = torch.cat([b.input_ids for b in batches])
        labels = torch.cat([b.target for b in batches])
        padded = any(b.attention_mask is not None for b in batches)  # then every stage gets all
        masks = [
            torch.ones_like(b.input_ids) if b.attention_mask is None else b.attention_mask
            for b in batches
        ]
        mask = torch.cat(masks) if padded else None
        device = ids.device
        with precision.autocast(device):
            logits_dtype = precision.autocast_dtype or next(self.model.parameters()).dtype
            self.pipeline.step(ids, labels, len(batches), loss_fn, logits_dtype, mask)

    def _run_scored(self, batches: list[MicroBatch], loss_fn: Callable, precision) -> None:
        """Dict micro-batches through an encoder's stages: the first stage gets the model's
        input, every stage the padding mask; the last stage's output goes to ``loss_fn`` with
        its micro-batch's dict (torch's schedule hands the loss each micro-batch's slice of the
        target: here its index)."""
        name = self.model.input_name
        for i, batch in enumerate(batches):
            other = sorted(set(batch.kwargs) - {name, "attention_mask"})
            if name not in batch.kwargs or other:
                raise ValueError(
                    f"micro_batches[{i}]: under pipelining the model gets {name!r} (the first "
                    f"stage) and 'attention_mask' (every stage); this one gives "
                    f"{sorted(batch.kwargs)}"
                )
        shapes = {tuple(b.kwargs[name].shape) for b in batches}
        if len(shapes) > 1:
            raise ValueError(
                f"under pipelining every micro-batch's {name} must have one shape (the stages "
                f"exchange fixed-size activations); got {sorted(shapes)}"
            )
        x = torch.cat([b.kwargs[name] for b in batches])
        masks = [b.attention_mask for b in batches]
        mask = None
        if any(m is not None for m in masks):
            mask = torch.cat([torch.ones(b.kwargs[name].shape[:2], dtype=torch.long,
                                         device=x.device) if m is None else m
                              for b, m in zip(batches, masks)])  # fmt: skip
        index = torch.arange(len(batches), device=x.device)

        def scored(output, which):
            return loss_fn(HeadOutput(output), batches[int(which)].target)

        with precision.autocast(x.device):
            logits_dtype = precision.autocast_dtype or next(self.model.parameters()).dtype
            self.pipeline.step(x, index, len(batches), scored, logits_dtype, mask)


class HeadOutput(dict):
    """The last pipeline stage's output as a ``loss_fn`` reads a model's: ``output.logits`` (or
    ``output["logits"]``)."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__(logits=logits)

    @property
    def logits(self) -> torch.Tensor:
        return self["logits"]
