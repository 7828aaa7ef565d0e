"""The training state a run needs to go on where it stopped, saved and loaded by
:meth:`Trainer.save_checkpoint` / :meth:`Trainer.load_checkpoint`.

One DCP checkpoint (:func:`tp_ext.checkpoint.dcp.write_checkpoint`: safetensors files, atomic,
with a JSON manifest) holds:

- the model's tensors under their Hugging Face names, each rank writing the rows it holds;
- the optimizer's per-parameter state under ``optimizer.<key>.<name>``, sharded exactly like its
  parameter (TP rows, FSDP2's data-parallel slices, pipeline stages), so it reshards like the
  model: a checkpoint saved at one (tp, pp, dp) loads at any other;
- under ZeRO with bf16 / fp16 parameters, the fp32 master weights under ``master.<name>``,
  sharded like the parameter (a run without master weights reads the parameters alone; one
  with them, resumed from a checkpoint without, starts them from the parameters);
- each rank's random-number states under ``rng.rank<r>.cpu`` / ``rng.rank<r>.cuda<d>`` (the TP
  streams are derived from these: :mod:`tp_ext.distributed.rng`);
- with gradient compression, each rank's error-feedback residuals under
  ``compression.rank<r>.<parameter>`` (int8 / 1-bit; PowerSGD's ``<parameter>.powersgd_error``
  and its step count) (restored at the same layout and method; elsewhere they
  start at zero, with a warning);
- in the manifest (JSON, no pickle): the step, the dims (``ParallelDims.as_dict()``; also the
  older "layout" entry: tp, pp, dp, world size, pipeline stages), the optimizer's hyperparameters,
  the LR schedule's, loss scale's and data position's ``state_dict()``.

Exactness: at the same layout every tensor and stream is restored as it was, so the resumed run
is bitwise the uninterrupted one. At another layout the model and optimizer state are the same
numbers, resharded; each rank takes the random-number state of global rank 0 (the layout's
streams no longer correspond), which matters only to dropout.
"""

from __future__ import annotations

import json
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from tp_ext.checkpoint import CheckpointError
from tp_ext.checkpoint.dcp import (
    TRAINING_FORMAT,
    PendingSave,
    check_config,
    checkpoint_tensors,
    copy_tied,
    model_fields,
    read_checkpoint,
    write_checkpoint,
)
from tp_ext.compression.hooks import SERVER
from tp_ext.dims import ParallelDims
from tp_ext.distributed import rng

__all__ = [
    "save_training_state",
    "load_training_state",
    "materialise_optimizer_state",
    "dims_of",
]

OPTIMIZER_PREFIX = "optimizer."
MASTER_PREFIX = "master."


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def dims_of(trainer) -> ParallelDims:
    """The degrees ``trainer`` runs at (virtual stages: its model's, 1 without a pipeline)."""
    parallel = trainer.parallel
    if parallel is None:
        dp = 1 if trainer.dp_group is None else trainer.dp_group.size
        return ParallelDims(tp=trainer.tp.size, pp=1, dp=dp)
    stages = getattr(trainer.model, "stage_split", None)
    return parallel.dims.replace(virtual_stages=1 if stages is None else stages.virtual_stages)


def _layout_record(trainer) -> dict:
    """The manifest's "layout", as tp_ext has always written it (``tp`` the TP group's size),
    for the readers of older checkpoints: the degrees, world size and pipeline stages."""
    dims = dims_of(trainer)
    record = {"tp": dims.tp_size, "pp": dims.pp, "dp": dims.dp, "world": _world_size()}
    if trainer.parallel is None:
        return record
    stages = getattr(trainer.model, "stage_split", None)
    return dict(
        record,
        stage_layers=None if stages is None else stages.layer_counts,
        stage_order=None if stages is None else stages.order,
        schedule=trainer.strategy.schedule_name,
    )


def _same_dims(info: dict, trainer) -> bool:
    """Whether the checkpoint was saved at this trainer's dims and pipeline stages (RNG streams
    and compression residuals carry over only then). A checkpoint from before "dims" was
    written is judged by its "layout" alone."""
    saved = info.get("dims")
    same = saved is None or saved == dims_of(trainer).as_dict()
    return same and info.get("layout") == _layout_record(trainer)


def layout_of(trainer) -> dict:
    """Deprecated: :func:`dims_of` (the degrees) is the record of where a checkpoint was saved;
    this is the manifest's older "layout" entry."""
    warnings.warn(
        "tp_ext.training.state.layout_of is deprecated; use dims_of (a tp_ext.ParallelDims)",
        DeprecationWarning,
        stacklevel=2,
    )
    return _layout_record(trainer)


