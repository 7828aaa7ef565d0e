"""2D tensor parallelism (SUMMA) on a P x Q grid: the linear layer, splitting and gathering
activations, and what every 2D layer shares (each parameter's block of its full tensor).

Layout (:class:`tp_ext.distributed.grid.TPGrid`): an activation ``[tokens, features]`` (or
``[batch, seq, features]``) is split into blocks, tokens (sequences) over the P grid rows and
features over the Q grid columns; rank (i, j) holds block (i, j). A weight ``[out, in]`` holds
``out`` over the columns and ``in`` over the rows, so a layer's output has its input's layout
and layers chain without redistribution. Each rank stores 1 / (P * Q) of every weight and of
every activation; a linear layer moves O(1 / P + 1 / Q) of the input and weight per rank (1D
TP all-reduces whole activations).

Sizes that do not divide are split by the one policy (:func:`tp_ext.shard_sizes`); a layer may
also take the split of its features over Q explicitly (whole attention heads). Parameters that
are not split over an axis (biases and norm weights over P) are replicated over it: their
gradients are summed over it in backward, so every copy takes the same update.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Callable, Optional

import torch

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.grid import TPGrid
from tp_ext.layers.base import ParallelModule, check_int, default_grid, default_linear_init
from tp_ext.sharding import GridBlock, shard_sizes

__all__ = [
    "GridModule",
    "Linear2D",
    "split_2d",
    "gather_2d",
    "regrid",
    "summa_product",
    "default_grid",
]

InitFn = Callable[[torch.Tensor], None]


def _check_sizes(name: str, sizes, total: int, parts: int) -> tuple[int, ...]:
    ok = isinstance(sizes, Sequence) and len(sizes) == parts
    ok = ok and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in sizes)
    if not ok or sum(sizes) != total:
        raise ValueError(
            f"{name} must list {parts} sizes >= 0 (one per grid column) summing to {total}, got "
            f"{sizes!r}; e.g. tp_ext.shard_sizes({total}, {parts}) = {shard_sizes(total, parts)}"
        )
    return tuple(int(n) for n in sizes)


class GridModule(ParallelModule):
    """Base of the 2D layers: a :class:`ParallelModule` set up on a grid (``_setup_grid``),
    each parameter's spec a :class:`GridBlock`. Kept as a name for the 2D layers; everything it
    does is :class:`ParallelModule`'s."""


# ---- activations: split and gather ---------------------------------------------------------------


def split_2d(x: torch.Tensor, grid: Optional[TPGrid] = None, dim: int = 0) -> torch.Tensor:
    """This rank's block of ``x`` (the same full tensor on every rank): ``dim`` (tokens, or
    sequences of ``[batch, seq, features]``) split over the grid rows, the last dimension
    (features) over the columns, by :func:`tp_ext.shard_sizes`. Differentiable: the gradient
    of ``x`` is gathered, whole, on every rank."""
    grid = default_grid() if grid is None else grid
    if x.dim() < 2:
        raise ValueError(f"split_2d: x must have at least 2 dimensions, got shape {tuple(x.shape)}")
    dim = dim % x.dim()
    if dim == x.dim() - 1:
        raise ValueError(
            "split_2d: dim is split over the grid rows and must not be the last dimension"
        )
    x = comm.scatter_to_tp(x, dim, shard_sizes(x.size(dim), grid.rows), group=grid.col_group)
    return comm.scatter_to_tp(x, -1, shard_sizes(x.size(-1), grid.cols), group=grid.row_group)


