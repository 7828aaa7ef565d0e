"""Hugging Face checkpoints in and out, for any model that declares its checkpoint map
(:mod:`tp_ext.checkpoint.checkpoint_map`); nothing is ever unpickled.

- **In** (:func:`load_hf_checkpoint`): ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``. Every rank reads only its own rows (or columns) of each
  tensor through safetensors' slice reads, so its peak host memory stays near its shard.
- **Out** (:func:`save_hf_checkpoint`): a merged checkpoint that transformers loads. Tensors are
  gathered one at a time; rank 0 writes; the directory appears atomically. A pipelined model
  (see :mod:`tp_ext.checkpoint.checkpoint_map`) is saved whole: every stage sends its tensors
  to global rank 0, which writes them all.

Every load checks names, shapes and files before reading, and an error on any rank is raised on
every rank.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Iterable, Optional

import torch
import torch.distributed as dist

from tp_ext.checkpoint.atomic import reading, saving
from tp_ext.checkpoint.checkpoint_map import (
    Piece,
    declared_map,
    detect_checkpoint_map,
    expected_shapes,
    model_checkpoint_map,
    own_names_map,
    tied_names,
)
from tp_ext.checkpoint.errors import CheckpointError
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
from tp_ext.distributed.dtensors import local_tensor
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers import (
    ParallelModule,
    expert_rows,
    full_shapes,
    is_full_transposed,
    iter_full_tensors,
    tensor_specs,
)
from tp_ext.sharding import GridBlock, Partition
from tp_ext.validation import as_torch_dtype, check_int

__all__ = ["load_hf_checkpoint", "save_hf_checkpoint", "model_group", "tp_size"]


def model_group(model) -> ResolvedGroup:
    """The TP group of a tp_ext model (a group of one for a model without one)."""
    tp = model.tp if isinstance(model, ParallelModule) else None
    return tp if isinstance(tp, ResolvedGroup) else ResolvedGroup.local()


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
    used_elsewhere: Iterable[str] = (),
    files_view=None,
) -> dict:
    """Load a Hugging Face checkpoint directory into a tp_ext model, each rank reading only its
    own slices. ``fmt``: one of the model's ``checkpoint_formats`` (None: the one whose tensor
    names the checkpoint has; a Qwen2 model reads "qwen2" and "qwen"). ``lossy_dtypes``: round
    between float16 and bfloat16 where values differ (see ``safetensors_io.converted``).
    ``used_elsewhere``: checkpoint names other parts of the model use (a pipeline stage's
    model: the other stages'), which ``strict`` does not count as unused. ``files_view``: a
    function from the checkpoint's files to the view read (e.g. one of
    :func:`~tp_ext.checkpoint.hf_conversions.converted_files` for a form transformers converts
    on load). Returns a report: bytes read by this rank, its shard size, and its peak host
    memory."""
    group = model_group(model)
    elsewhere = frozenset(used_elsewhere)
    with reading(path, group) as directory:
        options = (fmt, strict, progress, lossy_dtypes, elsewhere, files_view)
        return _load(model, directory, path, group, *options)


def _load(
    model, directory, path, group, fmt, strict, progress, lossy_dtypes, elsewhere, files_view
) -> dict:
    entries = list(tensor_specs(model))
    show = progress and group.rank == 0

    def prepare():
        files = SafetensorsFiles(directory)
        if os.path.isfile(os.path.join(directory, MANIFEST)):  # saved by tp_ext: verified
            info = read_manifest(directory)
            check_listed(directory, info, files.paths())
            check_files(directory, info, hashes=True, group=group)
        if files_view is not None:
            files = files_view(files)
        cmap = (
            detect_checkpoint_map(model, files.names())
            if fmt is None
            else model_checkpoint_map(model, fmt)
        )
        check_names_and_shapes(files, expected_shapes(entries, cmap), strict, elsewhere)
        for name, tensor, *_ in entries:
            if tensor.device.type == "meta":
                raise CheckpointError(
                    f"{name} is on the meta device; build the model on a real "
                    "device (or call to_empty) before loading"
                )
        return files, cmap

    files, cmap = comm.everywhere(group, f"loading {path}", prepare, CheckpointError)

    def read():
        read_bytes = 0
        bar = _progress(len(entries), f"loading {os.path.basename(os.path.normpath(path))}", show)
        for name, tensor, spec, owner in entries:
            rows = _row_split(name, spec)
            rank = 0 if spec is None else owner.shard_coord
            dest = tensor
            if is_full_transposed(owner, name.rpartition(".")[2]):  # the file holds [in, out]
                dest = tensor.t()
                rows = None if rows is None else (1 - rows[0], rows[1])
            experts = expert_rows(owner, name)  # (first, count) of the experts this rank holds
            if experts is not None:
                experts = (experts[0], tensor.shape[0])
            read_bytes += load_local(files, cmap[name], rows, rank, dest, lossy_dtypes, experts)
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
    every rank calls it; tensors are gathered one at a time and rank 0 writes.

    A pipelined model (one declaring a ``pipeline_group``) holds only its stages' tensors: the
    save is then a collective of every rank of the world. Each rank gathers its tensors over
    its TP (and, under FSDP2, DP) group; the ranks of global rank 0's pipeline (DP replica 0,
    TP rank 0 of every stage) send them to global rank 0, which plans the files from every
    stage's names and sizes, in stage order, and writes the whole model."""
    pipeline = getattr(model, "pipeline_group", None)
    # Under pipelining every rank of the world takes part (and fails together); else the TP group.
    group = model_group(model) if pipeline is None else comm.resolve_group(dist.group.WORLD)
    what = f"saving {path}"

    def describe():
        check_int("max_shard_bytes", max_shard_bytes, 1, why="bytes per file")
        entries = list(tensor_specs(model))
        # a 2D model's entries carry the checkpoint's names already (as tp_ext.checkpoint.dcp
        # reads them); its declared map is the 1D model's fusions, for training checkpoints
        own = any(isinstance(spec, GridBlock) for _, _, spec, _ in entries)
        own = own or declared_map(model) is None
        cmap = own_names_map(model) if own else model_checkpoint_map(model)
        if not entries:
            raise CheckpointError(f"{type(model).__name__} has no tensors on this rank to save")
        unknown = [name for name, *_ in entries if name not in cmap]
        if unknown:
            raise CheckpointError(
                f"{type(model).__name__}.checkpoint_map() has no place for {unknown[:5]}"
            )
        return cmap, entries, _describe_entries(model, entries, pipeline), own

    cmap, entries, mine, own = comm.everywhere(group, what, describe, CheckpointError)
    me = group.rank
    if pipeline is None:
        sources = [(me, mine)]
    else:  # every stage's names and sizes, so that the writer plans the whole model's files
        texts = comm.all_gather_text(json.dumps(mine), group)
        sources = [(r, json.loads(texts[r])) for r in dist.get_process_group_ranks(pipeline)]
        if own:  # own names: other stages' tensors are theirs too
            aliases = getattr(model, "checkpoint_aliases", None) or {}  # (as own_names_map)
            for _, described in sources:
                for name, _, shape, _ in described:
                    piece = Piece(aliases.get(name, name), 0, shape[0] if shape else 1)
                    cmap.setdefault(name, [piece])
    plan = comm.everywhere(
        group, what, lambda: _plan_files(sources, cmap, max_shard_bytes), CheckpointError
    )
    writer = me == 0
    # The stages of global rank 0's pipeline send their tensors to it; every other rank only
    # takes part in its TP and DP gathers.
    sending = pipeline is not None and not writer and any(r == 0 for r, _ in sources)
    info = {"format": "huggingface", "tp": model_group(model).size}

    with saving(path, group, info) as directory:

        def write_all():
            if writer:
                _write(model, entries, directory, cmap, plan, me, pipeline)
                return
            for name, full in iter_full_tensors(model):  # a collective: every rank iterates
                if sending and name in plan.file_of:
                    dist.send(full.contiguous(), 0, group=pipeline)

        comm.everywhere(group, what, write_all, CheckpointError)