# ---- optimizer state ----------------------------------------------------------------------------


def _state_keys(optimizer) -> list[str]:
    keys = set()
    for state in optimizer.state.values():
        keys |= set(state)
    return sorted(keys)


def _optimizer_tensors(model, optimizer, tied_copies=None) -> dict[str, torch.Tensor]:
    """The optimizer's per-parameter state, keyed ``optimizer.<key>.<checkpoint name>``."""
    state: dict[str, torch.Tensor] = {}
    for key in _state_keys(optimizer):

        def tensor_of(param, key=key):
            value = optimizer.state.get(param, {}).get(key)
            if value is None:
                return None
            if not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {key!r} is a {type(value).__name__}; tp_ext's training "
                    "checkpoints hold tensor state (per element, or one scalar per parameter)"
                )
            if value.dim() and tuple(value.shape) != tuple(param.shape):
                raise CheckpointError(
                    f"optimizer state {key!r} has shape {tuple(value.shape)}, its parameter "
                    f"{tuple(param.shape)}: tp_ext's training checkpoints hold state shaped "
                    "like its parameter, or one scalar per parameter"
                )
            return value

        state.update(
            checkpoint_tensors(
                model,
                prefix=f"{OPTIMIZER_PREFIX}{key}.",
                tensor_of=tensor_of,
                tied_copies=tied_copies,
            )
        )
    return state


def _finish_gather(optimizer) -> None:
    """ZeRO's all-gathers of the updated parameters still in flight, waited for."""
    if hasattr(optimizer, "finish_gather"):
        optimizer.finish_gather()


def _master_tensors(model, optimizer, tied_copies=None) -> dict[str, torch.Tensor]:
    """ZeRO's fp32 master rows of bf16 / fp16 parameters, keyed ``master.<checkpoint name>`` and
    sharded like their parameters (none for other optimizers, or when every parameter is fp32)."""
    if not getattr(optimizer, "has_separate_masters", False):
        return {}
    return checkpoint_tensors(
        model, prefix=MASTER_PREFIX, tensor_of=optimizer.master_weights, tied_copies=tied_copies
    )


@torch.no_grad()
def materialise_optimizer_state(optimizer) -> None:
    """Give every parameter its optimizer state (torch's optimizers make it at the first step),
    so a checkpoint can be read into it: one step with zero gradients and lr 0, which changes no
    parameter. Parameters that already have state keep it."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if all(p in optimizer.state for p in params):
        return
    if any(p.grad is not None for p in params):
        raise CheckpointError(
            "load_checkpoint: parameters hold gradients; load before the first step (or call "
            "optimizer.zero_grad(set_to_none=True) first)"
        )
    saved_lrs = []
    for group in optimizer.param_groups:
        saved_lrs.append(group["lr"])
        group["lr"] = torch.zeros_like(group["lr"]) if torch.is_tensor(group["lr"]) else 0.0
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer.step()
    finally:
        for group, lr in zip(optimizer.param_groups, saved_lrs):
            group["lr"] = lr
        optimizer.zero_grad(set_to_none=True)


def _type_name(optimizer) -> str:
    """The optimizer whose state a checkpoint holds (ZeRO's: the one it shards, so its
    checkpoints load into DDP and FSDP2 runs and back)."""
    return getattr(optimizer, "saved_type_name", type(optimizer).__name__)


def _hyperparameters(optimizer) -> list[dict]:
    """Each parameter group's settings (lr, betas, ...), JSON-able."""
    groups = []
    for group in optimizer.param_groups:
        settings = {}
        for key, value in group.items():
            if key == "params":
                continue
            if torch.is_tensor(value):
                value = value.item()
            if isinstance(value, tuple):
                value = list(value)
            if value is None or isinstance(value, (bool, int, float, str, list)):
                settings[key] = value
        groups.append(settings)
    return groups


