"""The training core: one step is a runner x a gradient sync x the model's loss kind, chosen
once, by two tables, from the job's :class:`~tp_ext.ParallelDims` and the model's declared
contract (:class:`~tp_ext.contract.ParallelModel`).

- :data:`RUNNERS` (``dims.pp_enabled``): the local loop over the micro-batches, or torch's
  pipeline schedule over the stages (:mod:`tp_ext.training.runners`);
- :data:`~tp_ext.pipeline.data_parallel.SYNCS` (``data_parallel`` x whether the model has
  experts): what wraps the stage modules (DDP, FSDP2, nothing), which
  :mod:`~tp_ext.training.sync` finishes the gradients, and the optimizer's ZeRO stage (one
  table, which the planner reads too);
- the loss kind is the model's own (:mod:`tp_ext.training.losses`).

No class stands for one parallel form: TP (1D or a 2D grid), sequence and context
parallelism live inside the model and its stages; pipelining is the runner; DP, CP replicas
and experts are the sync's groups. A new combination is a row of :data:`SYNCS` and a test.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed import comm
from tp_ext.distributed.dtensors import local_tensor
from tp_ext.layers import expert_parameters
from tp_ext.pipeline import SCHEDULES, check_schedule
from tp_ext.pipeline.data_parallel import Replicas, SyncRow, choose_sync
from tp_ext.pipeline.schedules import prepare_stages
from tp_ext.training.grad_norm import clip_grad_norm_, parallel_grad_norm, scale_grads_
from tp_ext.training.losses import BatchLoss, Loss, router_loss_of
from tp_ext.training.micro_batches import MicroBatch
from tp_ext.training.runners import LocalRunner, PipelinedRunner
from tp_ext.training.sync import EngineSync, GradientSync, ReduceScatterSync, ReplicaSums
from tp_ext.training.zero import sharded_optimizer_for

__all__ = ["RUNNERS", "TrainingCore", "assemble", "assemble_plain"]

# dims.pp_enabled -> the runner
RUNNERS = {False: LocalRunner, True: PipelinedRunner}


class TrainingCore:
    """One step's forward and backward (:meth:`forward_backward`) and its gradient norm
    (:meth:`clip`), from its parts: ``model`` (a ParallelModel), ``module`` (what holds the
    parameters: the model itself, or the module a plain model adapts), the ``runner``, the
    ``sync``, the ``loss``; ``parallel`` (None: a plain model with ``dp_group``)."""

    def __init__(
        self,
        model,
        module,
        runner,
        sync: GradientSync,
        loss: Loss,
        parallel,
        dp_group,
        data_parallel,
    ):
        self.model, self.module, self.runner, self.sync = model, module, runner, sync
        self.loss, self.parallel, self.dp_group = loss, parallel, dp_group
        self.data_parallel = data_parallel  # the engine over the replicas (None: one replica)
        # the ranks whose loss sums make up the step's loss: the last stage's TP rank 0 of
        # every replica (over every rank), or each DP rank of a plain model (over DP)
        self._loss_group = dist.group.WORLD if parallel is not None else dp_group
        self._loss_owner = parallel is None or (
            parallel.tp_rank == 0 and model.stage_split.last_stage in model.stage_ids
        )

    def forward_backward(self, batches: list[MicroBatch], precision) -> torch.Tensor:
        """Every micro-batch forward and backward, the gradients synchronised; returns the
        step's mean loss (the same on every rank)."""
        padded = any(b.attention_mask is not None for b in batches)
        whole = self.loss.kind is LossKind.MODEL_OUTPUT  # a dict batch: the model's own keys
        if padded and not whole and not self.model.takes_attention_mask:
            raise ValueError(
                f"a padded micro-batch (input_ids, labels, attention_mask): "
                f"{type(self.model).__name__}'s stages take no attention mask; padded batches "
                "train transformers models (tp_ext.parallelize) and plain ones that take one"
            )
        count = torch.stack([self.loss.count(b.target) for b in batches]).sum().float()
        if self.dp_group is not None and self.dp_group.size > 1:
            with comm.tag("train.loss"):
                count = comm.all_reduce(count, "sum", group=self.dp_group)
        denominator = count.clamp_min(1) / self.sync.averages_over
        positions = self._loss_positions(batches[0])
        sums: list[torch.Tensor] = []

        def loss_fn(output, target):
            loss = self.loss.summed(output, target, positions, count)
            sums.append(loss.detach().float())
            return precision.scaled(loss / denominator)

        self.sync.before_backward(len(batches))
        with comm.tag("train.compute"):
            self.runner.run(batches, loss_fn, precision)
        params = [p for p in self.module.parameters() if p.requires_grad]
        self.sync.after_backward(params)
        self._sum_tied_gradients()
        mine = torch.stack(sums).sum() if sums and self._loss_owner else None
        total = torch.zeros((), device=count.device) if mine is None else mine
        if self._loss_group is not None:
            with comm.tag("train.loss"):
                total = comm.all_reduce(total, "sum", group=self._loss_group)
        return total / count  # nan when no target counts, as torch's mean

    def _loss_positions(self, batch: MicroBatch) -> Optional[torch.Tensor]:
        if self.loss.kind is LossKind.MODEL_OUTPUT:  # the model's own output, whole
            return None
        return self.model.loss_positions(batch.input_ids.size(1))

    def clip(self, max_norm: float) -> torch.Tensor:
        """The gradient norm over every rank that holds part of the model, every element of
        the unsharded model counted once; the gradients scaled to ``max_norm``."""
        if self.parallel is None:
            return clip_grad_norm_(self.module, max_norm, self.loss.tp)
        norm = parallel_grad_norm(
            self.module, self.parallel, self.sync.shards_gradients, self.model.tied_weights()
        )
        scale_grads_(self.module, max_norm, norm)
        return norm

    @torch.no_grad()
    def _sum_tied_gradients(self) -> None:
        """A tied embedding split by pipelining has a copy on the first and on the last stage:
        both get the sum of the two gradients (so both copies take the same update)."""
        grads = [local_tensor(w.grad) for w in self.model.tied_weights() if w.grad is not None]
        if len(grads) == 2:  # both copies on this rank (V-shaped schedules)
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])
            return
        group = self.model.tied_group()
        if group is not None and grads:
            with comm.tag("train.tied"):
                dist.all_reduce(grads[0], group=group)


