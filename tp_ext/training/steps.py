"""The parts a :class:`~tp_ext.training.Trainer` is composed of: how one step runs for each
parallel form (a :class:`StepStrategy`, chosen once by :func:`build_step`), the loss of a
micro-batch (:func:`choose_loss`) and the precision settings (:class:`Precision`: autocast and
fp16's loss scale).

The Trainer owns what every form shares (checking the micro-batches, the optimizer step, the
LR schedule, checkpoints); a strategy owns the forward and backward of one step, its
data-parallel synchronisation and the gradient norm over its ranks:

- :class:`LocalStep`: the Trainer's own loop over the micro-batches, optionally with a DP group
  (one flat all-reduce per step); a model without ``parallel=`` (plain or 1D tensor parallel);
- :class:`GridStep`: the same loop for a 2D (SUMMA) model, DP from its ``parallel=`` state;
- :class:`ExpertStep`: the same loop for a model with ExpertParallelMoE layers (the loss scaled
  by the global token count; dense gradients summed over DP, expert ones over expert-DP);
- :class:`PipelineStep`: torch's pipeline schedules over the stages, DDP or FSDP2 on DP;
- :class:`ExpertPipelineStep`: the same schedules over stages with ExpertParallelMoE layers
  (dense gradients summed over DP and expert ones over expert-DP after the step).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.dtensors import local_tensor
from tp_ext.layers import (
    ExpertParallelMoE,
    ParallelModule,
    expert_parameters,
    vocab_parallel_cross_entropy,
)
from tp_ext.layers.context import cp_positions
from tp_ext.parallelize.stages import StagedCausalLM, single_stage
from tp_ext.pipeline import DATA_PARALLEL, SCHEDULES, PipelineRunner, check_schedule
from tp_ext.pipeline.data_parallel import replicate_stages
from tp_ext.pipeline.schedules import prepare_stages
from tp_ext.training.grad_norm import (
    clip_grad_norm_,
    model_tp_group,
    parallel_grad_norm,
    scale_grads_,
)
from tp_ext.training.zero import ZERO_STAGES

__all__ = [
    "Precision",
    "StepStrategy",
    "LocalStep",
    "GridStep",
    "ExpertStep",
    "PipelineStep",
    "ExpertPipelineStep",
    "build_step",
    "choose_loss",
]

Batches = list[tuple[torch.Tensor, torch.Tensor]]


# ---- precision ----------------------------------------------------------------------------------


class Precision:
    """Autocast to ``autocast_dtype`` (None: none) and, for float16, a dynamic loss scale whose
    overflow check is agreed over every rank (so every rank skips the same steps)."""

    def __init__(self, autocast_dtype: Optional[torch.dtype], model: nn.Module) -> None:
        self.autocast_dtype = autocast_dtype
        self.scaler = None
        if autocast_dtype == torch.float16:
            device = next(model.parameters()).device
            self.scaler = _loss_scaler(device)
            # the scale is made on first use; ranks without the loss (earlier pipeline stages)
            # never scale one, yet take part in the agreed overflow check
            self.scaler.scale(torch.zeros((), device=device))

    def autocast(self, device: torch.device):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast_dtype)

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale(self, optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)  # the overflow check, agreed over every rank

    def step(self, optimizer) -> bool:
        """``optimizer.step()`` (skipped when any rank overflowed); returns whether skipped."""
        if self.scaler is None:
            optimizer.step()
            return False
        scale = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() < scale


def _loss_scaler(device: torch.device):
    """fp16's dynamic loss scale. torch's ShardedGradScaler all-reduces the overflow flag over
    the default group, so every rank (TP, PP and DP) skips the same steps; plain GradScaler
    checks only its own process's gradients."""
    if dist.is_initialized():
        from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

        return ShardedGradScaler(device=device.type, process_group=dist.group.WORLD)
    return torch.amp.GradScaler(device.type)


# ---- the loss -----------------------------------------------------------------------------------