def _row_split(name: str, spec):
    """A 1D spec as the ``(dim, Partition)`` that slice reads take; a grid block is refused."""
    if spec is None or isinstance(spec, Partition):
        return None if spec is None else (spec.dim, spec)
    raise CheckpointError(
        f"{name}: a {type(spec).__name__} (2D) is read by the 2D model's own from_pretrained, "
        "not load_hf_checkpoint; build it with Qwen2ForCausalLM.from_pretrained(path, "
        "parallel=state)"
    )


def _stage_of_entries(model, entries) -> list[int]:
    """Order keys for this rank's entries: the pipeline stage each belongs to (from the model's
    ``stage_ids`` and ``stage_modules()``), made non-decreasing along the state_dict order so
    that sorting by them never reorders this rank's own tensors."""
    stage_ids = getattr(model, "stage_ids", None)
    modules = getattr(model, "stage_modules", None)
    stage_of = {}
    if stage_ids is not None and modules is not None:
        for stage, module in zip(stage_ids, modules()):
            for tensor in module.state_dict(keep_vars=True).values():
                stage_of[id(tensor)] = stage
    keys, current = [], min(stage_ids) if stage_ids else 0
    for _, tensor, *_ in entries:
        current = max(current, stage_of.get(id(tensor), current))
        keys.append(current)
    return keys


