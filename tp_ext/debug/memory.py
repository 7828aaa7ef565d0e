"""The peak bytes of live tensor storages in this process while a block runs, on any device (CPU
included, where torch keeps no allocator statistics). torch's MemTracker does this per module
but refuses a module called more than once per step (micro-batches); this counts storages only.
A storage resized in place counts at its new size (FSDP2 frees its gathered parameters by
``untyped_storage().resize_(0)`` and gathers into them again by resizing them back).

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
        self._sizes: dict[int, int] = {}  # id of each live storage: the bytes counted for it
        self._existing = existing
        self._resize = None

    def _add_tensor(self, t: torch.Tensor) -> None:
        self._add(getattr(t, "_local_tensor", t).untyped_storage())  # a DTensor's local shard

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = id(storage)
        if key in self._sizes or storage.device.type == "meta":
            return
        self._sizes[key] = 0
        self._count(key, storage.nbytes())
        weakref.finalize(storage, self._free, key)

    def _count(self, key: int, size: int) -> None:
        self.live += size - self._sizes[key]
        self._sizes[key] = size
        self.peak = max(self.peak, self.live)

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def _resized(self, storage: torch.UntypedStorage) -> None:
        """A storage's bytes changed in place (no dispatched op: the mode does not see it)."""
        key = id(storage)
        if key in self._sizes:
            self._count(key, storage.nbytes())
        else:  # first seen here: what it holds from now on is this block's
            self._add(storage)

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
        # as torch's MemTracker does: UntypedStorage.resize_ bypasses the dispatcher
        self._resize = resize = torch.UntypedStorage.resize_

        def resize_(storage, size):
            out = resize(storage, size)
            self._resized(storage)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self._add_tensors(out)
        return out
