"""Everything that talks across ranks: the parallel groups on DeviceMesh (:mod:`.mesh`), the one
group resolver (:mod:`.groups`), every collective called from Python (:mod:`.comm`), the TP random
streams (:mod:`.rng`) and the accounting and settings of the C++ communication layer
(:mod:`.accounting`). The one process-wide state is :mod:`.state`."""

from tp_ext.distributed import accounting, comm, rng
from tp_ext.distributed.groups import GroupLike, ResolvedGroup, default_group, resolve_group
from tp_ext.distributed.mesh import (
    ParallelState,
    destroy_parallel,
    init_parallel,
    launcher_store,
    parallel_state,
)

__all__ = [
    "accounting",
    "comm",
    "rng",
    "GroupLike",
    "ResolvedGroup",
    "default_group",
    "resolve_group",
    "ParallelState",
    "destroy_parallel",
    "init_parallel",
    "launcher_store",
    "parallel_state",
]
