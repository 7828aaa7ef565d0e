"""A directory of a run's checkpoints: ``DIR/step-00000012`` for the checkpoint after step 12,
each an atomic tp_ext checkpoint (a symlink onto ``step-00000012.versions/v-.../``).

Only published checkpoints count: a save killed before it was published leaves a
``step-N.versions`` directory without its ``step-N`` link, which :func:`newest` never takes and
:func:`remove_unpublished` deletes. These run on one rank (rank 0) over a shared file system.
"""

from __future__ import annotations

import os
import re
import shutil
from typing import Optional

from tp_ext.checkpoint import CheckpointError, complete_checkpoint
from tp_ext.checkpoint.atomic import VERSIONS

__all__ = ["step_path", "published", "newest", "remove_unpublished", "keep_newest"]

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
