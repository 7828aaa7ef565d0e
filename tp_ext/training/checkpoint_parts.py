"""The Stateful parts of a training checkpoint, each saving and restoring one piece of a run:

- :class:`ModelPart`: the model's tensors under their Hugging Face names, each rank writing the
  rows it holds (:func:`tp_ext.checkpoint.dcp.checkpoint_tensors`), so a checkpoint saved at one
  (tp, pp, dp, ...) loads at any other; the model config in the manifest;
- :class:`OptimizerPart`: the per-parameter state under ``optimizer.<key>.<name>``, sharded
  exactly like its parameter (TP rows, FSDP2's and ZeRO's DP rows, pipeline stages), and under
  ZeRO with bf16 / fp16 parameters the fp32 master rows under ``master.<name>``; the optimizer's
  type, hyperparameters and state keys in the manifest;
- :class:`RngPart`: each rank's random-number states under ``rng.rank<r>.cpu`` /
  ``rng.rank<r>.cuda<d>`` (the TP streams derive from them);
- :class:`CompressionPart`: each rank's gradient-compression residuals under
  ``compression.rank<r>.<parameter>`` (restored at the same dims and method; elsewhere they
  start at zero, with a warning);
- :class:`JsonPart`: a ``state_dict()`` / ``load_state_dict()`` object kept in the manifest as
  JSON (the LR schedule, the data position, the Trainer's step counters and loss scale).

Each part gives what it saves (:meth:`Part.save`: tensors and a JSON entry), the tensors a load
reads into once the manifest is checked (:meth:`Part.targets`), and restores itself from them
(:meth:`Part.load`). :class:`~tp_ext.training.checkpointer.CheckpointManager` puts them
together. Nothing is ever unpickled.

Exactness: at the same dims every tensor and stream is restored as it was, so the resumed run is
bitwise the uninterrupted one. At other dims the model and optimizer state are the same numbers,
resharded; each rank takes the random-number state of global rank 0 (the streams no longer
correspond), which matters only to dropout.
"""

from __future__ import annotations

import dataclasses
import json
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from tp_ext.checkpoint import CheckpointError
from tp_ext.checkpoint.dcp import check_config, checkpoint_tensors, copy_tied, model_fields
from tp_ext.compression.hooks import SERVER
from tp_ext.distributed import rng
from tp_ext.training.zero import is_sharded

__all__ = [
    "Saved",
    "Part",
    "ModelPart",
    "OptimizerPart",
    "RngPart",
    "CompressionPart",
    "JsonPart",
    "materialise_optimizer_state",
]

OPTIMIZER_PREFIX = "optimizer."
MASTER_PREFIX = "master."
# 2: int8 / 1-bit server residuals and PowerSGD's errors are saved too (1: neither)
COMPRESSION_STATE = 2


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


@dataclasses.dataclass
class Saved:
    """What a load knows of the checkpoint it reads: its manifest (``info``), where it is, and
    whether it was saved at this run's dims and pipeline stages."""

    info: dict
    directory: str
    same_dims: bool


class Part:
    """One Stateful part: ``key`` is its entry in the manifest."""

    key = ""

    def save(self) -> tuple[dict, object]:
        """(the tensors to write, keyed by their checkpoint names; the JSON-able entry)."""
        raise NotImplementedError

    def targets(self, saved: Saved) -> dict:
        """The tensors to read ``saved`` into (views written in place), after checking that it
        fits this part (raising :class:`~tp_ext.checkpoint.CheckpointError` if not)."""
        return {}

    def load(self, saved: Saved, tensors: dict) -> None:
        """Restore this part from ``saved``'s entry and the tensors read into its targets."""


# ---- the model ----------------------------------------------------------------------------------


class ModelPart(Part):
    key = "config"

    def __init__(self, model) -> None:
        self.model = model
        self._copies: list = []  # separate copies of a tied embedding, and their originals

    def save(self):
        config = getattr(self.model, "config", None)  # (a plain module has none)
        return checkpoint_tensors(self.model), model_fields(config)

    def targets(self, saved: Saved) -> dict:
        check_config(saved.directory, saved.info, self.model)
        self._copies.clear()
        return checkpoint_tensors(self.model, tied_copies=self._copies)

    def load(self, saved: Saved, tensors: dict) -> None:
        copy_tied(self._copies)


# ---- the optimizer ------------------------------------------------------------------------------


