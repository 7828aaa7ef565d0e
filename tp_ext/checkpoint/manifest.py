"""The manifest of a tp_ext checkpoint, ``tp_ext_checkpoint.json``: every file's size and sha256,
every tensor's dtype, and what the saver adds (format, TP degree, step, model config). Written
last, before the save is published; checked before anything is read."""

from __future__ import annotations

import hashlib
import json
import os

from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.safetensors_io import file_inside, header_dtypes
from tp_ext.distributed import comm

__all__ = [
    "MANIFEST",
    "hash_files",
    "write_manifest",
    "read_manifest",
    "check_files",
    "check_listed",
]

MANIFEST = "tp_ext_checkpoint.json"


def _sha256(path: str, sync: bool = False) -> str:
    with open(path, "rb") as f:
        if sync:  # saving: the bytes hashed are on disk before the save is published
            os.fsync(f.fileno())
        return hashlib.file_digest(f, "sha256").hexdigest()


def _mine(names: list[str], group) -> list[str]:
    """This rank's share of ``names`` (file i to rank i mod size): hashing is split over ranks,
    which share the checkpoint's file system."""
    g = comm.resolve_group(group)
    return names[g.rank :: g.size]


def hash_files(directory: str, group=None) -> dict[str, str]:
    """sha256 of this rank's share of the files in ``directory`` (every file, over the group)."""
    return {
        n: _sha256(os.path.join(directory, n), sync=True) for n in _mine(_files(directory), group)
    }


def _files(directory: str) -> list[str]:
    return sorted(
        n
        for n in os.listdir(directory)
        if n != MANIFEST and os.path.isfile(os.path.join(directory, n))
    )


def write_manifest(directory: str, info: dict, hashes: dict[str, str]) -> None:
    """The last file of a save: every file's size and sha256 (``hashes``, from every rank's
    :func:`hash_files`), every tensor's dtype, and ``info``."""
    files, dtypes = {}, {}
    for name in _files(directory):
        full = os.path.join(directory, name)
        files[name] = {"size": os.path.getsize(full), "sha256": hashes[name]}
        if name.endswith(".safetensors"):
            dtypes.update(header_dtypes(full))
    temp = os.path.join(directory, MANIFEST + ".tmp")
    with open(temp, "w") as f:
        json.dump({**info, "files": files, "dtypes": dict(sorted(dtypes.items()))}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(directory, MANIFEST))


def read_manifest(directory: str) -> dict:
    manifest = os.path.join(directory, MANIFEST)
    try:
        with open(manifest) as f:
            info = json.load(f)
        if not isinstance(info.get("files"), dict):
            raise ValueError('no "files" mapping')
    except (OSError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{manifest} is unreadable: {e}") from None
    return info


def check_listed(directory: str, info: dict, paths) -> None:
    """Only files the manifest lists are read: ``paths`` (what a load is about to read) must
    all be among them."""
    for path in paths:
        if os.path.basename(path) not in info["files"]:
            raise CheckpointError(
                f"{path} would be read, but {os.path.join(directory, MANIFEST)} does not "
                "list it: it was added after the save"
            )


def check_files(directory: str, info: dict, hashes: bool = True, group=None) -> None:
    """Every file the manifest lists is inside ``directory``, has its size and its tensors
    their dtypes; with ``hashes``, this rank's share of the files (every file, over the group)
    has its sha256. Errors name the file, what the manifest says and what was found."""
    dtypes = info.get("dtypes", {})
    for name, entry in sorted(info["files"].items()):
        full = file_inside(directory, name, MANIFEST)
        # manifests of the rename format hold only sizes
        size = entry if isinstance(entry, int) else entry.get("size")
        found = os.path.getsize(full)
        if found != size:
            raise CheckpointError(
                f"checkpoint file {full} has {found} bytes, the manifest says {size}: "
                "truncated or overwritten"
            )
        if name.endswith(".safetensors") and dtypes:
            for tensor, dtype in header_dtypes(full).items():
                if dtypes.get(tensor) != dtype:
                    raise CheckpointError(
                        f"tensor {tensor!r} in {full} is stored as {dtype}, the manifest says "
                        f"{dtypes.get(tensor, 'no such tensor')}: the file was modified after "
                        "the save"
                    )
    if not hashes:
        return
    for name in _mine(sorted(info["files"]), group):
        expected = info["files"][name]
        if isinstance(expected, dict) and "sha256" in expected:
            found = _sha256(os.path.join(directory, name))
            if found != expected["sha256"]:
                raise CheckpointError(
                    f"checkpoint file {os.path.join(directory, name)} has sha256 {found}, the "
                    f"manifest says {expected['sha256']}: modified or corrupt"
                )
