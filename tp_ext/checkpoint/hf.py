"""Hugging Face checkpoints in and out, for any model that declares its layout
(:mod:`tp_ext.checkpoint.layout`); nothing is ever unpickled.

- **In** (:func:`load_hf_checkpoint`): ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``. Every rank reads only its own rows (or columns) of each
  tensor through safetensors' slice reads, so its peak host memory stays near its shard.
- **Out** (:func:`save_hf_checkpoint`): a merged checkpoint that transformers loads. Tensors are
  gathered one at a time; rank 0 writes; the directory appears atomically.

Every load checks names, shapes and files before reading, and an error on any rank is raised on
every rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Optional

import torch

from tp_ext.checkpoint.atomic import reading, saving
from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.layout import detect_layout, expected_shapes, model_layout, tied_names
from tp_ext.checkpoint.manifest import MANIFEST, check_files, check_listed, read_manifest
from tp_ext.checkpoint.memory import peak_rss_bytes
from tp_ext.checkpoint.safetensors_io import (
    INDEX_FILE,
    SINGLE_FILE,
    SafetensorsFiles,
    check_names_and_shapes,
    load_local,
)
from tp_ext.distributed import comm
from tp_ext.distributed.groups import TPGroup
from tp_ext.layers import ParallelModule, iter_full_tensors, state_entries

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "model_group", "tp_size"]


def model_group(model) -> TPGroup:
    """The TP group of a tp_ext model (a group of one for a model without one)."""
    tp = getattr(model, "tp", None)
    return tp if isinstance(tp, TPGroup) else TPGroup.local()


def tp_size(model) -> int:
    return model_group(model).size


@torch.no_grad()
def load_hf_checkpoint(
    model,
    path: str,
    fmt: Optional[str] = None,
    strict: bool = True,
    progress: bool = True,
    lossy_dtypes: bool = False,
) -> dict:
    """Load a Hugging Face checkpoint directory into a tp_ext model, each rank reading only its
    own slices. ``fmt``: one of the model's ``checkpoint_formats`` (None: the one whose tensor
    names the checkpoint has; a Qwen2 model reads "qwen2" and "qwen"). ``lossy_dtypes``: round
    between float16 and bfloat16 where values differ (see ``safetensors_io.converted``).
    Returns a report: bytes read by this rank, its shard size, and its peak host memory."""
    group = model_group(model)
    with reading(path, group) as directory:
        return _load(model, directory, path, group, fmt, strict, progress, lossy_dtypes)


def _load(model, directory, path, group, fmt, strict, progress, lossy_dtypes) -> dict:
    entries = list(state_entries(model))
    show = progress and group.rank == 0

    def prepare():
        files = SafetensorsFiles(directory)
        if os.path.isfile(os.path.join(directory, MANIFEST)):  # saved by tp_ext: verified
            info = read_manifest(directory)
            check_listed(directory, info, files.paths())
            check_files(directory, info, hashes=True, group=group)
        layout = detect_layout(model, files.names()) if fmt is None else model_layout(model, fmt)
        check_names_and_shapes(files, expected_shapes(entries, layout), strict)
        for name, tensor, *_ in entries:
            if tensor.device.type == "meta":
                raise CheckpointError(
                    f"{name} is on the meta device; build the model on a real "
                    "device (or call to_empty) before loading"
                )
        return files, layout

    files, layout = comm.everywhere(group, f"loading {path}", prepare, CheckpointError)

    def read():
        read_bytes = 0
        bar = _progress(len(entries), f"loading {os.path.basename(os.path.normpath(path))}", show)
        for name, tensor, spec, owner in entries:
            rank = owner.tp_rank if isinstance(owner, ParallelModule) else 0
            read_bytes += load_local(files, layout[name], spec, rank, tensor, lossy_dtypes)
            bar.update(1)
        bar.close()
        return read_bytes

    read_bytes = comm.everywhere(group, f"loading {path}", read, CheckpointError)
    shard_bytes = sum(t.numel() * t.element_size() for _, t, *_ in entries)
    return {
        "read_bytes": read_bytes,
        "shard_bytes": shard_bytes,
        "checkpoint_bytes": files.nbytes(),
        "peak_rss_bytes": peak_rss_bytes(),
    }


class _NoBar:
    def update(self, n):
        pass

    def close(self):
        pass


def _progress(total: int, desc: str, show: bool):
    if not show:
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)


@torch.no_grad()
def save_hf_checkpoint(model, path: str, max_shard_bytes: int = 5 * 1024**3) -> None:
    """Write a merged Hugging Face (transformers Qwen2ForCausalLM) checkpoint of ``model`` to
    directory ``path``: config.json, and model.safetensors or shards with an index. A collective:
    every rank calls it; tensors are gathered one at a time and rank 0 writes."""
    from safetensors.torch import save_file

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    group = model_group(model)
    writer = group.rank == 0
    layout = model_layout(model)
    entries = list(state_entries(model))
    tied = tied_names(entries, layout)
    dtype = entries[0][1].dtype
    # Plan the files from shapes alone, so each file is written as soon as it is full.
    sizes = {}
    for name, tensor, spec, _ in entries:
        if name in tied:
            continue
        numel = (
            tensor.numel() // (tensor.shape[spec[0]] or 1) * spec[1].full
            if spec
            else tensor.numel()
        )
        sizes[name] = numel * tensor.element_size()
    files, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    files.append(current)
    names = (
        [SINGLE_FILE]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    file_of = {name: names[i] for i, group_names in enumerate(files) for name in group_names}

    with saving(path, group, {"format": "huggingface", "tp": group.size}) as directory:

        def write_all():
            pending = {file: {} for file in names}  # tensors of each file not yet written
            needed = {
                file: sum(len(layout[n]) for n in group_names)
                for file, group_names in zip(names, files)
            }
            weight_map = {}
            for name, full in iter_full_tensors(model):  # a collective: every rank iterates
                if not writer or name not in file_of:
                    continue
                file = file_of[name]
                start = 0
                for piece in layout[name]:
                    pending[file][piece.name] = full[start : start + piece.rows].contiguous()
                    weight_map[piece.name] = file
                    start += piece.rows
                if len(pending[file]) == needed[file]:
                    out = os.path.join(directory, file)
                    save_file(pending.pop(file), out, metadata={"format": "pt"})
            if not writer:
                return
            if len(names) > 1:
                total = sum(sizes.values())
                with open(os.path.join(directory, INDEX_FILE), "w") as f:
                    json.dump(
                        {"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2
                    )
            with open(os.path.join(directory, "config.json"), "w") as f:
                json.dump(model.hf_config(dtype), f, indent=2)

        comm.everywhere(group, f"saving {path}", write_all, CheckpointError)
