"""The one piece of process-wide state tp_ext keeps: the parallel groups made by
:func:`tp_ext.init_parallel`, the TP random streams, and whether layers initialise their weights
while being built. Everything else is passed explicitly (groups, plans, configs).

One object, so a reader finds every global in one place and a test can reset all of it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

__all__ = ["ProcessState", "PROCESS"]


@dataclasses.dataclass
class ProcessState:
    # the ParallelState of init_parallel (tp_ext.distributed.mesh), None before it
    parallel: Optional[Any] = None
    # TP random stream (tp_ext.distributed.rng): this rank's place in it (None before
    # manual_seed), and how many tp_rng() blocks are open
    tp_rng_rank: Optional[int] = None
    tp_rng_depth: int = 0
    # False while layers are built to be loaded right after (tp_ext.layers.base.no_init)
    init_weights: bool = True
    # every rank's (pid, host) per group name, to name dead ranks (tp_ext.distributed.peers)
    peers: dict[str, list[tuple[int, str]]] = dataclasses.field(default_factory=dict)
    # groups of the first and last pipeline rank, per dims (tp_ext.distributed.mesh)
    tied_groups: dict[int, dict] = dataclasses.field(default_factory=dict)
    # the gloo group of DCP's background checkpoint writes (tp_ext.checkpoint.dcp)
    async_checkpoint_group: Optional[Any] = None

    def reset(self) -> None:
        self.parallel, self.tp_rng_rank, self.tp_rng_depth, self.init_weights = None, None, 0, True
        self.peers.clear()
        self.tied_groups.clear()
        self.async_checkpoint_group = None


PROCESS = ProcessState()
