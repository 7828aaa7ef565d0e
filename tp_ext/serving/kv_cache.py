"""The paged KV cache of :class:`tp_ext.serving.Engine`: fixed-size blocks of positions, a block
table per request, blocks shared by requests whose prompts begin alike (prefix caching).

Every layer on this rank keeps one pool of ``num_blocks * block_size`` slots for its keys and
one for its values, each slot this rank's KV heads of one position (the heads are split over
TP, so each TP rank holds its heads' share of every block). A request's block table lists its
blocks in order; position ``p`` of the request lives in slot ``table[p // B] * B + p % B``.

A step runs a batch of rows, each a request's next ``n`` tokens after its ``c`` cached ones.
The attention of a row needs its ``c + n`` keys; the step gathers them from the pool into a
dense, left-padded ``[rows, heads, L, head_dim]`` (``L`` the longest row), so each row's new
tokens sit at its last positions and one causal mask with a key mask serves every row. This is
what both model kinds' attention take: tp_ext's layers (``length`` and ``update``) and
transformers' (a ``Cache`` whose layers answer ``update`` and the mask sizes).

Every rank makes the same block decisions (the same scheduler on the same requests), so no block
table travels between ranks.
"""

from __future__ import annotations

import collections
import copy
from typing import Optional, Sequence

import torch

__all__ = ["BlockPool", "PagedKV", "PagedStep", "StepSlots"]


