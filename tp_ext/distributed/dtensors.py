"""DTensor checks that do not import DTensor.

``torch.distributed.tensor`` costs over a second at import (it pulls in sympy), which every rank of
every launch would pay for a class most runs never instantiate (only FSDP2 and DCP make
DTensors). A process that has not imported it cannot hold a DTensor, so these look the class up
only when its module is already loaded.
"""

from __future__ import annotations

import sys

import torch

__all__ = ["is_dtensor", "local_tensor"]


def is_dtensor(tensor) -> bool:
    """Whether ``tensor`` is a ``torch.distributed.tensor.DTensor``."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The rank's own piece of a DTensor; any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor
