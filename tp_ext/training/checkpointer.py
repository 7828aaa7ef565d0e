"""A run's checkpoints: :class:`CheckpointManager`, built from the Stateful parts of a run
(:mod:`tp_ext.training.checkpoint_parts`: model, optimizer, random streams, compression
residuals, LR schedule, data position, the Trainer's counters), saves and loads one checkpoint,
and, given a directory, keeps a run's checkpoints in it.

One checkpoint is one DCP checkpoint (:func:`tp_ext.checkpoint.dcp.write_checkpoint`:
safetensors files, atomic, a JSON manifest; nothing unpickled). Its manifest holds the step, the
dims it was saved at (``ParallelDims.as_dict()``) with its pipeline stages, and each part's
entry. A directory holds ``DIR/step-00000012`` for the checkpoint after step 12, each published
by one symlink swap; only published checkpoints count: a save killed before it was published
leaves a ``step-N.versions`` directory without its ``step-N`` link, which :func:`newest` never
takes and :func:`remove_unpublished` deletes.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from typing import Callable, Optional, Union

import torch.distributed as dist

from tp_ext.checkpoint import CheckpointError, complete_checkpoint
from tp_ext.checkpoint.atomic import VERSIONS
from tp_ext.checkpoint.dcp import TRAINING_FORMATS, read_checkpoint, write_checkpoint
from tp_ext.distributed import ResolvedGroup, comm
from tp_ext.training.checkpoint_parts import Saved
from tp_ext.validation import ConfigError, check_int

__all__ = [
    "CheckpointManager",
    "TRAINING_FORMAT",
    "step_path",
    "published",
    "newest",
    "remove_unpublished",
    "keep_newest",
]

TRAINING_FORMAT, _V1 = TRAINING_FORMATS  # v1: its entries at the top level (_upgraded)


class CheckpointManager:
    """Saves and loads ``parts`` (:class:`~tp_ext.training.checkpoint_parts.Part`) as one
    checkpoint. ``where()`` gives the record of where the run stands (``{"step", "dims",
    "stages"}``): saved in the manifest; a checkpoint whose dims and stages equal this run's
    carries its random streams and compression residuals over.

    With ``directory``: the run's checkpoints there, saved every ``every`` steps and after the
    last (None: only after the last), the newest ``keep_last`` kept (None: all), written in the
    background with ``async_save``. ``on_accept``: called on rank 0 once the directory passed
    the checks of a start (a launcher may then let its restarts resume)."""

    def __init__(
        self,
        parts: list,
        where: Callable[[], dict],
        directory: Union[None, str, os.PathLike] = None,
        *,
        every: Optional[int] = None,
        keep_last: Optional[int] = None,
        async_save: bool = False,
        on_accept: Optional[Callable[[], None]] = None,
    ) -> None:
        if directory is not None:
            directory = os.fspath(directory)
            if os.path.exists(directory) and not os.path.isdir(directory):
                raise ConfigError(f"checkpoint_dir {directory} exists and is not a directory")
        _check_positive("checkpoint_every", every)
        _check_positive("keep_last", keep_last)
        if not isinstance(async_save, bool):
            raise TypeError(f"async_save must be True or False, got {async_save!r}")
        self.parts, self.where = list(parts), where
        self.directory, self.every, self.keep_last = directory, every, keep_last
        self.async_save, self.on_accept = async_save, on_accept
        self._pending = None  # an asynchronous save being written
        self._shared = self  # the manager whose pending save this one's is (in_directory)

    def in_directory(self, directory, **policy) -> "CheckpointManager":
        """This run's parts, kept in ``directory`` by ``policy`` (``every``, ``keep_last``,
        ``async_save``, ``on_accept``); its saves are this manager's (one pending at a time)."""
        other = CheckpointManager(self.parts, self.where, directory, **policy)
        other._shared = self._shared
        return other

    # ---- one checkpoint -------------------------------------------------------------------

    def save(self, path: str, async_save: bool = False) -> None:
        """Write every part to checkpoint ``path`` (a collective over every rank), atomically:
        ``path`` changes from its previous checkpoint to this one in one step. ``async_save``:
        return once the state is copied to CPU memory; the files are written in the background,
        and published by :meth:`wait` (or :meth:`publish_finished` once every rank is done)."""
        self.wait()
        tensors, info = {}, {"format": TRAINING_FORMAT, **self.where()}
        for part in self.parts:
            mine, entry = part.save()
            tensors.update(mine)
            info[part.key] = entry
        self._shared._pending = write_checkpoint(tensors, path, info, async_save=async_save)

    def wait(self) -> None:
        """Wait for an asynchronous save to be written and publish it (every rank calls it)."""
        pending, self._shared._pending = self._shared._pending, None
        if pending is not None:
            pending.finish()

    def publish_finished(self) -> None:
        """Publish an asynchronous save if every rank has written it (one small all-reduce)."""
        pending = self._shared._pending
        if pending is not None and pending.done_everywhere():
            self.wait()

    def load(self, path: str) -> dict:
        """Restore every part from checkpoint ``path``, saved at any dims (a collective).
        Returns its manifest."""
        self.wait()
        here, found = self.where(), []

        def targets(info: dict, directory: str) -> dict:
            info = _upgraded(info)
            same = info.get("dims") == here["dims"] and info.get("stages") == here["stages"]
            found[:] = [Saved(info, directory, same)]
            state = {}
            for part in self.parts:
                state.update(part.targets(found[0]))
            return state

        _, state = read_checkpoint(path, targets, formats=(TRAINING_FORMAT, _V1))
        for part in self.parts:
            part.load(found[0], state)
        return found[0].info

    # ---- a directory of them --------------------------------------------------------------

    def find(self, steps: int, resume: bool, wording) -> Optional[tuple[int, str]]:
        """The newest published checkpoint of the directory, ``(step, path)`` on every rank, or
        None; refused (on every rank) when one exists and ``resume`` is False, or is beyond
        ``steps``. Rank 0 reads the directory (creating it, and removing what killed saves
        left)."""

        def look():
            if _rank() != 0:
                return ""
            os.makedirs(self.directory, exist_ok=True)
            remove_unpublished(self.directory)
            found = newest(self.directory)
            if found is not None and not resume:
                raise ConfigError(
                    f"{self.directory} holds checkpoints (the newest after step {found[0]}): "
                    f"pass {wording.arg('resume', True)} to continue from it, or give another "
                    f"{wording.arg('checkpoint_dir')}"
                )
            if found is not None and found[0] > steps:
                raise ConfigError(
                    f"{wording.arg('steps', steps)} is below the step of the newest checkpoint "
                    f"in {self.directory} ({found[0]}): give "
                    f"{wording.arg('steps', found[0] + 1)} or more to train on"
                )
            if self.on_accept is not None:
                self.on_accept()
            return json.dumps(None if found is None else list(found))

        world = _world()
        text = comm.everywhere(world, "reading the checkpoint directory", look, ConfigError)
        found = json.loads(comm.broadcast_text(text, 0, world))
        return None if found is None else (found[0], found[1])

    def due(self, step: int, last: int) -> bool:
        return step == last or (self.every is not None and step % self.every == 0)

    def save_step(self, step: int) -> None:
        """Save the checkpoint after ``step`` in the directory (the newest ``keep_last`` kept)."""
        self.wait()  # the previous one published: older ones may go
        if _rank() == 0:
            keep_newest(self.directory, self.keep_last)
        self.save(step_path(self.directory, step), async_save=self.async_save)

    def finish(self) -> None:
        """Publish the last save and keep the newest."""
        self.wait()
        if _rank() == 0:
            keep_newest(self.directory, self.keep_last)


