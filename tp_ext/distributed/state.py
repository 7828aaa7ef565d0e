"""The one piece of process-wide state tp_ext keeps: the parallel layout made by
:func:`tp_ext.init_parallel`, the TP random streams, and whether layers initialise their weights
while being built. Everything else is passed explicitly (groups, plans, configs).

One object, so a reader finds every global in one place and a test can reset all of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

__all__ = ["ProcessState", "PROCESS"]


@dataclasses.dataclass
class ProcessState:
    # the ParallelState of init_parallel (tp_ext.distributed.mesh), None before it
    parallel: Optional[Any] = None
    # TP random stream: the seed of this rank's stream and its saved state per device type
    tp_seed: Optional[int] = None
    tp_rng_states: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    # False while layers are built to be loaded right after (tp_ext.layers.base.no_init)
    init_weights: bool = True

    def reset(self) -> None:
        self.parallel, self.tp_seed, self.init_weights = None, None, True
        self.tp_rng_states.clear()


PROCESS = ProcessState()
