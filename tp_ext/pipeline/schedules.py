"""The named pipeline schedules, checked before anything runs, and one step through them.

Every schedule is torch.distributed.pipelining's; tp_ext adds the checks that turn a bad
combination into an error at construction (never a hang), the loss that counts every token
once across micro-batches and DP replicas, and stage modules built from the model's own
:class:`tp_ext.sharding.StageSplit`.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Optional

import torch

from tp_ext.compression import METHODS
from tp_ext.pipeline.data_parallel import Replicas, ReplicatedStages, replicate_stages

__all__ = [
    "SCHEDULES",
    "Schedule",
    "check_schedule",
    "check_weight_split_supported",
    "weight_split_supported",
    "prepare_stages",
    "PipelineRunner",
]


@dataclasses.dataclass(frozen=True)
class Schedule:
    name: str
    torch_class_name: str  # in torch.distributed.pipelining
    multi_stage: bool  # several stages per rank (virtual stages)
    order: str  # the StageSplit order it needs: "loop" or "v"
    weight_split: bool  # backward split into input and weight gradients (zero bubble)

    @property
    def torch_class(self) -> type:
        return getattr(_torch_pipelining(), self.torch_class_name)

    def requirement(self) -> str:
        if self.order == "v":
            return "virtual_stages=2, stage_order='v' (rank r holds stages r and 2*pp-1-r)"
        if self.multi_stage:
            return "virtual_stages >= 1, stage_order='loop' (stage s on rank s % pp)"
        return "virtual_stages=1 (one stage per rank)"


def _torch_pipelining():
    """torch.distributed.pipelining, imported on first use: it imports torch._dynamo (a second of
    CPU per process), which a job without a pipeline, and `import tp_ext`, need not pay."""
    return importlib.import_module("torch.distributed.pipelining")


SCHEDULES = {
    s.name: s
    for s in (
        Schedule("GPipe", "ScheduleGPipe", False, "loop", False),
        Schedule("1F1B", "Schedule1F1B", False, "loop", False),
        Schedule("Interleaved1F1B", "ScheduleInterleaved1F1B", True, "loop", False),
        Schedule("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", True, "loop", True),
        Schedule("ZBVZeroBubble", "ScheduleZBVZeroBubble", True, "v", True),
        Schedule("DualPipeV", "ScheduleDualPipeV", True, "v", True),
    )
}


def check_compression(method: Optional[str], data_parallel: Optional[str], schedule) -> None:
    """Refuse a gradient compression this DP setup cannot run, saying what would."""
    if method is None:
        return
    if method not in METHODS:
        raise ValueError(f"gradient_compression must be one of {METHODS} or None, got {method!r}")
    if data_parallel != "ddp":
        raise ValueError(
            f"gradient_compression={method!r} needs data_parallel='ddp' (its DDP communication "
            f"hooks); FSDP2 reduce-scatters sharded gradients, which they do not see"
        )
    if method == "powersgd" and schedule is not None and schedule.weight_split:
        raise ValueError(
            f"gradient_compression='powersgd' with schedule {schedule.name!r}: the schedule "
            "writes weight gradients outside DDP, so no DDP hook runs; use 'int8' or '1bit' "
            "(tp_ext compresses its own all-reduce after the step) or another schedule"
        )


# The first torch whose weight-split (zero-bubble) schedules tp_ext's tests find exact.
WEIGHT_SPLIT_MIN_TORCH = (2, 13)


def weight_split_supported(torch_version=None) -> bool:
    """Whether this torch (or ``torch_version``) runs the zero-bubble schedules exactly."""
    version = str(torch_version or torch.__version__)
    major_minor = tuple(int(x) for x in version.split(".")[:2])  # 2.13 nightlies count as 2.13
    return major_minor >= WEIGHT_SPLIT_MIN_TORCH


def check_weight_split_supported(schedule: Schedule, torch_version=None) -> None:
    """Refuse a zero-bubble schedule on a torch whose split backward is not exact: with torch
    2.11 the input / weight split gave weight gradients 4-10% off in norm against one-process
    training (ZBVZeroBubble tied and untied, InterleavedZeroBubble), while Interleaved1F1B on
    the same torch was exact."""
    version = str(torch_version or torch.__version__)
    if schedule.weight_split and not weight_split_supported(version):
        plain = [s.name for s in SCHEDULES.values() if not s.weight_split]
        needed = ".".join(map(str, WEIGHT_SPLIT_MIN_TORCH))
        raise ValueError(
            f"schedule {schedule.name!r} splits the backward into input and weight gradients, "
            f"which gives wrong weight gradients with torch {version} (measured with 2.11); it "
            f"needs torch >= {needed}. Upgrade torch, or use one of {plain}"
        )


def check_schedule(name, split) -> Schedule:
    """The schedule called ``name``, if it can run the stages of ``split`` (a StageSplit);
    otherwise an error that says what would work."""
    schedule = SCHEDULES.get(name) if isinstance(name, str) else None
    if schedule is None:
        raise ValueError(f"schedule must be one of {sorted(SCHEDULES)}, got {name!r}")
    v, order = split.virtual_stages, split.order
    fits = (
        (order == "v" and v == 2)
        if schedule.order == "v"
        else (order == "loop" and (schedule.multi_stage or v == 1))
    )
    if not fits:
        works = [
            s.name
            for s in SCHEDULES.values()
            if (s.order == "v" and order == "v" and v == 2)
            or (s.order == "loop" and order == "loop" and (s.multi_stage or v == 1))
        ]
        raise ValueError(
            f"schedule {name!r} needs a model built with {schedule.requirement()}; this model "
            f"has virtual_stages={v}, stage_order={order!r}, for which these schedules work: "
            f"{works}"
        )
    check_weight_split_supported(schedule)
    return schedule


def check_micro_batches(schedule: Schedule, split, n: int) -> None:
    """The micro-batch counts torch's schedules accept, checked before the first send."""
    pp, stages = split.pp, split.num_stages
    need = None
    if schedule.name in ("1F1B", "DualPipeV") and n < stages:
        need = f"at least {stages} (one per stage)"
    elif schedule.name in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, n // pp)
        if n % rounds:
            need = f"a multiple of max(1, n // pp) (pp={pp}), e.g. {pp}, {2 * pp} or {3 * pp}"
    elif schedule.name == "ZBVZeroBubble" and n < stages:
        need = f"at least {stages} (one per stage)"
    if need is not None:
        raise ValueError(
            f"schedule {schedule.name!r} with {stages} stages needs {need} micro-batches; got "
            f"len(micro_batches)={n}"
        )


def prepare_stages(
    model,
    schedule: Optional[Schedule],
    data_parallel: Optional[str],
    replicas: Optional[Replicas],
    compression: Optional[str] = None,
    reduce_dtype: Optional[torch.dtype] = None,
) -> ReplicatedStages:
    """``model``'s stages set up for data parallelism over ``replicas`` under ``schedule`` (None:
    no pipeline; checked first: FSDP2 and the compression method against the schedule). The
    data-parallel side (:func:`~tp_ext.pipeline.data_parallel.replicate_stages`) wraps them and
    installs the compression; the runner only runs them."""
    dp = 1 if replicas is None else replicas.size
    weight_split = schedule is not None and schedule.weight_split
    if weight_split and data_parallel == "fsdp" and dp > 1:
        raise ValueError(
            f"schedule {schedule.name!r} splits the weight gradient out of autograd (torch writes "
            "it to .grad directly), which FSDP2's reduce-scatter never sees: use "
            "data_parallel='ddp' with it, or data_parallel='fsdp' with one of "
            f"{[s.name for s in SCHEDULES.values() if not s.weight_split]}"
        )
    compression = compression if dp > 1 else None
    check_compression(compression, data_parallel, schedule)
    # the same reason for DDP: its hooks would not fire, so tp_ext averages after the step
    return replicate_stages(
        model,
        replicas,
        data_parallel,
        sync_after_step=weight_split and dp > 1 and data_parallel is not None,
        compression=compression,
        reduce_dtype=reduce_dtype,
    )


def _skip_self_warmup(stage) -> None:
    """Drop the warm-up messages ``stage`` would send to its own rank. torch 2.11's schedules
    open every stage's links with a dummy send and receive to each neighbour stage, also when the
    neighbour is on the same rank (a V-shaped or interleaved schedule's two local stages), and
    gloo cannot send to itself ("Pair is not connected"). The stages' real traffic between local
    stages never goes through the process group; torch 2.13 replaced this warm-up."""
    warmup = getattr(stage, "_get_init_p2p_neighbors_ops", None)
    if warmup is None:
        return
    me = stage.group_rank

    def to_other_ranks():
        return [op for op in warmup() if getattr(op, "group_peer", None) != me]

    stage._get_init_p2p_neighbors_ops = to_other_ranks