def gather_2d(
    block: torch.Tensor,
    grid: Optional[TPGrid] = None,
    dim: int = 0,
    *,
    dim_sizes: Optional[Sequence[int]] = None,
    feature_sizes: Optional[Sequence[int]] = None,
) -> torch.Tensor:
    """The full tensor from every rank's block (the inverse of :func:`split_2d`), on every rank.
    ``dim_sizes`` / ``feature_sizes``: every grid row's / column's size (default: exchanged,
    one small all-gather each). Differentiable: each rank's block gets its part of the
    gradient."""
    grid = default_grid() if grid is None else grid
    dim = dim % block.dim()
    if feature_sizes is None:
        feature_sizes = _sizes_of(block.size(-1), grid.row_group, block.device)
    if dim_sizes is None:
        dim_sizes = _sizes_of(block.size(dim), grid.col_group, block.device)
    out = comm.gather_from_tp(block, -1, list(feature_sizes), group=grid.row_group)
    return comm.gather_from_tp(out, dim, list(dim_sizes), group=grid.col_group)


def _sizes_of(local: int, group, device) -> list[int]:
    if group.size == 1:
        return [local]
    mine = torch.tensor([local], dtype=torch.long, device=device)
    return comm.all_gather(mine, 0, group=group).tolist()


def regrid(block: torch.Tensor, src: GridBlock, dst: GridBlock, grid: TPGrid) -> torch.Tensor:
    """This rank's ``dst`` block of the tensor whose ``src`` blocks the grid's ranks hold
    (``block``: this rank's), by one all-to-all over the grid: each rank sends every rank the
    part of its block that the other's ``dst`` block holds. Each element is held by one rank
    of ``src`` (no replicated axis), so each moves once. Differentiable: the backward sends the
    gradient back the same way."""
    me = (grid.row, grid.col)
    ranks = [divmod(r, grid.cols) for r in range(grid.size)]  # TP rank r sits at (r // Q, r % Q)
    mine, want = src.ranges(*me), dst.ranges(*me)
    sent = [_overlap(mine, dst.ranges(*r)) for r in ranks]
    came = [_overlap(src.ranges(*r), want) for r in ranks]
    pieces = [_narrow(block, box, mine).reshape(-1) for box in sent]
    flat = comm.all_to_all_single(
        torch.cat(pieces), [p.numel() for p in pieces], [_numel(b) for b in came], grid.tp_group
    )
    parts = flat.split([_numel(b) for b in came])
    tiles: dict = {}  # the pieces that arrived, by their first row, then their first column
    for box, part in zip(came, parts):
        if _numel(box):
            tiles.setdefault(box[0][0], []).append((box[1][0], part.view(box[0][1], box[1][1])))
    if not tiles:  # an empty block (as many grid rows or columns as entries, or more)
        return flat.view(dst.shape(*me))
    rows = [torch.cat([t for _, t in sorted(row)], 1) for _, row in sorted(tiles.items())]
    return torch.cat(rows, 0)


def _overlap(a, b) -> list[tuple[int, int]]:
    """The box where boxes ``a`` and ``b`` ((offset, length) per dimension) meet."""
    out = []
    for (a0, an), (b0, bn) in zip(a, b):
        start = max(a0, b0)
        out.append((start, max(0, min(a0 + an, b0 + bn) - start)))
    return out


def _narrow(block: torch.Tensor, box, held) -> torch.Tensor:
    """The part of ``block`` (which holds box ``held`` of the full tensor) in ``box``."""
    for d, ((start, length), (offset, _)) in enumerate(zip(box, held)):
        block = block.narrow(d, start - offset if length else 0, length)
    return block


def _numel(box) -> int:
    return math.prod(length for _, length in box)


def summa_product(x: torch.Tensor, weight: torch.Tensor, in_sizes, weight_in_sizes, grid):
    """``x @ weight.T`` of blocks on ``grid``: ``weight`` this rank's ``[out, in]`` block in
    :class:`Linear2D`'s layout (the SUMMA op; a plain product on a grid of one)."""
    if grid.size == 1:
        return ops.linear(x, weight, None)
    return comm.summa_linear(x, weight, in_sizes, weight_in_sizes, grid.row_group, grid.col_group)


# ---- the linear layer ----------------------------------------------------------------------------