@dataclasses.dataclass
class StepSettings:
    """What a Trainer's step is built from (its keyword arguments)."""

    schedule: str = "1F1B"
    data_parallel: Optional[str] = "ddp"
    compression: Optional[str] = None
    ignore_index: int = -100
    grad_reduce_dtype: Optional[torch.dtype] = None
    overlap_param_gather: bool = False
    loss_fn: Any = None  # a callable or "model" (dict batches); None: the model's loss kind


def assemble(model: ParallelModel, module, parallel, settings: StepSettings, make_optimizer):
    """The :class:`TrainingCore` and the optimizer of ``model`` built with ``parallel`` (a
    :class:`~tp_ext.ParallelState`): the row of :data:`SYNCS`, the stage modules wrapped by its
    engine, the optimizer built over them (``make_optimizer(module)``; sharded by ZeRO, then
    handed to the sync), the runner of :data:`RUNNERS`."""
    dims = parallel.dims.replace(virtual_stages=model.stage_split.virtual_stages)
    experts = expert_parameters(module)[0]
    row = choose_sync(settings.data_parallel, dims.dp, dims.replicas, dims.ep_enabled)
    _check_row(row, settings, dims)
    schedule = check_schedule(settings.schedule, model.stage_split) if dims.pp_enabled else None
    replicas = Replicas.of(parallel, experts)
    stages = prepare_stages(
        model,
        schedule,
        row.engine,
        replicas,
        settings.compression,
        settings.grad_reduce_dtype if row.sync == "engine" else None,
    )
    optimizer = make_optimizer(module)
    if row.zero is not None:  # the state in rows over the replicas; experts over theirs
        optimizer = sharded_optimizer_for(
            optimizer, parallel, row.zero, settings.grad_reduce_dtype, experts=experts
        )
        optimizer.follow_model_order(module)  # buckets as the backward fills them
        if settings.overlap_param_gather:
            optimizer.overlap_gather_with_forward(module)
    sync = _build_sync(row, stages, replicas, parallel, experts, module, optimizer, settings)
    runner = RUNNERS[dims.pp_enabled]
    runner = runner(model, sync, settings.schedule) if dims.pp_enabled else runner(model, sync)
    tp = comm.resolve_group(parallel.tp_group)
    loss = _loss(model, module, settings, tp)
    dp = comm.resolve_group(parallel.dp_group)
    engine = settings.data_parallel if dims.replicas > 1 else None
    return TrainingCore(model, module, runner, sync, loss, parallel, dp, engine), optimizer