def _describe_entries(model, entries, pipeline) -> list[list]:
    """``[name, order key, full shape, dtype]`` of each entry, in state_dict order."""
    keys = _stage_of_entries(model, entries) if pipeline is not None else [0] * len(entries)
    # the written (full) form: TP and expert splits undone, a Conv1D weight transposed back (a
    # DTensor's shape is already its whole, DP-unsharded one)
    shapes = full_shapes(model)
    return [
        [name, key, list(shapes[name]), str(tensor.dtype).removeprefix("torch.")]
        for (name, tensor, _, _), key in zip(entries, keys)
    ]


class _Plan:
    """The files of a merged save, planned from every stage's names and sizes before writing."""

    def __init__(self, order, sizes, files, names, shapes):
        self.order = order  # (source rank, name) in the whole model's order
        self.sizes = sizes  # bytes of each written entry
        self.files = files  # entry names of each file
        self.names = names  # file names
        self.file_of = {name: names[i] for i, group in enumerate(files) for name in group}
        self.shapes = shapes  # name -> (full shape, dtype)


def _plan_files(sources, cmap, max_shard_bytes) -> _Plan:
    """Files from shapes alone, so each file is written as soon as it is full. ``sources``:
    ``(rank, described entries)`` per stage-holding rank; the entries are merged in stage order
    (within a rank, its own order), so the plan is the whole model's, as without pipelining."""
    merged = sorted(
        (key, position, index, rank, name, shape, dtype)
        for position, (rank, described) in enumerate(sources)
        for index, (name, key, shape, dtype) in enumerate(described)
    )
    seen = set()
    for *_, name, _, _ in merged:
        if name in seen:
            raise CheckpointError(f"{name} is held by more than one pipeline rank")
        seen.add(name)
    tied = tied_names([(m[4],) for m in merged], cmap)
    sizes, shapes = {}, {}
    for *_, name, shape, dtype in merged:
        shapes[name] = (shape, dtype)
        if name not in tied:
            numel = 1
            for n in shape:
                numel *= n
            sizes[name] = numel * as_torch_dtype(dtype).itemsize
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
    order = [(m[3], m[4]) for m in merged]
    return _Plan(order, sizes, files, names, shapes)


def _write(model, entries, directory, cmap, plan, me, pipeline) -> None:
    """The writer's part: its own tensors (gathered with its TP/DP peers, in its own order) and
    the other stages' (received in theirs), merged in the plan's order; each file is written as
    soon as its tensors are all in. A failed write still receives everything the others send
    (none is left blocked), then raises."""
    from safetensors.torch import save_file

    pending = {file: {} for file in plan.names}  # tensors of each file not yet written
    needed = {
        file: sum(len(cmap[n]) for n in group_names)
        for file, group_names in zip(plan.names, plan.files)
    }
    weight_map, failure = {}, None
    own = iter_full_tensors(model)  # a collective: every rank iterates
    first = entries[0][1]
    dtype = first.dtype
    device = local_tensor(first).device
    for rank, name in plan.order:
        if rank == me:
            own_name, full = next(own)
            if own_name != name:  # the plan keeps each rank's order; this is a bug if it fires
                raise CheckpointError(f"saving: expected {name} next, got {own_name}")
        elif name in plan.file_of:
            shape, dtype_name = plan.shapes[name]
            full = torch.empty(shape, dtype=as_torch_dtype(dtype_name), device=device)
            dist.recv(full, rank, group=pipeline)
        if name not in plan.file_of or failure is not None:
            continue
        file = plan.file_of[name]
        start = 0
        for piece in cmap[name]:
            pending[file][piece.name] = full[start : start + piece.rows].contiguous()
            weight_map[piece.name] = file
            start += piece.rows
        if len(pending[file]) == needed[file]:
            try:
                save_file(
                    pending.pop(file), os.path.join(directory, file), metadata={"format": "pt"}
                )
            except Exception as e:  # noqa: BLE001 (raised once every tensor has arrived)
                failure, pending = e, {}
    for _ in own:  # nothing should be left; the collectives must still complete
        pass
    if failure is not None:
        raise failure
    if len(plan.names) > 1:
        total = sum(plan.sizes.values())
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(_config_json(model, dtype), f, indent=2)


def _config_json(model, dtype: torch.dtype) -> dict:
    """The export's config.json: the model's own (tp_ext's models), or the config of a Hugging
    Face model that tp_ext.parallelize converted in place, with the saved dtype."""
    if hasattr(model, "hf_config"):
        return model.hf_config(dtype)
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise CheckpointError(
            f"{type(model).__name__} has no config to write beside its weights: give it an "
            "hf_config(dtype) method, or save a Hugging Face model (its .config is written)"
        )
    return {**config.to_dict(), "torch_dtype": str(dtype).removeprefix("torch.")}
