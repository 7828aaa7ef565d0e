"""The process group an asynchronous collective (:mod:`tp_ext.distributed.pending`) runs on.

On a gloo group with several worker threads (torch's default: two) it is a companion group of
the same ranks with one worker thread, made by :func:`prepare` or by the first asynchronous
collective of a CPU tensor on the group, and kept until :func:`release`
(``tp_ext.destroy_parallel``). Why: after each collective, a ProcessGroupGloo worker thread
assigns the group's "last completed" op name (a ``std::string``) without a lock
(``ProcessGroupGloo::runLoop``). A name longer than the string's inline buffer (15 characters)
is moved in, freeing the buffer it replaces, so two such collectives finishing together on the
two workers free one buffer twice. The functional all-gather records ALLGATHER_COALESCED (19
characters; tp_ext's synchronous and C++-started collectives record ALLGATHER, ALLREDUCE,
BROADCAST, REDUCE or ALLTOALL_BASE, which never free). That is heap corruption: ZeRO's bucketed
all-gathers in flight aborted about 1 run in 10 of ``tests/test_zero.py`` ("malloc(): unaligned
tcache chunk detected"), and AddressSanitizer named the double free in ``runLoop``.

With one worker, the companion runs its collectives one after another, in the order issued (the
order every rank issues them in), while the calling thread goes on. Synchronous collectives stay
on the group itself and are waited for one at a time. NCCL groups, CUDA tensors and compiled
code (Inductor names the group in the graph) use the group itself.
"""

from __future__ import annotations

import os
import warnings

import torch
import torch.distributed as dist

from tp_ext.distributed.groups import ResolvedGroup

__all__ = ["group_name_for", "prepare", "companion_of", "release"]

# group name -> (that group, its companion or None where it needs none). Torch reuses group
# names once the world group is destroyed: an entry holds only for the very group it was made for.
_COMPANIONS: dict[str, tuple] = {}
# (group name, its global ranks) -> companions made for it: each rendezvous's own store prefix
_MADE: dict[tuple, int] = {}
_warned = False


def group_name_for(g: ResolvedGroup, x: torch.Tensor) -> str:
    """The c10d name of the group that an asynchronous collective of ``x`` over ``g`` runs on:
    ``g``'s single-threaded companion for a CPU tensor on a multi-threaded gloo group (made
    here if :func:`prepare` did not: every rank of ``g`` joins it, as NCCL's first collective
    does), else ``g``'s own."""
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return g.name
    companion = prepare(g)
    return g.name if companion is None else companion.group_name


def prepare(g: ResolvedGroup):
    """Make ``g``'s companion now, if it needs one (a collective: every rank of ``g`` calls
    it), so that no later asynchronous collective has to wait for the others to set it up.
    Returns it, or None for a group that runs its asynchronous collectives itself."""
    entry = _COMPANIONS.get(g.name)
    if entry is not None and entry[0] is g.group:
        return entry[1]
    if entry is not None:  # a destroyed group's name, reused
        _forget(g.name)
    companion = _make_companion(g) if _needs_companion(g.group) else None
    _COMPANIONS[g.name] = (g.group, companion)
    return companion


def companion_of(g: ResolvedGroup):
    """``g``'s companion group, or None (none made yet, or none needed)."""
    entry = _COMPANIONS.get(g.name)
    return entry[1] if entry is not None and entry[0] is g.group else None


def release() -> None:
    """Forget every companion (``destroy_parallel``, a test's teardown). A companion goes once
    the last handle of a collective on it is gone: it first finishes the collectives issued
    on it, which need every rank of the group (a rank that issued one the others never will
    waits for the group's timeout). The next asynchronous collective makes a new one."""
    for name in list(_COMPANIONS):
        _forget(name)


def _forget(name: str) -> None:
    from torch._C._distributed_c10d import _unregister_process_group

    _, companion = _COMPANIONS.pop(name)
    if companion is not None:
        companion.shutdown()  # as torch's destroy_process_group does
        try:
            _unregister_process_group(companion.group_name)
        except (RuntimeError, ValueError):  # torch's own destroy_process_group() unregistered it
            pass


def _gloo_backend(group: dist.ProcessGroup):
    try:
        backend = group._get_backend(torch.device("cpu"))
    except RuntimeError:  # no CPU backend (NCCL only)
        return None
    wrapper = getattr(dist.distributed_c10d, "_ProcessGroupWrapper", None)
    if wrapper is not None and isinstance(backend, wrapper):  # TORCH_DISTRIBUTED_DEBUG=DETAIL
        backend = backend.wrapped_pg
    return backend if isinstance(backend, dist.ProcessGroupGloo) else None


def _needs_companion(group) -> bool:
    if group is None:
        return False
    backend = _gloo_backend(group)
    return backend is not None and backend.options._threads > 1


def _devices() -> list:
    """Transport devices of its own for a companion, as torch makes them for each new gloo
    group (GLOO_SOCKET_IFNAME's interfaces, else the host's default), so that the companion's
    connections come and go apart from the group's."""
    interfaces = [i for i in os.environ.get("GLOO_SOCKET_IFNAME", "").split(",") if i]
    if interfaces:
        return [dist.ProcessGroupGloo.create_device(interface=i) for i in interfaces]
    return [dist.ProcessGroupGloo.create_default_device()]


def _make_companion(g: ResolvedGroup):
    """A ProcessGroup of gloo with one worker thread over ``g``'s ranks, registered under a
    name of its own (functional collectives find groups by name). Its rendezvous goes through
    ``g``'s store under a prefix no earlier companion of these ranks used. None, with a
    warning, on a torch without the private pieces it needs."""
    global _warned
    backend = _gloo_backend(g.group)
    key = (g.name, tuple(dist.get_process_group_ranks(g.group)))
    made = _MADE.get(key, 0)
    _MADE[key] = made + 1
    name = f"{g.name}:tp_ext_async:{made}"
    try:
        from torch._C._distributed_c10d import _register_process_group

        store = dist.distributed_c10d._world.pg_map[g.group][1]
        store = dist.PrefixStore(f"tp_ext_async/{made}/", store)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = backend.options._timeout
        options._threads = 1
        options._devices = _devices()
        gloo = dist.ProcessGroupGloo(store, g.rank, g.size, options)
        companion = dist.ProcessGroup(store, g.rank, g.size)
        gloo_type = dist.ProcessGroup.BackendType.GLOO
        companion._set_default_backend(gloo_type)
        companion._register_backend(torch.device("cpu"), gloo_type, gloo)
        companion._set_group_name(name)
        _register_process_group(name, companion)
        # every rank returns once all have connected: one that released the companion right
        # after making it would close connections a slower rank was still setting up
        companion.barrier().wait()
    except (AttributeError, ImportError, KeyError, TypeError) as e:  # another torch's internals
        if not _warned:
            _warned = True
            warnings.warn(
                f"tp_ext.comm(..., async_op=True): could not make a single-threaded gloo group "
                f"beside '{g.name}' ({type(e).__name__}: {e}); asynchronous collectives run on "
                "gloo groups directly, where two finishing together can corrupt the heap "
                "(torch's ProcessGroupGloo); wait for each before starting the next",
                RuntimeWarning,
                stacklevel=2,
            )
        return None
    return companion