class PipelineRunner:
    """The stages of ``model`` (a :class:`~tp_ext.contract.ParallelModel`) this rank holds, as
    the data-parallel side prepared them (``stages``: :func:`prepare_stages`), run by schedule
    ``schedule`` (a key of :data:`SCHEDULES`).

    :meth:`step` runs one forward and backward over the micro-batches; ``loss_fn(output,
    labels)`` gives each micro-batch's loss on the last stage (the quantity whose gradient is
    accumulated: no scaling by the number of micro-batches is added)."""

    def __init__(self, model, schedule: str, stages: ReplicatedStages) -> None:
        self.model, self.parallel = model, model.parallel
        self.stage_split = model.stage_split
        self.schedule = check_schedule(schedule, self.stage_split)
        self.stages = stages
        self.modules = stages.modules
        self._built: dict = {}

    @property
    def holds_last_stage(self) -> bool:
        return self.stage_split.last_stage in self.model.stage_ids

    def step(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        n: int,
        loss_fn: Callable,
        logits_dtype: torch.dtype,
        attention_mask: Optional[torch.Tensor] = None,
    ):
        """One forward and backward of ``n`` micro-batches cut from ``input_ids`` / ``labels``
        (``[n * micro_batch, seq]``: torch's schedules split along dim 0). ``logits_dtype``:
        the last stage's output dtype (the autocast dtype under autocast). ``attention_mask``
        (padded micro-batches, the ids' shape): cut the same way and given to every stage's
        forward as ``attention_mask=`` (torch hands a step's keyword arguments to each stage)."""
        check_micro_batches(self.schedule, self.stage_split, n)
        if input_ids.size(0) % n:
            raise ValueError(f"{input_ids.size(0)} rows do not split into {n} micro-batches")
        key = (n, tuple(input_ids.shape), input_ids.dtype, logits_dtype)
        if key not in self._built:
            # one micro-batch's input: token ids, or an encoder's images
            shape = (input_ids.size(0) // n, *input_ids.shape[1:])
            self._built = {key: self._build(n, loss_fn, shape, logits_dtype, input_ids.dtype)}
        schedule, box = self._built[key]
        box["loss_fn"] = loss_fn
        self.model.sequence_length = input_ids.size(1)  # what later stages cannot see
        first = 0 in self.model.stage_ids
        args = (input_ids,) if first else ()
        target = labels if self.holds_last_stage else None
        padding = {} if attention_mask is None else {"attention_mask": attention_mask}
        try:
            schedule.step(*args, target=target, return_outputs=False, **padding)
        except RuntimeError as e:
            inner = _model_error(e)
            if inner is e:
                raise
            raise inner from inner.__cause__
        finally:
            self.model.sequence_length = None  # this step's, not the next one's

    def _build(self, n: int, loss_fn: Callable, shape, logits_dtype, input_dtype):
        device = self.parallel.device
        # Activation shapes given up front (meta tensors): without them torch infers them by
        # running a forward and the loss on the first micro-batch, which would count that
        # micro-batch's loss twice and draw dropout masks out of turn.
        stages = [
            _torch_pipelining().PipelineStage(
                module,
                stage,
                self.stage_split.num_stages,
                device,
                input_args=self._activation(stage, shape, input_dtype),
                output_args=self._activation(stage + 1, shape, logits_dtype),
                group=self.parallel.pp_group,
            )
            for module, stage in zip(self.modules, self.model.stage_ids)
        ]
        for stage in stages:
            _skip_self_warmup(stage)
        box = {"loss_fn": loss_fn}  # the step's own loss function, swapped in per step

        def loss(output, target):
            return box["loss_fn"](output, target)

        cls = self.schedule.torch_class
        try:
            if self.schedule.multi_stage:
                schedule = cls(stages, n, loss_fn=loss, scale_grads=False)
            else:
                schedule = cls(stages[0], n, loss_fn=loss, scale_grads=False)
        except ValueError as e:
            raise ValueError(
                f"schedule {self.schedule.name!r} with {self.stage_split.num_stages} stages and "
                f"{n} micro-batches: {e}"
            ) from e
        return schedule, box

    def _activation(self, stage: int, shape, dtype) -> torch.Tensor:
        """A meta tensor shaped like stage ``stage``'s input (0: the model's, ``shape`` of
        ``dtype``; ``num_stages``: the last stage's output, this rank's vocabulary shard of the
        logits, in ``dtype``). Floating activations carry ``requires_grad``: torch reads from it
        which ones get gradients sent back."""
        model = self.model
        if stage == 0:
            return torch.empty(shape, dtype=dtype, device="meta")
        batch, length = shape[:2]  # (an image's channels stand in for its length: unread)
        if stage == self.stage_split.num_stages:  # the model's: its shard of the logits
            shape = model.output_shape(batch, length)
        else:
            shape, dtype = model.activation_shape(batch, length), next(model.parameters()).dtype
        return torch.empty(shape, dtype=dtype, device="meta", requires_grad=True)


def _model_error(error: RuntimeError) -> BaseException:
    """torch's stages wrap an error of the model's own ("token id 5990 is outside the
    vocabulary") in a RuntimeError that says only "[Stage 0] failed to run forward: args: ..."
    (or "Failed to run stage backward ..."): the model's error is what a user needs, so it goes
    on, with the stage in a note. Any other error is ``error`` itself."""
    cause = error.__cause__
    message = str(error).strip()
    if cause is None or "failed to run" not in message.lower():
        return error
    if hasattr(cause, "add_note"):  # Python 3.11+
        cause.add_note(f"(in the pipeline: {message.splitlines()[0].strip()})")
    return cause
