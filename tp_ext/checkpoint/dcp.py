"""Sharded training checkpoints through torch.distributed.checkpoint (DCP) and its safetensors
storage: each rank writes the rows it holds under the unsharded Hugging Face names, with their
offsets, so a checkpoint saved at one TP degree loads at any other. No ``.metadata`` pickle: DCP
rebuilds its metadata from the safetensors headers. Atomic like every tp_ext save
(:mod:`tp_ext.checkpoint.atomic`)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Optional

import torch
import torch.distributed as dist

from tp_ext.checkpoint.atomic import abandon_save, commit_save, reading, saving, start_save
from tp_ext.checkpoint.checkpoint_map import (
    Piece,
    declared_map,
    model_checkpoint_map,
    row_reads,
    tied_names,
)
from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.hf import tp_size
from tp_ext.checkpoint.manifest import MANIFEST, check_files, read_manifest
from tp_ext.distributed import comm, peers
from tp_ext.distributed.dtensors import is_dtensor
from tp_ext.distributed.groups import ResolvedGroup, device_of
from tp_ext.distributed.state import PROCESS
from tp_ext.layers import expert_rows, tensor_specs
from tp_ext.layers.state_dict import is_full_transposed
from tp_ext.sharding import GridBlock

__all__ = [
    "save_sharded",
    "load_sharded",
    "checkpoint_tensors",
    "write_checkpoint",
    "read_checkpoint",
    "PendingSave",
    "check_config",
    "copy_tied",
    "model_fields",
]


def _dcp_errors() -> tuple:
    """What a DCP call can raise: its gathered failure is a BaseException, which ``except
    Exception`` would let through. DCP is imported on first use (it imports DTensor: see
    :mod:`tp_ext.distributed.dtensors`)."""
    from torch.distributed.checkpoint.api import CheckpointException

    return (Exception, CheckpointException)


def _world():
    """DCP saves over every rank: the world group, or a group of one without torch.distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    return distributed, (
        ResolvedGroup.of(dist.group.WORLD) if distributed else ResolvedGroup.local()
    )


class _Chunk(torch.Tensor):
    """A DCP-checkpointable view of this rank's block of one unsharded tensor: DCP sees the
    global size and one chunk at ``offsets`` (the protocol DTensor implements), so the planner
    reshards between any two TP degrees. Blocks held by several ranks (replicated KV heads) are
    written once: DCP de-duplicates equal chunks."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: tuple[int, ...], size: tuple[int, ...]):
        chunk = torch.Tensor._make_wrapper_subclass(
            cls, size, dtype=local.dtype, device=local.device
        )
        chunk._local, chunk._offsets = local, torch.Size(offsets)
        return chunk

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"_Chunk is a checkpoint view; {func} is not supported on it")

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata,
            MetadataIndex,
            TensorProperties,
        )
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

        return [
            WriteItem(
                index=MetadataIndex(fqn, self._offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size()),
                    properties=TensorProperties.create_from_tensor(self._local),
                    size=self.size(),
                ),
            )
        ]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

        return [ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size())]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._local


def checkpoint_tensors(
    model, *, prefix: str = "", tensor_of=None, tied_copies: Optional[list] = None
) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` under its unsharded Hugging Face name(s), as DCP saves and loads
    them: replicated tensors as themselves, the rows this rank holds of sharded ones (TP shards,
    and FSDP2's data-parallel slices of them) as :class:`_Chunk` views at their offsets.

    ``tensor_of(tensor)`` replaces each model tensor by another of its shape and sharding (an
    optimizer's state for that parameter), or None to leave it out; keys get ``prefix``.

    A tied tensor (its checkpoint names all belong to an earlier entry) is saved once. Where it
    is a separate copy on this rank (a tied embedding under a V-shaped pipeline: the first and
    the last stage on one rank), ``(copy, original)`` goes into ``tied_copies``: a load fills
    the original and must then copy it over."""
    entries = list(tensor_specs(model))
    if any(isinstance(spec, GridBlock) for _, _, spec, _ in entries):
        # a 2D model: its entries carry the checkpoint's names already, each a grid block
        return _grid_checkpoint_tensors(model, entries, prefix, tensor_of, tied_copies)
    cmap = model_checkpoint_map(model)
    tied = tied_names(entries, cmap)
    state: dict[str, torch.Tensor] = {}
    holder: dict[str, torch.Tensor] = {}  # checkpoint name -> the tensor saved under it
    for name, tensor, spec, owner in entries:
        if tensor_of is not None:
            tensor = tensor_of(tensor)
            if tensor is None:
                continue
        if name in tied:
            original = holder.get(cmap[name][0].name)
            if tied_copies is not None and original is not None and original is not tensor:
                tied_copies.append((tensor, original))
            continue
        pieces = cmap[name]
        for piece in pieces:
            holder[piece.name] = tensor
        local, first_row, shape = _data_parallel_slice(tensor, name)
        if is_full_transposed(owner, name.rpartition(".")[2]):
            # the checkpoint map counts the rows of transformers' [in, out] form (Conv1D); the
            # sharded checkpoint holds the layer's own [out, in] form, whole rows of it
            (piece,) = pieces
            pieces = [Piece(piece.name, 0, _full_rows(local, shape, spec))]
        if local.numel() == 0:  # FSDP2 gave this rank no rows of it (or EP no experts)
            continue
        experts = expert_rows(owner, name)
        if experts is not None:  # this EP rank's experts: rows from its first of all of them
            # (ZeRO's state: this rank's rows of them, from first_row on)
            first_row, shape = experts[0] + first_row, (experts[1], *shape[1:])
        blocks = _blocks(pieces, local, first_row, shape, spec, owner)
        for key, block, offsets, size in blocks:
            if tuple(block.shape) == tuple(size) and not any(offsets):
                state[prefix + key] = block  # the whole tensor: saved once, read by every rank
            else:
                _add_chunk(state, prefix + key, block, offsets, size)
    return state


def _full_rows(local: torch.Tensor, shape, spec) -> int:
    """Rows (dim 0) of the unsharded tensor whose TP-local form has ``shape``."""
    if spec is None or not local.dim():
        return shape[0] if local.dim() else 1
    return spec.full_shape_of(shape)[0]


@torch.no_grad()
def copy_tied(tied_copies: list) -> None:
    """After a load: give each separate copy of a tied tensor its original's values."""
    for copy, original in tied_copies:
        _data_parallel_slice(copy, "")[0].copy_(_data_parallel_slice(original, "")[0])


def _data_parallel_slice(tensor: torch.Tensor, name: str):
    """(this rank's local data, the first of its rows, the shape it is a slice of). FSDP2 keeps
    a dim-0 slice of each TP-local tensor on each DP rank (a DTensor on the DP mesh)."""
    if not is_dtensor(tensor):
        return tensor.detach(), 0, tuple(tensor.shape)
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if tensor.device_mesh.ndim != 1 or tensor.placements[0] not in (Shard(0), Replicate()):
        raise CheckpointError(
            f"{name}: a DTensor placed {tensor.placements} on a {tensor.device_mesh.ndim}-d mesh; "
            "tp_ext checkpoints hold FSDP2's dim-0 data-parallel shards (Shard(0) on one mesh "
            "dimension)"
        )
    _, offsets = compute_local_shape_and_global_offset(
        tensor.shape, tensor.device_mesh, tensor.placements
    )
    return tensor.to_local().detach(), offsets[0] if offsets else 0, tuple(tensor.shape)


def _blocks(pieces, local, first_row, shape, spec, owner):
    """(checkpoint name, block of ``local``, its offsets, the checkpoint tensor's size) for each
    piece of checkpoint tensor ``local`` holds. ``local`` is rows [first_row, first_row + n) of
    this TP rank's tensor of ``shape``; ``spec`` says which rows (or columns) of the unsharded
    tensor that one holds."""
    rows = local.shape[0] if local.dim() else 0
    if local.dim() == 0:  # one number per tensor (an optimizer's step count): under the name
        yield pieces[0].name, local, (), ()  # of its first piece, the same at all dims
        return
    if spec is not None and spec.dim != 0:  # split along another dim: one checkpoint tensor
        dim, partition = spec.dim, spec
        (piece,) = pieces
        start = 0
        for offset, length in partition.segments[owner.shard_coord]:
            # A merged split (gate | up of fused experts) gives each rank a block of every part:
            # each part is a checkpoint tensor of its own ("<name>.part<k>"), at every TP degree
            # (one block per name per rank, as the sharded format needs).
            k, (part_start, part_length) = partition.part_of(offset)
            name = piece.name if len(partition.parts) == 1 else f"{piece.name}.part{k}"
            size = list(shape)
            size[dim] = part_length
            offsets = [0] * local.dim()
            offsets[0], offsets[dim] = first_row, offset - part_start
            yield name, local.narrow(dim, start, length), tuple(offsets), tuple(size)
            start += length
        return
    # rows: this TP rank's rows of the unsharded tensor, as (unsharded row, length) runs
    runs = [(0, shape[0])] if spec is None else spec.segments[owner.shard_coord]
    # one checkpoint tensor holding several split parts (a transformers model's fused q|k|v or
    # gate|up, under its own name): as above, each part is a tensor of its own
    by_part = spec is not None and len(pieces) == 1 and len(spec.parts) > 1
    start = 0
    for offset, length in runs:
        lo, hi = max(start, first_row), min(start + length, first_row + rows)
        if lo < hi and by_part:
            k, (part_start, part_length) = spec.part_of(offset)
            yield (
                f"{pieces[0].name}.part{k}",
                local.narrow(0, lo - first_row, hi - lo),
                (offset + lo - start - part_start,) + (0,) * (local.dim() - 1),
                (part_length, *shape[1:]),
            )
        elif lo < hi:
            block = local.narrow(0, lo - first_row, hi - lo)
            taken = 0
            for piece, a, b in row_reads(pieces, offset + lo - start, hi - lo):
                yield (
                    piece.name,
                    block.narrow(0, taken, b - a),
                    (a,) + (0,) * (local.dim() - 1),
                    (piece.rows, *shape[1:]),
                )
                taken += b - a
        start += length


def _grid_checkpoint_tensors(
    model, entries, prefix: str, tensor_of, tied_copies: Optional[list]
) -> dict[str, torch.Tensor]:
    """:func:`checkpoint_tensors` of a 2D (SUMMA) model: its parameters carry the Hugging Face
    names already, and each rank's block goes in at its offsets in both dimensions (copies
    replicated over a grid axis are equal chunks, which DCP writes once). The keys are those
    of a 1D model's checkpoint, so the two load each other's: a scalar (an optimizer's step
    count) goes under the first piece of the tensor the model's declared checkpoint map fuses it
    into (q for k and v, gate for up), once; its other holders are ``tied_copies`` of it, as is a
    tied head's copy of the embedding (named in ``checkpoint_aliases``). A DTensor
    (ZeRO's optimizer state, Shard(0) on the DP mesh) holds rows of this rank's block: they go
    in at the block's offsets moved down by the first of them."""
    first_piece = {}
    if declared_map(model) is not None:
        for pieces in model_checkpoint_map(model).values():
            for piece in pieces:
                first_piece[piece.name] = pieces[0].name
    aliases = getattr(model, "checkpoint_aliases", None) or {}  # a tied head: the embedding
    state: dict[str, torch.Tensor] = {}
    saved: dict[str, torch.Tensor] = {}  # key -> the tensor saved under it
    for name, tensor, block, owner in entries:
        if tensor_of is not None:
            tensor = tensor_of(tensor)
            if tensor is None:
                continue
        name = aliases.get(name, name)
        # rows [first_row, first_row + n) of this rank's block (of `shape`): all of it but
        # for ZeRO's state
        local, first_row, shape = _data_parallel_slice(tensor, name)
        key = prefix + (first_piece.get(name, name) if local.dim() == 0 else name)
        if key in saved:  # one tensor under two names, or a copy of the one saved
            if saved[key] is not tensor and tied_copies is not None:
                tied_copies.append((tensor, saved[key]))
            continue
        saved[key] = tensor
        if local.dim() == 0:
            state[key] = local
            continue
        if block is None:  # whole on every rank
            offsets, full_shape = (0,) * local.dim(), shape
        else:
            (box,) = block.boxes(owner.shard_coord, shape)  # a grid block is one box
            offsets, full_shape = tuple(offset for offset, _ in box), block.full_shape_of(shape)
        if local.numel() == 0:
            continue  # an empty block (more grid rows or columns than entries), or no DP rows
        offsets = (offsets[0] + first_row, *offsets[1:])
        if tuple(local.shape) == tuple(full_shape):
            state[key] = local
        else:
            _add_chunk(state, key, local, offsets, full_shape)
    return state


def _add_chunk(state, name, block, offsets, size) -> None:
    if name in state:  # one chunk per name per rank: DCP's safetensors files key by name
        raise CheckpointError(
            f"{name}: this rank holds two separate blocks of it, which the "
            "sharded format cannot store"
        )
    state[name] = _Chunk(block, offsets, size)


def save_sharded(model, path: str, step: Optional[int] = None) -> None:
    """Save ``model`` as a sharded DCP checkpoint in directory ``path`` (every rank calls it and
    writes only its own rows). Atomic (:mod:`tp_ext.checkpoint.atomic`): ``path`` changes to
    the new checkpoint in one step once it is complete."""
    _, world = _world()
    state = comm.everywhere(
        world, f"saving {path}", lambda: checkpoint_tensors(model), CheckpointError
    )
    info = {
        "format": SHARDED_FORMAT,
        "tp": tp_size(model),
        "step": step,
        "config": model_fields(model.config),
    }
    write_checkpoint(state, path, info)


def write_checkpoint(state: dict, path: str, info: dict, *, async_save: bool = False):
    """Write ``state`` (tensors and :func:`checkpoint_tensors` views, keyed by name) as a DCP
    checkpoint with DCP's safetensors storage at ``path``, atomically, with ``info`` in its
    manifest (JSON). A collective over every rank.

    ``async_save``: the tensors are copied to CPU memory here, DCP writes them in a background
    thread (its collectives on a process group of their own), and a :class:`PendingSave` is
    returned; the checkpoint is published by its :meth:`~PendingSave.finish`. Until then
    ``path`` keeps its previous version, whatever happens to the job."""
    distributed, world = _world()
    if not async_save:
        with saving(path, world, info) as directory:
            _save(state, directory, distributed, path, world)
        return None
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    staging = start_save(path, world)
    try:
        staged = comm.everywhere(world, f"saving {path}", lambda: _cpu_copy(state), CheckpointError)
        with _single_process_is_intended(distributed):
            future = dcp.async_save(
                staged,
                storage_writer=HuggingFaceStorageWriter(staging.directory, save_distributed=True),
                process_group=_async_group() if distributed else None,
                async_stager=_AlreadyStaged(),
                no_dist=not distributed,
            )
    except BaseException as e:
        error = abandon_save(staging, world, path, e)
        if error is e:
            raise
        raise error from e
    return PendingSave(staging, future, world, info, path)


def _save(state, directory, distributed, path, world) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    try:
        with _single_process_is_intended(distributed):
            dcp.save(
                state,
                storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True),
                no_dist=not distributed,
            )
    except _dcp_errors() as e:  # DCP raises on every rank (it gathers failures)
        raise CheckpointError(f"saving {path}: {e}{peers.explain(world)}") from e


def _cpu_copy(state: dict) -> dict:
    """What an asynchronous save writes: a CPU copy of every tensor (training goes on changing
    the originals), as the same views."""
    staged = {}
    for name, value in state.items():
        if isinstance(value, _Chunk):
            local = value._local.detach().to("cpu", copy=True)
            staged[name] = _Chunk(local, tuple(value._offsets), tuple(value.shape))
        else:
            staged[name] = value.detach().to("cpu", copy=True)
    return staged


class _AlreadyStaged:
    """DCP's stager for a state already copied to CPU by :func:`_cpu_copy` (DCP's own stager
    cannot copy :class:`_Chunk` views)."""

    should_synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _async_group():
    """The process group DCP's background writes use (gloo, every rank): collectives from the
    writer thread must not interleave with training's on the default group."""
    if PROCESS.async_checkpoint_group is None:
        PROCESS.async_checkpoint_group = dist.new_group(backend="gloo")
    return PROCESS.async_checkpoint_group


class PendingSave:
    """An asynchronous save being written. :meth:`finish` (a collective) waits for every rank's
    writes, then publishes the checkpoint; :meth:`done_everywhere` (one small all-reduce) says
    whether every rank has finished writing, so a training loop can publish without waiting."""

    def __init__(self, staging, future, world, info: dict, path: str) -> None:
        self.path, self.info = path, info
        self._staging, self._future, self._world = staging, future, world

    def done_everywhere(self) -> bool:
        done = torch.tensor([1 if self._future.done() else 0], device=device_of(self._world))
        return bool(comm.all_reduce(done, "min", group=self._world).item())

    def finish(self) -> None:
        def written():
            try:
                self._future.result()
            except _dcp_errors() as e:  # DCP's gathered failure is a BaseException
                raise CheckpointError(f"saving {self.path}: {e}") from e

        try:
            comm.everywhere(self._world, f"saving {self.path}", written, CheckpointError)
            commit_save(self._staging, self._world, self.info, self.path)
        except BaseException as e:
            error = abandon_save(self._staging, self._world, self.path, e)
            if error is e:
                raise
            raise error from e


SHARDED_FORMAT = "tp_ext-dcp-v1"
# a training checkpoint (tp_ext.training.checkpointer), newest first: the model reads from all
TRAINING_FORMATS = ("tp_ext-train-v2", "tp_ext-train-v1")


def load_sharded(model, path: str) -> dict:
    """Load a checkpoint written by :func:`save_sharded` (or the model of a Trainer's) at any
    TP x PP (x DP) dims into ``model`` (at its own). Checks the manifest (sizes, sha256s,
    dtypes) and model config first, on every rank; reads only the files the manifest lists.
    Returns the manifest (``tp`` it was saved at, ``step``)."""

    copies: list = []

    def state_of(info, directory):
        check_config(directory, info, model)
        copies.clear()
        return checkpoint_tensors(model, tied_copies=copies)

    info, _ = read_checkpoint(path, state_of, formats=(SHARDED_FORMAT, *TRAINING_FORMATS))
    copy_tied(copies)
    return info


def read_checkpoint(path: str, state_of, formats=(SHARDED_FORMAT,)) -> tuple[dict, dict]:
    """Read a checkpoint of :func:`write_checkpoint` into the tensors ``state_of(manifest,
    directory)`` returns (what to load, keyed as saved; views are written in place). The
    manifest is checked first on every rank (format in ``formats``, sizes, sha256s, dtypes); an
    error on one rank is raised on all. Returns (manifest, the state read)."""
    distributed, world = _world()
    with reading(path, world) as directory:

        def check():
            if not os.path.isfile(os.path.join(directory, MANIFEST)):
                raise CheckpointError(
                    f"{path} is not a complete tp_ext checkpoint: {MANIFEST} is missing"
                )
            info = read_manifest(directory)
            if info.get("format") not in formats:
                raise CheckpointError(
                    f"{directory} is a {info.get('format')!r} checkpoint, not one of "
                    f"{list(formats)}; a Hugging Face export loads with load_hf_checkpoint / "
                    "from_pretrained"
                )
            check_files(directory, info, hashes=True, group=world)
            state = state_of(info, directory)
            _check_dtypes(directory, info, state)
            return info, state

        info, state = comm.everywhere(world, f"loading {path}", check, CheckpointError)
        _read(directory, info, state, world, distributed, path)
    return info, state


@contextlib.contextmanager
def _single_process_is_intended(distributed: bool):
    """Without a process group DCP warns that it assumes one process, which is what we mean."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def model_fields(config) -> dict:
    """A model config's fields (recorded in a manifest, compared on load): a dataclass's fields;
    of a Hugging Face config, the numbers and names that fix the tensors' shapes (not its
    run-time switches such as ``output_router_logits``); none for a model without a config."""
    if config is None:
        return {}
    if dataclasses.is_dataclass(config) and not hasattr(config, "to_dict"):  # tp_ext's own
        return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return {k: v for k, v in sorted(config.to_dict().items()) if _fixes_shapes(k, v)}


def _fixes_shapes(key: str, value) -> bool:
    if isinstance(value, bool):
        return key.startswith("tie_")  # tie_word_embeddings: one tensor or two
    words = ("size", "num_", "vocab", "experts", "model_type", "head", "layers", "top_k")
    return isinstance(value, (int, str)) and any(w in key for w in words)


def check_config(directory, info, model) -> None:
    """The checkpoint in ``directory`` (manifest ``info``) was saved from a model of ``model``'s
    architecture; else an error naming the first field that differs."""
    ours = model_fields(getattr(model, "config", None))
    saved = info.get("config", {})
    differ = [k for k in ours if k in saved and saved[k] != ours[k] and k != "architecture"]
    if differ:
        k = differ[0]
        raise CheckpointError(
            f"{directory} was saved from a model with {k}={saved[k]!r}; "
            f"this model has {k}={ours[k]!r}"
        )


def _check_dtypes(directory, info, state) -> None:
    """DCP converts whatever it reads into the model's dtype: allow only exact conversions
    (to a wider float type); anything else is an error naming the tensor and both dtypes."""
    from safetensors.torch import _getdtype

    for name, tensor in state.items():
        stored = info.get("dtypes", {}).get(name)
        if stored is None:
            continue
        dtype = _getdtype(stored)
        exact = dtype == tensor.dtype or (
            dtype.is_floating_point
            and tensor.dtype.is_floating_point
            and torch.finfo(tensor.dtype).bits > torch.finfo(dtype).bits
        )
        if not exact:
            raise CheckpointError(
                f"tensor {name!r} in {directory} is stored as {dtype}, the model's is "
                f"{tensor.dtype}: build the model in {dtype} to load it exactly"
            )


def _read(directory, info, state, world, distributed, path) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.filesystem import FileSystem

    class ListedFiles(FileSystem):
        """DCP's reader takes every .safetensors file in the directory; only the manifest's
        files are checkpoint files (one added later must not become a source of weights)."""

        def ls(self, p):
            return [f for f in super().ls(p) if os.path.basename(f) in info["files"]]

    reader = HuggingFaceStorageReader(directory)
    reader.fs = ListedFiles()
    try:
        with _single_process_is_intended(distributed):
            dcp.load(state, storage_reader=reader, no_dist=not distributed)
    except _dcp_errors() as e:  # DCP raises on every rank (it gathers failures)
        raise CheckpointError(f"loading {path} ({directory}): {e}{peers.explain(world)}") from e
