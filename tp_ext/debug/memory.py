"""The peak bytes of live tensor storages in this process while a block runs, on any device (CPU
included, where torch keeps no allocator statistics). torch's MemTracker does this per module
but refuses a module called more than once per step (micro-batches); this counts storages only.

    with PeakMemory(model.parameters(), optimizer) as mem:
        trainer.step(batches)
    mem.peak  # bytes, the storages alive before the block included
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakMemory"]


class PeakMemory(TorchDispatchMode):
    def __init__(self, *existing) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        self._existing = existing

    def _add_tensor(self, t: torch.Tensor) -> None:
        self._add(getattr(t, "_local_tensor", t).untyped_storage())  # a DTensor's local shard

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._seen or storage.device.type == "meta":
            return
        self._seen.add(key)
        size = storage.nbytes()
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key, size)

    def _free(self, key: int, size: int) -> None:
        self._seen.discard(key)
        self.live -= size

    def _add_tensors(self, obj) -> None:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor):
                self._add_tensor(t)

    def __enter__(self):
        for source in self._existing:
            if isinstance(source, torch.optim.Optimizer):
                for state in source.state.values():
                    self._add_tensors(list(state.values()))
                for group in source.param_groups:
                    self._add_tensors(group["params"])
                    self._add_tensors([p.grad for p in group["params"] if p.grad is not None])
            else:
                for p in source:
                    self._add_tensors([p, p.grad])
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._add_tensors(out)
        return out
