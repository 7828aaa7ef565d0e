"""Asynchronous collectives: what ``tp_ext.comm.<collective>(..., async_op=True)`` returns.

Each collective starts at the call and returns a :class:`Pending` handle; ``handle.wait()``
returns exactly what the synchronous call returns (values, shape, uneven ``sizes``, every reduce
op). In between, this rank computes while the transfer runs.

They are built on torch's functional collectives (``torch.ops._c10d_functional.*`` then
``wait_tensor``), not on tp_ext's own C++ ops: those are single opaque ops that block until the
transfer is over, while Inductor lowers only the functional ones to a start and a wait it can
schedule apart, and its compute-communication passes only recognise those. Inductor's default
schedule still places each wait right after its start; with
``torch._inductor.config.reorder_for_compute_comm_overlap = True`` and
``reorder_for_compute_comm_overlap_passes = ["sink_waits", "raise_comms"]`` (or torch's
recommended list) it issues the collective before independent compute and waits at the first
use (tests/test_async_collectives.py checks the generated code). Consequences:

* Do not modify ``x`` until ``wait()``: the transfer may read it (a contiguous ``x`` is sent
  as it is).
* Not differentiable, like the synchronous plain collectives (use the Megatron pairs for
  training); an input that requires grad under grad mode is refused.
* They go through the process group (NCCL), or on gloo through a companion group of the same
  ranks with one worker thread, which runs them one after another in the order issued
  (:mod:`tp_ext.distributed.async_groups`: torch's ProcessGroupGloo corrupts its heap when two
  collectives finish together on its two workers); never tp_ext's shared-memory channel. They
  skip the cross-rank consistency checks (:func:`set_consistency_checks`): every rank must
  issue the same collectives, with the same shapes and ``sizes``, in the same order, and a call
  made with ``async_op=True`` on one rank must be made with it on all (the synchronous call may
  take the shared-memory channel, which the others would never join).
* ``avg`` is a sum then a division after the wait, on every backend, as the synchronous ops do.
* ``track()`` records each one when it is waited on, with the bytes the synchronous call records,
  under the :func:`tag` current when it was issued; seconds run from the issue to the end of the
  wait. In compiled code the count and bytes are recorded (by a side-effect op, so Inductor keeps
  it) but not the time (0) nor the issuing tag.
* Compiled code: a handle may be returned unwaited (it is rebuilt, and waits later); one that is
  neither waited on nor returned is dead code there, dropped with its collective on every rank,
  without the warning eager code gives.
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from collections.abc import Sequence
from typing import Any, Callable, Optional

import torch
from torch.fx.node import has_side_effect

from tp_ext.distributed import async_groups
from tp_ext.distributed.accounting import record_transfer
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.ops import _C

__all__ = ["Pending"]

REDUCE_OPS = ("sum", "avg", "max", "min", "product")


# ---- accounting from compiled code --------------------------------------------------------------


@torch.library.custom_op("tp_ext_async::record_transfer", mutates_args=())
def _record_op(done: torch.Tensor, op: str, collective: str, nbytes: int) -> None:
    """track()'s record of a collective waited on in compiled code (``done``: its result, an
    input only so the record runs after the wait)."""
    record_transfer(op, collective, nbytes, 0.0)


@_record_op.register_fake
def _record_op_fake(done, op, collective, nbytes) -> None:
    return None


# returns nothing and mutates nothing: without this, compiled graphs drop it as dead code
has_side_effect(torch.ops.tp_ext_async.record_transfer.default)


# ---- the handle ---------------------------------------------------------------------------------


class Pending:
    """A collective in flight (``tp_ext.comm.<collective>(..., async_op=True)``).

    ``wait()`` blocks until it is done and returns its result, the tensor the synchronous call
    returns; calling it again returns the same tensor. Every handle must be waited on: one that is
    garbage-collected first is waited on then, with a ``RuntimeWarning`` naming the collective and
    where it was issued. Works inside ``torch.compile(fullgraph=True)`` (plain attributes, which
    Dynamo traces). There is no ``is_completed()``: torch's functional collectives do not expose
    their work object.
    """

    # Class-level defaults: torch.compile may make instances without running __init__.
    _tensor: Optional[torch.Tensor] = None  # the functional collective's output, until waited
    _result: Optional[torch.Tensor] = None
    _record = False  # track() has yet to count it
    _unwaited = False

    def __init__(
        self,
        op: str,
        collective: str,
        nbytes: int,
        tensor: Optional[torch.Tensor],
        finish: Callable[..., torch.Tensor] = None,
        args: tuple = (),
        keep: Any = None,
        result: Optional[torch.Tensor] = None,
        record: bool = True,
    ) -> None:
        self._op, self._collective, self._nbytes = op, collective, nbytes
        self._tensor, self._finish, self._args = tensor, finish, args
        self._keep = keep  # the buffers the transfer reads, alive until it is over
        self._result, self._record = result, record
        self._unwaited = True  # a group of one too: the same code warns at every size
        if torch.compiler.is_compiling():
            self._where, self._started, self._tag = None, None, None
        else:
            self._where, self._started, self._tag = _caller(), time.perf_counter(), _C._get_tag()

    def wait(self) -> torch.Tensor:
        """The collective's result (blocks until it is done); the same tensor on every call."""
        self._unwaited = False
        if self._tensor is not None:
            tensor = self._tensor
            self._tensor = None
            done = torch.ops._c10d_functional.wait_tensor(tensor)
            self._result = self._finish(done, *self._args)
            self._keep = None
        elif self._result is None:
            raise RuntimeError(f"tp_ext.comm.{self._op}: an earlier wait() on this handle failed")
        if self._record:
            self._record = False
            self._account(self._result)
        return self._result

    def _account(self, result: torch.Tensor) -> None:
        if torch.compiler.is_compiling():
            torch.ops.tp_ext_async.record_transfer(result, self._op, self._collective, self._nbytes)
            return
        seconds = 0.0 if self._started is None else time.perf_counter() - self._started
        now = _C._get_tag()
        if self._tag is None or self._tag == now:
            record_transfer(self._op, self._collective, self._nbytes, seconds)
            return
        _C._set_tag(self._tag)  # the tag it was issued under
        try:
            record_transfer(self._op, self._collective, self._nbytes, seconds)
        finally:
            _C._set_tag(now)

    def __repr__(self) -> str:
        state = "waited" if not self._unwaited else "not waited"
        return f"Pending(tp_ext.comm.{getattr(self, '_op', '?')}, {state})"

    def __del__(self) -> None:
        if not self._unwaited:
            return
        try:
            self.wait()
            outcome = "waited for it now"
        except Exception as e:  # noqa: BLE001 (reported in the warning; __del__ cannot raise)
            outcome = f"waiting for it now failed: {type(e).__name__}: {e}"
        where = getattr(self, "_where", None)
        where = f" issued at {where}" if where else ""
        try:
            warnings.warn(
                f"tp_ext.comm.{self._op}(..., async_op=True){where} was garbage-collected "
                f"without wait(); {outcome}. Call wait() on every handle.",
                RuntimeWarning,
                stacklevel=2,
            )
        except Exception:  # noqa: BLE001 (interpreter shutdown)
            pass


