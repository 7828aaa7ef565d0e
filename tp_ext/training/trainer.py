"""A :class:`Trainer` whose step accumulates gradients over micro-batches, synchronises data
parallelism once, clips by the TP-aware norm and steps the optimizer.

Collectives issued by :class:`Trainer` are tagged for :func:`tp_ext.comm.track`:
``train.compute`` (the model's own, per micro-batch), ``train.dp_sync`` (one per step with a
data-parallel group) and ``train.grad_norm`` (one per step when clipping at TP > 1)::

    trainer = Trainer(model, max_grad_norm=1.0, dp_group=state.dp_group)
    loss = trainer.step([ids_0, ids_1])          # two micro-batches, one optimizer step

With ``parallel=`` (a model built with ``parallel=state``) its collectives add ``train.loss``
(the global token count and loss, an all-reduce each) and ``train.tied`` (a tied embedding's
gradient, summed between the first and last stage under pipelining).

The Trainer is composed of parts chosen once, at construction (:mod:`tp_ext.training.core`):
a runner (its own loop, or torch's pipeline schedule) x a gradient sync (DDP / FSDP2, sums
over the replicas, ZeRO-2) x the model's loss kind, the precision settings, the optimizer and
LR schedule, and a checkpointer of its Stateful parts. :meth:`Trainer.fit` runs the whole loop
(:mod:`tp_ext.training.loop`: checkpoints in a directory, resume, metrics)::

    losses = trainer.fit(trainer.data, steps=1000, checkpoint_dir="ckpt", checkpoint_every=100)
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable, Optional, Union

import torch
from torch import nn

from tp_ext.compression import OneBitAdam
from tp_ext.contract import LossKind
from tp_ext.dims import ParallelDims
from tp_ext.distributed import comm
from tp_ext.pipeline import PipelineRunner
from tp_ext.training import loop
from tp_ext.training.adapters import trained_model
from tp_ext.training.checkpoint_parts import (
    CompressionPart,
    JsonPart,
    ModelPart,
    OptimizerPart,
    RngPart,
)
from tp_ext.training.checkpointer import CheckpointManager
from tp_ext.training.core import StepSettings, assemble, assemble_plain
from tp_ext.training.grad_norm import model_tp_group
from tp_ext.training.micro_batches import dict_batches, forward_keys, token_batches
from tp_ext.training.optimizer import build_lr_scheduler, build_optimizer
from tp_ext.training.precision import Precision
from tp_ext.training.trainer_checks import (
    built_optimizer,
    built_scheduler,
    check_arguments,
    check_overlap,
    check_zero,
    set_recompute,
    stateful_data,
)
from tp_ext.training.zero import is_sharded
from tp_ext.validation import as_torch_dtype

__all__ = ["Trainer"]

MicroBatch = Union[
    torch.Tensor,
    tuple[torch.Tensor, torch.Tensor],
    tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dict,  # with loss_fn
]


class Trainer:
    """One optimizer step per :meth:`step` over a list of micro-batches, for a tp_ext causal LM
    (``model(input_ids, local_logits=True)`` gives this rank's vocabulary shard of the logits).

    - ``optimizer``: an optimizer; a callable taking the trainable parameters and returning
      one (called after data-parallel wrapping, so it sees FSDP2's sharded parameters); or None
      for :func:`build_optimizer` with the default settings.
    - ``max_grad_norm``: clip to this TP-aware norm (None: no clipping; the norm is not computed).
    - ``dp_group``: a data-parallel group (e.g. ``init_parallel(...).dp_group``); each DP rank
      passes its own micro-batches, and the step equals one over all of them.
    - ``autocast_dtype``: e.g. ``torch.bfloat16`` runs forward under ``torch.autocast``
      (parameters, gradients and optimizer state stay in their own dtype). ``torch.float16``
      adds a dynamic loss scale whose overflow check is agreed over every rank (torch's
      ShardedGradScaler on the default group), so every rank skips the same steps.
    - ``tp_group``: None takes the model's.
    - ``parallel``: the :class:`tp_ext.ParallelState` the model was built with
      (``Qwen2ForCausalLM(config, parallel=state)``, or the stages of a Hugging Face model that
      ``tp_ext.parallelize(hf_model, "auto", parallel=state)`` returns): TP x PP x DP training. Then
      ``schedule`` (one of :data:`tp_ext.pipeline.SCHEDULES`) runs the pipeline,
      ``data_parallel`` ("ddp" or "fsdp") synchronises DP once per step, and
      ``activation_checkpointing`` recomputes each decoder layer in backward.
      ``data_parallel="zero1"`` / ``"zero2"``: the optimizer's state and fp32 master weights
      sharded over DP (:mod:`tp_ext.training.zero`; ``trainer.optimizer.inner`` holds this
      rank's rows), gradients all-reduced (ZeRO-1) or reduce-scattered (ZeRO-2).
      ``grad_reduce_dtype`` (e.g. torch.bfloat16): the DP gradient sum travels in that dtype
      (DDP, ZeRO-1, ZeRO-2), accumulated back into the gradients' own.
      ``overlap_param_gather`` (ZeRO): each bucket's all-gather of the updated parameters is
      waited for by the next forward of its first layer (or a ``state_dict()``), not at the
      end of :meth:`step`: read parameters otherwise after
      ``trainer.optimizer.finish_gather()``.

    - A Hugging Face MoE model parallelized with ``parallel=state`` at ``ep > 1``
      (:class:`tp_ext.layers.ExpertParallelMoE` layers) trains in this Trainer's own loop with
      ``parallel=state`` (pp = 1): full logits and the model's aux loss, dense gradients summed
      over DP and expert gradients over the expert-DP group. The aux loss is each micro-batch's
      own (the model's, on its tokens), weighted by its token count: the average of per-batch
      load-balancing losses, as in Megatron's per-micro-batch aux loss, not one over the global
      batch (a product of averages, which would need the router statistics all-reduced).

    - ``gradient_compression``: "int8", "1bit" (with error feedback) or "powersgd": DDP sends
      the DP gradients compressed (:mod:`tp_ext.compression`; with ``parallel=`` and
      ``data_parallel="ddp"``; the int8 / 1-bit residuals are saved with the checkpoints).

    - ``lr_scheduler``: a torch LR scheduler over ``optimizer`` (or a callable taking the
      optimizer and returning one), stepped after every optimizer step.
    - ``data``: the run's data source, if it is Stateful (``state_dict()`` /
      ``load_state_dict()``, e.g. :class:`tp_ext.data.TokenBatches`): checkpoints hold its
      position.

    The loss is the mean token cross-entropy over every target of every micro-batch (of every
    DP rank); targets equal to ``ignore_index`` do not count.

    - ``loss_fn``: any other model and loss (masked LM, classification, seq2seq, vision). Each
      micro-batch is a dict of tensors; the model gets the keys its forward takes as keyword
      arguments, and ``loss_fn(output, batch)`` returns the micro-batch's mean loss; the step's
      loss is the mean over the micro-batches of every DP rank. ``labels`` is the loss's, not
      given to the model; ``loss_fn="model"`` gives the model the whole batch and takes its own
      ``output.loss`` (transformers' models). A ``loss_fn`` with a ``num_items_in_batch``
      keyword gets the step's count of labels that are not ``ignore_index`` (every micro-batch,
      every DP rank) and returns its sum divided by it: every label weighs alike, as in one big
      batch. The model trains whole under DDP, FSDP2 or ZeRO, with TP (and sequence
      parallelism where its layout allows) from ``parallelize``; an encoder's pipeline stages
      (``parallelize`` at pp > 1: BERT, RoBERTa, ViT) run under the schedule, each micro-batch
      giving the first stage its ``input_ids`` or ``pixel_values`` and every stage its
      ``attention_mask``, and ``loss_fn`` reading ``output.logits``::

          trainer = Trainer(bert, loss_fn=lambda out, b: F.cross_entropy(out.logits, b["labels"]))
          trainer.step([{"input_ids": ids, "attention_mask": mask, "labels": labels}])

    :meth:`save_checkpoint` / :meth:`load_checkpoint` save and restore all of it (model,
    optimizer state, LR schedule, loss scale, step, data position, every rank's random streams),
    resharding between any two dims (:mod:`tp_ext.training.checkpointer`).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Union[torch.optim.Optimizer, Callable, None] = None,
        *,
        max_grad_norm: Optional[float] = None,
        dp_group=None,
        tp_group=None,
        autocast_dtype: Optional[torch.dtype] = None,
        ignore_index: int = -100,
        parallel=None,
        schedule: str = "1F1B",
        data_parallel: Optional[str] = "ddp",
        activation_checkpointing: bool = False,
        lr_scheduler=None,
        data=None,
        gradient_compression: Optional[str] = None,
        grad_reduce_dtype: Optional[torch.dtype] = None,
        overlap_param_gather: bool = False,
        loss_fn: Union[Callable, str, None] = None,
    ) -> None:
        check_arguments(max_grad_norm, autocast_dtype, activation_checkpointing)
        check_zero(data_parallel, parallel, autocast_dtype, grad_reduce_dtype, gradient_compression)
        check_overlap(overlap_param_gather, data_parallel)
        contract, module = trained_model(model, parallel, loss_fn)
        self.model, self.parallel = module, parallel
        set_recompute(contract, activation_checkpointing)
        settings = StepSettings(
            schedule, data_parallel, gradient_compression, ignore_index, grad_reduce_dtype,
            overlap_param_gather, loss_fn,
        )  # fmt: skip
        if parallel is None:
            tp = model_tp_group(module, tp_group)
            self.core = assemble_plain(contract, module, tp, dp_group, settings)
            self.optimizer = built_optimizer(optimizer, module)
        else:
            if dp_group is not None or tp_group is not None:
                raise ValueError(
                    "with parallel=, the TP and DP groups are the ParallelState's; drop "
                    "dp_group= / tp_group="
                )
            self.core, self.optimizer = assemble(
                contract, module, parallel, settings, lambda m: built_optimizer(optimizer, m)
            )
        self.gradient_compression = gradient_compression if self.compression_states else None
        self._pair_onebit_adam(self.optimizer, autocast_dtype)
        self.lr_scheduler = built_scheduler(lr_scheduler, self.optimizer)
        self.data = stateful_data(data)
        self.steps = 0  # optimizer steps taken (skipped fp16 steps included)
        self.max_grad_norm = max_grad_norm
        self.precision = Precision(autocast_dtype, module)
        self.ignore_index = ignore_index
        self.last_grad_norm: Optional[float] = None
        self.skipped_steps = 0  # steps whose gradients overflowed under fp16 (not applied)
        self.checkpointer = self._checkpointer()  # from the run's Stateful parts
        self.last_step_tokens = 0  # this rank's tokens (a dict batch's items) of the last step
        self._takes = forward_keys(module) if loss_fn is not None else None

    @classmethod
    def from_config(
        cls,
        job,
        model: nn.Module,
        parallel,
        *,
        steps: Optional[int] = None,
        max_grad_norm: Optional[float] = None,
        data=None,
        autocast_dtype: Optional[torch.dtype] = None,
    ) -> "Trainer":
        """The Trainer a job config (:class:`tp_ext.config.JobConfig`) describes for ``model``
        built with ``parallel``: AdamW from ``job.optimizer`` (built over the parameters after
        DDP / FSDP2 wrapping, so FSDP2's sharded ones are the ones stepped) and, given the run's
        total ``steps``, its LR schedule; the schedule, DP engine, gradient sum dtype,
        overlapped gathers and recompute from ``job.parallel``. What every command trains with."""
        p = job.parallel

        def lr_schedule(optimizer):
            return build_lr_scheduler(optimizer, job.optimizer, steps)

        return cls(
            model,
            optimizer=lambda params: build_optimizer(model, job.optimizer),
            parallel=parallel,
            schedule=p.schedule,
            max_grad_norm=max_grad_norm,
            data_parallel=p.data_parallel,
            grad_reduce_dtype=as_torch_dtype(p.grad_reduce_dtype),
            overlap_param_gather=p.overlap_param_gather,
            activation_checkpointing=p.activation_checkpointing,
            lr_scheduler=None if steps is None else lr_schedule,
            data=data,
            autocast_dtype=autocast_dtype,
        )

    # the core's parts, read by checkpoints, tests and tools
    @property
    def runner(self) -> Optional[PipelineRunner]:
        """The pipeline runner (None unless the step runs on a pipeline)."""
        return self.core.runner.pipeline

    @property
    def tp(self):
        return self.core.loss.tp

    @property
    def dp_group(self):
        return self.core.dp_group

    @property
    def data_parallel(self) -> Optional[str]:
        return self.core.data_parallel

    @property
    def compression_states(self) -> list:
        """The gradient-compression states (int8 / 1-bit residuals, PowerSGD's errors)."""
        return self.core.sync.compression_states

    @property
    def _device(self) -> torch.device:
        return next((p.device for p in self.model.parameters()), torch.device("cpu"))

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return self.precision.autocast_dtype

    @property
    def scaler(self):
        return self.precision.scaler

    def _pair_onebit_adam(self, optimizer, autocast_dtype) -> None:
        """1-bit compression with a :class:`OneBitAdam` runs as 1-bit Adam (its hooks send the
        momentum after the optimizer's warm-up); with Adam itself, warn: sign-compressed
        gradients corrupt its second moment."""
        if isinstance(optimizer, OneBitAdam) and self.gradient_compression == "1bit":
            if autocast_dtype == torch.float16:
                raise ValueError(
                    "OneBitAdam with gradient_compression='1bit' and float16 autocast: the hook "
                    "blends the loss-scaled gradients with the unscaled momentum; use bfloat16 "
                    "autocast (no loss scale) with 1-bit Adam"
                )
            for state in self.compression_states:
                state.attach(optimizer)
        elif self.gradient_compression == "1bit" and isinstance(
            optimizer, (torch.optim.Adam, torch.optim.AdamW)
        ):
            warnings.warn(
                "gradient_compression='1bit' with Adam: each chunk's gradients arrive with one "
                "magnitude, which distorts Adam's second moment (slower convergence); "
                "tp_ext.compression.OneBitAdam (1-bit Adam) keeps it exact",
                stacklevel=3,
            )

    def step(self, micro_batches: list[MicroBatch]) -> float:
        """Forward and backward every micro-batch (``input_ids`` ``[batch, seq]``, or
        ``(input_ids, labels)`` with labels of the same shape, Hugging Face style: position t
        predicts ``labels[:, t + 1]``; without labels, the ids themselves; a padded batch as
        ``(input_ids, labels, attention_mask)``, 0 at padding, which is never a target and which
        the model's forward is given: a model that declares ``takes_attention_mask``), then one DP
        synchronisation, clipping and ``optimizer.step()``. Gradients already on the parameters
        are discarded first. Returns the step's mean loss, the same on every rank; the norm
        before clipping is left in ``last_grad_norm``."""
        batches = self._micro_batches(micro_batches)
        self.last_step_tokens = sum(b.tokens for b in batches)
        self.checkpointer.publish_finished()
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.core.forward_backward(batches, self.precision)
        self.precision.unscale(self.optimizer)
        if self.max_grad_norm is not None:
            with comm.tag("train.grad_norm"):
                norm = self.core.clip(self.max_grad_norm)
            self.last_grad_norm = norm.item()
        self._optimizer_step()
        return loss.item()

    def _micro_batches(self, micro_batches):
        if self.core.loss.kind is not LossKind.MODEL_OUTPUT:
            return token_batches(micro_batches, self._device, self.ignore_index)
        return dict_batches(
            micro_batches,
            self._device,
            self._takes,
            labels_to_model=self.core.loss.labels_to_model,
            model_name=type(self.model).__name__,
        )

    def fit(
        self,
        batches,
        steps: int,
        *,
        checkpoint_dir=None,
        checkpoint_every: Optional[int] = None,
        keep_last: Optional[int] = None,
        async_save: bool = False,
        resume: bool = True,
        metrics=None,
        wording: Optional[loop.Wording] = None,
    ) -> list[float]:
        """Train until :attr:`steps` reaches ``steps`` (the total, not a count from now); every
        rank calls it. Returns the loss of each step it ran.

        - ``batches``: an iterable whose items are one step's list of micro-batches (what
          :meth:`step` takes), the first item for the step after this Trainer's; or the
          Trainer's ``data`` loader (e.g. :class:`tp_ext.data.TokenBatches`), whose position
          the checkpoints hold.
        - ``checkpoint_dir``: a directory (or a :class:`~tp_ext.training.CheckpointManager`) for
          ``step-<N>`` checkpoints, saved every ``checkpoint_every`` steps (None: after the
          last step only) and after the last, the newest ``keep_last`` kept (None: all);
          ``async_save`` writes them in the background (the last one published before fit
          returns). If it holds a published checkpoint, fit continues from the newest
          (``resume=True``: with a plain iterable, skipping the items of the steps it holds;
          its LR schedule must be the one this Trainer was built with) or refuses to start
          (``resume=False``), so nothing is overwritten.
        - ``metrics``: a file path (rank 0 appends ``{"step", "loss", "grad_norm", "lr",
          "tokens_per_s"}`` per step as JSON lines; the lines after the step fit starts at are
          dropped first), a callable taking that dict (on every rank), or a list of these.
        - ``wording``: how errors name the settings to change (a command's flags)."""
        return loop.fit(
            self,
            batches,
            steps,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            keep_last=keep_last,
            async_save=async_save,
            resume=resume,
            metrics=metrics,
            wording=wording,
        )

    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        """Save everything this run needs to continue to checkpoint ``path`` (every rank calls
        it): model, optimizer state, LR schedule, loss scale, step, data position and every
        rank's random streams, through torch.distributed.checkpoint's safetensors storage
        (:attr:`checkpointer`). Atomic: ``path`` changes from its previous checkpoint to this one
        in one step.

        ``async_save``: returns once the state is copied to CPU memory; the files are written
        in the background while training goes on, and the checkpoint is published at the first
        :meth:`step` after every rank finished writing (or by :meth:`wait_for_checkpoint`)."""
        self.checkpointer.save(path, async_save=async_save)

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save to be written and publish it (every rank calls it).
        Call it before the program ends, or the last asynchronous save is not published."""
        self.checkpointer.wait()

    def load_checkpoint(self, path: str) -> dict:
        """Restore the state :meth:`save_checkpoint` saved, at this Trainer's dims, whatever
        dims it was saved at (every rank calls it). Returns the checkpoint's manifest (``step``,
        ``dims``, ...). The LR scheduler resumes the saved schedule: with
        :func:`~tp_ext.training.build_lr_scheduler`, its settings too, replacing those it was
        built with (``tp-ext train --resume`` refuses a run that asks for others)."""
        return self.checkpointer.load(path)

    def checkpoints(self, directory, **policy) -> CheckpointManager:
        """A :class:`CheckpointManager` keeping this run's checkpoints in ``directory``
        (``every``, ``keep_last``, ``async_save``, ``on_accept``), for :meth:`fit`."""
        return self.checkpointer.in_directory(directory, **policy)

    def state_dict(self) -> dict:
        """The Trainer's own counters (Stateful): steps taken, steps skipped by fp16's loss
        scale, and the loss scale."""
        scaler = self.precision.scaler
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "loss_scale": None if scaler is None else scaler.state_dict(),
        }

    def load_state_dict(self, state: dict) -> None:
        self.steps, self.skipped_steps = int(state["steps"]), int(state["skipped_steps"])
        scaler = self.precision.scaler
        if scaler is not None and state.get("loss_scale") is not None:
            scaler.load_state_dict(state["loss_scale"])

    def compression_residuals(self) -> dict[str, torch.Tensor]:
        """This rank's gradient-compression residuals by parameter name (empty without int8 /
        1-bit compression)."""
        states = self.compression_states
        return {name: r for state in states for name, r in state.state_dict().items()}

    def load_compression_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        for state in self.compression_states:  # each takes its parameters' residuals
            mine = state.state_dict().keys()
            state.load_state_dict({k: v for k, v in residuals.items() if k in mine})

    def where(self) -> dict:
        """Where the run stands, for checkpoints: its step, its dims and pipeline stages."""
        stages = None
        if self.parallel is None:
            tp, dp = self.core.loss.tp.size, 1 if self.dp_group is None else self.dp_group.size
            dims = ParallelDims(tp=tp, pp=1, dp=dp)
        else:
            split = self.core.model.stage_split
            dims = self.parallel.dims.replace(virtual_stages=split.virtual_stages)
            stages = {
                "stage_layers": split.layer_counts,
                "stage_order": split.order,
                "schedule": self.core.runner.schedule_name,
            }
        return {"step": self.steps, "dims": dims.as_dict(), "stages": stages}

    def _checkpointer(self) -> CheckpointManager:
        parts = [
            ModelPart(self.model),
            OptimizerPart(self.model, self.optimizer),
            RngPart(),
            CompressionPart(self),
            JsonPart("data", lambda: self.data, early=True),  # a mismatch refused first
            JsonPart("lr_scheduler", lambda: self.lr_scheduler),
            JsonPart("trainer", lambda: self, "Trainer"),
        ]
        return CheckpointManager(parts, self.where)

    @contextlib.contextmanager
    def whole_parameters(self):
        """Under FSDP2 each DP rank holds a slice of every parameter between steps, while the
        model's own forward, ``generate`` and ``save_pretrained`` read whole ones: inside this
        block they are gathered (every FSDP2 unit of every stage; an all-gather over DP, so
        every rank enters it) and sharded again after it. Otherwise it changes nothing."""
        if is_sharded(self.optimizer):  # ZeRO's parameters still being gathered
            self.optimizer.finish_gather()
        from torch.distributed.fsdp import FSDPModule

        modules = self.core.sync.modules
        units = [m for stage in modules for m in stage.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def _optimizer_step(self) -> None:
        if self.precision.step(self.optimizer):
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1
