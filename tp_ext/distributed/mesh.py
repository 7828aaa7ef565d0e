"""Process groups for TP x CP x PP x DP on torch's DeviceMesh.

Rank order: mesh shape ``(pp, dp, cp, tp)`` with ``tp`` innermost, so the ranks of one TP group
are adjacent (``0..tp-1``, ``tp..2tp-1``, ...) and sit inside one node under torchrun, where TP's
frequent all-reduces belong; context parallelism (CP, its ring) comes next, DP groups stride by
``cp * tp``, and PP is outermost. This is Megatron's order.

Expert parallelism (``ep=E``) takes its groups from the ranks of one pipeline stage, as
Megatron-Core and torchtitan do: from the DP ranks when E divides dp (E consecutive DP ranks of
one TP position), else from all DP ranks and E / dp consecutive TP ranks (E / dp dividing tp).
The expert-DP group of a rank is the ranks of its stage at the same place in their EP groups:
they hold the same experts, and expert gradients are averaged over them. With context
parallelism, EP groups form at each CP position and the expert-DP groups span the CP positions.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from tp_ext.dims import ParallelDims
from tp_ext.distributed import async_groups, peers
from tp_ext.distributed.grid import TPGrid, make_tp_grid
from tp_ext.distributed.state import PROCESS

__all__ = [
    "ParallelState",
    "init_parallel",
    "parallel_state",
    "destroy_parallel",
    "expert_groups",
    "tied_embedding_group",
    "launcher_store",
]

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclasses.dataclass(frozen=True)
class ParallelState:
    """The groups :func:`init_parallel` made for ``dims`` (resolved: every degree filled) and
    this rank's place in them. Every group is always there (a group of one rank where a degree
    is 1), so nothing needs to ask whether a form is on: ``dims`` says (``dims.cp_enabled``,
    ``dims.grid``, ...). ``tp``, ``pp``, ``dp``, ``ep`` and ``cp`` read ``dims`` (``tp`` is the
    TP group's size, P * Q for a grid; ``tp_grid`` then holds the grid's row and column groups,
    and is None for 1D tensor parallelism)."""

    mesh: DeviceMesh
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    dims: ParallelDims
    rank: int
    device: torch.device
    backend: str
    ep_group: dist.ProcessGroup  # the ranks that share out the experts
    expert_dp_group: dist.ProcessGroup  # the ranks holding the same experts
    cp_group: dist.ProcessGroup  # the ranks that share each sequence
    # the DP and CP ranks of this TP position and stage, which hold the same (dense) weights:
    # the group their gradients are synchronised over (the DP group itself when cp == 1)
    dp_cp_group: dist.ProcessGroup
    tp_grid: Optional[TPGrid] = None  # tp=(P, Q): the 2D grid of the TP ranks

    @property
    def tp(self) -> int:
        return self.dims.tp_size

    @property
    def pp(self) -> int:
        return self.dims.pp

    @property
    def dp(self) -> int:
        return self.dims.dp

    @property
    def ep(self) -> int:
        return self.dims.ep

    @property
    def cp(self) -> int:
        return self.dims.cp

    @property
    def cp_rank(self) -> int:
        return self.cp_group.rank()

    @property
    def tp_rank(self) -> int:
        return self.tp_group.rank()

    @property
    def pp_rank(self) -> int:
        return self.pp_group.rank()

    @property
    def ep_rank(self) -> int:
        return self.ep_group.rank()

    @property
    def dp_rank(self) -> int:
        return self.dp_group.rank()


def parallel_state() -> ParallelState:
    """The parallel state made by :func:`init_parallel` in this process."""
    if PROCESS.parallel is None:
        raise RuntimeError("tp_ext.init_parallel(tp=...) has not been called in this process")
    return PROCESS.parallel


def expert_groups(mesh_ranks, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(EP groups, expert-DP groups) as lists of global ranks, from the ``[pp, dp, tp]`` array of
    global ranks (see the module doc)."""
    pp, dp, tp = mesh_ranks.shape
    ep_groups, edp_groups = [], []
    for p in range(pp):
        stage = mesh_ranks[p]
        if dp % ep == 0:  # E consecutive DP ranks at one TP position
            blocks = [
                [(k * ep + j, t) for j in range(ep)] for t in range(tp) for k in range(dp // ep)
            ]
        else:  # every DP rank and E / dp consecutive TP ranks
            width = ep // dp
            blocks = [[(d, m * width + u) for d in range(dp) for u in range(width)]
                      for m in range(tp // width)]  # fmt: skip
        ep_groups += [[int(stage[d, t]) for d, t in block] for block in blocks]
        # the same place in every EP group of the stage (and, with TP inside the experts, the
        # same TP position): the ranks that hold the same expert shards
        per_place: dict = {}
        for block in blocks:
            for j, (d, t) in enumerate(block):
                key = (j, t) if dp % ep == 0 else j
                per_place.setdefault(key, []).append(int(stage[d, t]))
        edp_groups += [sorted(ranks) for ranks in per_place.values()]
    return ep_groups, edp_groups


def launcher_store(timeout: datetime.timedelta = DEFAULT_TIMEOUT) -> Optional[dist.Store]:
    """torchrun's agent store, shared by every restart of one ``torchrun`` invocation (and
    nothing else): a place for what a job must remember across its restarts. None when not
    launched by torchrun with its agent store."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return dist.TCPStore(
        host_name=os.environ["MASTER_ADDR"],
        port=int(os.environ["MASTER_PORT"]),
        world_size=int(os.environ["WORLD_SIZE"]),
        is_master=False,
        timeout=timeout,
    )


def _attempt_store(timeout: datetime.timedelta):
    """Under torchrun's agent store, a store whose keys are this restart's own.

    Why: torch (2.13) has workers of every restart share the agent's TCPStore without a prefix
    per attempt, so after torchrun restarts a group, a worker can read the gloo address a
    killed worker published in the previous attempt and fail to connect (or wait forever),
    whenever the workers take more than a moment to start. Keys under
    ``tp_ext/attempt_<TORCHELASTIC_RESTART_COUNT>`` are never stale. None: not under torchrun's
    agent store (``env://`` as usual)."""
    store = launcher_store(timeout)
    if store is None:
        return None
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"tp_ext/attempt_{attempt}", store)


def _lost_rendezvous(error: Exception, timeout: datetime.timedelta) -> RuntimeError:
    """torch's bare "Connection was likely closed", said as what it means at a rendezvous: the
    rank hosting the store (rank 0, or torchrun's agent) is gone, most often because it gave up
    at the timeout waiting for a rank that never started."""
    where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    return RuntimeError(
        f"init_parallel: rank {os.environ.get('RANK', '?')} of {os.environ.get('WORLD_SIZE', '?')} "
        f"lost the rendezvous store at {where} before every rank joined: its host exited, most "
        f"likely because it timed out waiting for a rank that never started (this rank's "
        f"timeout is {timeout.total_seconds():g} s), or it crashed; see its own error. Every "
        f"rank must be launched (torchrun --nproc-per-node N). ({error})"
    )


def default_backend() -> str:
    """NCCL when each rank of this node can have a GPU of its own, else gloo: NCCL refuses two
    ranks on one device, so 8 ranks on a 1-GPU machine run on CPU with gloo (and say so)."""
    if not torch.cuda.is_available():
        return "gloo"
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count()
    if gpus >= local_world:
        return "nccl"
    warnings.warn(
        f"{local_world} ranks per node but {gpus} GPU(s): NCCL needs a GPU per rank, so the "
        "process group uses gloo on CPU. Launch at most one rank per GPU to use NCCL, or pass "
        "backend='gloo' to silence this.",
        stacklevel=3,
    )
    return "gloo"


def init_parallel(
    tp,
    pp: int = 1,
    dp: Optional[int] = None,
    ep: int = 1,
    backend: Optional[str] = None,
    timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    cp: int = 1,
) -> ParallelState:
    """Set up TP/PP/DP groups (and the default process group from torchrun's env:// variables
    if it is not up yet). Backend: NCCL when every local rank can have its own GPU, else gloo
    (:func:`default_backend`), unless ``backend`` says.
    ``timeout`` bounds every collective, so a dead rank makes the others fail instead of waiting.

    The degrees: a :class:`tp_ext.ParallelDims` as the first argument
    (``init_parallel(ParallelDims(tp=2, pp=2))``), or ``tp``, ``pp``, ``dp``, ``ep`` as keywords;
    either way :meth:`ParallelDims.resolve` fills what is left over the world size (``dp=None``:
    the ranks TP and PP leave) and names a degree that does not fit. ``state.dims`` holds them.
    ``tp=(P, Q)``: 2D tensor parallelism on a P x Q grid of P * Q TP ranks (``state.tp_grid``,
    :class:`tp_ext.distributed.grid.TPGrid`); ``state.tp`` is then P * Q. ``ep=E``: expert
    parallelism over E ranks of each pipeline stage (``state.ep_group``,
    ``state.expert_dp_group``; see the module doc). ``cp=C``: context parallelism, each
    sequence's positions split over C ranks (``state.cp_group``; :mod:`tp_ext.layers.context`).
    Called again with the same degrees, it returns the same state (making groups again would be
    a collective).
    """
    dims = _dims_from(tp, pp, dp, ep, cp)  # bad values are refused before any rank connects
    if not dist.is_initialized():
        _init_process_group(backend, timeout)
    dims = dims.resolve(dist.get_world_size(), world_name="world size")
    current = PROCESS.parallel
    if current is not None and current.dims == dims:
        return current  # same degrees: reuse the groups (making them again is a collective)
    PROCESS.parallel = _make_state(dims)
    peers.record(dist.group.WORLD)  # lets errors name a rank that died (one small all-gather)
    return PROCESS.parallel


def _dims_from(tp, pp, dp, ep, cp) -> ParallelDims:
    """The degrees init_parallel was given: a ParallelDims, or its keyword arguments."""
    if not isinstance(tp, ParallelDims):
        dims = ParallelDims(tp=tp, pp=pp, dp=dp, ep=ep, cp=cp)
    else:
        defaults = {"pp": 1, "dp": None, "ep": 1, "cp": 1}
        also = {k: v for k, v in zip(defaults, (pp, dp, ep, cp)) if v != defaults[k]}
        if also:
            raise ValueError(
                f"init_parallel: got {tp!r} and also {also}: give the degrees either as a "
                "ParallelDims or as tp=, pp=, dp=, ep=, cp=, not both (ParallelDims.replace "
                "changes one)"
            )
        dims = tp
    return dims


def _init_process_group(backend: Optional[str], timeout: datetime.timedelta) -> None:
    """The default process group, from torchrun's env:// variables."""
    missing = [
        v for v in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ
    ]
    if missing:
        raise RuntimeError(
            f"init_parallel needs torchrun's environment; {', '.join(missing)} not set. Launch "
            "with `torchrun --nproc-per-node N script.py`, or call "
            "torch.distributed.init_process_group yourself first."
        )
    if backend is None:
        backend = default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    store = _attempt_store(timeout)
    try:
        if store is None:
            dist.init_process_group(backend=backend, init_method="env://", timeout=timeout)
        else:
            dist.init_process_group(
                backend=backend,
                store=store,
                rank=int(os.environ["RANK"]),
                world_size=int(os.environ["WORLD_SIZE"]),
                timeout=timeout,
            )
    except dist.DistNetworkError as e:
        if "closed" not in str(e):  # not a lost store (no store at that address, ...)
            raise
        raise _lost_rendezvous(e, timeout) from e


def _make_state(dims: ParallelDims) -> ParallelState:
    """The mesh and every group of ``dims`` (resolved), and this rank's state in them."""
    backend = dist.get_backend()
    tp = dims.tp_size
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    if tp > local_world or local_world % tp:
        warnings.warn(
            f"tp={tp} does not fit inside a node of {local_world} ranks: TP all-reduces will "
            "cross nodes. Prefer a tp that divides the ranks per node.",
            stacklevel=3,
        )
    device_type = "cuda" if backend == "nccl" else "cpu"
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if device_type == "cuda"
        else torch.device("cpu")
    )
    mesh = init_device_mesh(
        device_type, (dims.pp, dims.dp, dims.cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp")
    )
    tp_grid = None
    if dims.grid is not None:
        every_tp_group = mesh.mesh.reshape(-1, tp).tolist()  # [pp * dp TP groups][tp ranks]
        tp_grid = make_tp_grid(*dims.grid, mesh.get_group("tp"), all_tp_ranks=every_tp_group)
    return ParallelState(
        mesh=mesh,
        tp_group=mesh.get_group("tp"),
        pp_group=mesh.get_group("pp"),
        dp_group=mesh.get_group("dp"),
        cp_group=mesh.get_group("cp"),
        dims=dims,
        rank=dist.get_rank(),
        device=device,
        backend=backend,
        tp_grid=tp_grid,
        dp_cp_group=_dp_cp_group(mesh) if dims.cp_enabled else mesh.get_group("dp"),
        **_expert_process_groups(mesh, dims.ep),
    )


def _dp_cp_group(mesh: DeviceMesh) -> dist.ProcessGroup:
    """This rank's group of the DP x CP ranks at its stage and TP position (every rank makes
    every group: a collective)."""
    ranks = mesh.mesh  # [pp, dp, cp, tp]
    me, mine = dist.get_rank(), None
    for p in range(ranks.shape[0]):
        for t in range(ranks.shape[3]):
            members = sorted(int(r) for r in ranks[p, :, :, t].flatten())
            group = dist.new_group(members)
            if me in members:
                mine = group
    return mine


def _expert_process_groups(mesh: DeviceMesh, ep: int) -> dict:
    """This rank's EP and expert-DP groups (every rank makes every group: a collective). With
    context parallelism each CP position has its own EP groups (its tokens are its positions),
    and the expert-DP group spans the CP positions: they hold the same experts."""
    ep_groups, edp_groups = [], []
    by_place: dict = {}
    for c in range(mesh.mesh.size(2)):
        eps, edps = expert_groups(mesh.mesh[:, :, c, :], ep)
        ep_groups += eps
        for i, ranks in enumerate(edps):  # the i-th expert-DP group at every CP position
            by_place.setdefault(i, []).extend(ranks)
    edp_groups = [sorted(ranks) for ranks in by_place.values()]
    me = dist.get_rank()
    out = {}
    for key, lists in (("ep_group", ep_groups), ("expert_dp_group", edp_groups)):
        for ranks in lists:
            group = dist.new_group(ranks)
            if me in ranks:
                out[key] = group
    return out


def tied_embedding_group(state: ParallelState) -> Optional[dist.ProcessGroup]:
    """The group of the first and last pipeline rank with this rank's (dp, tp) position, over
    which a tied embedding's two copies (embedding on the first stage, LM head on the last) are
    kept equal; None on the ranks in between, and when pp == 1. Made on first use by every rank
    (making groups is a collective), then kept with the state."""
    if state.pp == 1:
        return None
    groups = PROCESS.tied_groups.get(id(state))
    if groups is None:
        ranks = state.mesh.mesh  # [pp, dp, cp, tp] -> global rank
        groups = {}
        for d in range(state.dp):
            for c in range(state.cp):
                for t in range(state.tp):
                    pair = [int(ranks[0, d, c, t]), int(ranks[state.pp - 1, d, c, t])]
                    groups[(d, c, t)] = dist.new_group(pair)
        PROCESS.tied_groups[id(state)] = groups
    if state.pp_rank not in (0, state.pp - 1):
        return None
    return groups[(state.dp_rank, state.cp_rank, state.tp_rank)]


def destroy_parallel(destroy_process_group: bool = False) -> None:
    """Forget the groups from init_parallel; with ``destroy_process_group=True`` also tear down
    torch.distributed (every group, the default one last) for a clean exit."""
    PROCESS.parallel = None
    PROCESS.tied_groups.clear()
    if destroy_process_group and dist.is_initialized():
        # groups of the world torn down: a job started later in this process (a second
        # `tp-ext train` in a notebook) makes its own
        PROCESS.async_checkpoint_group = None
        PROCESS.peers.clear()
        async_groups.release()
        dist.destroy_process_group()
