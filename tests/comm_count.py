"""The payload bytes of torch.distributed's own communication in this process while a block runs,
per process group: what torch.distributed.pipelining sends and receives between stages, DDP's
gradient all-reduces (bucketed, or per parameter by tp_ext's comm hook) and FSDP2's all-gathers
and reduce-scatters. ``tp_ext.comm.track()`` sees only tp_ext's collectives; this sees the rest.

How: every torch.distributed call, from Python or from C++ (DDP's reducer), reaches the
dispatcher as a ``c10d::`` operator (``c10d::allreduce_``, ``c10d::_allgather_base_``,
``c10d::send``, ...), which a TorchDispatchMode sees with its tensors and its process group.
tp_ext's collectives are ``tp_ext::`` operators whose C++ talks to the process group inside the
operator, so they never show up here as ``c10d::`` calls (no double counting with track()).

Bytes follow track()'s convention: the tensor of an all-reduce, broadcast, reduce, send or
receive; the gathered output of an all-gather; the full input of a reduce-scatter (numel x
element size, summed over the call's tensors). A send and its receive count on both ranks.

    with CommCount({"pp": state.pp_group, "dp": state.dp_group}) as count:
        trainer.step(batches)
    count.bytes["pp"], count.bytes["dp"]  # groups not named count under "other"
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _nbytes(obj) -> int:
    return sum(
        t.numel() * t.element_size() for t in tree_leaves(obj) if isinstance(t, torch.Tensor)
    )


class CommCount(TorchDispatchMode):
    def __init__(self, groups: dict[str, dist.ProcessGroup]) -> None:
        super().__init__()
        self._label = {g.group_name: name for name, g in groups.items()}
        self.bytes: dict[str, int] = defaultdict(int, {name: 0 for name in groups})
        self.calls: list[tuple[str, str, int]] = []  # (label, op, bytes), in call order

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace == "c10d" and func.name() != "c10d::check_for_nan":
            bound = dict(zip((a.name for a in func._schema.arguments), args), **kwargs)
            group = dist.ProcessGroup.unbox(bound["process_group"]).group_name
            label = self._label.get(group, "other")
            op = func.name().removeprefix("c10d::")
            if "allgather" in op:  # (output, input): the gathered output
                payload = _nbytes(args[0])
            elif "reduce_scatter" in op:  # (output, input): the full input
                payload = _nbytes(args[1])
            elif op in ("barrier", "monitored_barrier_"):  # a placeholder tensor, no payload
                payload = 0
            else:  # the tensors themselves (alltoall: its input)
                payload = _nbytes(args[1] if op.startswith("alltoall") else args[0])
            self.bytes[label] += payload
            self.calls.append((label, op, payload))
        return func(*args, **kwargs)