class BlockPool:
    """Which blocks are free, which are used (by how many requests) and which hold a prompt
    prefix that a later request may reuse. A full block of prompt tokens is known by the hash of
    its tokens and every token before it; when no request uses it any more it stays findable
    until its memory is needed (least recently freed first)."""

    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"BlockPool: num_blocks ({num_blocks}) and block_size ({block_size}) must be >= 1"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self._free = collections.deque(range(num_blocks))
        self._refs = [0] * num_blocks
        self._hash_of: dict[int, int] = {}  # block -> prefix hash
        self._block_of: dict[int, int] = {}  # prefix hash -> block
        self._idle: collections.OrderedDict[int, None] = collections.OrderedDict()  # cached, unused
        self.prefix_hits = 0  # blocks found cached for a new request, so far

    @property
    def used(self) -> int:
        """Blocks some request holds."""
        return self.num_blocks - len(self._free) - len(self._idle)

    @property
    def available(self) -> int:
        return len(self._free) + len(self._idle)

    def allocate(self, count: int) -> Optional[list[int]]:
        """``count`` blocks for one request, or None (nothing taken) when fewer are available."""
        if count > self.available:
            return None
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently freed cached block gives up its prefix
                block, _ = self._idle.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def release(self, blocks: Sequence[int]) -> None:
        """A request is done with ``blocks`` (finished, cancelled or preempted)."""
        for block in blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._hash_of:
                    self._idle[block] = None
                else:
                    self._free.append(block)

    def cached_prefix(self, tokens: Sequence[int]) -> list[int]:
        """The blocks already holding the longest run of ``tokens``' full blocks, each now used
        once more by the caller (at least one token is left out: its logits are needed)."""
        found = []
        if not self.prefix_caching:
            return found
        for h in self._hashes(tokens, (len(tokens) - 1) // self.block_size):
            block = self._block_of.get(h)
            if block is None:
                break
            self._idle.pop(block, None)
            self._refs[block] += 1
            found.append(block)
        self.prefix_hits += len(found)
        return found

    def remember(self, tokens: Sequence[int], blocks: Sequence[int], computed: int) -> None:
        """Make the full blocks among the first ``computed`` of ``tokens`` (their keys now in
        ``blocks``) findable by later prompts."""
        if not self.prefix_caching:
            return
        for i, h in enumerate(self._hashes(tokens, computed // self.block_size)):
            block = blocks[i]
            if block in self._hash_of or h in self._block_of:
                continue  # already known (this block, or the same prefix in another block)
            self._hash_of[block], self._block_of[h] = h, block

    def _hashes(self, tokens: Sequence[int], count: int):
        h, size = 0, self.block_size
        for i in range(count):
            h = hash((h, tuple(tokens[i * size : (i + 1) * size])))
            yield h


class StepSlots:
    """Where one step's rows write their new keys and read all of theirs: ``write`` ``[rows,
    S]`` (a row with fewer than ``S`` new tokens is padded on the left) and ``read`` ``[rows,
    L]`` (left-padded likewise). Padding points at the pool's scratch slot (the last) and is
    masked out by ``key_mask`` ``[rows, L]``."""

    def __init__(self, tables, cached, new, block_size: int, scratch: int, device):
        rows, width = len(new), max(new)
        length = max(c + n for c, n in zip(cached, new))
        self.write = torch.full((rows, width), scratch, dtype=torch.long)
        self.read = torch.full((rows, length), scratch, dtype=torch.long)
        self.key_mask = torch.zeros(rows, length, dtype=torch.long)
        for row, (table, c, n) in enumerate(zip(tables, cached, new)):
            positions = torch.arange(c + n)
            blocks = torch.tensor(table, dtype=torch.long)[positions // block_size]
            slots = blocks * block_size + positions % block_size
            self.read[row, length - c - n :] = slots
            self.write[row, width - n :] = slots[c:]
            self.key_mask[row, length - c - n :] = 1
        self.write, self.read = self.write.to(device), self.read.to(device)
        self.key_mask = self.key_mask.to(device)
        self.past = length - width  # the keys before the step's first query column

    @property
    def length(self) -> int:
        return self.read.size(1)

    def rows(self, which: slice) -> "StepSlots":
        """The slots of some of the rows (a micro-batch): the same columns."""
        part = copy.copy(self)
        part.write, part.read = self.write[which], self.read[which]
        part.key_mask = self.key_mask[which]
        return part


class PagedKV:
    """This rank's key and value pools, one pair per attention layer (allocated by the first
    step, when the layers' local heads, head size and dtype are seen)."""

    def __init__(self, num_blocks: int, block_size: int, device):
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, device
        self.scratch = num_blocks * block_size  # one more slot, the padding's
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (*self.keys.values(), *self.values.values())
        )

    def write(self, layer: int, slots: StepSlots, k: torch.Tensor, v: torch.Tensor):
        """Store the step's new ``k``, ``v`` ``[rows, heads, S, head_dim]`` of ``layer``; return
        the layer's pools ``[slots + 1, heads, head_dim]``."""
        if layer not in self.keys:
            shape = (self.scratch + 1, k.size(1), k.size(3))
            self.keys[layer] = torch.zeros(shape, dtype=k.dtype, device=k.device)
            self.values[layer] = torch.zeros(shape, dtype=v.dtype, device=v.device)
        keys, values = self.keys[layer], self.values[layer]
        where = slots.write.reshape(-1)
        keys[where] = k.transpose(1, 2).reshape(-1, k.size(1), k.size(3))
        values[where] = v.transpose(1, 2).reshape(-1, v.size(1), v.size(3))
        return keys, values

    def update(self, layer: int, slots: StepSlots, k: torch.Tensor, v: torch.Tensor):
        """:meth:`write`, then every row's keys and values ``[rows, heads, L, head_dim]``,
        gathered (for attention that takes dense keys)."""
        keys, values = self.write(layer, slots, k, v)
        return keys[slots.read].transpose(1, 2), values[slots.read].transpose(1, 2)


class PagedStep:
    """One step (or micro-batch) of rows over the cache, as a model's attention takes it:
    ``gather`` (store, then dense keys) or ``write`` (store, then the pools, for attention that
    reads the slots itself: ``tp_ext.ops.paged_attention`` with ``read``, ``key_mask``,
    ``past``)."""

    def __init__(self, cache: PagedKV, slots: StepSlots):
        self.cache, self.slots = cache, slots
        self.read, self.key_mask = slots.read, slots.key_mask
        self.past, self.length = slots.past, slots.length

    def gather(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.update(layer, self.slots, k, v)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        return self.cache.write(layer, self.slots, k, v)
