"""Where a model's tensors live in a Hugging Face checkpoint, as the model declares it.

A model that the checkpoint code can load and save (any model, not only Qwen2) provides:

- ``config``: a dataclass of its architecture (recorded in sharded checkpoints' manifests);
- ``checkpoint_formats``: the names of the checkpoint formats it can be read from, the first
  being the one it saves in;
- ``checkpoint_map(fmt=None) -> {name: [Piece, ...]}``: for every entry of its
  ``state_dict()``, the checkpoint tensors that, stacked along dim 0, make up the full tensor
  in format ``fmt`` (None: the first format);
- ``hf_config(dtype) -> dict``: the config.json written next to a merged export;
- under pipeline parallelism (a model holding only some stages' tensors): ``pipeline_group``,
  the ProcessGroup of its pipeline ranks (None, or absent, without pipelining), with
  ``stage_ids`` (the stages this rank holds, in order) and ``stage_modules()`` (one module per
  stage, owning that stage's tensors), which order a merged save as the whole model's. Each
  rank's ``state_dict()`` then names its stages' tensors as in the whole model; a merged save
  is a collective of the world, written by global rank 0 from what the ranks of its pipeline
  send it, and a load reads each rank's own stages.

A model that declares no checkpoint map is saved under its own state-dict names
(:func:`own_names_map`). The checkpoint code never imports a model: it reads these, and the
layers' shard specs for which rows each rank holds. A tensor whose pieces all belong to an
earlier entry is tied to it (a tied LM head): it is read from that entry's tensors and never
written twice.
"""

from __future__ import annotations

import dataclasses

from tp_ext.layers import full_shapes, is_full_transposed

__all__ = [
    "Piece",
    "row_reads",
    "expected_shapes",
    "tied_names",
    "declared_map",
    "model_checkpoint_map",
    "own_names_map",
    "detect_checkpoint_map",
]


@dataclasses.dataclass(frozen=True)
class Piece:
    """Rows ``[start, start + rows)`` (dim 0) of checkpoint tensor ``name``."""

    name: str
    start: int
    rows: int


def declared_map(model):
    """The model's ``checkpoint_map`` method, or None when it declares none."""
    return getattr(model, "checkpoint_map", None)


def model_checkpoint_map(model, fmt=None) -> dict[str, list[Piece]]:
    """The model's declared checkpoint map (see the module docstring); for a model that
    declares none, :func:`own_names_map`."""
    declare = declared_map(model)
    if declare is None:
        return own_names_map(model)
    return declare(fmt)


def own_names_map(model) -> dict[str, list[Piece]]:
    """Every entry of ``model.state_dict()`` as one checkpoint tensor of its own name and full
    shape: the checkpoint map of a model whose names are already the checkpoint's, such as a Hugging
    Face model that ``tp_ext.parallelize`` sharded in place (it keeps its module names). A tied
    tensor (one object under two names, or a copy the model lists in ``checkpoint_aliases``,
    e.g. a pipeline's last stage's LM head) lives under its first name, as transformers saves
    it."""
    aliases = dict(getattr(model, "checkpoint_aliases", None) or {})
    first: dict[int, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        owner = first.setdefault(id(tensor), name)
        if owner != name:
            aliases.setdefault(name, owner)
    return {
        name: [Piece(aliases.get(name, name), 0, shape[0] if shape else 1)]
        for name, shape in full_shapes(model).items()
    }


def detect_checkpoint_map(model, names) -> dict[str, list[Piece]]:
    """The checkpoint map of the first of the model's formats whose tensors are all among
    ``names`` (a checkpoint's tensor names); the default format's when none is complete (its
    check then says what is missing)."""
    for fmt in getattr(model, "checkpoint_formats", (None,)):
        try:
            cmap = model_checkpoint_map(model, fmt)
        except ValueError:  # a format this model's config cannot have
            continue
        if {p.name for pieces in cmap.values() for p in pieces} <= set(names):
            return cmap
    return model_checkpoint_map(model)


def tied_names(entries, cmap) -> set[str]:
    """Names of ``entries`` (in state_dict order) whose pieces all belong to earlier entries."""
    seen, tied = set(), set()
    for name, *_ in entries:
        pieces = {p.name for p in cmap[name]}
        if pieces <= seen:
            tied.add(name)
        seen |= pieces
    return tied


def expected_shapes(entries, cmap) -> dict[str, tuple[int, ...]]:
    """Full shape each checkpoint tensor must have, from the model's full shapes and checkpoint map.
    ``entries``: :func:`tp_ext.layers.tensor_specs` of the model."""
    shapes: dict[str, list[int]] = {}
    for name, tensor, spec, owner in entries:
        if isinstance(spec, tuple):  # the (dim, Partition) of tp_ext.layers.state_entries
            spec = spec[1].along(spec[0])
        full = list(tensor.shape if spec is None else spec.full_shape_of(tensor.shape))
        if is_full_transposed(owner, name.rpartition(".")[2]):
            full.reverse()
        for piece in cmap[name]:
            rows = max(shapes.get(piece.name, [0])[0], piece.start + piece.rows)
            shapes[piece.name] = [rows] + full[1:]
    return {name: tuple(shape) for name, shape in shapes.items()}


def row_reads(pieces, offset: int, length: int):
    """The (piece, first row, end row) reads, in checkpoint-tensor rows, that give rows
    [offset, offset+length) of the tensor the pieces stack into."""
    reads, start = [], 0
    for piece in pieces:
        lo, hi = max(offset, start), min(offset + length, start + piece.rows)
        if lo < hi:
            reads.append((piece, piece.start + lo - start, piece.start + hi - start))
        start += piece.rows
    return reads


# Large slices are read in pieces of at most this many bytes, each straight into its place in
