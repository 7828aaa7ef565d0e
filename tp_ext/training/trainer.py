"""A :class:`Trainer` whose step accumulates gradients over micro-batches, synchronises data
parallelism once, clips by the TP-aware norm and steps the optimizer.

Collectives issued by :class:`Trainer` are tagged for :func:`tp_ext.comm.track`:
``train.compute`` (the model's own, per micro-batch), ``train.dp_sync`` (one per step with a
data-parallel group) and ``train.grad_norm`` (one per step when clipping at TP > 1)::

    trainer = Trainer(model, max_grad_norm=1.0, dp_group=state.dp_group)
    loss = trainer.step([ids_0, ids_1])          # two micro-batches, one optimizer step

With ``parallel=`` (a model built with ``parallel=state``) the step runs on a pipeline instead
(:mod:`tp_ext.pipeline`: torch's schedules, DDP or FSDP2 on the DP dimension); its collectives
add ``train.loss`` (the global loss, one all-reduce) and ``train.tied`` (a tied embedding's
gradient, summed between the first and last stage).
"""

from __future__ import annotations

import contextlib
import inspect
import warnings
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from tp_ext.compression import OneBitAdam
from tp_ext.distributed import comm
from tp_ext.layers import ExpertParallelMoE, expert_parameters, vocab_parallel_cross_entropy
from tp_ext.pipeline import DATA_PARALLEL, SCHEDULES, PipelineRunner
from tp_ext.training.grad_norm import (
    clip_grad_norm_,
    model_tp_group,
    parallel_grad_norm,
    scale_grads_,
)
from tp_ext.training.optimizer import build_optimizer
from tp_ext.training.state import load_training_state, save_training_state
from tp_ext.validation import is_number

__all__ = ["Trainer"]