def assemble_plain(model: ParallelModel, module, tp, dp_group, settings: StepSettings):
    """The :class:`TrainingCore` of a model without a ParallelState: the local loop, the
    gradients summed over ``dp_group`` (None: none), ``tp`` the model's TP group."""
    if settings.compression is not None:
        raise ValueError(
            f"gradient_compression={settings.compression!r} needs Trainer(parallel=...): the "
            "DP hooks go on the DDP modules of its stages"
        )
    if settings.grad_reduce_dtype is not None:
        raise ValueError(
            f"grad_reduce_dtype={settings.grad_reduce_dtype} applies to the DP gradient sum of a "
            "model trained with Trainer(parallel=...)"
        )
    stages = prepare_stages(model, None, None, None)
    dp = None if dp_group is None else comm.resolve_group(dp_group)
    groups = [] if dp is None else [(list(module.parameters()), dp)]
    sync = ReplicaSums(stages, groups)
    loss = _loss(model, module, settings, tp)
    return TrainingCore(model, module, LocalRunner(model, sync), sync, loss, None, dp, None)


def _build_sync(row, stages, replicas, parallel, experts, module, optimizer, settings):
    if row.sync == "engine":
        return EngineSync(stages, row.engine, replicas.group)
    if row.sync == "reduce_scatter":
        return ReduceScatterSync(stages, optimizer)
    if row.sync == "none":
        return GradientSync(stages)
    expert_ids = {id(p) for p in experts}
    dense = [p for p in module.parameters() if id(p) not in expert_ids]
    groups = [(dense, replicas.group), (list(experts), parallel.expert_dp_group)]
    return ReplicaSums(stages, groups, settings.grad_reduce_dtype)


def _check_row(row: SyncRow, settings: StepSettings, dims) -> None:
    if settings.schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {settings.schedule!r}")
    if settings.compression is not None and row.sync != "engine" and dims.replicas > 1:
        raise ValueError(
            f"data_parallel={settings.data_parallel!r}, gradient_compression="
            f"{settings.compression!r}: compression runs as DDP's communication hooks, which "
            "this combination does not use (expert parallelism sums its own groups, ZeRO-2 "
            "reduce-scatters); use data_parallel='ddp' without experts, or no compression"
        )
    if settings.compression is not None and row.zero is not None:
        raise ValueError(
            f"data_parallel={settings.data_parallel!r} with gradient_compression="
            f"{settings.compression!r} is not supported: use data_parallel='ddp'"
        )


def _loss(model, module, settings: StepSettings, tp):
    """The step's loss: the user's (``settings.loss_fn``, over dict batches) or the one of the
    model's loss kind; a whole-logits model's load-balancing loss added, its statistics over its
    CP positions' group (the other loss kinds' models score their tokens alone)."""
    if model.loss_kind is LossKind.MODEL_OUTPUT:
        return BatchLoss(settings.loss_fn, settings.ignore_index)
    router = None
    if model.loss_kind is LossKind.FULL_LOGITS:
        router = router_loss_of(module, model.cp_group)
    return Loss(model.loss_kind, settings.ignore_index, tp, model, router)
