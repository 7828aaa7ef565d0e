"""Multi-process launcher for distributed tests: gloo on CPU, file:// rendezvous in a temp dir.

``run_distributed(fn, world_size, *args)`` runs module-level ``fn(*args)`` on every rank of a
process group of ``world_size`` ranks and returns the per-rank results. Worker processes are kept
between calls (one pool per world size), since starting Python and importing torch dominates
small tests; they are forked from a server process that imported torch, tp_ext, Dynamo and
transformers once (see PRELOAD). When any rank fails, the others get a short grace period, then
every rank's status is reported together (tracebacks of failed ranks, the Python stack of ranks
that were still running) and the pool is torn down, so the next test starts clean. A call that
runs past its timeout (default 120 s) fails the same way, so a hang fails the test within about
two minutes.

``launch_once`` starts fresh processes for one call and returns every rank's outcome, for tests
that kill or hang ranks on purpose.
"""

from __future__ import annotations

import atexit
import datetime
import faulthandler
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import tempfile
import time
import traceback

DEFAULT_TIMEOUT = 120.0
PG_TIMEOUT = 60.0  # every collective of the test group fails after this long
FAILURE_GRACE = 3.0  # after one rank fails, how long the others get to report


class DistributedTestError(AssertionError):
    pass


def _reusing_meshes(init_device_mesh):
    """init_device_mesh that hands back the worker's earlier mesh of the same shape and names.
    Workers outlive tests, and every live gloo group costs idle CPU (measured: a worker after a
    dozen meshes idled at 4-5% instead of 0.5%, slowing every later test), but a mesh's groups
    cannot be destroyed after its test: DTensor caches sharding plans keyed by mesh equality
    (ranks and dim names, not groups), so a later equal mesh may be handed the earlier one. Equal
    meshes are therefore one mesh here, and its groups live as long as the worker (forked again
    once it holds too many: MAX_WORKER_THREADS)."""
    meshes = {}

    def reused(device_type, mesh_shape, *, mesh_dim_names=None, **kwargs):
        key = (device_type, tuple(mesh_shape), tuple(mesh_dim_names or ()), repr(kwargs))
        if key not in meshes:
            meshes[key] = init_device_mesh(
                device_type, mesh_shape, mesh_dim_names=mesh_dim_names, **kwargs
            )
        return meshes[key]

    return reused