class OptimizerPart(Part):
    """``optimizer``'s per-parameter state (and ZeRO's master rows) over ``model``'s
    parameters, sharded like them."""

    key = "optimizer"

    def __init__(self, model, optimizer) -> None:
        self.model, self.optimizer = model, optimizer
        self._copies: list = []
        self._masters_read = False

    def save(self):
        _finish_gather(self.optimizer)
        tensors = self._state_tensors()
        masters = self._master_tensors()
        tensors.update(masters)
        entry = {
            "type": _type_name(self.optimizer),
            "param_groups": _hyperparameters(self.optimizer),
            "state_keys": _state_keys(self.optimizer),
            "master_weights": bool(masters),  # ZeRO's fp32 rows of bf16 / fp16 parameters
        }
        return tensors, entry

    def targets(self, saved: Saved) -> dict:
        optimizer = self.optimizer
        _finish_gather(optimizer)  # (a gather in flight would write over the loaded weights)
        materialise_optimizer_state(optimizer)
        entry = saved.info.get(self.key, {})
        if entry.get("type") != _type_name(optimizer):
            raise CheckpointError(
                f"{saved.directory} holds the state of a {entry.get('type')} optimizer; this "
                f"Trainer's is a {_type_name(optimizer)}"
            )
        if entry.get("state_keys") != _state_keys(optimizer):
            raise CheckpointError(
                f"{saved.directory} holds optimizer state {entry.get('state_keys')}, this "
                f"optimizer keeps {_state_keys(optimizer)}: build it with the same settings"
            )
        self._copies.clear()
        tensors = self._state_tensors(self._copies)
        # a run without master rows reads the weights alone
        self._masters_read = bool(entry.get("master_weights"))
        if self._masters_read:
            tensors.update(self._master_tensors(self._copies))
        return tensors

    def load(self, saved: Saved, tensors: dict) -> None:
        copy_tied(self._copies)
        if is_sharded(self.optimizer) and self.optimizer.has_separate_masters:
            if not self._masters_read:  # ZeRO's master rows, from the loaded weights
                self.optimizer.refresh_masters()
        _restore_hyperparameters(self.optimizer, saved.info[self.key]["param_groups"])

    def _state_tensors(self, tied_copies=None) -> dict[str, torch.Tensor]:
        """The per-parameter state, keyed ``optimizer.<key>.<checkpoint name>``."""
        optimizer, state = self.optimizer, {}
        for key in _state_keys(optimizer):

            def tensor_of(param, key=key):
                return _checked_state(optimizer, param, key)

            state.update(
                checkpoint_tensors(
                    self.model,
                    prefix=f"{OPTIMIZER_PREFIX}{key}.",
                    tensor_of=tensor_of,
                    tied_copies=tied_copies,
                )
            )
        return state

    def _master_tensors(self, tied_copies=None) -> dict[str, torch.Tensor]:
        """ZeRO's fp32 master rows of bf16 / fp16 parameters, keyed ``master.<checkpoint
        name>`` and sharded like their parameters (none for other optimizers)."""
        optimizer = self.optimizer
        if not (is_sharded(optimizer) and optimizer.has_separate_masters):
            return {}
        return checkpoint_tensors(
            self.model,
            prefix=MASTER_PREFIX,
            tensor_of=optimizer.master_weights,
            tied_copies=tied_copies,
        )


def _checked_state(optimizer, param, key):
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
            f"{tuple(param.shape)}: tp_ext's training checkpoints hold state shaped like its "
            "parameter, or one scalar per parameter"
        )
    return value


def _state_keys(optimizer) -> list[str]:
    keys = set()
    for state in optimizer.state.values():
        keys |= set(state)
    return sorted(keys)


def _finish_gather(optimizer) -> None:
    """ZeRO's all-gathers of the updated parameters still in flight, waited for."""
    if is_sharded(optimizer):
        optimizer.finish_gather()


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
    return optimizer.saved_type_name if is_sharded(optimizer) else type(optimizer).__name__


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


class RngPart(Part):
    """This rank's random-number states; at other dims, global rank 0's (replicated)."""

    key = "rng"

    def __init__(self) -> None:
        self._source = rank()

    def save(self):
        states = rng.get_states()
        tensors = {f"rng.rank{rank()}.cpu": states["cpu"]}
        for device, state in enumerate(states["cuda"]):
            tensors[f"rng.rank{rank()}.cuda{device}"] = state
        return tensors, {"cuda_devices": len(states["cuda"])}

    def targets(self, saved: Saved) -> dict:
        self._source = rank() if saved.same_dims else 0  # whose streams this rank continues
        source, devices = self._source, saved.info[self.key]["cuda_devices"]
        targets = {f"rng.rank{source}.cpu": torch.empty_like(torch.get_rng_state())}
        if devices and torch.cuda.is_available() and torch.cuda.device_count() == devices:
            for device in range(devices):
                targets[f"rng.rank{source}.cuda{device}"] = torch.empty_like(
                    torch.cuda.get_rng_state(device)
                )
        return targets

    def load(self, saved: Saved, tensors: dict) -> None:
        source = self._source
        cuda, device = [], 0
        while f"rng.rank{source}.cuda{device}" in tensors:
            cuda.append(tensors[f"rng.rank{source}.cuda{device}"])
            device += 1
        mine = rng.get_states()
        rng.set_states(
            {
                "cpu": tensors[f"rng.rank{source}.cpu"],
                "cuda": cuda if len(cuda) == len(mine["cuda"]) else mine["cuda"],
                "tp_rank": mine["tp_rank"],
            }
        )