def _upgraded(info: dict) -> dict:
    """A manifest in this format's shape; a v1 one (its entries at the top level) is read as the
    same state."""
    if info.get("format") != _V1:
        return info
    # v1 wrote the stage split (beside the degrees) under the key "layout": read as written
    v1_split = info.get("layout", {})
    stages = None
    if "stage_layers" in v1_split:
        stages = {k: v1_split[k] for k in ("stage_layers", "stage_order", "schedule")}
    return {
        **info,
        "stages": stages,
        "optimizer": {**info["optimizer"], "master_weights": info.get("master_weights", False)},
        "rng": {"cuda_devices": info.get("cuda_rng_devices", 0)},
        "compression": {
            "method": info.get("gradient_compression"),
            "state": info.get("compression_state", 1),
        },
        "trainer": {
            "steps": info["step"],
            "skipped_steps": info.get("skipped_steps", 0),
            "loss_scale": info.get("loss_scale"),
        },
    }


# ---- the directory ------------------------------------------------------------------------------

_NAME = re.compile(r"^step-(\d{8,})$")
_STRAY_LINK = re.compile(r"^\.step-\d{8,}\.v-.+\.link$")


def step_path(directory: str, step: int) -> str:
    """Where the checkpoint after ``step`` goes."""
    return os.path.join(directory, f"step-{step:08d}")


def published(directory: str) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete checkpoint in ``directory``, oldest first (checked
    against their manifests: sizes and dtypes)."""
    if not os.path.isdir(directory):
        return []
    found = []
    for name in os.listdir(directory):
        match = _NAME.match(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        try:
            complete_checkpoint(path)
        except CheckpointError:
            continue  # not published, or damaged: never resumed from
        found.append((int(match.group(1)), path))
    return sorted(found)


def newest(directory: str) -> Optional[tuple[int, str]]:
    """The newest complete checkpoint in ``directory``, or None."""
    done = published(directory)
    return done[-1] if done else None


def remove_unpublished(directory: str) -> list[str]:
    """Delete what saves killed before publishing left (a ``step-N.versions`` without the
    ``step-N`` link, and the ``.step-N.v-*.link`` symlinks not yet swapped in). Returns what was
    removed. Run only while no save is under way."""
    removed = []
    if not os.path.isdir(directory):
        return removed
    for name in sorted(os.listdir(directory)):
        if _STRAY_LINK.match(name):  # a new symlink a kill left before it was swapped in
            os.unlink(os.path.join(directory, name))
            removed.append(name)
            continue
        if not name.endswith(VERSIONS) or not _NAME.match(name[: -len(VERSIONS)]):
            continue
        link = os.path.join(directory, name[: -len(VERSIONS)])
        if not os.path.lexists(link):
            shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
            removed.append(name)
    return removed


def keep_newest(directory: str, keep: Optional[int]) -> list[str]:
    """Delete all but the newest ``keep`` complete checkpoints (None: keep all). The link goes
    first, so a checkpoint is never seen half removed. Returns the removed paths."""
    if keep is None:
        return []
    removed = []
    for _, path in published(directory)[:-keep]:
        os.unlink(path)
        shutil.rmtree(path + VERSIONS, ignore_errors=True)
        removed.append(path)
    return removed


def _check_positive(name: str, value) -> None:
    if value is not None:
        check_int(name, value, 1, why="or None")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _world():
    if dist.is_available() and dist.is_initialized():
        return dist.group.WORLD
    return ResolvedGroup.local()