def _restore_hyperparameters(optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise CheckpointError(
            f"the checkpoint's optimizer has {len(saved)} parameter groups, this one "
            f"{len(optimizer.param_groups)}: build the optimizer the same way (e.g. "
            "tp_ext.training.build_optimizer)"
        )
    for group, settings in zip(optimizer.param_groups, saved):
        for key, value in settings.items():
            current = group.get(key)
            if isinstance(current, tuple):
                value = tuple(value)
            if torch.is_tensor(current):
                current.fill_(value)
            else:
                group[key] = value


# ---- random-number states -----------------------------------------------------------------------


def _rng_tensors(rank: int) -> dict[str, torch.Tensor]:
    states = rng.get_states()
    tensors = {f"rng.rank{rank}.cpu": states["cpu"]}
    for device, state in enumerate(states["cuda"]):
        tensors[f"rng.rank{rank}.cuda{device}"] = state
    return tensors


def _rng_targets(rank: int, cuda_devices: int) -> dict[str, torch.Tensor]:
    """Tensors to read rank ``rank``'s saved states into (a state's size is fixed per device)."""
    targets = {f"rng.rank{rank}.cpu": torch.empty_like(torch.get_rng_state())}
    if cuda_devices and torch.cuda.is_available() and torch.cuda.device_count() == cuda_devices:
        for device in range(cuda_devices):
            targets[f"rng.rank{rank}.cuda{device}"] = torch.empty_like(
                torch.cuda.get_rng_state(device)
            )
    return targets


def _restore_rng(state: dict, rank: int) -> None:
    cuda = []
    device = 0
    while f"rng.rank{rank}.cuda{device}" in state:
        cuda.append(state[f"rng.rank{rank}.cuda{device}"])
        device += 1
    mine = rng.get_states()
    rng.set_states(
        {
            "cpu": state[f"rng.rank{rank}.cpu"],
            "cuda": cuda if len(cuda) == len(mine["cuda"]) else mine["cuda"],
            "tp_rank": mine["tp_rank"],
        }
    )


# ---- JSON state of the schedule, the loss scale and the data ------------------------------------


COMPRESSION_STATE = 2


def _compression_tensors(
    trainer, rank: int, empty: bool = False, saved_state: int = COMPRESSION_STATE
) -> dict[str, torch.Tensor]:
    """This rank's gradient-compression residuals (``empty``: tensors to read them into) under
    ``compression.rank<r>.<parameter>``: each DP rank's are its own. ``saved_state`` 1: a
    checkpoint from before server residuals, which holds the ranks' residuals only."""
    return {
        f"compression.rank{rank}.{name}": torch.empty_like(r) if empty else r
        for name, r in trainer.compression_residuals().items()
        if saved_state >= 2 or not name.endswith(SERVER)
    }


def _compression_carries_over(trainer, info: dict, same_layout: bool, directory: str) -> bool:
    """Whether the saved residuals continue here: the same method at the same layout. Elsewhere
    they start at zero (said once): the next steps send what they would have sent, less at
    most one step's quantisation error of each rank."""
    saved = info.get("gradient_compression")
    mine = trainer.gradient_compression
    if mine is None or saved is None:
        return False
    if mine == "powersgd" and info.get("compression_state", 1) < 2:
        return False  # saved before PowerSGD's errors were (its warm-up runs again)
    if saved == mine and same_layout:
        return True
    if _rank() == 0:
        why = f"saved with {saved!r}" if saved != mine else "saved at another layout"
        warnings.warn(
            f"{directory}: gradient-compression residuals {why}; {mine!r} starts from zero "
            "residuals (at most one step's quantisation error per rank is not carried over)",
            stacklevel=3,
        )
    return False


def _json_state(name: str, obj) -> Optional[dict]:
    if obj is None:
        return None
    state = obj.state_dict()
    try:
        return json.loads(json.dumps(state))
    except (TypeError, ValueError) as e:
        raise CheckpointError(
            f"{name}.state_dict() must be JSON-able (ints, floats, strings, lists, dicts) to go "
            f"in a checkpoint manifest: {e}"
        ) from None


def _check_saved(name: str, obj, saved) -> None:
    if (obj is None) != (saved is None):
        has = "has" if saved is not None else "has no"
        given = "was given one" if obj is not None else "was given none"
        raise CheckpointError(
            f"the checkpoint {has} {name} state, and this Trainer {given}: pass the same "
            f"{name}= as the saved run"
        )


# ---- save and load ------------------------------------------------------------------------------


def save_training_state(trainer, path: str, async_save: bool = False) -> Optional[PendingSave]:
    """Write ``trainer``'s whole state to checkpoint ``path`` (a collective over every rank).
    With ``async_save`` returns the :class:`PendingSave` still being written."""
    model, optimizer = trainer.model, trainer.optimizer
    _finish_gather(optimizer)
    state = checkpoint_tensors(model)
    state.update(_optimizer_tensors(model, optimizer))
    masters = _master_tensors(model, optimizer)
    state.update(masters)
    state.update(_rng_tensors(_rank()))
    state.update(_compression_tensors(trainer, _rank()))
    info = {
        "format": TRAINING_FORMAT,
        "step": trainer.steps,
        "config": model_fields(getattr(model, "config", None)),
        "dims": dims_of(trainer).as_dict(),
        "layout": _layout_record(trainer),  # for the readers of older checkpoints
        "optimizer": {
            "type": _type_name(optimizer),
            "param_groups": _hyperparameters(optimizer),
            "state_keys": _state_keys(optimizer),
        },
        "lr_scheduler": _json_state("lr_scheduler", trainer.lr_scheduler),
        "loss_scale": _json_state("loss scale", trainer.scaler),
        "data": _json_state("data", trainer.data),
        "skipped_steps": trainer.skipped_steps,
        "cuda_rng_devices": len(rng.get_states()["cuda"]),
        "gradient_compression": trainer.gradient_compression,
        # 2: int8 / 1-bit server residuals and PowerSGD's errors are saved too (1: neither)
        "compression_state": COMPRESSION_STATE,
        "master_weights": bool(masters),  # ZeRO's fp32 rows of bf16 / fp16 parameters
    }
    return write_checkpoint(state, path, info, async_save=async_save)


def load_training_state(trainer, path: str) -> dict:
    """Restore ``trainer`` from checkpoint ``path``, saved at any layout (a collective)."""
    model, optimizer = trainer.model, trainer.optimizer
    _finish_gather(optimizer)  # (a gather in flight would write over the loaded weights)
    materialise_optimizer_state(optimizer)
    rank = _rank()
    rng_source = {"rank": rank}  # whose random streams this rank continues
    copies: list = []  # separate copies of a tied embedding on this rank, and their originals

    def state_of(info, directory):
        check_config(directory, info, model)
        saved = info.get("optimizer", {})
        if saved.get("type") != _type_name(optimizer):
            raise CheckpointError(
                f"{directory} holds the state of a {saved.get('type')} optimizer; this Trainer's "
                f"is a {_type_name(optimizer)}"
            )
        if saved.get("state_keys") != _state_keys(optimizer):
            raise CheckpointError(
                f"{directory} holds optimizer state {saved.get('state_keys')}, this optimizer "
                f"keeps {_state_keys(optimizer)}: build it with the same settings"
            )
        _check_saved("lr_scheduler", trainer.lr_scheduler, info.get("lr_scheduler"))
        _check_saved("data", trainer.data, info.get("data"))
        if trainer.data is not None:  # first: a data mismatch is refused before any read
            try:
                trainer.data.load_state_dict(info["data"])
            except ValueError as e:
                raise CheckpointError(f"{directory}: the data position does not fit: {e}") from e
        same_layout = _same_dims(info, trainer)
        if not same_layout:
            rng_source["rank"] = 0  # the streams of another layout: rank 0's, replicated
        copies.clear()
        state = checkpoint_tensors(model, tied_copies=copies)
        state.update(_optimizer_tensors(model, optimizer, tied_copies=copies))
        masters_loaded[0] = bool(info.get("master_weights"))
        if masters_loaded[0]:  # (a run without master rows reads the weights alone)
            state.update(_master_tensors(model, optimizer, tied_copies=copies))
        state.update(_rng_targets(rng_source["rank"], info.get("cuda_rng_devices", 0)))
        residuals.clear()
        if _compression_carries_over(trainer, info, same_layout, directory):
            saved_state = info.get("compression_state", 1)
            residuals.update(_compression_tensors(trainer, rank, True, saved_state))
            state.update(residuals)
        return state

    residuals: dict = {}
    masters_loaded = [False]
    info, state = read_checkpoint(path, state_of, formats=(TRAINING_FORMAT,))
    prefix = f"compression.rank{rank}."
    trainer.load_compression_residuals({k[len(prefix) :]: state[k] for k in residuals})
    copy_tied(copies)
    has_masters = getattr(optimizer, "has_separate_masters", False)
    if has_masters and not masters_loaded[0]:  # ZeRO's master rows, from the loaded weights
        optimizer.refresh_masters()
    _restore_hyperparameters(optimizer, info["optimizer"]["param_groups"])
    _restore_rng(state, rng_source["rank"])
    if trainer.lr_scheduler is not None:
        trainer.lr_scheduler.load_state_dict(info["lr_scheduler"])
    if trainer.scaler is not None and info.get("loss_scale") is not None:
        trainer.scaler.load_state_dict(info["loss_scale"])
    trainer.steps = int(info["step"])
    trainer.skipped_steps = int(info.get("skipped_steps", 0))
    return info