# ---- gradient compression -----------------------------------------------------------------------


class CompressionPart(Part):
    """The Trainer's gradient-compression residuals (:meth:`Trainer.compression_residuals`)."""

    key = "compression"

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self._reading: dict = {}

    def _tensors(self, empty: bool = False, saved_state: int = COMPRESSION_STATE) -> dict:
        """This rank's residuals (``empty``: tensors to read them into) under
        ``compression.rank<r>.<parameter>``; ``saved_state`` 1: a checkpoint from before server
        residuals, which holds the ranks' residuals only."""
        return {
            f"compression.rank{rank()}.{name}": torch.empty_like(r) if empty else r
            for name, r in self.trainer.compression_residuals().items()
            if saved_state >= 2 or not name.endswith(SERVER)
        }

    def save(self):
        entry = {"method": self.trainer.gradient_compression, "state": COMPRESSION_STATE}
        return self._tensors(), entry

    def targets(self, saved: Saved) -> dict:
        self._reading = {}
        if self._carries_over(saved):
            self._reading = self._tensors(True, saved.info[self.key].get("state", 1))
        return self._reading

    def load(self, saved: Saved, tensors: dict) -> None:
        prefix = f"compression.rank{rank()}."
        residuals = {k[len(prefix) :]: tensors[k] for k in self._reading}
        self.trainer.load_compression_residuals(residuals)

    def _carries_over(self, saved: Saved) -> bool:
        """Whether the saved residuals continue here: the same method at the same dims.
        Elsewhere they start at zero (said once): the next steps send what they would have
        sent, less at most one step's quantisation error of each rank."""
        entry = saved.info[self.key]
        theirs, mine = entry.get("method"), self.trainer.gradient_compression
        if mine is None or theirs is None:
            return False
        if mine == "powersgd" and entry.get("state", 1) < 2:
            return False  # saved before PowerSGD's errors were (its warm-up runs again)
        if theirs == mine and saved.same_dims:
            return True
        if rank() == 0:
            why = f"saved with {theirs!r}" if theirs != mine else "saved at other dims"
            warnings.warn(
                f"{saved.directory}: gradient-compression residuals {why}; {mine!r} starts from "
                "zero residuals (at most one step's quantisation error per rank is not carried "
                "over)",
                stacklevel=3,
            )
        return False


# ---- JSON state ---------------------------------------------------------------------------------


class JsonPart(Part):
    """The object ``source()`` gives (``state_dict()`` / ``load_state_dict()``; None: the run has
    none) in the manifest under ``key``, as JSON. A checkpoint with state for it loads only into
    a run that has it, and the other way round. ``early``: restored while the checkpoint is
    checked, before any tensor is read (the data position: a mismatch is refused on every rank
    first)."""

    def __init__(self, key: str, source, name: Optional[str] = None, early: bool = False) -> None:
        self.key, self.source, self.name, self.early = key, source, name or key, early

    @property
    def obj(self):
        return self.source()

    def save(self):
        obj = self.obj
        if obj is None:
            return {}, None
        state = obj.state_dict()
        try:
            return {}, json.loads(json.dumps(state))
        except (TypeError, ValueError) as e:
            raise CheckpointError(
                f"{self.name}.state_dict() must be JSON-able (ints, floats, strings, lists, "
                f"dicts) to go in a checkpoint manifest: {e}"
            ) from None

    def targets(self, saved: Saved) -> dict:
        entry = saved.info.get(self.key)
        if (self.obj is None) != (entry is None):
            has = "has" if entry is not None else "has no"
            given = "was given one" if self.obj is not None else "was given none"
            raise CheckpointError(
                f"the checkpoint {has} {self.name} state, and this Trainer {given}: pass the same "
                f"{self.name}= as the saved run"
            )
        if self.early:
            self._restore(saved)
        return {}

    def load(self, saved: Saved, tensors: dict) -> None:
        if not self.early:
            self._restore(saved)

    def _restore(self, saved: Saved) -> None:
        obj = self.obj
        if obj is not None:
            try:
                obj.load_state_dict(saved.info[self.key])
            except ValueError as e:
                raise CheckpointError(
                    f"{saved.directory}: the {self.name} state does not fit: {e}"
                ) from e
