"""How tensors are split across ranks: the one policy every layer, loader and checkpoint uses.

Policy (the same as ``numpy.array_split``): ``n`` items over ``world_size`` ranks give every rank
``n // world_size`` items and the first ``n % world_size`` ranks one extra, in rank order. Sizes
never differ by more than one, no padding is added, and ``n < world_size`` leaves the last ranks
empty.
"""

from __future__ import annotations

import abc
from typing import Optional

import torch

from tp_ext.validation import check_int

__all__ = [
    "divisors",
    "shard_sizes",
    "cp_chunks",
    "balanced_layer_split",
    "shard_offsets",
    "shard_range",
    "split_tensor",
    "uneven_sizes",
    "ShardSpec",
    "Partition",
    "HeadLayout",
    "GridBlock",
    "StageSplit",
    "STAGE_ORDERS",
]


def divisors(n: int) -> list[int]:
    """The degrees that split ``n`` ranks evenly, ascending (what a refused degree lists)."""
    return [d for d in range(1, n + 1) if n % d == 0]


def shard_sizes(n: int, world_size: int) -> list[int]:
    """Sizes of the ``world_size`` shards of ``n`` items: ``[3, 3, 2, 2]`` for 10 over 4."""
    check_int("n", n, 0)
    check_int("world_size", world_size, 1)
    base, extra = divmod(n, world_size)
    return [base + (1 if rank < extra else 0) for rank in range(world_size)]


def cp_chunks(seq_len: int, cp_size: int, cp_rank: int) -> list[tuple[int, int, int]]:
    """Context parallelism's causal load balance: the sequence in ``2 * cp_size`` chunks (sizes by
    :func:`shard_sizes`), rank r holding chunks r and ``2 * cp_size - 1 - r``, so every rank has
    as many queries early in the sequence (few keys before them) as late (many). Returns rank
    ``cp_rank``'s chunks in the order it holds them: ``(chunk index, start, length)``."""
    check_int("seq_len", seq_len, 0)
    check_int("cp_size", cp_size, 1)
    check_int("cp_rank", cp_rank, 0, cp_size - 1)
    sizes = shard_sizes(seq_len, 2 * cp_size)
    starts = [sum(sizes[:i]) for i in range(2 * cp_size)]
    return [(c, starts[c], sizes[c]) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)]


def uneven_sizes(sizes) -> "list[int] | None":
    """The ``sizes`` argument of the collectives for pieces of these sizes: None when every rank
    holds the same amount (the ops then split evenly), else the list itself. Pass
    ``shard_sizes(n, world_size)`` for the standard split of ``n`` items."""
    sizes = [int(s) for s in sizes]
    return None if len(set(sizes)) <= 1 else sizes


def shard_offsets(n: int, world_size: int) -> list[int]:
    """Start of each shard: ``[0, 3, 6, 8]`` for 10 over 4."""
    offsets, start = [], 0
    for size in shard_sizes(n, world_size):
        offsets.append(start)
        start += size
    return offsets


