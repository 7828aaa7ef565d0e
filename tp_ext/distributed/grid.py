"""The P x Q grid of 2D tensor parallelism (SUMMA): TP rank ``r`` of a grid sits at row
``r // Q``, column ``r % Q``. Each rank talks over two groups: its grid row (the Q ranks of row
i, where it is rank j) and its grid column (the P ranks of column j, where it is rank i).

What is split over which axis (2D layers, :mod:`tp_ext.layers.summa`): tokens (or sequences)
over the P rows, features over the Q columns; a weight ``[out, in]`` holds ``out`` over the
columns and ``in`` over the rows. Any P and Q (1 x Q and P x 1 included), any sizes, by the one
split policy (:func:`tp_ext.shard_sizes`).
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from tp_ext.dims import grid_shape_of
from tp_ext.distributed.groups import GroupLike, ResolvedGroup, resolve_group

__all__ = ["TPGrid", "make_tp_grid"]


@dataclasses.dataclass(frozen=True)
class TPGrid:
    """This rank's place in a P x Q grid and the groups it talks over.

    ``rows`` = P, ``cols`` = Q, (``row``, ``col``) = (i, j). ``row_group``: the Q ranks of grid
    row i (this rank is rank j of it); ``col_group``: the P ranks of grid column j (rank i);
    ``tp_group``: all P x Q ranks (rank i * Q + j)."""

    rows: int
    cols: int
    row: int
    col: int
    row_group: ResolvedGroup
    col_group: ResolvedGroup
    tp_group: ResolvedGroup

    @property
    def size(self) -> int:
        return self.rows * self.cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    def __repr__(self) -> str:
        return f"TPGrid({self.rows}x{self.cols}, row={self.row}, col={self.col})"


def make_tp_grid(rows: int, cols: int, tp_group: GroupLike = None, *, all_tp_ranks=None) -> TPGrid:
    """Cut ``tp_group`` (rows x cols ranks; None: the default TP group) into a grid.

    Creating groups is collective over the default group (every process creates every group,
    in the same order), so the grids of every TP group of the job are made together:
    ``all_tp_ranks`` lists the global ranks of each TP group, by TP rank (default: this one
    group, which must then hold every process). Without torch.distributed (a group of one) the
    groups are groups of one."""
    rows, cols = grid_shape_of((rows, cols))
    tp = resolve_group(tp_group)
    if tp.size != rows * cols:
        raise ValueError(
            f"a {rows} x {cols} grid needs {rows * cols} ranks, but the TP group has {tp.size}; "
            f"pick rows x cols = {tp.size}"
        )
    row, col = divmod(tp.rank, cols)
    if tp.group is None:  # a group of one: no communication
        local = ResolvedGroup.local()
        return TPGrid(rows, cols, row, col, local, local, tp)
    mine = dist.get_process_group_ranks(tp.group)  # global ranks, by TP rank
    if all_tp_ranks is None:
        if len(mine) != dist.get_world_size():
            raise ValueError(
                f"the TP group holds {len(mine)} of {dist.get_world_size()} processes: pass "
                "all_tp_ranks= (the global ranks of every TP group, by TP rank) so that every "
                "process creates every grid group, or use tp_ext.init_parallel(tp=(P, Q))"
            )
        all_tp_ranks = [mine]
    found = None
    for members in all_tp_ranks:
        members = [int(r) for r in members]
        row_groups = [
            dist.new_group([members[r * cols + c] for c in range(cols)]) for r in range(rows)
        ]
        col_groups = [
            dist.new_group([members[r * cols + c] for r in range(rows)]) for c in range(cols)
        ]
        if members == mine:
            found = (row_groups[row], col_groups[col])
    if found is None:
        raise ValueError(f"all_tp_ranks {all_tp_ranks} does not contain this TP group {mine}")
    return TPGrid(rows, cols, row, col, ResolvedGroup.of(found[0]), ResolvedGroup.of(found[1]), tp)