def _caller() -> str:
    """file:line of the first frame outside tp_ext.comm and this module."""
    frame = sys._getframe(1)
    skip = (__file__, __file__.replace("pending.py", "comm.py"))
    while frame is not None and frame.f_code.co_filename in skip:
        frame = frame.f_back
    if frame is None:
        return "<unknown>"
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


# ---- what happens after the wait (module-level functions: Dynamo inlines them) ----------------


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


def _divided(t: torch.Tensor, n: int) -> torch.Tensor:
    return t / n


def _gathered(t: torch.Tensor, dim: int, per_rank: list[int], widest: int) -> torch.Tensor:
    """[w * widest, ...] slots -> every rank's rows in order, ``dim`` back in place."""
    if any(n != widest for n in per_rank):
        t = torch.cat([t.narrow(0, r * widest, n) for r, n in enumerate(per_rank)], 0)
    return t if dim == 0 else t.movedim(0, dim).contiguous()


def _scattered(t: torch.Tensor, dim: int, mine: int, avg_over: int) -> torch.Tensor:
    """[widest, ...] -> this rank's piece (``mine`` rows), ``dim`` back in place."""
    if t.size(0) != mine:
        t = t.narrow(0, 0, mine)
    t = t.contiguous() if dim == 0 else t.movedim(0, dim).contiguous()
    return t / avg_over if avg_over else t