class Linear2D(GridModule):
    """``y = x @ W.T + b`` on a P x Q grid (SUMMA).

    Rank (i, j) takes ``x``'s block (i, j) ``[..., in_sizes[j]]`` and returns ``y``'s block (i, j)
    ``[..., out_sizes[j]]``; it holds ``W[out rows of column j, in columns of row i]`` and the
    bias's piece of column j (replicated over the rows). The product is
    ``tp_ext.ops.summa_linear``: panels of ``x`` broadcast along grid rows and of ``W`` along
    grid columns, each multiplied locally, the next panel's broadcasts overlapped with the
    current product. ``in_sizes`` / ``out_sizes``: the split of the features over the columns
    (default :func:`tp_ext.shard_sizes`; whole heads for attention); ``W``'s input features are
    split over the rows by :func:`tp_ext.shard_sizes`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        grid: Optional[TPGrid] = None,
        *,
        in_sizes: Optional[Sequence[int]] = None,
        out_sizes: Optional[Sequence[int]] = None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
    ):
        super().__init__()
        grid = self._setup_grid(grid)
        self.in_features = check_int("in_features", in_features)
        self.out_features = check_int("out_features", out_features)
        Q, P = grid.cols, grid.rows
        self.in_sizes = _check_sizes(
            "in_sizes",
            shard_sizes(in_features, Q) if in_sizes is None else in_sizes,
            in_features,
            Q,
        )
        self.out_sizes = _check_sizes(
            "out_sizes",
            shard_sizes(out_features, Q) if out_sizes is None else out_sizes,
            out_features,
            Q,
        )
        self.weight_in_sizes = tuple(shard_sizes(in_features, P))
        weight = GridBlock(
            (out_features, in_features), [("Q", self.out_sizes), ("P", self.weight_in_sizes)]
        )
        self._new_param("weight", weight, device, dtype)
        if bias:
            self._new_param(
                "bias", GridBlock((out_features,), [("Q", self.out_sizes)]), device, dtype
            )
        else:
            self.register_parameter("bias", None)
        self.reset_parameters(init_method)

    def reset_parameters(self, init_method: Optional[InitFn] = None) -> None:
        weight_init, bias_init = default_linear_init(self.in_features)
        self._init_from_full("weight", init_method or weight_init)
        if self.bias is not None:
            self._init_from_full("bias", bias_init)

    @property
    def local_in_features(self) -> int:
        return self.in_sizes[self.grid.col]

    @property
    def local_out_features(self) -> int:
        return self.out_sizes[self.grid.col]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear_2d_shared_input(x, [self])[0]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, grid={self.grid.rows}x{self.grid.cols}"
        )


def linear_2d_shared_input(x: torch.Tensor, linears: Sequence[Linear2D]) -> list[torch.Tensor]:
    """The outputs of several :class:`Linear2D` of the same input (q, k and v; gate and up) from
    one SUMMA product over their stacked weight blocks: ``x``'s panels are broadcast along the
    grid rows once for all of them instead of once each (the weights' panels are the same
    bytes either way)."""
    first = linears[0]
    grid = first.grid
    for lin in linears[1:]:
        if lin.grid is not grid or lin.in_sizes != first.in_sizes:
            raise ValueError(
                "linear_2d_shared_input: every layer must be on the same grid with the same "
                f"in_sizes; got {first.in_sizes} and {lin.in_sizes}"
            )
    if x.dim() == 0 or x.size(-1) != first.local_in_features:
        raise ValueError(
            f"Linear2D: input block has shape {tuple(x.shape)} but its last dimension must be "
            f"this grid column's share of in_features, in_sizes[{grid.col}] = "
            f"{first.local_in_features} (split_2d gives the block)"
        )
    if grid.size == 1:
        return [ops.linear(x, lin.weight, lin.bias) for lin in linears]
    weight = first.weight if len(linears) == 1 else torch.cat([lin.weight for lin in linears])
    y = summa_product(x, weight, first.in_sizes, first.weight_in_sizes, grid)
    outs = y.split([lin.local_out_features for lin in linears], dim=-1)
    return [
        out if lin.bias is None else out + comm.copy_to_tp(lin.bias, group=grid.col_group)
        for out, lin in zip(outs, linears)  # dbias: summed over the grid rows
    ]