def shard_range(n: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(offset, size)`` of ``rank``'s shard of ``n`` items."""
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank must be an int in [0, {world_size - 1}], got {rank!r}")
    return shard_offsets(n, world_size)[rank], shard_sizes(n, world_size)[rank]


def split_tensor(t: torch.Tensor, dim: int, world_size: int) -> tuple[torch.Tensor, ...]:
    """Split ``t`` along ``dim`` into ``world_size`` shards by the policy above.

    Returns views of ``t`` (``narrow``), never copies; shards may have size 0 when
    ``t.size(dim) < world_size``.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"t must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() == 0:
        raise ValueError("t must have at least one dimension, got a 0-d tensor")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(
            f"dim={dim} is out of range for a tensor with {t.dim()} dimensions; "
            f"use a value in [{-t.dim()}, {t.dim() - 1}]"
        )
    n = t.size(dim)
    return tuple(
        t.narrow(dim, offset, size)
        for offset, size in zip(shard_offsets(n, world_size), shard_sizes(n, world_size))
    )


# ---- what every reader of a sharded tensor needs: the spec protocol -----------------------------

Segment = tuple[int, int]  # (offset, length) along the full axis
Box = tuple[Segment, ...]  # (offset, length) along every dimension of the full tensor


class ShardSpec(abc.ABC):
    """How one tensor is split over ranks (its layout): which block of the full tensor a rank
    holds. Implemented by :class:`Partition` (1D: one axis over a TP group, heads included) and
    :class:`GridBlock` (2D: a P x Q grid); layers, state dicts, checkpoints and gradient norms
    read a tensor's spec through these methods alone.

    ``where`` is the rank's place in the spec: a TP rank (int) for a Partition, ``(row, col)``
    for a GridBlock (:attr:`tp_ext.layers.ParallelModule.shard_coord` gives it for a layer).
    A rank's local tensor is its :meth:`boxes` laid end to end along :attr:`local_dim`.
    """

    local_dim: int = 0

    @abc.abstractmethod
    def full_shape_of(self, local_shape) -> tuple[int, ...]:
        """The full (unsharded) shape of a tensor whose local block has ``local_shape``."""

    @abc.abstractmethod
    def boxes(self, where, local_shape) -> list[Box]:
        """Rank ``where``'s pieces of the full tensor, in local order."""

    @abc.abstractmethod
    def counted(self, local: torch.Tensor, where) -> Optional[torch.Tensor]:
        """The part of ``local`` that rank ``where`` alone counts in sums over the full tensor
        (a norm): all of it, the elements no earlier rank also holds, or None when another
        rank's copy counts."""

    def take_block(self, full: torch.Tensor, where) -> torch.Tensor:
        """Rank ``where``'s block of ``full`` (a view when it is one box)."""
        pieces = [_narrowed(full, box) for box in self.boxes(where, tuple(full.shape))]
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return full.narrow(self.local_dim, 0, 0)
        return torch.cat(pieces, self.local_dim)

    def put_block(self, local: torch.Tensor, full: torch.Tensor, where) -> None:
        """Copy rank ``where``'s block ``local`` into its place in ``full`` (the inverse of
        :meth:`take_block`)."""
        position = 0
        for box in self.boxes(where, tuple(local.shape)):
            length = box[self.local_dim][1]
            _narrowed(full, box).copy_(local.narrow(self.local_dim, position, length))
            position += length


def _narrowed(t: torch.Tensor, box: Box) -> torch.Tensor:
    for d, (offset, length) in enumerate(box):
        t = t.narrow(d, offset, length)
    return t


# ---- partitions of one axis: plain, merged (gate/up) and attention heads ------------------------


def _holder_runs(full: int, segments) -> list[tuple[int, int, int]]:
    """``(start, stop, holders)`` runs covering ``[0, full)``: how many ranks hold each index.
    Counted per run between segment boundaries, not per index, so building a full-size model on
    the meta device (the planner's footprints) costs no time per row."""
    pieces = []
    for rank, rank_segments in enumerate(segments):
        for offset, length in rank_segments:
            if offset < 0 or offset + length > full:
                raise ValueError(
                    f"rank {rank}'s segment (offset {offset}, length {length}) lies outside "
                    f"the full axis [0, {full})"
                )
            pieces.append((offset, offset + length))
    bounds = sorted({0, full, *(start for start, _ in pieces), *(stop for _, stop in pieces)})
    return [
        (start, stop, sum(1 for s, e in pieces if s <= start and stop <= e))
        for start, stop in zip(bounds, bounds[1:])
    ]


class Partition(ShardSpec):
    """Which indices of a full axis of length ``full`` each rank holds.

    ``segments[r]`` lists rank r's pieces as ``(offset, length)``; rank r's local axis is their
    concatenation, in that order. Pieces are whole ``unit``s (attention heads); an index may be
    held by more than one rank (replicated KV heads). Every layer, loader and checkpoint reads
    the same Partition, so they always agree on who holds what.

    As a :class:`ShardSpec` it splits dimension ``dim`` of a tensor (:meth:`along` sets it;
    layers record ``partition.along(dim)`` for each sharded parameter); ``where`` is a TP rank.
    """

    def __init__(self, full: int, segments, parts=None, dim: int = 0) -> None:
        self.full = full
        self.dim = dim
        # the logical parts laid end to end, (start, length) each (merged: gate, up)
        self.parts: tuple[Segment, ...] = tuple(parts) if parts is not None else ((0, full),)
        self.segments: tuple[tuple[Segment, ...], ...] = tuple(
            tuple((int(o), int(n)) for o, n in rank_segments if n > 0) for rank_segments in segments
        )
        self._holders = _holder_runs(full, self.segments)
        unheld = next((start for start, _, holders in self._holders if holders == 0), None)
        if unheld is not None:
            raise ValueError(f"partition leaves index {unheld} of {full} on no rank")
        self.replicated = any(holders > 1 for _, _, holders in self._holders)

    @classmethod
    def split(cls, n: int, world_size: int, unit: int = 1) -> "Partition":
        """``n`` items in whole units of ``unit``, by :func:`shard_sizes` over the units."""
        return cls.merged([n], world_size, unit)

    @classmethod
    def merged(cls, parts, world_size: int, unit: int = 1) -> "Partition":
        """Several logical parts laid end to end (e.g. gate and up), each split on its own:
        rank r holds its shard of part 0, then of part 1, ..."""
        segments = [[] for _ in range(world_size)]
        start = 0
        for n in parts:
            if n % unit:
                raise ValueError(f"size {n} is not a whole number of units of {unit}")
            for rank in range(world_size):
                offset, size = shard_range(n // unit, world_size, rank)
                segments[rank].append((start + offset * unit, size * unit))
            start += n
        return cls(start, segments, [(sum(parts[:k]), n) for k, n in enumerate(parts)])

    def along(self, dim: int) -> "Partition":
        """This partition applied to dimension ``dim`` of a tensor (the same split)."""
        check_int("dim", dim, 0, why="the split dimension")
        if dim == self.dim:
            return self
        other = object.__new__(Partition)
        other.__dict__.update(self.__dict__)
        other.dim = dim
        return other

    # -- the ShardSpec protocol --------------------------------------------------------------------

    @property
    def local_dim(self) -> int:
        return self.dim

    def full_shape_of(self, local_shape) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = self.full
        return tuple(shape)

    def boxes(self, where, local_shape) -> list[Box]:
        whole = [(0, int(n)) for n in local_shape]
        out = []
        for segment in self.segments[where]:
            box = list(whole)
            box[self.dim] = segment
            out.append(tuple(box))
        return out

    def counted(self, local: torch.Tensor, where) -> Optional[torch.Tensor]:
        if not self.replicated:
            return local
        keep = self.first_owner_positions(where)
        if len(keep) == local.size(self.dim):
            return local
        index = torch.tensor(keep, dtype=torch.long, device=local.device)
        return local.index_select(self.dim, index)

    def first_owner_positions(self, rank: int) -> list[int]:
        """Local positions of ``rank``'s indices that no lower rank also holds."""
        earlier = {i for r in range(rank) for i in self.local_indices(r)}
        return [pos for pos, i in enumerate(self.local_indices(rank)) if i not in earlier]

    def part_of(self, offset: int) -> tuple[int, Segment]:
        """(index, (start, length)) of the logical part holding full index ``offset``."""
        for k, (start, n) in enumerate(self.parts):
            if start <= offset < start + n:
                return k, (start, n)
        raise IndexError(f"index {offset} is outside this partition's {self.full}")

    @property
    def world_size(self) -> int:
        return len(self.segments)

    def local_size(self, rank: int) -> int:
        return sum(length for _, length in self.segments[rank])

    def local_sizes(self) -> list[int]:
        return [self.local_size(r) for r in range(self.world_size)]

    def is_contiguous_split(self) -> bool:
        """True when concatenating every rank's local axis in rank order gives the full axis."""
        flat = [seg for rank_segments in self.segments for seg in rank_segments]
        position = 0
        for offset, length in flat:
            if offset != position:
                return False
            position += length
        return position == self.full

    def local(self, full: torch.Tensor, dim: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s piece of ``full`` along ``dim``: a view when it is one segment."""
        pieces = [full.narrow(dim, o, n) for o, n in self.segments[rank]]
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return full.narrow(dim, 0, 0)
        return torch.cat(pieces, dim)

    def replicated_indices(self) -> list[int]:
        """Full indices held by more than one rank (replicated KV heads' rows), ascending."""
        return [i for start, stop, n in self._holders if n > 1 for i in range(start, stop)]

    def local_indices(self, rank: int) -> list[int]:
        return [i for o, n in self.segments[rank] for i in range(o, o + n)]

    def gather_order(self) -> list[int]:
        """For each full index, its position in the rank-major concatenation of every rank's
        local axis (the first rank holding it): turns an all-gather into the full axis."""
        where = [-1] * self.full
        position = 0
        for rank_segments in self.segments:
            for offset, length in rank_segments:
                for i in range(offset, offset + length):
                    if where[i] < 0:
                        where[i] = position
                    position += 1
        return where

    def __eq__(self, other) -> bool:
        return isinstance(other, Partition) and (self.full, self.segments) == (
            other.full,
            other.segments,
        )

    def __repr__(self) -> str:
        return f"Partition(full={self.full}, segments={self.segments})"


class HeadLayout:
    """How attention heads are split over ``world_size`` ranks, in whole heads.

    - ``num_kv_heads >= world_size``: KV heads are split by :func:`shard_sizes` and each rank
      takes the query heads of its KV heads (uneven counts split unevenly, never mid-head).
    - ``num_kv_heads < world_size``: each rank holds one KV head, replicated over the ranks
      that serve it (KV head j over ``shard_sizes(world_size, num_kv_heads)[j]`` ranks), and the
      query heads of that group are split among them. Replicas' gradients are summed by the
      layers, so replicas stay equal.

    ``q[r]`` and ``kv[r]`` are rank r's ``(first head, count)``.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, world_size: int) -> None:
        check_int("num_heads", num_heads, 1)
        check_int("num_kv_heads", num_kv_heads, 1)
        check_int("world_size", world_size, 1)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads} "
                f"(each KV head serves num_heads/num_kv_heads query heads)"
            )
        group = num_heads // num_kv_heads
        self.num_heads, self.num_kv_heads, self.world_size = num_heads, num_kv_heads, world_size
        self.q: list[tuple[int, int]] = []
        self.kv: list[tuple[int, int]] = []
        if num_kv_heads >= world_size:
            for rank in range(world_size):
                kv_start, kv_count = shard_range(num_kv_heads, world_size, rank)
                self.kv.append((kv_start, kv_count))
                self.q.append((kv_start * group, kv_count * group))
        else:
            replicas = shard_sizes(world_size, num_kv_heads)
            if group < max(replicas):
                raise ValueError(
                    f"{num_heads} query heads in {num_kv_heads} KV groups cannot be split over "
                    f"{world_size} ranks: KV head groups of {group} query heads would be served "
                    f"by up to {max(replicas)} ranks, leaving some ranks without a query head. "
                    f"Use a tensor-parallel size these heads fit: one of "
                    f"{[w for w in range(1, num_heads + 1) if _fits(num_heads, num_kv_heads, w)]}"
                )
            for kv_head, count in enumerate(replicas):
                for replica in range(count):
                    offset, size = shard_range(group, count, replica)
                    self.kv.append((kv_head, 1))
                    self.q.append((kv_head * group + offset, size))

    def q_partition(self, head_dim: int) -> Partition:
        return Partition(
            self.num_heads * head_dim, [[(s * head_dim, n * head_dim)] for s, n in self.q]
        )

    def kv_partition(self, head_dim: int) -> Partition:
        return Partition(
            self.num_kv_heads * head_dim, [[(s * head_dim, n * head_dim)] for s, n in self.kv]
        )

    def qkv_partition(self, head_dim: int) -> Partition:
        """The fused [q | k | v] projection: rank r holds its q rows, then k rows, then v rows."""
        q_rows = self.num_heads * head_dim
        kv_rows = self.num_kv_heads * head_dim
        segments = []
        for (qs, qn), (ks, kn) in zip(self.q, self.kv):
            segments.append(
                [
                    (qs * head_dim, qn * head_dim),
                    (q_rows + ks * head_dim, kn * head_dim),
                    (q_rows + kv_rows + ks * head_dim, kn * head_dim),
                ]
            )
        parts = [(0, q_rows), (q_rows, kv_rows), (q_rows + kv_rows, kv_rows)]
        return Partition(q_rows + 2 * kv_rows, segments, parts)

    def kv_index_for_q(self, rank: int) -> list[int]:
        """For each local query head of ``rank``, the index of its KV head among the local ones."""
        group = self.num_heads // self.num_kv_heads
        (qs, qn), (ks, _) = self.q[rank], self.kv[rank]
        return [(h // group) - ks for h in range(qs, qs + qn)]

    def __repr__(self) -> str:
        return f"HeadLayout(q={self.q}, kv={self.kv})"


def _fits(num_heads: int, num_kv_heads: int, world_size: int) -> bool:
    try:
        HeadLayout(num_heads, num_kv_heads, world_size)
    except ValueError:
        return False
    return True


class GridBlock(ShardSpec):
    """Which block of a full tensor a rank of a P x Q grid holds (2D tensor parallelism).

    ``splits[d]`` says how dimension ``d`` is cut: None (whole on every rank), or ``(axis,
    sizes)`` with ``axis`` "P" (over the grid rows: rank (i, j) holds piece i) or "Q" (over the
    columns: piece j) and ``sizes`` every piece's length (:func:`shard_sizes`, or whole heads).
    A tensor not cut over an axis is replicated over it: the copy at index 0 of that axis is the
    one counted (gradient norms) and saved. As a :class:`ShardSpec`, ``where`` is
    ``(row, col)``.
    """

    AXES = ("P", "Q")

    def __init__(self, full_shape, splits) -> None:
        self.full_shape = tuple(int(n) for n in full_shape)
        self.splits = tuple(
            None if s is None else (s[0], tuple(int(n) for n in s[1])) for s in splits
        )
        if len(self.splits) != len(self.full_shape):
            raise ValueError(
                f"GridBlock: {len(self.splits)} splits for a {len(self.full_shape)}-d tensor"
            )
        for d, split in enumerate(self.splits):
            if split is None:
                continue
            axis, sizes = split
            if (
                axis not in self.AXES
                or sum(sizes) != self.full_shape[d]
                or min(sizes, default=0) < 0
            ):
                raise ValueError(
                    f"GridBlock: dimension {d} of {self.full_shape} split {split!r}; want an axis "
                    f"in {self.AXES} and sizes >= 0 summing to {self.full_shape[d]}"
                )

    def index(self, axis: str, row: int, col: int) -> int:
        return row if axis == "P" else col

    def ranges(self, row: int, col: int) -> list[tuple[int, int]]:
        """(offset, length) of rank (row, col)'s block along each dimension."""
        out = []
        for n, split in zip(self.full_shape, self.splits):
            if split is None:
                out.append((0, n))
            else:
                axis, sizes = split
                k = self.index(axis, row, col)
                out.append((sum(sizes[:k]), sizes[k]))
        return out

    def shape(self, row: int, col: int) -> tuple[int, ...]:
        return tuple(n for _, n in self.ranges(row, col))

    def take(self, full: torch.Tensor, row: int, col: int) -> torch.Tensor:
        """Rank (row, col)'s block of ``full`` (a view)."""
        if tuple(full.shape) != self.full_shape:
            raise ValueError(
                f"expected a full tensor of shape {self.full_shape}, got {tuple(full.shape)}"
            )
        for d, (offset, length) in enumerate(self.ranges(row, col)):
            full = full.narrow(d, offset, length)
        return full

    # -- the ShardSpec protocol --------------------------------------------------------------------

    def full_shape_of(self, local_shape) -> tuple[int, ...]:
        return self.full_shape

    def boxes(self, where, local_shape) -> list[Box]:
        return [tuple(self.ranges(*where))]

    def counted(self, local: torch.Tensor, where) -> Optional[torch.Tensor]:
        return local if self.first_copy(*where) else None

    def take_block(self, full: torch.Tensor, where) -> torch.Tensor:
        return self.take(full, *where)

    def replicated_axes(self) -> list[str]:
        used = {s[0] for s in self.splits if s is not None}
        return [a for a in self.AXES if a not in used]

    def first_copy(self, row: int, col: int) -> bool:
        """Whether rank (row, col) holds the counted copy of its block."""
        return all(self.index(a, row, col) == 0 for a in self.replicated_axes())


STAGE_ORDERS = ("loop", "v")


def balanced_layer_split(
    layer_costs, num_stages: int, first_cost: int = 0, last_cost: int = 0
) -> list[int]:
    """Layers per pipeline stage (each >= 1, in order) that make the costliest stage as cheap as
    possible: stage 0 also pays ``first_cost`` (the embedding), the last stage ``last_cost``
    (the LM head). Among the splits with that bottleneck, the most even (least sum of squared
    stage costs), and among those the one whose earlier stages take more layers, so that equal
    costs and no extras give :func:`shard_sizes`' split. Costs are ints (e.g. FLOPs per
    token), so ties are exact."""
    costs = [int(c) for c in layer_costs]
    check_int("num_stages", num_stages, 1)
    n = len(costs)
    if n < num_stages:
        raise ValueError(
            f"{n} decoder layers cannot fill {num_stages} pipeline stages; every stage needs at "
            f"least one layer"
        )
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> int:
        extra = (first_cost if stage == 0 else 0) + (last_cost if stage == num_stages - 1 else 0)
        return prefix[end] - prefix[start] + extra

    def cheapest(key):
        """best[s][i]: the least key over splits of layers i.. into stages s..; key combines
        a stage's cost with the rest's (max for the bottleneck, sum of squares for evenness)."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
        best[num_stages][n] = 0
        for s in range(num_stages - 1, -1, -1):
            left = num_stages - s  # stages s.. need a layer each
            for i in range(n - left, s - 1, -1):
                best[s][i] = min(
                    key(stage_cost(s, i, j), best[s + 1][j])
                    for j in range(i + 1, n - left + 2)
                    if best[s + 1][j] != inf
                )
        return best

    bottleneck = cheapest(max)[0][0]

    def even(cost, rest):  # squares, over splits within the bottleneck only
        return cost * cost + rest if cost <= bottleneck else float("inf")

    best = cheapest(even)
    counts, start = [], 0
    for s in range(num_stages):
        left = num_stages - s
        # the most layers for this stage that keep the optimum (earlier stages take more)
        end = max(
            j
            for j in range(start + 1, n - left + 2)
            if even(stage_cost(s, start, j), best[s + 1][j]) == best[s][start]
        )
        counts.append(end - start)
        start = end
    return counts


class StageSplit:
    """Which pipeline stages a rank holds and which decoder layers each stage runs.

    ``num_stages = pp * virtual_stages``. Layers go to stages in order, split by the one policy
    (``shard_sizes``: earlier stages take the extra layer), or by ``default`` (a model's own
    default split, e.g. by cost) when given, or by ``split`` (layers per stage).
    Stage 0 also holds the embedding; the last stage the final norm and the LM head.

    Stages sit on pipeline ranks in one of two orders (the schedules need one or the other):
    ``"loop"`` puts stage ``s`` on rank ``s % pp`` (GPipe, 1F1B, Interleaved1F1B,
    InterleavedZeroBubble); ``"v"`` (``virtual_stages=2``) puts stages ``r`` and ``2*pp - 1 - r``
    on rank ``r``, so the first and last stage share rank 0 (ZBVZeroBubble, DualPipeV).
    """

    def __init__(
        self,
        num_layers: int,
        pp: int = 1,
        virtual_stages: int = 1,
        split=None,
        order: str = "loop",
        default=None,
    ):
        check_int("num_layers", num_layers, 0)
        check_int("pp", pp, 1)
        check_int("virtual_stages", virtual_stages, 1)
        if order not in STAGE_ORDERS:
            raise ValueError(f"stage_order must be one of {STAGE_ORDERS}, got {order!r}")
        if order == "v" and virtual_stages != 2:
            raise ValueError(
                f"stage_order='v' places two stages on each rank; it needs virtual_stages=2, "
                f"got virtual_stages={virtual_stages}"
            )
        self.num_layers, self.pp, self.virtual_stages, self.order = (
            num_layers,
            pp,
            virtual_stages,
            order,
        )
        self.num_stages = pp * virtual_stages
        if split is None:
            if num_layers < self.num_stages:
                raise ValueError(
                    f"{num_layers} decoder layers cannot fill {self.num_stages} pipeline stages "
                    f"(pp={pp} x virtual_stages={virtual_stages}); every stage needs at least "
                    f"one layer: use pp * virtual_stages <= {num_layers}"
                )
            counts = shard_sizes(num_layers, self.num_stages) if default is None else list(default)
        else:
            counts = list(split) if isinstance(split, (list, tuple)) else None
            if (
                counts is None
                or len(counts) != self.num_stages
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
                or sum(counts) != num_layers
            ):
                raise ValueError(
                    f"pipeline_split must list the layers of each of the {self.num_stages} "
                    f"stages (pp={pp} x virtual_stages={virtual_stages}), each >= 1, summing to "
                    f"num_layers={num_layers}; got {split!r} (the default split would be "
                    f"{self._default(default)})"
                )
        self.layer_counts = counts
        self._starts = [sum(counts[:s]) for s in range(self.num_stages)]

    def _default(self, default) -> list:
        if default is not None:
            return list(default)
        if self.num_layers < self.num_stages:
            return []
        return shard_sizes(self.num_layers, self.num_stages)

    def stages_of(self, pp_rank: int) -> list[int]:
        """The stages rank ``pp_rank`` of the pipeline group holds, in the order it runs them."""
        if isinstance(pp_rank, bool) or not isinstance(pp_rank, int) or not 0 <= pp_rank < self.pp:
            raise ValueError(f"pp_rank must be an int in [0, {self.pp - 1}], got {pp_rank!r}")
        if self.order == "v":
            return [pp_rank, 2 * self.pp - 1 - pp_rank]
        return [pp_rank + chunk * self.pp for chunk in range(self.virtual_stages)]

    def rank_of(self, stage: int) -> int:
        """The pipeline rank that holds ``stage``."""
        if self.order == "v" and stage >= self.pp:
            return 2 * self.pp - 1 - stage
        return stage % self.pp

    def layers_of(self, stage: int) -> range:
        """Global indices of the decoder layers ``stage`` runs."""
        return range(self._starts[stage], self._starts[stage] + self.layer_counts[stage])

    @property
    def last_stage(self) -> int:
        return self.num_stages - 1

    def __repr__(self) -> str:
        return (
            f"StageSplit(num_layers={self.num_layers}, pp={self.pp}, "
            f"virtual_stages={self.virtual_stages}, order={self.order!r}, "
            f"layer_counts={self.layer_counts})"
        )