class VocabParallelLoss:
    """A tp_ext causal LM's loss: ``model(ids, local_logits=True)`` gives this rank's vocabulary
    shard of the logits; position t predicts ``labels[:, t + 1]`` (Hugging Face style)."""

    def __init__(self, tp_group, ignore_index: int) -> None:
        self.tp, self.ignore_index = tp_group, ignore_index

    def summed(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of the token losses (also the pipeline's last stage's loss)."""
        return vocab_parallel_cross_entropy(
            local_logits[:, :-1],
            labels[:, 1:],
            tp_group=self.tp,
            ignore_index=self.ignore_index,
            reduction="sum",
        )

    def __call__(self, model, ids, labels) -> torch.Tensor:
        return self.summed(model(ids, local_logits=True), labels)


class GridLoss:
    """A 2D model's loss from its logits blocks (the model's ``summed_loss``)."""

    def __init__(self, ignore_index: int) -> None:
        self.ignore_index = ignore_index

    def __call__(self, model, ids, labels) -> torch.Tensor:
        return model.summed_loss(model(ids, local_logits=True), labels, self.ignore_index)


class FullLogitsLoss:
    """Full logits (a Hugging Face model, parallelized); an MoE model's load-balancing loss
    (``output_router_logits``) is added as its own loss adds it: ``router_aux_loss_coef *
    aux_loss`` per token."""

    def __init__(self, ignore_index: int) -> None:
        self.ignore_index = ignore_index

    def __call__(self, model, ids, labels) -> torch.Tensor:
        out = model(ids)
        targets = labels[:, 1:]
        logits = out.logits[:, :-1].flatten(0, 1)
        loss = torch.nn.functional.cross_entropy(
            logits.to(torch.promote_types(logits.dtype, torch.float32)),  # fp64 stays fp64
            targets.flatten(),
            ignore_index=self.ignore_index,
            reduction="sum",
        )
        aux = getattr(out, "aux_loss", None)
        coef = getattr(getattr(model, "config", None), "router_aux_loss_coef", 0.0)
        if aux is not None and coef:
            loss = loss + coef * aux.float() * (targets != self.ignore_index).sum()
        return loss


class ContextParallelLoss(VocabParallelLoss):
    """Under context parallelism: the model gives the logits of this CP rank's positions
    (:func:`tp_ext.cp_positions` order), each scored against the next token of the whole
    sequence (the last position has none). ``logits``: how to get them (``model, ids ->
    logits``): split by vocabulary (the native model's ``local_logits``, or the one stage of a
    converted Hugging Face model), or over the whole vocabulary with ``whole_vocab`` (a
    converted Hugging Face model with expert parallelism, which runs as it is)."""

    def __init__(self, tp_group, cp_group, ignore_index: int, logits, whole_vocab=False) -> None:
        super().__init__(tp_group, ignore_index)
        self.cp, self.logits, self.whole_vocab = cp_group, logits, whole_vocab

    def __call__(self, model, ids, labels) -> torch.Tensor:
        return self.summed(self.logits(model, ids), labels)

    def summed(self, local_logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Sum of this rank's token losses (also the pipeline's last stage's loss):
        ``local_logits`` at this rank's positions, ``labels`` of the whole sequence."""
        order = cp_positions(labels.size(1), group=self.cp).to(labels.device)
        none = labels.new_full((labels.size(0), 1), self.ignore_index)
        targets = torch.cat([labels[:, 1:], none], 1)[:, order]
        if self.whole_vocab:  # a Hugging Face model's own head gathered the vocabulary
            logits = local_logits.flatten(0, 1)
            return torch.nn.functional.cross_entropy(
                logits.to(torch.promote_types(logits.dtype, torch.float32)),
                targets.flatten(),
                ignore_index=self.ignore_index,
                reduction="sum",
            )
        return vocab_parallel_cross_entropy(
            local_logits, targets, tp_group=self.tp, ignore_index=self.ignore_index, reduction="sum"
        )


def choose_loss(model: nn.Module, tp_group, ignore_index: int, is_2d: bool = False):
    """The micro-batch loss for ``model`` (a callable ``loss(model, ids, labels)``, the summed
    token loss)."""
    if is_2d:
        return GridLoss(ignore_index)
    if "local_logits" in inspect.signature(model.forward).parameters:
        return VocabParallelLoss(tp_group, ignore_index)
    return FullLogitsLoss(ignore_index)


# ---- the strategies -----------------------------------------------------------------------------


