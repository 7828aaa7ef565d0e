"""Checkpoints in a form transformers converts on load, read by slices.

transformers 5 keeps a mixture-of-experts layer's experts in fused tensors (``experts.gate_up_proj``
``[experts, 2 x intermediate, hidden]``, ``experts.down_proj``) but reads and writes checkpoints
with one tensor per expert and projection (Mixtral's ``block_sparse_moe.experts.3.w1.weight``),
converting on load by its conversion mapping (``transformers.conversion_mapping``: renamings, and
converters that stack the experts' tensors and concatenate the projections). Its own loader
reads every tensor whole.

:func:`converted_files` puts a view with the model's names over such a checkpoint, from that
same mapping: a renamed tensor reads as itself; a converted one is a virtual tensor whose slice
reads only the experts, rows and columns asked for, from each expert's own tensors. So every
rank of an expert-parallel (and tensor-parallel) model reads just its experts' share of the
files. Converters other than that stack-and-concatenate (quantisation, transposes, splits) are
not read this way: :func:`converted_files` then gives None and the checkpoint is read whole.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Optional

import torch

from tp_ext.checkpoint.safetensors_io import SafetensorsFiles

__all__ = ["ConvertedFiles", "converted_files"]


@dataclasses.dataclass
class _Stacked:
    """A converted tensor: ``parts[k][e]`` is the checkpoint tensor of part ``k`` (a source
    pattern) of expert ``e``; the full tensor stacks the experts (dim 0), each the parts
    concatenated along its dim 0 (the full tensor's dim 1)."""

    parts: list  # [part][expert] -> checkpoint name
    rows: list  # rows of each part (dim 0 of its tensors)
    rest: tuple  # the remaining dims, the same for every part


class ConvertedFiles:
    """:class:`~tp_ext.checkpoint.safetensors_io.SafetensorsFiles`' reading interface under the
    model's names (see the module doc)."""

    def __init__(self, files: SafetensorsFiles, renamed: dict, stacked: dict) -> None:
        self.files = files
        self.root = files.root
        self._renamed = renamed  # model name -> checkpoint name
        self._stacked = stacked  # model name -> _Stacked

    def names(self) -> set[str]:
        return set(self._renamed) | set(self._stacked)

    def _first(self, name: str) -> str:
        """A checkpoint tensor ``name`` is read from (its file and dtype stand for it)."""
        stacked = self._stacked.get(name)
        return self._renamed[name] if stacked is None else stacked.parts[0][0]

    def where(self, name: str) -> str:
        return self.files.where(self._first(name))

    def paths(self) -> list[str]:
        return self.files.paths()

    def nbytes(self) -> int:
        return self.files.nbytes()

    def dtype(self, name: str) -> str:
        return self.files.dtype(self._first(name))

    def shape(self, name: str) -> tuple[int, ...]:
        stacked = self._stacked.get(name)
        if stacked is None:
            return self.files.shape(self._renamed[name])
        return (len(stacked.parts[0]), sum(stacked.rows), *stacked.rest)

    def read(self, name: str, index) -> torch.Tensor:
        """``tensor[index]`` (a tuple of slices, dim 0 first): for a converted tensor, only
        those experts' tensors, and of each only the rows and columns asked for, are read."""
        stacked = self._stacked.get(name)
        if stacked is None:
            return self.files.read(self._renamed[name], index)
        experts = range(len(stacked.parts[0]))[index[0]]
        rows = range(sum(stacked.rows))[index[1]] if len(index) > 1 else None
        later = tuple(index[2:])
        blocks = []
        for e in experts:
            pieces, start = [], 0
            for names, count in zip(stacked.parts, stacked.rows):
                lo, hi = (0, count) if rows is None else (rows.start - start, rows.stop - start)
                lo, hi = max(lo, 0), min(hi, count)
                if lo < hi:
                    pieces.append(self.files.read(names[e], (slice(lo, hi), *later)))
                start += count
            blocks.append(torch.cat(pieces) if len(pieces) > 1 else pieces[0])
        if not blocks:  # no experts asked for
            shape = self.shape(name)
            return torch.empty((0, *shape[1:]))
        return torch.stack(blocks)


def converted_files(files: SafetensorsFiles, model) -> Optional[ConvertedFiles]:
    """A view of ``files`` under ``model``'s names by transformers' conversion mapping of
    ``model`` (a transformers model, or one with its ``config`` and class name); None when the
    mapping converts something other than stacking experts and concatenating projections, or
    when transformers has no such mapping."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            Concatenate,
            MergeModulelist,
            WeightConverter,
            WeightRenaming,
            apply_renamings,
        )
    except ImportError:  # a transformers without conversion mappings
        return None
    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    for converter in converters:
        ops = list(converter.operations)
        shapes = [type(op) for op in ops]
        if shapes not in ([MergeModulelist], [MergeModulelist, Concatenate]):
            return None
        if ops[0].dim != 0 or (len(ops) == 2 and ops[1].dim != 1):
            return None
    renamed: dict = {}
    found: dict = {}  # model name -> {part: {expert: checkpoint name}}
    for key in sorted(files.names()):
        name = apply_renamings(key, renamings)
        for converter in converters:
            target, pattern = converter.rename_source_key(name)
            if pattern is None:
                continue
            part = converter.source_patterns.index(pattern)
            expert = _expert_index(name, converter._original_source_patterns[part])
            if expert is None:
                return None
            found.setdefault(target, {}).setdefault(part, {})[expert] = key
            break
        else:
            renamed[name] = key
    stacked = {}
    for target, parts in found.items():
        experts = sorted(parts[0])
        if any(sorted(p) != experts for p in parts.values()) or experts != list(
            range(len(experts))
        ):
            return None  # an expert or a part missing: the check of the names will say so
        names = [[parts[k][e] for e in experts] for k in sorted(parts)]
        shapes = [files.shape(n[0]) for n in names]
        if len({s[1:] for s in shapes}) != 1:
            return None
        stacked[target] = _Stacked(names, [s[0] for s in shapes], shapes[0][1:])
    return ConvertedFiles(files, renamed, stacked)


def _expert_index(name: str, pattern: str) -> Optional[int]:
    """The expert number a source pattern's ``*`` stands for in ``name``
    (``.experts.*.w1.weight`` in ``...experts.3.w1.weight``: 3)."""
    if pattern.count("*") != 1:
        return None
    before, after = pattern.split("*")
    match = re.search(re.escape(before) + r"(\d+)" + re.escape(after) + "$", name)
    return None if match is None else int(match.group(1))
