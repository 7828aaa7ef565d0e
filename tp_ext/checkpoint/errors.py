"""The error every checkpoint failure becomes."""

from __future__ import annotations

__all__ = ["CheckpointError"]


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the tensor or file."""