def _exchanged(t: torch.Tensor, scatter_dim: int, gather_dim: int, mine: int, w: int):
    """[w * mine, ...] (rank r's piece r, scatter_dim first) -> concatenated along gather_dim."""
    pieces = [t.narrow(0, r * mine, mine) for r in range(w)]
    if scatter_dim != 0:
        pieces = [p.movedim(0, scatter_dim) for p in pieces]
    return torch.cat(pieces, gather_dim)


# ---- checks (the synchronous ops make them in C++) ----------------------------------------------


def _check_tensor(x: torch.Tensor, op: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"tp_ext.comm.{op}: x must be a tensor, got {type(x).__name__}")
    if x.layout != torch.strided:
        raise ValueError(
            f"tp_ext.{op}: x must be a dense (strided) tensor, got a sparse one; call "
            "x.to_dense() first."
        )
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            f"tp_ext.{op}(async_op=True) is not differentiable, but x requires grad. For "
            "training use the differentiable pairs in tp_ext.comm (copy_to_tp, reduce_from_tp, "
            "scatter_to_tp, gather_from_tp, gather_from_sp, reduce_scatter_to_sp), or pass "
            "x.detach()."
        )


def _check_reduce(x: torch.Tensor, reduce: str, op: str) -> None:
    if reduce not in REDUCE_OPS:
        raise ValueError(
            f"tp_ext.{op}: reduce='{reduce}' is not supported; use one of 'sum', 'avg', 'max', "
            "'min', 'product'."
        )
    if reduce == "avg" and not (x.is_floating_point() or x.is_complex()):
        raise ValueError(
            f"tp_ext.{op}: reduce='avg' needs a floating-point tensor, got {x.dtype}; use "
            "reduce='sum' and divide, or convert x to float."
        )


def _wrap_dim(dim: int, ndim: int, name: str, op: str) -> int:
    if not -ndim <= dim < max(ndim, 1) or ndim == 0:
        raise IndexError(
            f"tp_ext.{op}: {name}={dim} is out of range for a tensor of {ndim} dimensions"
        )
    return dim % ndim


def _rank_sizes(sizes: Sequence[int], g: ResolvedGroup, what: str, op: str) -> list[int]:
    sizes = [int(s) for s in sizes]
    if len(sizes) != g.size or any(s < 0 for s in sizes):
        raise ValueError(
            f"tp_ext.{op}: {what}={sizes} must give one size >= 0 per rank of the group "
            f"({g.size} ranks)"
        )
    return sizes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _front(x: torch.Tensor, dim: int) -> torch.Tensor:
    return (x if dim == 0 else x.movedim(dim, 0)).contiguous()


def _done(op: str, result: torch.Tensor) -> Pending:
    """A group of one: nothing travels and nothing is recorded, as the synchronous ops."""
    return Pending(op, "", 0, None, result=result, record=False)


def _started(g, op, collective, nbytes, send, out_rows, start, finish, args, idle=None) -> Pending:
    """``start(name)`` (a functional collective reading ``send``, over the group named ``name``:
    ``g`` or, on gloo, its single-threaded companion, :mod:`~tp_ext.distributed.async_groups`)
    in flight; when nothing would travel on any rank (``idle``; default: ``send``, whose shape
    every rank shares, has no elements), its empty output ``[out_rows, ...]`` at once (counted
    all the same)."""
    if idle is None:
        idle = send.numel() == 0
    if idle:
        out = send.new_empty((out_rows, *send.shape[1:]))
        return Pending(op, collective, nbytes, None, result=finish(out, *args))
    tensor = start(async_groups.group_name_for(g, send))
    return Pending(op, collective, nbytes, tensor, finish, args, keep=send)