def _destroy_test_groups():
    """Destroy the process groups a test made with new_group (EP, 2D grids, checkpoint groups),
    keeping the world group and the reused meshes' groups (see _reusing_meshes). DTensor's
    sharding-propagation caches go too: a mesh made from such a group (DeviceMesh.from_group:
    FSDP2 over DP x CP or expert-DP ranks) equals a later test's mesh of the same ranks, and a
    cached plan would hand that test the destroyed group's name."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    if not dist.is_initialized():
        return
    world = c10d._get_default_group()
    for group in list(c10d._world.pg_map):
        if group is not world and not getattr(group, "group_desc", "").startswith("mesh_"):
            dist.destroy_process_group(group)
    _clear_sharding_prop_cache()


def _reset_tp_ext_state():
    from tp_ext.distributed import async_groups
    from tp_ext.distributed.state import PROCESS
    from tp_ext.ops import _C

    PROCESS.reset()
    async_groups.release()
    _destroy_test_groups()
    # Tests run with cross-rank checks on: a test that calls mismatched collectives gets a clear
    # error on every rank instead of a gloo abort.
    _C._set_consistency_checks(True)
    _C._set_timeout_ms(0)
    _C._set_tag("default")
    _C._set_tracking(False)


def _worker(rank, world_size, init_file, tasks, results, stack_dir, pg_timeout, environ, cwd):
    # A worker is forked from the fork server, whose environment and directory are the ones it
    # started with: take the test's (a spawned process would have inherited them), TMPDIR too.
    os.environ.clear()
    os.environ.update(environ)
    tempfile.tempdir = None
    os.chdir(cwd)
    import torch

    torch.set_num_threads(1)
    import torch.distributed as dist

    stack_path = os.path.join(stack_dir, f"rank{rank}.stack")
    stack_file = open(stack_path, "w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=pg_timeout),
    )
    import tp_ext  # noqa: F401
    from tp_ext.distributed import mesh

    mesh.init_device_mesh = _reusing_meshes(mesh.init_device_mesh)
    _reset_tp_ext_state()
    while True:
        task = tasks.get()
        if task is None:
            break
        fn, args, kwargs = task
        try:
            results.put((rank, True, fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - every failure goes back to the parent
            results.put((rank, False, traceback.format_exc()))
        finally:
            _reset_tp_ext_state()
    dist.destroy_process_group()


# Workers are forked from one server process that has imported these once: a spawned worker
# spent 5 to 8 s of CPU importing them (torch, tp_ext, Dynamo that torch's optimizers load,
# transformers for the reference models, whose first model module pulls in its generation
# stack, ~1 s; Inductor, ~1 s), and the suite starts a few hundred workers on 2 cores (pools
# are forked again when crowded, see MAX_WORKER_THREADS). The server only imports (no ops, no
# threads of tp_ext's), so forking it is safe.
PRELOAD = [
    "torch",
    "tp_ext",
    "torch._dynamo",
    "torch._inductor.compile_fx",
    "torch.distributed.checkpoint",
    "torch.distributed.pipelining",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
]


def _context():
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


class _Pool:
    def __init__(self, world_size: int, pg_timeout: float = PG_TIMEOUT):
        ctx = _context()
        self.world_size = world_size
        self.dir = tempfile.mkdtemp(prefix=f"tp_ext_ws{world_size}_")
        init_file = os.path.join(self.dir, "rendezvous")
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        self.procs = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(
                    r,
                    world_size,
                    init_file,
                    self.tasks[r],
                    self.results,
                    self.dir,
                    pg_timeout,
                    dict(os.environ),
                    os.getcwd(),
                ),
            )
            for r in range(world_size)
        ]
        for p in self.procs:
            p.start()

    def run(self, fn, args, kwargs, timeout: float):
        """Per-rank ``(ok, payload)``; ranks that never answered are missing."""
        for q in self.tasks:
            q.put((fn, args, kwargs))
        outcome, first_failure = {}, None
        deadline = time.monotonic() + timeout
        while len(outcome) < self.world_size:
            now = time.monotonic()
            if now > deadline or (
                first_failure is not None and now > first_failure + FAILURE_GRACE
            ):
                break
            try:
                rank, ok, payload = self.results.get(timeout=0.1)
            except queue.Empty:
                for rank, p in enumerate(self.procs):
                    if rank not in outcome and not p.is_alive():
                        outcome[rank] = (False, f"process died (exit code {p.exitcode})")
                        first_failure = first_failure or now
                continue
            outcome[rank] = (ok, payload)
            if not ok and first_failure is None:
                first_failure = now
        return outcome

    def stacks_of(self, ranks) -> dict[int, str]:
        """Python stacks of still-running ranks (faulthandler on SIGUSR1)."""
        for r in ranks:
            if self.procs[r].is_alive():
                os.kill(self.procs[r].pid, signal.SIGUSR1)
        time.sleep(0.5)
        stacks = {}
        for r in ranks:
            path = os.path.join(self.dir, f"rank{r}.stack")
            if not os.path.exists(path):  # still importing torch (a loaded machine)
                stacks[r] = "(no stack: the worker had not finished starting)"
                continue
            with open(path) as f:
                stacks[r] = f.read().strip() or "(no stack available)"
        return stacks

    def close(self, graceful: bool = False):
        if graceful:
            for q in self.tasks:
                q.put(None)
            for p in self.procs:
                p.join(timeout=10)
        for p in self.procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
        shutil.rmtree(self.dir, ignore_errors=True)


_POOLS: dict[int, _Pool] = {}

# Every gloo process group a worker keeps (the meshes it reuses, groups a test left) has a TCP
# loop thread that wakes many times a second: measured, 294 such threads in the idle pools
# after two test files took a fifth of a core, and the whole suite ran the torchrun tests
# about 2x slower than alone. A pool whose workers hold more threads than this (a fresh one
# holds 5, each group adds 3) is closed, and the next call forks it again (0.1-0.2 s).
MAX_WORKER_THREADS = 32


def _threads(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # no /proc (not Linux), or the process is gone
        return 0


def _close_crowded_pools():
    for world_size, pool in list(_POOLS.items()):
        if max(_threads(p.pid) for p in pool.procs) > MAX_WORKER_THREADS:
            pool.close()  # killed: a graceful exit tears down every group first (seconds)
            del _POOLS[world_size]


def _close_all():
    for pool in list(_POOLS.values()):
        pool.close(graceful=True)
    _POOLS.clear()


atexit.register(_close_all)


def _report(fn, world_size, outcome, pool, timeout) -> str:
    missing = [r for r in range(world_size) if r not in outcome]
    stacks = pool.stacks_of(missing) if missing else {}
    lines = [f"{fn.__module__}.{fn.__name__} failed at world size {world_size}:"]
    for r in range(world_size):
        if r in outcome:
            ok, payload = outcome[r]
            lines.append(f"--- rank {r}: {'ok' if ok else 'FAILED'}")
            if not ok:
                lines.append(str(payload).rstrip())
        else:
            lines.append(
                f"--- rank {r}: still running (killed; timeout {timeout:.0f}s or "
                f"another rank failed). Its stack:\n{stacks[r]}"
            )
    return "\n".join(lines)


def run_distributed(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT, **kwargs):
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks; return the list of rank results."""
    _close_crowded_pools()
    pool = _POOLS.get(world_size)
    if pool is None or not all(p.is_alive() for p in pool.procs):
        if pool is not None:
            pool.close()
        pool = _POOLS[world_size] = _Pool(world_size)
    outcome = pool.run(fn, args, kwargs, timeout)
    if len(outcome) == world_size and all(ok for ok, _ in outcome.values()):
        return [outcome[r][1] for r in range(world_size)]
    message = _report(fn, world_size, outcome, pool, timeout)
    pool.close()
    del _POOLS[world_size]
    raise DistributedTestError(message)


def launch_once(
    fn,
    world_size: int,
    *args,
    timeout: float = DEFAULT_TIMEOUT,
    pg_timeout: float = PG_TIMEOUT,
    **kwargs,
):
    """Fresh processes for one call. Returns ``(outcome, report)``: ``outcome[rank] = (ok,
    payload)`` for ranks that answered, and the text run_distributed would have raised."""
    pool = _Pool(world_size, pg_timeout=pg_timeout)
    try:
        outcome = pool.run(fn, args, kwargs, timeout)
        ok = len(outcome) == world_size and all(o for o, _ in outcome.values())
        return outcome, ("" if ok else _report(fn, world_size, outcome, pool, timeout))
    finally:
        pool.close()


def rank() -> int:
    """This process's rank; 0 outside a process group (a test running in the main process)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else 0


def world_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size()


if __name__ == "__main__":  # pragma: no cover
    sys.exit("import this module from tests")