MicroBatch = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]


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
      (``Qwen2ForCausalLM(config, parallel=state)``): TP x PP x DP training. Then
      ``schedule`` (one of :data:`tp_ext.pipeline.SCHEDULES`) runs the pipeline,
      ``data_parallel`` ("ddp" or "fsdp") synchronises DP once per step, and
      ``activation_checkpointing`` recomputes each decoder layer in backward.

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

    :meth:`save_checkpoint` / :meth:`load_checkpoint` save and restore all of it (model,
    optimizer state, LR schedule, loss scale, step, data position, every rank's random streams),
    resharding between any two (tp, pp, dp) layouts (:mod:`tp_ext.training.state`).
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
    ) -> None:
        if max_grad_norm is not None and (not is_number(max_grad_norm) or not max_grad_norm > 0):
            raise ValueError(
                f"max_grad_norm must be a number > 0, or None for no clipping; got "
                f"{max_grad_norm!r}"
            )
        if autocast_dtype is not None and not isinstance(autocast_dtype, torch.dtype):
            raise TypeError(
                f"autocast_dtype must be a torch.dtype (e.g. torch.bfloat16) or "
                f"None, got {autocast_dtype!r}"
            )
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(
                f"activation_checkpointing must be True or False, got {activation_checkpointing!r}"
            )
        self.model = model
        self.parallel = parallel
        self.runner = None
        self.gradient_compression = None
        if gradient_compression is not None and parallel is None:
            raise ValueError(
                f"gradient_compression={gradient_compression!r} needs Trainer(parallel=...): the "
                "DP hooks go on the DDP modules of its layout"
            )
        self.expert_dp_group = None
        if parallel is not None and _has_expert_parallel_layers(model):
            self._setup_expert_parallel(
                model, parallel, data_parallel, dp_group, tp_group, gradient_compression
            )
        elif parallel is not None:
            self._setup_pipeline(
                model, parallel, schedule, data_parallel, dp_group, tp_group, gradient_compression
            )
        if hasattr(model, "activation_checkpointing"):
            model.activation_checkpointing = activation_checkpointing
        elif activation_checkpointing:
            raise ValueError(
                f"activation_checkpointing: {type(model).__name__} has no per-layer recompute "
                "switch (tp_ext's models do)"
            )
        if optimizer is None:
            optimizer = build_optimizer(model)
        elif callable(optimizer) and not isinstance(optimizer, torch.optim.Optimizer):
            built = optimizer([p for p in model.parameters() if p.requires_grad])
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(
                    f"optimizer: the callable must return a torch.optim.Optimizer, got "
                    f"{type(built).__name__}"
                )
            optimizer = built
        _check_float16_parameters(optimizer)
        self.optimizer = optimizer
        self._pair_onebit_adam(optimizer, autocast_dtype)
        self.lr_scheduler = _scheduler(lr_scheduler, optimizer)
        if data is not None and not (
            callable(getattr(data, "state_dict", None))
            and callable(getattr(data, "load_state_dict", None))
        ):
            raise TypeError(
                f"data must be Stateful (state_dict() and load_state_dict(), e.g. "
                f"tp_ext.data.TokenBatches) so checkpoints hold its position, got "
                f"{type(data).__name__}"
            )
        self.data = data
        self.steps = 0  # optimizer steps taken (skipped fp16 steps included)
        self._pending_save = None
        self.max_grad_norm = max_grad_norm
        if parallel is None:
            self.tp = model_tp_group(model, tp_group)
            self.dp_group = None if dp_group is None else comm.resolve_group(dp_group)
        self.autocast_dtype = autocast_dtype
        self.scaler = None
        if autocast_dtype == torch.float16:
            device = next(model.parameters()).device
            self.scaler = _loss_scaler(device)
            # the scale is made on first use; ranks without the loss (earlier pipeline stages)
            # never scale one, yet take part in the agreed overflow check
            self.scaler.scale(torch.zeros((), device=device))
        self.ignore_index = ignore_index
        self.last_grad_norm: Optional[float] = None
        self.skipped_steps = 0  # steps whose gradients overflowed under fp16 (not applied)

    def _setup_pipeline(
        self, model, parallel, schedule, data_parallel, dp_group, tp_group, compression
    ):
        built_with = getattr(model, "parallel", None)
        if built_with is not parallel:
            how = "without parallel=" if built_with is None else "with another layout"
            raise ValueError(
                f"parallel= needs the model built with the same layout: "
                f"{type(model).__name__}(config, parallel=state); this one was built {how}"
            )
        if dp_group is not None or tp_group is not None:
            raise ValueError(
                "with parallel=, the TP and DP groups are the layout's; drop dp_group= / tp_group="
            )
        if getattr(model, "is_2d", False):
            if compression is not None and parallel.dp > 1:
                raise ValueError(
                    f"gradient_compression={compression!r} with a 2D model: its DP all-reduce is "
                    "tp_ext's own, not a DDP hook's; use 1D tensor parallelism to compress"
                )
            self._setup_2d(parallel, data_parallel)
            return
        if schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
        if data_parallel is not None and data_parallel not in DATA_PARALLEL:
            raise ValueError(f"data_parallel must be one of {DATA_PARALLEL}, got {data_parallel!r}")
        if data_parallel is None and parallel.dp > 1:
            raise ValueError(
                f"data_parallel=None with dp={parallel.dp}: the replicas would drift apart; "
                f"use one of {DATA_PARALLEL}"
            )
        self.data_parallel = data_parallel if parallel.dp > 1 else None
        self.tp = comm.resolve_group(parallel.tp_group)
        self.dp_group = comm.resolve_group(parallel.dp_group)
        self.runner = PipelineRunner(model, schedule, self.data_parallel, compression)
        self.gradient_compression = compression if parallel.dp > 1 else None

    def _pair_onebit_adam(self, optimizer, autocast_dtype) -> None:
        """1-bit compression with a :class:`OneBitAdam` runs as 1-bit Adam (its hooks send the
        momentum after the optimizer's warm-up); with Adam itself, warn: sign-compressed
        gradients corrupt its second moment."""
        states = self.runner.compression_states if self.runner is not None else []
        if isinstance(optimizer, OneBitAdam) and self.gradient_compression == "1bit":
            if autocast_dtype == torch.float16:
                raise ValueError(
                    "OneBitAdam with gradient_compression='1bit' and float16 autocast: the hook "
                    "blends the loss-scaled gradients with the unscaled momentum; use bfloat16 "
                    "autocast (no loss scale) with 1-bit Adam"
                )
            for state in states:
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

    def _setup_2d(self, parallel, data_parallel) -> None:
        """A 2D (SUMMA) model runs without a pipeline: the step of this Trainer's own loop, its
        loss from the logits blocks (the model's ``summed_loss``), DP gradients all-reduced
        once per step over the DP group, the norm over the grid."""
        if data_parallel not in (None, "ddp"):
            raise ValueError(
                f"data_parallel={data_parallel!r} with a 2D model: its DP replicas synchronise "
                "by one all-reduce of the gradients per step; use data_parallel='ddp' (or None "
                "at dp=1)"
            )
        self.data_parallel = "ddp" if parallel.dp > 1 else None
        self.tp = comm.resolve_group(parallel.tp_group)
        self.dp_group = comm.resolve_group(parallel.dp_group)
        self.runner = None

    def _setup_expert_parallel(
        self, model, parallel, data_parallel, dp_group, tp_group, compression
    ) -> None:
        """A model with ExpertParallelMoE layers (``tp_ext.parallelize(model, "auto",
        parallel=state)`` at ep > 1) runs this Trainer's own loop: the loss is scaled by the
        global token count (one all-reduce before the forwards), so each rank's gradients are
        its share of the global mean; dense gradients are then summed over the DP group and
        expert gradients over the expert-DP group (the ranks holding the same experts: the
        dispatch's backward already summed over the EP group's tokens)."""
        if parallel.pp > 1:
            raise ValueError(
                f"expert parallelism with pp={parallel.pp}: pipeline stages of a model with "
                "ExpertParallelMoE layers are not supported yet; use pp=1"
            )
        if dp_group is not None or tp_group is not None:
            raise ValueError(
                "with parallel=, the TP and DP groups are the layout's; drop dp_group= / tp_group="
            )
        if data_parallel not in (None, "ddp") or compression is not None:
            raise ValueError(
                f"data_parallel={data_parallel!r}, gradient_compression={compression!r} with "
                "expert parallelism: its gradients are summed by one all-reduce per group "
                "(dense over DP, experts over expert-DP); use data_parallel='ddp' (or None) and "
                "no compression"
            )
        self.data_parallel = "ddp" if parallel.dp > 1 else None
        self.tp = comm.resolve_group(parallel.tp_group)
        self.dp_group = comm.resolve_group(parallel.dp_group)
        self.expert_dp_group = comm.resolve_group(parallel.expert_dp_group)
        self._expert_ids = {id(p) for p in expert_parameters(model)[0]}

    def step(self, micro_batches: list[MicroBatch]) -> float:
        """Forward and backward every micro-batch (``input_ids`` ``[batch, seq]``, or
        ``(input_ids, labels)`` with labels of the same shape, Hugging Face style: position t
        predicts ``labels[:, t + 1]``; without labels, the ids themselves), then one DP
        synchronisation, clipping and ``optimizer.step()``. Gradients already on the parameters
        are discarded first. Returns the step's mean loss, the same on every rank; the norm
        before clipping is left in ``last_grad_norm``."""
        batches = self._check(micro_batches)
        self._publish_finished_save()
        if self.runner is not None:
            return self._pipeline_step(batches)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer.zero_grad(set_to_none=True)
        # Known before any forward: scale each micro-batch's summed loss by the local token
        # count, so the accumulated gradient is that of the mean (no host sync needed).
        count = torch.stack(
            [(labels[:, 1:] != self.ignore_index).sum() for _, labels in batches]
        ).sum()
        if self.expert_dp_group is not None and self.dp_group.size > 1:
            # experts see other ranks' tokens: every rank scales by the global count
            with comm.tag("train.dp_sync"):
                count = comm.all_reduce(count.float(), "sum", group=self.dp_group)
        scale = count.clamp_min(1).float()
        count = count.float()
        loss_sum = torch.zeros((), device=batches[0][0].device)
        with comm.tag("train.compute"):
            for ids, labels in batches:
                with self._autocast(ids.device):
                    loss = self._micro_batch_loss(ids, labels)
                self._scaled(loss / scale).backward()
                loss_sum += loss.detach().float()
        if self.expert_dp_group is not None:
            loss_sum = self._sync_expert_parallel(params, loss_sum)
        elif self.dp_group is not None and self.dp_group.size > 1:
            loss_sum, count = self._sync_data_parallel(params, loss_sum, scale, count)
        self._unscale()
        if self.max_grad_norm is not None:
            with comm.tag("train.grad_norm"):
                norm = clip_grad_norm_(self.model, self.max_grad_norm, self.tp)
            self.last_grad_norm = norm.item()
        self._optimizer_step()
        return (loss_sum / count).item()  # nan when no target counts, as torch's mean

    def _pipeline_step(self, batches) -> float:
        """One step on the pipeline: torch's schedule runs forward and backward of every
        micro-batch (DP gradients synchronised once, in the last backward), then the tied
        embedding's copies are summed, the norm is taken over every rank, and the optimizer
        steps."""
        shapes = {tuple(ids.shape) for ids, _ in batches}
        if len(shapes) > 1:
            raise ValueError(
                f"under pipelining every micro-batch must have one shape (the stages exchange "
                f"fixed-size activations); got {sorted(shapes)}"
            )
        parallel = self.parallel
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        count = (labels[:, 1:] != self.ignore_index).sum().float()
        if parallel.dp > 1:
            with comm.tag("train.loss"):
                count = comm.all_reduce(count, "sum", group=self.dp_group)
        # DDP and FSDP2 average over DP: each replica's loss is its sum over count / dp, so the
        # averaged gradient is that of the mean over every token of every replica.
        denominator = count.clamp_min(1) / parallel.dp
        sums: list[torch.Tensor] = []

        def loss_fn(logits, target):
            loss = self._summed_loss(logits, target)
            sums.append(loss.detach().float())
            return self._scaled(loss / denominator)

        self.optimizer.zero_grad(set_to_none=True)
        with comm.tag("train.compute"), self._autocast(parallel.device):
            logits_dtype = self.autocast_dtype or next(self.model.parameters()).dtype
            self.runner.step(ids, labels, len(batches), loss_fn, logits_dtype)
        self._sum_tied_gradients()
        # the global loss: the last stage's TP rank 0 of each replica holds a sum
        mine = torch.stack(sums).sum() if sums and self.tp.rank == 0 else None
        total = torch.zeros((), device=parallel.device) if mine is None else mine
        with comm.tag("train.loss"):
            total = comm.all_reduce(total, "sum", group=dist.group.WORLD)
        self._unscale()
        if self.max_grad_norm is not None:
            with comm.tag("train.grad_norm"):
                norm = parallel_grad_norm(self.model, parallel, self.data_parallel)
                scale_grads_(self.model, self.max_grad_norm, norm)
            self.last_grad_norm = norm.item()
        self._optimizer_step()
        return (total / count).item()

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """A tied embedding under pipelining has a copy on the first and on the last stage:
        both get the sum of the two gradients (so both copies take the same update)."""
        weights = self.model.tied_weights() if hasattr(self.model, "tied_weights") else []
        grads = [_local(w.grad) for w in weights if w.grad is not None]
        if len(grads) == 2:  # both copies on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        group = self.model.tied_group()
        if group is not None and grads:
            with comm.tag("train.tied"):
                dist.all_reduce(grads[0], group=group)

    def save_checkpoint(self, path: str, async_save: bool = False) -> None:
        """Save everything this run needs to continue to checkpoint ``path`` (every rank calls
        it): model, optimizer state, LR schedule, loss scale, step, data position and every
        rank's random streams, through torch.distributed.checkpoint's safetensors storage.
        Atomic: ``path`` changes from its previous checkpoint to this one in one step.

        ``async_save``: returns once the state is copied to CPU memory; the files are written
        in the background while training goes on, and the checkpoint is published at the first
        :meth:`step` after every rank finished writing (or by :meth:`wait_for_checkpoint`)."""
        self.wait_for_checkpoint()
        self._pending_save = save_training_state(self, path, async_save=async_save)

    def wait_for_checkpoint(self) -> None:
        """Wait for an asynchronous save to be written and publish it (every rank calls it).
        Call it before the program ends, or the last asynchronous save is not published."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish()

    def _publish_finished_save(self) -> None:
        if self._pending_save is not None and self._pending_save.done_everywhere():
            self.wait_for_checkpoint()

    def compression_residuals(self) -> dict[str, torch.Tensor]:
        """This rank's gradient-compression residuals by parameter name (empty without int8 /
        1-bit compression)."""
        states = self.runner.compression_states if self.runner is not None else []
        return {name: r for state in states for name, r in state.state_dict().items()}

    def load_compression_residuals(self, residuals: dict[str, torch.Tensor]) -> None:
        states = self.runner.compression_states if self.runner is not None else []
        for state in states:  # each takes the residuals of the parameters it holds
            mine = state.state_dict().keys()
            state.load_state_dict({k: v for k, v in residuals.items() if k in mine})

    def load_checkpoint(self, path: str) -> dict:
        """Restore the state :meth:`save_checkpoint` saved, at this Trainer's layout, whatever
        (tp, pp, dp) it was saved at (every rank calls it). Returns the checkpoint's manifest
        (``step``, ``layout``, ...). The LR scheduler resumes the saved schedule: with
        :func:`~tp_ext.training.build_lr_scheduler`, its settings too, replacing those it was
        built with (``tp-ext train --resume`` refuses a run that asks for others)."""
        self.wait_for_checkpoint()
        return load_training_state(self, path)

    @contextlib.contextmanager
    def whole_parameters(self):
        """Under FSDP2 each DP rank holds a slice of every parameter between steps, while the
        model's own forward, ``generate`` and ``save_pretrained`` read whole ones: inside this
        block they are gathered (every FSDP2 unit of every stage; an all-gather over DP, so
        every rank enters it) and sharded again after it. Otherwise it changes nothing."""
        from torch.distributed.fsdp import FSDPModule

        modules = self.runner.modules if self.runner is not None else []
        units = [m for stage in modules for m in stage.modules() if isinstance(m, FSDPModule)]
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()

    def _micro_batch_loss(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The micro-batch's summed token loss. tp_ext's models give this rank's vocabulary
        shard of the logits; other models (Hugging Face's, parallelized) give full logits, and
        an MoE model's load-balancing loss (``output_router_logits``) is added as its own loss
        adds it: ``router_aux_loss_coef * aux_loss`` per token."""
        if _takes_local_logits(self.model):
            return self._summed_loss(self.model(ids, local_logits=True), labels)
        out = self.model(ids)
        targets = labels[:, 1:]
        loss = torch.nn.functional.cross_entropy(
            out.logits[:, :-1].flatten(0, 1).float(),
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        aux = getattr(out, "aux_loss", None)
        coef = getattr(getattr(self.model, "config", None), "router_aux_loss_coef", 0.0)
        if aux is not None and coef:
            loss = loss + coef * aux.float() * (targets != self.ignore_index).sum()
        return loss

    @torch.no_grad()
    def _sync_expert_parallel(self, params, loss_sum):
        """Gradients already scaled by the global token count: dense ones (and the loss) summed
        over the DP group, expert ones over the expert-DP group."""
        dense = [p for p in params if id(p) not in self._expert_ids]
        split = [p for p in params if id(p) in self._expert_ids]
        if self.dp_group.size > 1:
            flat = _flat_grads(dense, [loss_sum])
            with comm.tag("train.dp_sync"):
                flat = comm.all_reduce(flat, "sum", group=self.dp_group)
            loss_sum = _set_grads(dense, flat)[0]
        if self.expert_dp_group.size > 1:
            with comm.tag("train.dp_sync"):
                flat = comm.all_reduce(_flat_grads(split, []), "sum", group=self.expert_dp_group)
            _set_grads(split, flat)
        return loss_sum

    def _summed_loss(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the token losses: position t predicts labels[:, t + 1] (Hugging Face style)."""
        if getattr(self.model, "is_2d", False):  # logits blocks of a grid: the model knows them
            return self.model.summed_loss(local_logits, labels, self.ignore_index)
        return vocab_parallel_cross_entropy(
            local_logits[:, :-1],
            labels[:, 1:],
            tp_group=self.tp,
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def _unscale(self) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # the overflow check, agreed over every rank

    def _optimizer_step(self) -> None:
        if self.scaler is None:
            self.optimizer.step()
        else:
            scale = self.scaler.get_scale()
            self.scaler.step(self.optimizer)  # skipped when any rank overflowed
            self.scaler.update()
            if self.scaler.get_scale() < scale:
                self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.steps += 1

    def _check(self, micro_batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if isinstance(micro_batches, torch.Tensor):
            raise ValueError(
                f"micro_batches must be a list of micro-batches, got one tensor of "
                f"shape {tuple(micro_batches.shape)}; pass [input_ids]"
            )
        if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
            raise ValueError(
                f"micro_batches must be a non-empty list of input_ids tensors or "
                f"(input_ids, labels) pairs, got {micro_batches!r}"
            )
        device = next((p.device for p in self.model.parameters()), torch.device("cpu"))
        batches = []
        for i, item in enumerate(micro_batches):
            ids, labels = (
                (item, item.long())
                if isinstance(item, torch.Tensor)
                else (
                    tuple(item)
                    if isinstance(item, (list, tuple)) and len(item) == 2
                    else (None, None)
                )
            )
            if not isinstance(ids, torch.Tensor) or not isinstance(labels, torch.Tensor):
                raise ValueError(
                    f"micro_batches[{i}] must be an input_ids tensor or an "
                    f"(input_ids, labels) pair of tensors, got {type(item).__name__}"
                )
            if ids.dim() != 2 or ids.size(1) < 2 or ids.dtype not in (torch.int32, torch.int64):
                raise ValueError(
                    f"micro_batches[{i}]: input_ids must be an int64/int32 tensor "
                    f"[batch, seq] with seq >= 2, got {ids.dtype} of shape "
                    f"{tuple(ids.shape)}"
                )
            if labels.shape != ids.shape or labels.dtype != torch.int64:
                raise ValueError(
                    f"micro_batches[{i}]: labels must be an int64 tensor of the "
                    f"input_ids' shape {tuple(ids.shape)} (shifted here), got "
                    f"{labels.dtype} of shape {tuple(labels.shape)}"
                )
            batches.append((ids.to(device), labels.to(device)))
        return batches

    def _autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    @torch.no_grad()
    def _sync_data_parallel(self, params, loss_sum, scale, count):
        """One all-reduce of every gradient, the loss sum and the token count: gradients become
        the gradient of the mean over all DP ranks' tokens (weighted by each rank's count)."""
        flat = _flat_grads(params, [loss_sum, count])
        flat[:-2] *= scale.to(flat.dtype)  # back to the gradient of this rank's summed loss
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(flat, "sum", group=self.dp_group)
        total = flat[-1]
        flat[:-2] /= total.clamp_min(1)
        _set_grads(params, flat)
        return flat[-2], total


def _has_expert_parallel_layers(model: nn.Module) -> bool:
    return any(isinstance(m, ExpertParallelMoE) for m in model.modules())


def _flat_grads(params, extras) -> torch.Tensor:
    """Every gradient (zeros where None) and then the 0-d ``extras``, in one flat tensor (fp64
    when a parameter is, else fp32), for one all-reduce."""
    dtype = torch.float64 if any(p.dtype == torch.float64 for p in params) else torch.float32
    pieces = [
        (p.grad if p.grad is not None else torch.zeros_like(p)).flatten().to(dtype) for p in params
    ]
    return torch.cat(pieces + [e.view(1).to(dtype) for e in extras])


def _set_grads(params, flat: torch.Tensor) -> torch.Tensor:
    """The gradients back from a tensor of :func:`_flat_grads`; returns the extras after them."""
    offset = 0
    for p in params:
        grad = flat[offset : offset + p.numel()].view_as(p).to(p.dtype)
        if p.grad is None:
            p.grad = grad
        else:
            p.grad.copy_(grad)
        offset += p.numel()
    return flat[offset:]


def _takes_local_logits(model: nn.Module) -> bool:
    return "local_logits" in inspect.signature(model.forward).parameters


def _scheduler(lr_scheduler, optimizer):
    if lr_scheduler is None:
        return None
    if callable(lr_scheduler) and not hasattr(lr_scheduler, "step"):
        lr_scheduler = lr_scheduler(optimizer)
    if not (hasattr(lr_scheduler, "step") and hasattr(lr_scheduler, "state_dict")):
        raise TypeError(
            f"lr_scheduler must be a torch LR scheduler (or a callable taking the optimizer and "
            f"returning one), got {type(lr_scheduler).__name__}"
        )
    if getattr(lr_scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError(
            "lr_scheduler schedules another optimizer than this Trainer's; pass a callable "
            "(lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, ...)) to build it "
            "over the Trainer's"
        )
    return lr_scheduler


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _loss_scaler(device: torch.device):
    """fp16's dynamic loss scale. torch's ShardedGradScaler all-reduces the overflow flag over
    the default group, so every rank (TP, PP and DP) skips the same steps; plain GradScaler
    checks only its own process's gradients."""
    if dist.is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(device.type)


def _check_float16_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Adam's second moment and eps (1e-8) underflow in float16: the first step divides by
    zero and the weights become NaN. Say so instead."""
    if not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        return
    for group in optimizer.param_groups:
        if any(p.dtype == torch.float16 for p in group["params"]):
            raise ValueError(
                f"{type(optimizer).__name__} over float16 parameters: its eps "
                f"({group.get('eps')}) and squared gradients underflow in float16, so the first "
                "step turns the weights into NaN. Keep the parameters in float32 (or bfloat16) "
                "and pass autocast_dtype=torch.float16 for mixed precision with a loss scale"
            )