def _solo(g: ResolvedGroup) -> bool:
    return g.group is None or g.size == 1


# ---- the collectives (tp_ext.comm calls these with a live resolved group) -----------------------

# torch's functional collectives, not tp_ext's ops: Inductor's comm passes only recognise these
# as a start and a wait they can move apart (the module's docstring)
_fc = torch.ops._c10d_functional


def all_reduce(x: torch.Tensor, reduce: str, g: ResolvedGroup) -> Pending:
    _check_tensor(x, "all_reduce")
    _check_reduce(x, reduce, "all_reduce")
    if _solo(g):
        return _done("all_reduce", x.clone(memory_format=torch.contiguous_format))
    send = x.contiguous()
    native = "sum" if reduce == "avg" else reduce
    return _started(
        g,
        "all_reduce",
        "all_reduce",
        _nbytes(x),
        send,
        send.size(0) if send.dim() else 0,
        lambda name: _fc.all_reduce(send, native, name),
        _divided if reduce == "avg" else _same,
        (g.size,) if reduce == "avg" else (),
    )


def all_gather(
    x: torch.Tensor, dim: int, sizes: Optional[Sequence[int]], g: ResolvedGroup
) -> Pending:
    _check_tensor(x, "all_gather")
    dim = _wrap_dim(dim, x.dim(), "dim", "all_gather")
    if _solo(g):
        return _done("all_gather", x.clone(memory_format=torch.contiguous_format))
    if sizes is None:
        per_rank = [x.size(dim)] * g.size
    else:
        per_rank = _rank_sizes(sizes, g, "sizes", "all_gather")
        if per_rank[g.rank] != x.size(dim):
            raise ValueError(
                f"tp_ext.all_gather: sizes={per_rank} gives rank {g.rank} {per_rank[g.rank]} "
                f"along dim {dim}, but x has {x.size(dim)} there (shape {tuple(x.shape)})"
            )
    widest = max(per_rank)
    front = _front(x, dim)
    if front.size(0) < widest:  # equal slots: pad the short piece (the padding is dropped)
        pad = front.new_zeros((widest - front.size(0), *front.shape[1:]))
        front = torch.cat([front, pad], 0)
    row = math.prod(front.shape[1:])
    return _started(
        g,
        "all_gather",
        "all_gather",
        sum(per_rank) * row * x.element_size(),
        front,
        widest * g.size,
        lambda name: _fc.all_gather_into_tensor(front, g.size, name),
        _gathered,
        (dim, per_rank, widest),
    )


