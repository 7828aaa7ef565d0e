"""Atomic checkpoint directories: every save goes to ``<path>.partial`` and becomes ``<path>`` by
a rename after a manifest (``tp_ext_checkpoint.json``: the size of every file) is written, so a
killed save leaves the previous checkpoint intact and a half-written one is never loaded."""

from __future__ import annotations

import json
import os
import shutil

from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.distributed import comm

__all__ = ["MANIFEST", "write_manifest", "commit", "complete_checkpoint", "start_save"]

MANIFEST = "tp_ext_checkpoint.json"


def write_manifest(directory: str, info: dict) -> None:
    """Last step of a save: the sizes of every file, fsynced, then the manifest itself."""
    files = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and name != MANIFEST:
            with open(full, "rb") as f:
                os.fsync(f.fileno())
            files[name] = os.path.getsize(full)
    temp = os.path.join(directory, MANIFEST + ".tmp")
    with open(temp, "w") as f:
        json.dump({**info, "files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(directory, MANIFEST))


def commit(partial: str, path: str) -> None:
    """Make ``partial`` the checkpoint at ``path``; the old one stays loadable until the swap
    (and, if killed between the two renames, as ``<path>.old``, which loads find)."""
    old = path + ".old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(partial, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def complete_checkpoint(path: str) -> str:
    """The directory holding the complete checkpoint for ``path``: ``path`` itself, or
    ``<path>.old`` when a save was killed between its two renames. A directory without a
    manifest, or whose files' sizes differ from it, is an error naming what is wrong."""
    path = os.fspath(path)
    for candidate in (path, path + ".old"):
        manifest = os.path.join(candidate, MANIFEST)
        if os.path.isfile(manifest):
            break
    else:
        hint = (
            f" ({path}.partial holds an interrupted save)"
            if os.path.isdir(path + ".partial")
            else ""
        )
        raise CheckpointError(
            f"{path} is not a complete tp_ext checkpoint: {MANIFEST} is missing{hint}"
        )
    try:
        with open(manifest) as f:
            info = json.load(f)
        sizes = dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is unreadable: {e}") from None
    for name, size in sizes.items():
        full = os.path.join(candidate, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(
                f"checkpoint file {full} has {os.path.getsize(full)} bytes, "
                f"the manifest says {size}: truncated or overwritten"
            )
    return candidate


def start_save(path: str, group) -> str:
    partial = os.fspath(path) + ".partial"
    if comm.resolve_group(group).rank == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)  # left by a killed save
        os.makedirs(partial)
    comm.barrier(group)
    return partial
