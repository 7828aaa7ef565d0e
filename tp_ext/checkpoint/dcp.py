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
from torch.distributed.checkpoint.api import CheckpointException

from tp_ext.checkpoint.atomic import reading, saving
from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.checkpoint.hf import tp_size
from tp_ext.checkpoint.layout import model_layout, row_reads, tied_names
from tp_ext.checkpoint.manifest import MANIFEST, check_files, read_manifest
from tp_ext.distributed import comm, peers
from tp_ext.distributed.groups import TPGroup
from tp_ext.layers import state_entries

__all__ = ["save_sharded", "load_sharded"]


# DCP's gathered failure is a BaseException, which ``except Exception`` would let through.
_DCP_ERRORS = (Exception, CheckpointException)


def _world():
    """DCP saves over every rank: the world group, or a group of one without torch.distributed."""
    distributed = dist.is_available() and dist.is_initialized()
    return distributed, (TPGroup.of(dist.group.WORLD) if distributed else TPGroup.local())


class _Chunk(torch.Tensor):
    """A DCP-checkpointable view of this rank's block of one unsharded tensor: DCP sees the
    global size and one chunk at ``offsets`` (the protocol DTensor implements), so the planner
    reshards between any two TP layouts. Blocks held by several ranks (replicated KV heads) are
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


def _dcp_state_dict(model) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` under its unsharded Hugging Face name(s): replicated tensors
    as themselves, this rank's rows of sharded ones as :class:`_Chunk` views."""
    layout = model_layout(model)
    entries = list(state_entries(model))
    tied = tied_names(entries, layout)
    state = {}
    for name, tensor, spec, owner in entries:
        if name in tied:
            continue
        pieces = layout[name]
        if spec is None:
            start = 0
            for piece in pieces:
                state[piece.name] = tensor.narrow(0, start, piece.rows)
                start += piece.rows
            continue
        dim, partition = spec
        local_start = 0
        for offset, length in partition.segments[owner.tp_rank]:
            if dim == 0:  # qwen2 layout: every piece is a whole checkpoint tensor
                for piece, a, b in row_reads(pieces, offset, length):
                    block = tensor.narrow(0, local_start, b - a)
                    _add_chunk(
                        state,
                        piece.name,
                        block,
                        (a,) + (0,) * (tensor.dim() - 1),
                        (piece.rows, *tensor.shape[1:]),
                    )
                    local_start += b - a
            else:
                (piece,) = pieces
                block = tensor.narrow(dim, local_start, length)
                full = list(tensor.shape)
                full[dim] = partition.full
                offsets = [0] * tensor.dim()
                offsets[dim] = offset
                _add_chunk(state, piece.name, block, tuple(offsets), tuple(full))
                local_start += length
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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    distributed, world = _world()
    state = comm.everywhere(
        world, f"saving {path}", lambda: _dcp_state_dict(model), CheckpointError
    )
    info = {
        "format": "tp_ext-dcp-v1",
        "tp": tp_size(model),
        "step": step,
        "config": _model_fields(model.config),
    }
    with saving(path, world, info) as directory:
        try:
            with _single_process_is_intended(distributed):
                dcp.save(
                    state,
                    storage_writer=HuggingFaceStorageWriter(directory, save_distributed=True),
                    no_dist=not distributed,
                )
        except _DCP_ERRORS as e:  # DCP raises on every rank (it gathers failures)
            raise CheckpointError(f"saving {path}: {e}{peers.explain(world)}") from e


@contextlib.contextmanager
def _single_process_is_intended(distributed: bool):
    """Without a process group DCP warns that it assumes one process, which is what we mean."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model_fields(config) -> dict:
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}


def load_sharded(model, path: str) -> dict:
    """Load a checkpoint written by :func:`save_sharded` at any TP degree into ``model`` (at
    its own). Checks the manifest (sizes, sha256s, dtypes) and model config first, on every
    rank; reads only the files the manifest lists. Returns the manifest (``tp`` it was saved
    at, ``step``)."""
    distributed, world = _world()
    with reading(path, world) as directory:

        def check():
            if not os.path.isfile(os.path.join(directory, MANIFEST)):
                raise CheckpointError(
                    f"{path} is not a complete tp_ext checkpoint: {MANIFEST} is missing"
                )
            info = read_manifest(directory)
            if info.get("format") != "tp_ext-dcp-v1":
                raise CheckpointError(
                    f"{directory} is a {info.get('format')!r} checkpoint, not a "
                    "sharded one; use load_hf_checkpoint / from_pretrained"
                )
            check_files(directory, info, hashes=True, group=world)
            _check_config(directory, info, model)
            state = _dcp_state_dict(model)
            _check_dtypes(directory, info, state)
            return info, state

        info, state = comm.everywhere(world, f"loading {path}", check, CheckpointError)
        _read(directory, info, state, world, distributed, path)
    return info


def _check_config(directory, info, model) -> None:
    ours = _model_fields(model.config)
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
    except _DCP_ERRORS as e:  # DCP raises on every rank (it gathers failures)
        raise CheckpointError(f"loading {path} ({directory}): {e}{peers.explain(world)}") from e
