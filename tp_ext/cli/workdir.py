"""The work directory of ``tp-ext run``: where its checkpoints go.

- Default: a fresh private directory (``tempfile.mkdtemp``: a new unpredictable name, mode
  0700) made by rank 0, whose path the other ranks receive as bytes through
  ``comm.broadcast``; removed at the end. Two jobs never share it, and no other user can have
  prepared it.
- ``--workdir DIR``: kept. DIR is created if absent; an existing DIR must be empty or one an
  earlier ``tp-ext run`` wrote (it holds :data:`MARKER`). Anything else is refused, so a
  user's files are never mixed with or overwritten by checkpoints.
"""

from __future__ import annotations

import os
import tempfile

from tp_ext.distributed import comm

__all__ = ["MARKER", "check_workdir", "make_workdir", "share_path"]

MARKER = ".tp_ext_workdir"
_MAX_PATH_BYTES = 4096  # PATH_MAX on Linux


def check_workdir(workdir: str) -> str:
    """The absolute path of ``--workdir``, or a ValueError saying why it cannot be used. Called
    on every rank before torch.distributed starts."""
    path = os.path.abspath(os.path.expanduser(workdir))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"--workdir {workdir!r} is a file, not a directory")
    if os.path.isdir(path):
        entries = sorted(os.listdir(path))
        if entries and MARKER not in entries:
            shown = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
            raise ValueError(
                f"--workdir {workdir!r} is not empty ({shown}) and was not made by tp-ext run "
                f"(no {MARKER} in it); give a new or empty directory"
            )
    if len(os.fsencode(path)) > _MAX_PATH_BYTES:
        raise ValueError(f"--workdir is longer than {_MAX_PATH_BYTES} bytes")
    return path


def make_workdir(workdir: str | None) -> str:
    """Rank 0's side: create the directory (``workdir`` checked by :func:`check_workdir`, or a
    fresh private temporary one when None) and mark it as tp_ext's."""
    if workdir is None:
        path = tempfile.mkdtemp(prefix="tp_ext_run_")  # mode 0700, a name no one can predict
    else:
        path = check_workdir(workdir)  # again: it may have changed since the first check
        os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, MARKER), "w") as f:
        f.write("written by tp-ext run; checkpoints below may be replaced by the next run\n")
    return path


def share_path(path: str | None, group) -> str:
    """Rank 0's ``path`` on every rank of ``group`` (other ranks pass None), as bytes through
    ``comm.broadcast_text`` (no pickle)."""
    return comm.broadcast_text("" if path is None else path, 0, group)
