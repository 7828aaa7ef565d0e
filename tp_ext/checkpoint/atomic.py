"""Atomic, versioned checkpoint directories.

A checkpoint at ``<path>`` is a symlink to one version, ``<path>.versions/v-<unique>/``:

- every save writes a fresh private version directory (a unique name, never reused), holding an
  exclusive lock on ``<version>.lock`` while it writes;
- it is published by one ``os.replace`` of a new symlink onto ``<path>``: readers see the old
  version or the new one, never a mix; of two concurrent saves, the later publish wins whole;
- readers hold a shared lock on the version they read, and old versions are removed only when
  nobody holds their lock, so a load that resolved the old version finishes reading it;
- a save killed at any point leaves ``<path>`` on the last published version; its unpublished
  directory is removed by a later save.

The user's own symlinks (``<path>`` pointing at a directory elsewhere) are followed: the
checkpoint goes where they point. A plain directory with a manifest (the previous format, a
rename-committed directory) still loads, and the first save over it moves it aside.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import time
import uuid
from typing import Optional

from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.manifest import (
    MANIFEST,
    check_files,
    hash_files,
    read_manifest,
    write_manifest,
)
from tp_ext.distributed import comm

__all__ = [
    "saving",
    "start_save",
    "commit_save",
    "abandon_save",
    "reading",
    "complete_checkpoint",
    "remove_unused_versions",
]

VERSIONS = ".versions"


def checkpoint_target(path) -> str:
    """``path`` made absolute, with the user's symlinks followed (ours, into ``.versions``,
    are the checkpoint itself and are kept)."""
    p = os.path.abspath(os.fspath(path))
    for _ in range(40):
        if not os.path.islink(p) or _is_version_link(p):
            return p
        p = os.path.abspath(os.path.join(os.path.dirname(p), os.readlink(p)))
    raise CheckpointError(f"checkpoint path {path}: too many levels of symbolic links")


def _is_version_link(p: str) -> bool:
    return os.path.dirname(os.readlink(p)) == os.path.basename(p) + VERSIONS


def _current(target: str) -> Optional[str]:
    """The version directory ``target`` points at now (None: not a versioned checkpoint)."""
    try:
        link = os.readlink(target)
    except OSError:
        return None
    return os.path.join(os.path.dirname(target), link)


def _lock(directory: str, shared: bool, wait: bool = True):
    """An open file holding a lock on version ``directory``; None if it is missing or (without
    ``wait``) taken."""
    try:
        fd = os.open(directory + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return None
    flags = (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | (0 if wait else fcntl.LOCK_NB)
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


# ---- saving -------------------------------------------------------------------------------------


class Staging:
    """A save in progress: ``directory`` to write into, published onto ``target``."""

    def __init__(self, target: str, directory: str, lock: Optional[int]) -> None:
        self.target, self.directory, self._lock = target, directory, lock


def _check_replaceable(target: str) -> None:
    if os.path.isdir(target) and not os.path.islink(target):
        if os.listdir(target) and not os.path.isfile(os.path.join(target, MANIFEST)):
            raise CheckpointError(
                f"{target} is a directory that is not a tp_ext checkpoint (no {MANIFEST}); "
                "refusing to replace it: save to a new path, or remove it first"
            )


def start_save(path, group) -> Staging:
    """A fresh private version directory for one save (a collective: rank 0 creates it and
    locks it; every rank gets its name)."""
    g = comm.resolve_group(group)

    def create():
        if g.rank != 0:
            return None, None
        target = checkpoint_target(path)
        _check_replaceable(target)
        versions = target + VERSIONS
        name = f"v-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:12]}"
        directory = os.path.join(versions, name)
        try:
            os.makedirs(versions, exist_ok=True)
            fd = os.open(directory + ".lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)  # before the directory exists: never seen unlocked
            os.mkdir(directory)
        except OSError as e:
            raise CheckpointError(f"cannot save a checkpoint at {path}: {e}") from None
        return directory, fd

    directory, fd = comm.everywhere(g, f"saving {path}", create, CheckpointError)
    directory = comm.broadcast_text(directory or "", 0, g)
    return Staging(os.path.dirname(directory)[: -len(VERSIONS)], directory, fd)


@contextlib.contextmanager
def saving(path, group, info: dict):
    """A collective save of ``path``: the block writes into the yielded version directory, then
    :func:`commit_save` publishes it. An error anywhere removes the unpublished version and is
    raised on every rank."""
    g = comm.resolve_group(group)
    staging = start_save(path, g)
    try:
        yield staging.directory
        commit_save(staging, g, info, path)
    except BaseException as e:
        error = abandon_save(staging, g, path, e)
        if error is e:
            raise
        raise error from e


def commit_save(staging: Staging, group, info: dict, path) -> None:
    """Publish a save whose files are all written (a collective): every file is hashed (split
    over the ranks), then rank 0 writes the manifest with ``info`` and publishes."""
    g = comm.resolve_group(group)
    mine = comm.everywhere(
        g, f"saving {path}", lambda: hash_files(staging.directory, g), CheckpointError
    )
    hashes = {}
    for text in comm.all_gather_text(json.dumps(mine), g):
        hashes.update(json.loads(text))

    def commit():
        if g.rank == 0:
            write_manifest(staging.directory, info, hashes)
            publish(staging)

    comm.everywhere(g, f"saving {path}", commit, CheckpointError)


def abandon_save(staging: Staging, group, path, error: BaseException) -> BaseException:
    """After ``error`` ended a save: rank 0 removes the unpublished version. Returns the error to
    raise (an OSError, such as a full disk, becomes a CheckpointError)."""
    if comm.resolve_group(group).rank == 0 and staging._lock is not None:
        _abandon(staging)
    if isinstance(error, OSError):
        return CheckpointError(f"saving {path}: {error}")
    return error


def _abandon(staging: Staging) -> None:
    shutil.rmtree(staging.directory, ignore_errors=True)
    with contextlib.suppress(OSError):
        os.unlink(staging.directory + ".lock")
    with contextlib.suppress(OSError):
        os.close(staging._lock)
    staging._lock = None


def publish(staging: Staging) -> None:
    """Make ``staging`` the checkpoint at its target in one atomic step (rank 0 only), then
    remove versions nobody reads any more."""
    target = staging.target
    name = os.path.basename(staging.directory)
    link = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{name}.link")
    os.symlink(os.path.join(os.path.basename(target) + VERSIONS, name), link)
    if os.path.isdir(target) and not os.path.islink(target):
        _move_aside(target)
    os.replace(link, target)
    _fsync_dir(os.path.dirname(target))
    os.close(staging._lock)
    staging._lock = None  # published: from here on nothing removes it
    with contextlib.suppress(OSError):  # the save is done; leftovers go at the next one
        remove_unused_versions(target)


def _move_aside(target: str) -> None:
    """A plain directory at ``target`` (an empty one, or a checkpoint of the rename format) makes
    way for the symlink; a kill before the symlink lands leaves it loadable as ``<path>.old``."""
    _check_replaceable(target)
    if not os.listdir(target):
        os.rmdir(target)
        return
    shutil.rmtree(target + ".old", ignore_errors=True)
    os.rename(target, target + ".old")


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_unused_versions(target: str) -> None:
    """Remove every version that is not current, not being written and not being read (their
    lock is free), and what the rename format left (``.old``, ``.partial``)."""
    versions = target + VERSIONS
    for name in sorted(os.listdir(versions)):
        directory = os.path.join(versions, name)
        if name.startswith("trash-"):  # a cleanup killed halfway
            shutil.rmtree(directory, ignore_errors=True)
            continue
        if not name.startswith("v-") or name.endswith(".lock"):
            continue
        fd = _lock(directory, shared=False, wait=False)
        if fd is None:
            continue
        try:
            if _current(target) == directory:
                continue
            trash = os.path.join(versions, "trash-" + name)
            os.rename(directory, trash)  # readers that resolved it see it gone, and re-resolve
            os.unlink(directory + ".lock")
        finally:
            os.close(fd)
        shutil.rmtree(trash, ignore_errors=True)
    parent, base = os.path.split(target)
    for name in os.listdir(parent):  # symlinks of saves killed before they were swapped in
        if name.startswith(f".{base}.v-") and name.endswith(".link"):
            version = os.path.join(versions, name[len(base) + 2 : -len(".link")])
            if not os.path.exists(version):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(parent, name))
    for leftover in (target + ".old", target + ".partial"):
        shutil.rmtree(leftover, ignore_errors=True)


# ---- reading ------------------------------------------------------------------------------------


def _resolve(path) -> tuple[str, Optional[int]]:
    """The directory to read for ``path`` and the shared lock held on it (None: unversioned)."""
    target = checkpoint_target(path)
    previous = None
    for _ in range(100):
        current = _current(target)
        if current is None:
            break
        fd = _lock(current, shared=True)
        if fd is not None and os.path.isdir(current):
            return current, fd
        if fd is not None:
            os.close(fd)  # removed between resolving and locking: a newer one is current
        if current == previous:  # still the same missing version: nothing newer is coming
            raise CheckpointError(f"checkpoint {path} points at {current}, which is missing")
        previous = current
    else:
        raise CheckpointError(f"{path}: the checkpoint kept changing while it was resolved")
    if os.path.exists(target):  # a plain directory (or file), not saved by versions
        return target, None
    if os.path.isfile(os.path.join(target + ".old", MANIFEST)):  # a rename-format save killed
        return target + ".old", None
    raise CheckpointError(f"checkpoint path {path} does not exist")


@contextlib.contextmanager
def reading(path, group=None):
    """The directory to read for ``path``, kept from removal by a shared lock until the block
    ends. Every rank resolves its own ``path``; where they land on different versions of one
    checkpoint (a save published in between), all read rank 0's."""
    g = comm.resolve_group(group)
    directory, fd = comm.everywhere(g, f"loading {path}", lambda: _resolve(path), CheckpointError)
    first = comm.broadcast_text(directory, 0, g)
    if (
        first != directory
        and _is_version(first)
        and os.path.dirname(first) == os.path.dirname(directory)
    ):
        if fd is not None:
            os.close(fd)
        directory, fd = first, _lock(first, shared=True)  # rank 0 holds it: it still exists
    try:
        yield directory
    finally:
        if fd is not None:
            os.close(fd)


def _is_version(directory: str) -> bool:
    return os.path.dirname(directory).endswith(VERSIONS)


def complete_checkpoint(path) -> str:
    """The directory holding the complete checkpoint for ``path`` (its current version), after
    checking it against its manifest. Not locked: a later save may remove it; tp_ext's loads
    hold :func:`reading` while they read."""
    directory, fd = _resolve(path)
    try:
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            raise CheckpointError(
                f"{path} is not a complete tp_ext checkpoint: {MANIFEST} is missing"
            )
        check_files(directory, read_manifest(directory), hashes=False)
    finally:
        if fd is not None:
            os.close(fd)
    return directory