class StepStrategy:
    """One parallel form's step: :meth:`forward_backward` leaves the step's gradients on the
    parameters (synchronised over data parallelism) and returns the mean loss; :meth:`clip`
    takes the gradient norm over every rank that holds a part of the model and clips to it."""

    form = ""
    runner: Optional[PipelineRunner] = None
    expert_dp_group = None
    gradient_compression: Optional[str] = None

    def __init__(self, model, loss, tp, dp_group, data_parallel: Optional[str]) -> None:
        self.model, self.loss = model, loss
        self.tp, self.dp_group, self.data_parallel = tp, dp_group, data_parallel

    @property
    def compression_states(self) -> list:
        return []

    @property
    def schedule_name(self) -> Optional[str]:
        """The pipeline schedule the step runs (None without a pipeline)."""
        return None

    @property
    def stage_modules(self) -> list:
        """The modules the step runs (FSDP2 units among them are gathered by
        ``Trainer.whole_parameters``)."""
        return []

    def forward_backward(self, batches: Batches, precision: Precision) -> torch.Tensor:
        raise NotImplementedError

    def clip(self, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(self.model, max_norm, self.tp)


class LocalStep(StepStrategy):
    """The Trainer's own loop: each micro-batch's summed loss scaled by the local token count
    (known before any forward, so no host sync), backward, then one DP synchronisation.

    Under ZeRO-2 (``gradient_reducer``, the sharded optimizer, set by the Trainer) every loss is
    scaled by the global token count instead, the gradients' sums are reduce-scattered (buckets
    sent during the backward), each rank keeps its rows, and the norm is taken over every rank
    (``parallel``)."""

    form = "local"
    gradient_reducer = None
    parallel = None

    def forward_backward(self, batches: Batches, precision: Precision) -> torch.Tensor:
        params = [p for p in self.model.parameters() if p.requires_grad]
        ignore = self.loss.ignore_index
        count = torch.stack([(labels[:, 1:] != ignore).sum() for _, labels in batches]).sum()
        count = self._global_count(count)
        scale = count.clamp_min(1).float()
        count = count.float()
        if self.gradient_reducer is not None:  # sums of shares of the global mean
            self.gradient_reducer.expect_backward(len(batches), divide_by=1.0)
        loss_sum = torch.zeros((), device=batches[0][0].device)
        with comm.tag("train.compute"):
            for ids, labels in batches:
                with precision.autocast(ids.device):
                    loss = self.loss(self.model, ids, labels)
                precision.scaled(loss / scale).backward()
                loss_sum += loss.detach().float()
        loss_sum, count = self._synchronise(params, loss_sum, scale, count)
        return loss_sum / count  # nan when no target counts, as torch's mean

    def _global_count(self, count: torch.Tensor) -> torch.Tensor:
        if self.gradient_reducer is None:
            return count
        # ZeRO-2 reduce-scatters sums: every loss is scaled by the global count first
        with comm.tag("train.dp_sync"):
            return comm.all_reduce(self._counted(count.float()), "sum", group=self._sync_group)

    def _counted(self, count: torch.Tensor) -> torch.Tensor:
        """This rank's term of the token count summed over the synchronising group."""
        return count

    def clip(self, max_norm: float) -> torch.Tensor:
        if self.gradient_reducer is None:  # whole gradients, equal on every replica
            return super().clip(max_norm)
        norm = parallel_grad_norm(self.model, self.parallel, self.data_parallel)
        scale_grads_(self.model, max_norm, norm)
        return norm

    @property
    def _sync_group(self):
        """The ranks whose gradients one all-reduce combines (the DP group)."""
        return self.dp_group

    @torch.no_grad()
    def _synchronise(self, params, loss_sum, scale, count):
        """One all-reduce of every gradient, the loss sum and the token count: gradients become
        the gradient of the mean over all DP ranks' tokens (weighted by each rank's count).
        ZeRO-2: the reduce-scatters received, each rank keeping its rows; the loss summed."""
        group = self._sync_group
        if self.gradient_reducer is not None:
            self.gradient_reducer.reduce_gradients(divide_by=1.0)
            with comm.tag("train.loss"):
                return comm.all_reduce(loss_sum, "sum", group=group), count
        if group is None or group.size == 1:
            return loss_sum, count
        flat = _flat_grads(params, [loss_sum, self._counted(count)])
        flat[:-2] *= scale.to(flat.dtype)  # back to the gradient of this rank's summed loss
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(flat, "sum", group=group)
        total = flat[-1]
        flat[:-2] /= total.clamp_min(1)
        _set_grads(params, flat)
        return flat[-2], total


class GridStep(LocalStep):
    """A 2D (SUMMA) model: the local loop, its loss from the logits blocks, DP gradients
    all-reduced once per step over the DP group (DDP, ZeRO-1), the norm over the grid; ZeRO-2
    as :class:`LocalStep` (each rank left with its rows of every grid block)."""

    form = "2d"

    def __init__(self, model, loss, tp, dp_group, data_parallel, parallel) -> None:
        super().__init__(model, loss, tp, dp_group, data_parallel)
        self.parallel = parallel


class ExpertStep(LocalStep):
    """A model with ExpertParallelMoE layers: the loss is scaled by the global token count (one
    all-reduce before the forwards), so each rank's gradients are its share of the global mean;
    dense gradients are then summed over the DP group and expert gradients over the expert-DP
    group (the ranks holding the same experts: the dispatch's backward already summed over the
    EP group's tokens)."""

    form = "expert"

    def __init__(
        self, model, loss, tp, dp_group, data_parallel, expert_dp_group, parallel=None
    ) -> None:
        super().__init__(model, loss, tp, dp_group, data_parallel)
        self.expert_dp_group, self.parallel = expert_dp_group, parallel
        self._expert_ids = {id(p) for p in expert_parameters(model)[0]}

    def _global_count(self, count: torch.Tensor) -> torch.Tensor:
        if self.dp_group.size == 1:
            return count
        # experts see other ranks' tokens: every rank scales by the global count
        with comm.tag("train.dp_sync"):
            return comm.all_reduce(count.float(), "sum", group=self.dp_group)

    @torch.no_grad()
    def _synchronise(self, params, loss_sum, scale, count):
        """Gradients already scaled by the global token count: dense ones (and the loss) summed
        over the DP group, expert ones over the expert-DP group (ZeRO-2: reduce-scattered, each
        rank keeping its rows)."""
        if self.gradient_reducer is not None:  # experts' rows over expert-DP: the optimizer's
            return super()._synchronise(params, loss_sum, scale, count)
        loss_sum = _sum_dense_and_expert_grads(
            params, self._expert_ids, self.dp_group, self.expert_dp_group, [loss_sum]
        )[0]
        return loss_sum, count


class PipelineStep(StepStrategy):
    """One step on the pipeline: torch's schedule runs forward and backward of every
    micro-batch (DP gradients synchronised once, in the last backward), then the tied
    embedding's copies are summed, and the norm is taken over every rank."""

    form = "pipeline"

    def __init__(self, model, loss, parallel, runner, data_parallel, compression) -> None:
        tp, dp = comm.resolve_group(parallel.tp_group), comm.resolve_group(parallel.dp_group)
        super().__init__(model, loss, tp, dp, data_parallel)
        self.parallel, self.runner = parallel, runner
        self.gradient_compression = compression

    @property
    def compression_states(self) -> list:
        return self.runner.compression_states

    @property
    def schedule_name(self) -> Optional[str]:
        return self.runner.schedule.name

    @property
    def stage_modules(self) -> list:
        return self.runner.modules

    def forward_backward(self, batches: Batches, precision: Precision) -> torch.Tensor:
        shapes = {tuple(ids.shape) for ids, _ in batches}
        if len(shapes) > 1:
            raise ValueError(
                f"under pipelining every micro-batch must have one shape (the stages exchange "
                f"fixed-size activations); got {sorted(shapes)}"
            )
        parallel = self.parallel
        ids = torch.cat([b[0] for b in batches])
        labels = torch.cat([b[1] for b in batches])
        count = (labels[:, 1:] != self.loss.ignore_index).sum().float()
        if parallel.dp > 1:
            with comm.tag("train.loss"):
                count = comm.all_reduce(count, "sum", group=self.dp_group)
        denominator = self._loss_denominator(count)
        sums: list[torch.Tensor] = []

        def loss_fn(logits, target):
            loss = self.loss.summed(logits, target)
            sums.append(loss.detach().float())
            return precision.scaled(loss / denominator)

        if self.gradient_reducer is not None:  # (set only when there are replicas)
            # ZeRO-2 sends each bucket as the last micro-batch's backward finishes it
            self.gradient_reducer.expect_backward(len(batches), divide_by=self._zero_divisor())
        with comm.tag("train.compute"), precision.autocast(parallel.device):
            logits_dtype = precision.autocast_dtype or next(self.model.parameters()).dtype
            self.runner.step(ids, labels, len(batches), loss_fn, logits_dtype)
        self._synchronise_after_schedule()
        self._sum_tied_gradients()
        # the global loss: the last stage's TP rank 0 of each replica holds a sum
        mine = torch.stack(sums).sum() if sums and self.tp.rank == 0 else None
        total = torch.zeros((), device=parallel.device) if mine is None else mine
        with comm.tag("train.loss"):
            total = comm.all_reduce(total, "sum", group=dist.group.WORLD)
        return total / count

    def _loss_denominator(self, count: torch.Tensor) -> torch.Tensor:
        """What each micro-batch's summed loss is divided by. DDP and FSDP2 average over DP:
        each replica's loss is its sum over count / dp, so the averaged gradient is that of the
        mean over every token of every replica."""
        return count.clamp_min(1) / self.parallel.dp

    # ZeRO-2: the sharded optimizer, which reduce-scatters the gradients (set by the Trainer)
    gradient_reducer = None

    def _synchronise_after_schedule(self) -> None:
        """DP synchronisation left after the schedule's step (DDP and FSDP2 did it in the last
        backward; ZeRO-2 receives its buckets' reduce-scatters here, averaging over DP as they
        do)."""
        if self.gradient_reducer is not None:
            self.gradient_reducer.reduce_gradients(divide_by=self._zero_divisor())

    def _zero_divisor(self) -> float:
        """What ZeRO-2's summed gradients are divided by: DP's average, as DDP's."""
        return float(self.parallel.dp)

    def clip(self, max_norm: float) -> torch.Tensor:
        norm = parallel_grad_norm(self.model, self.parallel, self.data_parallel)
        scale_grads_(self.model, max_norm, norm)
        return norm

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """A tied embedding under pipelining has a copy on the first and on the last stage:
        both get the sum of the two gradients (so both copies take the same update)."""
        weights = self.model.tied_weights() if hasattr(self.model, "tied_weights") else []
        grads = [local_tensor(w.grad) for w in weights if w.grad is not None]
        if len(grads) == 2:  # both copies on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        group = self.model.tied_group()
        if group is not None and grads:
            with comm.tag("train.tied"):
                dist.all_reduce(grads[0], group=group)


class ExpertPipelineStep(PipelineStep):
    """Pipeline stages holding ExpertParallelMoE layers. Their expert gradients are summed over
    the expert-DP group, not averaged over DP, which DDP (one group for every parameter) cannot
    do: the stages run unwrapped, each micro-batch's loss is divided by the global token count
    (so every rank's gradients are its share of the global mean, as in :class:`ExpertStep`),
    and after the schedule's step one all-reduce sums the dense gradients over DP and one the
    expert gradients over expert-DP."""

    def __init__(self, model, loss, parallel, runner, expert_dp_group, data_parallel) -> None:
        if data_parallel is None and parallel.dp > 1:
            data_parallel = "ddp"  # replicas, as DDP keeps them
        super().__init__(model, loss, parallel, runner, data_parallel, None)
        self.expert_dp_group = expert_dp_group
        self._expert_ids = {id(p) for p in expert_parameters(model)[0]}

    def _loss_denominator(self, count: torch.Tensor) -> torch.Tensor:
        return count.clamp_min(1)

    def _zero_divisor(self) -> float:
        return 1.0  # every rank's gradients are its share of the global mean: sums

    def _synchronise_after_schedule(self) -> None:
        if self.gradient_reducer is not None:  # ZeRO-2
            self.gradient_reducer.reduce_gradients(divide_by=1.0)
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        _sum_dense_and_expert_grads(
            params, self._expert_ids, self.dp_group, self.expert_dp_group, []
        )


class ContextPipelineStep(PipelineStep):
    """Context parallelism inside pipeline stages: each CP rank's last stage scores its
    positions; the stages run unwrapped, each micro-batch's loss divided by the global token
    count, and after the schedule one all-reduce over DP x CP sums the gradients (the CP ranks'
    shares and the replicas')."""

    form = "context_pipeline"

    def __init__(self, model, loss, parallel, runner, data_parallel=None) -> None:
        super().__init__(model, loss, parallel, runner, data_parallel, None)
        self.dp_cp_group = comm.resolve_group(parallel.dp_cp_group)

    def _loss_denominator(self, count: torch.Tensor) -> torch.Tensor:
        return count.clamp_min(1)

    def _zero_divisor(self) -> float:
        return 1.0  # each rank's gradients are its share of the global mean: sums

    @torch.no_grad()
    def _synchronise_after_schedule(self) -> None:
        if self.gradient_reducer is not None:  # ZeRO-2: rows over DP x CP
            self.gradient_reducer.reduce_gradients(divide_by=1.0)
            return
        params = [p for p in self.model.parameters() if p.requires_grad]
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(_flat_grads(params, []), "sum", group=self.dp_cp_group)
        _set_grads(params, flat)


class ContextExpertStep(ExpertStep):
    """Context parallelism with ExpertParallelMoE layers: each CP position has its own EP
    groups (its tokens are its positions); the loss is scaled by the global token count, dense
    gradients are summed over DP x CP and expert gradients over the expert-DP group, which spans
    the CP positions."""

    form = "context_expert"

    def __init__(self, model, loss, tp, dp_group, expert_dp_group, dp_cp_group) -> None:
        super().__init__(model, loss, tp, dp_group, None, expert_dp_group)
        self.dp_cp_group = dp_cp_group

    @torch.no_grad()
    def _synchronise(self, params, loss_sum, scale, count):
        loss_sum = _sum_dense_and_expert_grads(
            params, self._expert_ids, self.dp_cp_group, self.expert_dp_group, [loss_sum]
        )[0]
        return loss_sum, count


class ContextStep(LocalStep):
    """Context parallelism: every CP rank runs the whole micro-batches on its positions (ring
    attention inside the model); its summed loss is its positions' share. One all-reduce over
    the DP x CP ranks then sums the gradients over CP and averages them over DP by the token
    count (every CP rank of a replica knows the whole count: only the first adds it)."""

    form = "context"

    def __init__(
        self,
        model,
        loss,
        tp,
        dp_group,
        dp_cp_group,
        cp_rank: int,
        data_parallel=None,
        parallel=None,
    ) -> None:
        # dp_group: the data's replicas (each its own batches; the CP ranks of one share them)
        if data_parallel is None and dp_group.size > 1:
            data_parallel = "ddp"
        super().__init__(model, loss, tp, dp_group, data_parallel)
        self.dp_cp_group, self.cp_rank, self.parallel = dp_cp_group, cp_rank, parallel

    def _counted(self, count: torch.Tensor) -> torch.Tensor:
        return count if self.cp_rank == 0 else torch.zeros_like(count)

    @property
    def _sync_group(self):
        return self.dp_cp_group


# ---- the factory --------------------------------------------------------------------------------


def build_step(
    model: nn.Module,
    parallel,
    *,
    schedule: str = "1F1B",
    data_parallel: Optional[str] = "ddp",
    dp_group=None,
    tp_group=None,
    compression: Optional[str] = None,
    ignore_index: int = -100,
    grad_reduce_dtype: Optional[torch.dtype] = None,
) -> StepStrategy:
    """The step strategy for ``model``: chosen once, from ``parallel`` (None: the local loop)
    and what the model is (2D, or with ExpertParallelMoE layers). Refuses, naming the argument,
    a combination the form cannot run."""
    experts = parallel is not None and (
        getattr(parallel, "ep", 1) > 1
        or any(isinstance(m, ExpertParallelMoE) for m in model.modules())
    )
    if grad_reduce_dtype is not None and (
        parallel is None
        or getattr(parallel, "cp", 1) > 1
        or experts
        or getattr(model, "is_2d", False)
    ):
        raise ValueError(
            f"grad_reduce_dtype={grad_reduce_dtype} applies to the DP gradient sum of DDP, ZeRO-1 "
            "and ZeRO-2 over a dense model's stages (Trainer(parallel=...)); not yet with "
            "expert or context parallelism, a 2D grid, or without parallel="
        )
    if parallel is None:
        if compression is not None:
            raise ValueError(
                f"gradient_compression={compression!r} needs Trainer(parallel=...): the "
                "DP hooks go on the DDP modules of its layout"
            )
        tp = model_tp_group(model, tp_group)
        dp = None if dp_group is None else comm.resolve_group(dp_group)
        return LocalStep(model, choose_loss(model, tp, ignore_index), tp, dp, None)
    if getattr(parallel, "cp", 1) > 1:
        return _context_step(
            model, parallel, schedule, data_parallel, dp_group, tp_group, compression, ignore_index
        )
    experts = any(isinstance(m, ExpertParallelMoE) for m in model.modules())
    if experts and parallel.pp == 1:
        return _expert_step(
            model, parallel, data_parallel, dp_group, tp_group, compression, ignore_index
        )
    _check_built_with(model, parallel, dp_group, tp_group)
    if getattr(model, "is_2d", False):
        return _grid_step(model, parallel, data_parallel, compression, ignore_index)
    # from the layout, not this rank's stages: a stage of dense layers in an MoE model must
    # scale and synchronise its gradients as the stages with experts do
    experts = experts or getattr(parallel, "ep", 1) > 1
    return _pipeline_step(
        model, parallel, schedule, data_parallel, compression, ignore_index, experts,
        grad_reduce_dtype,
    )  # fmt: skip


def trainable_model(model: nn.Module, parallel) -> nn.Module:
    """What the Trainer trains for ``model``: a Hugging Face causal LM that
    ``parallelize(model, "auto", parallel=state)`` converted at pp = 1 becomes its one pipeline
    stage (:func:`~tp_ext.parallelize.stages.single_stage`), so DDP or FSDP2, recompute,
    compression and resharding checkpoints apply as at pp > 1; anything else is itself."""
    plain_hf = (
        parallel is not None
        and parallel.pp == 1
        and getattr(model, "parallel", None) is None
        and not hasattr(model, "stage_split")
        and hasattr(model, "base_model_prefix")
        and hasattr(model, "get_output_embeddings")
        and not any(isinstance(m, ExpertParallelMoE) for m in model.modules())
    )
    if not plain_hf:
        return model
    if parallel.tp > 1 and not any(isinstance(m, ParallelModule) for m in model.modules()):
        raise ValueError(
            f"Trainer(parallel=...) with tp={parallel.tp}: {type(model).__name__} holds no "
            "tp_ext layers; convert it first with tp_ext.parallelize(model, 'auto', "
            "parallel=state)"
        )
    if getattr(model.config, "output_router_logits", False):
        raise ValueError(
            f"Trainer(parallel=...) trains {type(model).__name__} as a pipeline stage, whose "
            "loss is the tokens' alone: its router loss (config.output_router_logits=True) "
            "would be dropped. Set output_router_logits=False, or train it with "
            "Trainer(model, dp_group=state.dp_group) (full logits and the router loss)"
        )
    return single_stage(model, parallel)


def _check_built_with(model, parallel, dp_group, tp_group) -> None:
    built_with = getattr(model, "parallel", None)
    if built_with is not parallel:
        how = "without parallel=" if built_with is None else "with another layout"
        raise ValueError(
            f"parallel= needs the model built with the same layout: "
            f"{type(model).__name__}(config, parallel=state); this one was built {how}"
        )
    _check_no_groups(dp_group, tp_group)


def _check_no_groups(dp_group, tp_group) -> None:
    if dp_group is not None or tp_group is not None:
        raise ValueError(
            "with parallel=, the TP and DP groups are the layout's; drop dp_group= / tp_group="
        )


def _grid_step(model, parallel, data_parallel, compression, ignore_index) -> GridStep:
    if compression is not None and parallel.dp > 1:
        raise ValueError(
            f"gradient_compression={compression!r} with a 2D model: its DP all-reduce is "
            "tp_ext's own, not a DDP hook's; use 1D tensor parallelism to compress"
        )
    supported = (None, "ddp", *ZERO_STAGES)
    if data_parallel not in supported:
        raise ValueError(
            f"data_parallel={data_parallel!r} with a 2D model: its DP replicas synchronise by "
            "tp_ext's own gradient all-reduce (ddp, zero1) or ZeRO-2's reduce-scatter (FSDP2 "
            f"does not shard 2D blocks yet); use one of {list(supported[1:])} (or None at dp=1)"
        )
    tp, dp = comm.resolve_group(parallel.tp_group), comm.resolve_group(parallel.dp_group)
    loss = choose_loss(model, tp, ignore_index, is_2d=True)
    if parallel.dp == 1:
        data_parallel = None
    elif data_parallel is None:
        data_parallel = "ddp"  # replicas kept equal by the all-reduce, as DDP keeps them
    return GridStep(model, loss, tp, dp, data_parallel, parallel)


def _expert_step(
    model, parallel, data_parallel, dp_group, tp_group, compression, ignore_index
) -> ExpertStep:
    _check_no_groups(dp_group, tp_group)
    _check_expert_data_parallel(data_parallel, compression)
    tp, dp = comm.resolve_group(parallel.tp_group), comm.resolve_group(parallel.dp_group)
    expert_dp = comm.resolve_group(parallel.expert_dp_group)
    loss = choose_loss(model, tp, ignore_index)
    if parallel.dp == 1:
        data_parallel = None
    elif data_parallel is None:
        data_parallel = "ddp"  # replicas kept equal by the all-reduce, as DDP keeps them
    return ExpertStep(model, loss, tp, dp, data_parallel, expert_dp, parallel)


def _context_step(
    model, parallel, schedule, data_parallel, dp_group, tp_group, compression, ignore_index
) -> StepStrategy:
    # from the layout, not this rank's modules (a stage may hold only dense layers)
    experts = parallel.ep > 1 or any(isinstance(m, ExpertParallelMoE) for m in model.modules())
    if experts:  # a converted Hugging Face model, trained as it is (as without cp)
        _check_no_groups(dp_group, tp_group)
    else:
        _check_built_with(model, parallel, dp_group, tp_group)
    if getattr(model, "cp_group", None) is None:
        raise ValueError(
            f"Trainer(parallel=...) with cp={parallel.cp}: {type(model).__name__} does not run "
            "context parallelism; build tp_ext's Qwen2ForCausalLM(config, parallel=state), or "
            "convert a Hugging Face model with tp_ext.parallelize(model, 'auto', parallel=state)"
        )
    supported = (None, "ddp", *ZERO_STAGES)
    if data_parallel not in supported or compression is not None:
        raise ValueError(
            f"data_parallel={data_parallel!r}, gradient_compression={compression!r} with "
            f"cp={parallel.cp}: its gradients are summed over CP and DP by one all-reduce (or "
            f"ZeRO-2's reduce-scatter); use data_parallel in {list(supported[1:])} (or None) "
            "and no compression"
        )
    if experts and data_parallel in ZERO_STAGES:
        raise ValueError(
            f"data_parallel={data_parallel!r} with cp={parallel.cp} and expert parallelism is "
            "not supported yet: use data_parallel='ddp' (ZeRO runs with either alone)"
        )
    tp = comm.resolve_group(parallel.tp_group)
    cp = comm.resolve_group(parallel.cp_group)
    dp, dp_cp = comm.resolve_group(parallel.dp_group), comm.resolve_group(parallel.dp_cp_group)
    if experts:
        if parallel.pp > 1:
            raise ValueError(
                f"Trainer(parallel=...): cp={parallel.cp} with expert parallelism and "
                f"pp={parallel.pp} is not supported yet; use pp=1 with both"
            )
        loss = ContextParallelLoss(tp, cp, ignore_index, _whole_logits, whole_vocab=True)
        expert_dp = comm.resolve_group(parallel.expert_dp_group)
        return ContextExpertStep(model, loss, tp, dp, expert_dp, dp_cp)
    if parallel.pp > 1:
        loss = ContextParallelLoss(tp, cp, ignore_index, None)  # on the last stage's logits
        runner = PipelineRunner(model, schedule, stages=replicate_stages(model, None))
        zero = data_parallel if data_parallel in ZERO_STAGES else None
        return ContextPipelineStep(model, loss, parallel, runner, zero)
    if isinstance(model, StagedCausalLM):  # a Hugging Face model's one stage (trainable_model)
        logits = _stage_logits
    else:
        logits = _local_logits
    loss = ContextParallelLoss(tp, cp, ignore_index, logits)
    return ContextStep(model, loss, tp, dp, dp_cp, cp.rank, data_parallel, parallel)


def _stage_logits(model, ids):
    return model.stage_forward(0, ids)


def _local_logits(model, ids):
    return model(ids, local_logits=True)


def _whole_logits(model, ids):
    return model(ids).logits


def _check_expert_data_parallel(data_parallel, compression) -> None:
    supported = (None, "ddp", *ZERO_STAGES)
    if data_parallel not in supported or compression is not None:
        raise ValueError(
            f"data_parallel={data_parallel!r}, gradient_compression={compression!r} with "
            "expert parallelism: its gradients are summed per group (dense over DP, experts "
            "over expert-DP) by tp_ext's all-reduce or ZeRO-2's reduce-scatter; use "
            f"data_parallel in {list(supported[1:])} (or None) and no compression"
        )


def _pipeline_step(
    model,
    parallel,
    schedule,
    data_parallel,
    compression,
    ignore_index,
    experts=False,
    grad_reduce_dtype=None,
):
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {schedule!r}")
    if data_parallel is not None and data_parallel not in DATA_PARALLEL + tuple(ZERO_STAGES):
        raise ValueError(
            f"data_parallel must be one of {DATA_PARALLEL + tuple(ZERO_STAGES)}, got "
            f"{data_parallel!r}"
        )
    if data_parallel is None and parallel.dp > 1:
        raise ValueError(
            f"data_parallel=None with dp={parallel.dp}: the replicas would drift apart; "
            f"use one of {DATA_PARALLEL}"
        )
    data_parallel = data_parallel if parallel.dp > 1 else None
    checked = check_schedule(schedule, model.stage_split)
    loss = VocabParallelLoss(comm.resolve_group(parallel.tp_group), ignore_index)
    zero = ZERO_STAGES.get(data_parallel)
    if zero is not None and compression is not None:
        raise ValueError(
            f"data_parallel={data_parallel!r} with gradient_compression={compression!r} is "
            "not supported yet: use data_parallel='ddp'"
        )
    if experts:  # unwrapped stages; the step sums dense and expert gradients itself
        _check_expert_data_parallel(data_parallel, compression)
        runner = PipelineRunner(model, schedule, stages=replicate_stages(model, None))
        expert_dp = comm.resolve_group(parallel.expert_dp_group)
        return ExpertPipelineStep(model, loss, parallel, runner, expert_dp, data_parallel)
    # the data-parallel side wraps the stages and installs the compression hooks; ZeRO-1's
    # gradients are all-reduced as DDP's, ZeRO-2's reduce-scattered after the schedule
    engine = {1: "ddp", 2: None}.get(zero, data_parallel)
    stages = prepare_stages(model, checked, engine, compression, grad_reduce_dtype)
    runner = PipelineRunner(model, schedule, stages=stages)
    compression = compression if parallel.dp > 1 else None
    return PipelineStep(model, loss, parallel, runner, data_parallel, compression)


# ---- flat gradients -----------------------------------------------------------------------------


@torch.no_grad()
def _sum_dense_and_expert_grads(params, expert_ids, dp_group, expert_dp_group, extras) -> list:
    """Sum the gradients of ``params`` over their replicas: dense ones (with the 0-d
    ``extras``) over ``dp_group``, those whose id is in ``expert_ids`` over ``expert_dp_group``
    (the ranks holding the same experts). One all-reduce per group; returns the summed extras."""
    dense = [p for p in params if id(p) not in expert_ids]
    experts = [p for p in params if id(p) in expert_ids]
    if dp_group.size > 1:
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(_flat_grads(dense, extras), "sum", group=dp_group)
        extras = list(_set_grads(dense, flat))
    if experts and expert_dp_group.size > 1:  # (every rank of the group holds the same layers)
        with comm.tag("train.dp_sync"):
            flat = comm.all_reduce(_flat_grads(experts, []), "sum", group=expert_dp_group)
        _set_grads(experts, flat)
    return extras


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