def _split_along(x, dim: int, sizes, g: ResolvedGroup, op: str, arg: str) -> list[int]:
    """Every rank's piece of ``x`` along ``dim`` (``arg`` names it): ``sizes``, checked, or an
    even split."""
    if sizes is None:
        if x.size(dim) % g.size:
            raise ValueError(
                f"tp_ext.{op}: x has {x.size(dim)} along {arg} {dim}, which does not split "
                f"evenly over {g.size} ranks; pass sizes"
            )
        return [x.size(dim) // g.size] * g.size
    pieces = _rank_sizes(sizes, g, "sizes", op)
    if sum(pieces) != x.size(dim):
        raise ValueError(
            f"tp_ext.{op}: sizes={pieces} add up to {sum(pieces)} but x has {x.size(dim)} "
            f"along {arg} {dim} (shape {tuple(x.shape)})"
        )
    return pieces


def reduce_scatter(
    x: torch.Tensor, dim: int, sizes: Optional[Sequence[int]], reduce: str, g: ResolvedGroup
) -> Pending:
    _check_tensor(x, "reduce_scatter")
    _check_reduce(x, reduce, "reduce_scatter")
    dim = _wrap_dim(dim, x.dim(), "dim", "reduce_scatter")
    if _solo(g):
        return _done("reduce_scatter", x.clone(memory_format=torch.contiguous_format))
    per_rank = _split_along(x, dim, sizes, g, "reduce_scatter", "dim")
    widest = max(per_rank)
    front = _front(x, dim)
    if any(n != widest for n in per_rank):  # each rank's piece in an equal slot
        pieces, at = [], 0
        for n in per_rank:
            piece = front.narrow(0, at, n)
            if n < widest:
                pad = front.new_zeros((widest - n, *front.shape[1:]))
                piece = torch.cat([piece, pad], 0)
            pieces.append(piece)
            at += n
        front = torch.cat(pieces, 0)
    native = "sum" if reduce == "avg" else reduce
    return _started(
        g,
        "reduce_scatter",
        "reduce_scatter",
        _nbytes(x),
        front,
        widest,
        lambda name: _fc.reduce_scatter_tensor(front, native, g.size, name),
        _scattered,
        (dim, per_rank[g.rank], g.size if reduce == "avg" else 0),
    )


def broadcast(x: torch.Tensor, src: int, g: ResolvedGroup) -> Pending:
    _check_tensor(x, "broadcast")
    if not 0 <= src < g.size:
        raise ValueError(
            f"tp_ext.broadcast: src={src} is not a rank of group '{g.name}'; use a group rank in "
            f"[0, {g.size - 1}]."
        )
    if _solo(g):
        return _done("broadcast", x.clone(memory_format=torch.contiguous_format))
    send = x.contiguous()
    # src is a rank of the group, which is what the functional op takes (c10d's rootRank)
    return _started(
        g,
        "broadcast",
        "broadcast",
        _nbytes(x),
        send,
        send.size(0) if send.dim() else 0,
        lambda name: _fc.broadcast(send, src, name),
        _same,
        (),
    )


def all_to_all(
    x: torch.Tensor,
    scatter_dim: int,
    gather_dim: int,
    sizes: Optional[Sequence[int]],
    g: ResolvedGroup,
) -> Pending:
    _check_tensor(x, "all_to_all")
    scatter_dim = _wrap_dim(scatter_dim, x.dim(), "scatter_dim", "all_to_all")
    gather_dim = _wrap_dim(gather_dim, x.dim(), "gather_dim", "all_to_all")
    if _solo(g):
        return _done("all_to_all", x.clone(memory_format=torch.contiguous_format))
    send = _split_along(x, scatter_dim, sizes, g, "all_to_all", "scatter_dim")
    front = _front(x, scatter_dim)
    mine = send[g.rank]  # every rank sends me a piece of this size
    return _started(
        g,
        "all_to_all",
        "all_to_all",
        _nbytes(x),
        front,
        mine * g.size,
        lambda name: _fc.all_to_all_single(front, [mine] * g.size, send, name),
        _exchanged,
        (scatter_dim, gather_dim, mine, g.size),
    )


def all_to_all_single(
    x: torch.Tensor, send: list[int], recv: list[int], g: ResolvedGroup
) -> Pending:
    _check_tensor(x, "all_to_all_single")
    if x.dim() < 1:
        raise ValueError("tp_ext.all_to_all_single: x must have at least one dimension (rows).")
    send = _rank_sizes(send, g, "send_sizes", "all_to_all_single")
    recv = _rank_sizes(recv, g, "recv_sizes", "all_to_all_single")
    if sum(send) != x.size(0):
        raise ValueError(
            f"tp_ext.all_to_all_single: send_sizes={send} add up to {sum(send)} but x has "
            f"{x.size(0)} rows (shape {tuple(x.shape)}); they must add up to x.size(0)."
        )
    if _solo(g):
        if send[0] != recv[0]:
            raise ValueError(
                f"tp_ext.all_to_all_single: a group of one sends {send[0]} rows to itself but "
                f"expects {recv[0]}; they must be equal."
            )
        return _done("all_to_all_single", x if g.group is None else x.contiguous().clone())
    xc = x.contiguous()
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    return _started(
        g,
        "all_to_all_single",
        "all_to_all_v",  # the bytes sent to other ranks, as the synchronous op records
        (x.size(0) - send[g.rank]) * row_bytes,
        xc,
        sum(recv),
        lambda name: _fc.all_to_all_single(xc, recv, send, name),
        _same,
        (),
        idle=row_bytes == 0,  # ranks may send no rows yet receive some
    )
