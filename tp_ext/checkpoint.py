"""Checkpoints of tp_ext models: read and written per rank, never unpickled.

- **Hugging Face in** (:func:`load_hf_checkpoint`): ``model.safetensors`` or a sharded
  ``model.safetensors.index.json``. Every rank reads only its own rows (or columns) of each
  tensor through safetensors' slice reads, so its peak host memory stays near its shard.
- **Hugging Face out** (:func:`save_hf_checkpoint`): a merged checkpoint that transformers
  loads. Tensors are gathered one at a time; rank 0 writes.
- **Sharded training checkpoints** (:func:`save_sharded` / :func:`load_sharded`) with
  torch.distributed.checkpoint (DCP) through its safetensors storage: each rank writes the rows
  it holds under the unsharded Hugging Face names, with their offsets, so a checkpoint saved at
  one TP degree loads at any other. No ``.metadata`` pickle: DCP rebuilds its metadata from the
  safetensors headers.

Every save goes to ``<path>.partial`` and becomes ``<path>`` by a rename after a manifest
(``tp_ext_checkpoint.json``: sizes of every file) is written, so a killed save leaves the
previous checkpoint intact and a half-written one is never loaded. Every load checks names,
shapes and files before reading, and an error on any rank is raised on every rank.

Which rows a rank holds comes from the layers' shard specs (``tp_ext.sharding.Partition``);
where they live in a checkpoint comes from the model's ``checkpoint_layout``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import warnings
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from tp_ext.layers.base import ParallelModule, iter_full_tensors, state_entries

__all__ = ["CheckpointError", "load_hf_checkpoint", "save_hf_checkpoint", "save_sharded",
           "load_sharded", "complete_checkpoint", "checkpoint_dtype", "peak_rss_bytes",
           "reset_peak_rss", "current_rss_bytes"]

MANIFEST = "tp_ext_checkpoint.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some Hugging Face checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read or written; the message names the tensor or file."""


# ---- errors on every rank -------------------------------------------------------------------------

def _group_of(model) -> Optional[dist.ProcessGroup]:
    tp = getattr(model, "tp", None)
    return None if tp is None or tp.group is None else tp.group


def _everywhere(group, what: str, fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on every rank of ``group``; if it raised on any rank, raise on all of them
    (naming the first failing rank), so no rank goes on into a collective the others left."""
    error, result = None, None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 (re-raised below, on every rank)
        error = e
    if group is None or dist.get_world_size(group) == 1:
        if error is not None:
            raise error
        return result
    message = b"" if error is None else f"{type(error).__name__}: {error}".encode()[:4000]
    device = "cuda" if dist.get_backend(group) == "nccl" else "cpu"
    mine = torch.zeros(4096, dtype=torch.uint8, device=device)
    mine[0] = 1 if error is not None else 0
    if message:
        mine[1:1 + len(message)] = torch.frombuffer(bytearray(message), dtype=torch.uint8)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    for rank, row in enumerate(everyone):
        if row[0].item():
            if error is not None:
                raise error
            text = bytes(row[1:].cpu().tolist()).rstrip(b"\0").decode(errors="replace")
            raise CheckpointError(f"{what} failed on rank {rank} of the group: {text}")
    return result


def _barrier(group) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.barrier(group=group)


# ---- memory ---------------------------------------------------------------------------------------

def reset_peak_rss() -> bool:
    """Reset this process's peak resident set size (Linux ``clear_refs``); False if unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _proc_status_bytes(field: str) -> Optional[int]:
    """A ``kB`` field of /proc/self/status (Linux), in bytes; None where unavailable."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """Peak resident set size of this process since start (or the last reset), in bytes."""
    peak = _proc_status_bytes("VmHWM")
    if peak is None:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def current_rss_bytes() -> int:
    """This process's resident set size now, in bytes."""
    rss = _proc_status_bytes("VmRSS")
    return peak_rss_bytes() if rss is None else rss


def import_readers() -> None:
    """Import the libraries loading uses (safetensors, tqdm) now."""
    import safetensors  # noqa: F401
    import tqdm  # noqa: F401


def checkpoint_dtype(path: str) -> torch.dtype:
    """The dtype of a Hugging Face checkpoint's floating-point tensors (its first one)."""
    files = _SafetensorsFiles(path)
    for name in sorted(files.names()):
        dtype = _DTYPES.get(files.dtype(name))
        if dtype is not None:
            return dtype
    raise CheckpointError(f"{path}: no floating-point tensors in this checkpoint")


_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "F64": torch.float64}


# ---- reading Hugging Face safetensors ------------------------------------------------------------

class _SafetensorsFiles:
    """The tensors of a checkpoint directory (single file or sharded index), opened lazily."""

    def __init__(self, path: str) -> None:
        path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".safetensors"):
            self.root, files = os.path.dirname(path), {None: os.path.basename(path)}
        elif os.path.isdir(path):
            self.root = path
            files = self._weight_map(path)
        else:
            raise CheckpointError(f"checkpoint path {path!r} does not exist (expected a directory "
                                  f"with {SINGLE_FILE} or {INDEX_FILE})")
        # Headers are read once and the files closed again: a file stays memory-mapped only
        # while one slice is read from it, so mapped pages never add up to the whole checkpoint.
        self.file_of: dict[str, str] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._dtypes: dict[str, str] = {}
        for file in sorted(set(files.values())):
            with self._open(file) as handle:
                present = set(handle.keys())
                for name in present:
                    piece = handle.get_slice(name)
                    self._shapes[name] = tuple(piece.get_shape())
                    self._dtypes[name] = piece.get_dtype()
            if None in files:
                self.file_of = dict.fromkeys(present, file)
                continue
            listed = {n for n, f in files.items() if f == file}
            absent = sorted(listed - present)
            if absent:
                raise CheckpointError(f"{INDEX_FILE} lists {absent[0]!r} in {file}, but that "
                                      f"file does not contain it ({len(absent)} such tensors)")
        if None not in files:
            self.file_of = dict(files)

    @staticmethod
    def _weight_map(root: str) -> dict:
        index = os.path.join(root, INDEX_FILE)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index}: not a valid safetensors index ({e}); expected "
                                      '{"weight_map": {tensor name: file name}}') from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must map tensor names to files")
            return weight_map
        if os.path.isfile(os.path.join(root, SINGLE_FILE)):
            return {None: SINGLE_FILE}
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE} in this directory")

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open
        full = os.path.join(self.root, file)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing")
        try:
            return safe_open(full, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint file {full} is corrupt or truncated: {e}") from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def where(self, name: str) -> str:
        return os.path.join(self.root, self.file_of[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def read(self, name: str, index) -> torch.Tensor:
        """``tensor[index]`` of checkpoint tensor ``name``: a slice read of just those bytes."""
        with self._open(self.file_of[name]) as handle:
            return handle.get_slice(name)[index]

    def nbytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.root, f)) for f in set(self.file_of.values()))


def _expected_shapes(entries, layout) -> dict[str, tuple[int, ...]]:
    """Full shape each checkpoint tensor must have, from the model's full shapes and layout."""
    shapes: dict[str, list[int]] = {}
    for name, tensor, spec, _ in entries:
        full = list(tensor.shape)
        if spec is not None:
            full[spec[0]] = spec[1].full
        for piece in layout[name]:
            rows = max(shapes.get(piece.name, [0])[0], piece.start + piece.rows)
            shapes[piece.name] = [rows] + full[1:]
    return {name: tuple(shape) for name, shape in shapes.items()}


def _row_reads(pieces, offset: int, length: int):
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
# the model, so a rank's extra memory while loading stays within a few such pieces.
READ_CHUNK_BYTES = 16 * 2 ** 20


def _load_local(files: _SafetensorsFiles, pieces, spec, rank: int, dest: torch.Tensor) -> int:
    """Copy this rank's part of one model tensor into ``dest`` by slice reads; returns the
    bytes read."""
    reads = []  # (checkpoint name, first row, end row, columns or None, destination block)
    if spec is None:
        position = 0
        for piece, a, b in _row_reads(pieces, 0, sum(p.rows for p in pieces)):
            reads.append((piece.name, a, b, None, dest.narrow(0, position, b - a)))
            position += b - a
    else:
        dim, partition = spec
        position = 0
        for offset, length in partition.segments[rank]:
            if dim == 0:
                for piece, a, b in _row_reads(pieces, offset, length):
                    reads.append((piece.name, a, b, None, dest.narrow(0, position, b - a)))
                    position += b - a
            else:  # one whole tensor, cut along a later dim (row-parallel weights): strided
                (piece,) = pieces
                columns = (slice(None),) * (dim - 1) + (slice(offset, offset + length),)
                reads.append((piece.name, 0, piece.rows, columns,
                              dest.narrow(dim, position, length)))
                position += length
    total = 0
    for name, a, b, columns, block in reads:
        row_bytes = max(1, block[:1].numel() * block.element_size())
        step = max(1, READ_CHUNK_BYTES // row_bytes)
        for start in range(a, b, step):
            stop = min(b, start + step)
            index = (slice(start, stop),) + (columns or ())
            value = files.read(name, index)
            block.narrow(0, start - a, stop - start).copy_(value)
            total += value.numel() * value.element_size()
    return total


def _check_names_and_shapes(files: _SafetensorsFiles, expected: dict, strict: bool) -> None:
    present = files.names()
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"checkpoint {files.root} is missing tensor {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more: {missing[1:4]})' if len(missing) > 1 else ''}; "
            "does the config match the checkpoint?")
    extra = sorted(n for n in present - set(expected) if not n.endswith(_IGNORED_SUFFIXES))
    if strict and extra:
        raise CheckpointError(
            f"checkpoint {files.root} has tensor {extra[0]!r} (in {files.file_of[extra[0]]}) that "
            f"this model does not use{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; "
            "pass strict=False to ignore unused tensors")
    for name, shape in expected.items():
        found = files.shape(name)
        if found != shape:
            raise CheckpointError(
                f"tensor {name!r} in {files.where(name)} has shape {list(found)}, but the model's "
                f"config implies {list(shape)}: the config disagrees with the checkpoint")


@torch.no_grad()
def load_hf_checkpoint(model, path: str, fmt: Optional[str] = None, strict: bool = True,
                       progress: bool = True) -> dict:
    """Load a Hugging Face checkpoint directory into a tp_ext model, each rank reading only its
    own slices. ``fmt``: "qwen2" or "qwen" (default: the model config's architecture).
    Returns a report: bytes read by this rank, its shard size, and its peak host memory."""
    from tp_ext.models.qwen2 import checkpoint_layout

    fmt = fmt or model.config.architecture
    layout = checkpoint_layout(model.config, fmt)
    entries = list(state_entries(model))
    group = _group_of(model)
    show = progress and (group is None or dist.get_rank(group) == 0)

    def prepare():
        files = _SafetensorsFiles(path)
        _check_names_and_shapes(files, _expected_shapes(entries, layout), strict)
        for name, tensor, *_ in entries:
            if tensor.device.type == "meta":
                raise CheckpointError(f"{name} is on the meta device; build the model on a real "
                                      "device (or call to_empty) before loading")
        return files

    files = _everywhere(group, f"loading {path}", prepare)

    def read():
        read_bytes = 0
        bar = _progress(len(entries), f"loading {os.path.basename(os.path.normpath(path))}",
                        show)
        for name, tensor, spec, owner in entries:
            rank = owner.tp_rank if isinstance(owner, ParallelModule) else 0
            read_bytes += _load_local(files, layout[name], spec, rank, tensor)
            bar.update(1)
        bar.close()
        return read_bytes

    read_bytes = _everywhere(group, f"loading {path}", read)
    shard_bytes = sum(t.numel() * t.element_size() for _, t, *_ in entries)
    return {"read_bytes": read_bytes, "shard_bytes": shard_bytes,
            "checkpoint_bytes": files.nbytes(), "peak_rss_bytes": peak_rss_bytes()}


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


# ---- atomic directories ---------------------------------------------------------------------------

def _write_manifest(directory: str, info: dict) -> None:
    """Last step of a save: the sizes of every file, fsynced, then the manifest itself."""
    files = {}
    for name in sorted(os.listdir(directory)):
        full = os.path.join(directory, name)
        if os.path.isfile(full) and name != MANIFEST:
            with open(full, "rb") as f:
                os.fsync(f.fileno())
            files[name] = os.path.getsize(full)
    temp = os.path.join(directory, MANIFEST + ".tmp")
    with open(temp, "w") as f:
        json.dump({**info, "files": files}, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, os.path.join(directory, MANIFEST))


def _commit(partial: str, path: str) -> None:
    """Make ``partial`` the checkpoint at ``path``; the old one stays loadable until the swap
    (and, if killed between the two renames, as ``<path>.old``, which loads find)."""
    old = path + ".old"
    if os.path.exists(old):
        shutil.rmtree(old)
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(partial, path)
    if os.path.exists(old):
        shutil.rmtree(old)


def complete_checkpoint(path: str) -> str:
    """The directory holding the complete checkpoint for ``path``: ``path`` itself, or
    ``<path>.old`` when a save was killed between its two renames. A directory without a
    manifest, or whose files' sizes differ from it, is an error naming what is wrong."""
    path = os.fspath(path)
    for candidate in (path, path + ".old"):
        manifest = os.path.join(candidate, MANIFEST)
        if os.path.isfile(manifest):
            break
    else:
        hint = (f" ({path}.partial holds an interrupted save)"
                if os.path.isdir(path + ".partial") else "")
        raise CheckpointError(f"{path} is not a complete tp_ext checkpoint: {MANIFEST} is "
                              f"missing{hint}")
    try:
        with open(manifest) as f:
            info = json.load(f)
        sizes = dict(info["files"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{manifest} is unreadable: {e}") from None
    for name, size in sizes.items():
        full = os.path.join(candidate, name)
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing")
        if os.path.getsize(full) != size:
            raise CheckpointError(f"checkpoint file {full} has {os.path.getsize(full)} bytes, "
                                  f"the manifest says {size}: truncated or overwritten")
    return candidate


def _start_save(path: str, group) -> str:
    partial = os.fspath(path) + ".partial"
    if group is None or dist.get_rank(group) == 0:
        if os.path.exists(partial):
            shutil.rmtree(partial)  # left by a killed save
        os.makedirs(partial)
    _barrier(group)
    return partial


# ---- Hugging Face out -----------------------------------------------------------------------------

def _hf_config_dict(config, dtype: torch.dtype) -> dict:
    return {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "max_position_embeddings": config.max_position_embeddings,
        "rope_theta": config.rope_theta, "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu",
        "torch_dtype": str(dtype).removeprefix("torch."),
    }


@torch.no_grad()
def save_hf_checkpoint(model, path: str, max_shard_bytes: int = 5 * 1024 ** 3) -> None:
    """Write a merged Hugging Face (transformers Qwen2ForCausalLM) checkpoint of ``model`` to
    directory ``path``: config.json, and model.safetensors or shards with an index. A collective:
    every rank calls it; tensors are gathered one at a time and rank 0 writes."""
    from safetensors.torch import save_file

    from tp_ext.models.qwen2 import checkpoint_layout

    if not isinstance(max_shard_bytes, int) or max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be an int >= 1, got {max_shard_bytes!r}")
    group = _group_of(model)
    writer = group is None or dist.get_rank(group) == 0
    layout = checkpoint_layout(model.config, "qwen2")
    entries = list(state_entries(model))
    dtype = entries[0][1].dtype
    # Plan the files from shapes alone, so each file is written as soon as it is full.
    sizes = {}
    for name, tensor, spec, _ in entries:
        if model.config.tie_word_embeddings and name == "lm_head.weight":
            continue
        numel = tensor.numel() // (tensor.shape[spec[0]] or 1) * spec[1].full if spec else \
            tensor.numel()
        sizes[name] = numel * tensor.element_size()
    files, current, used = [], [], 0
    for name, size in sizes.items():
        if current and used + size > max_shard_bytes:
            files.append(current)
            current, used = [], 0
        current.append(name)
        used += size
    files.append(current)
    names = ([SINGLE_FILE] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    file_of = {name: names[i] for i, group_names in enumerate(files) for name in group_names}
    partial = _start_save(path, group)

    def write_all():
        pending = {file: {} for file in names}  # tensors of each file not yet written
        needed = {file: sum(len(layout[n]) for n in group_names)
                  for file, group_names in zip(names, files)}
        weight_map = {}
        for name, full in iter_full_tensors(model):  # a collective: every rank iterates
            if not writer or name not in file_of:
                continue
            file = file_of[name]
            start = 0
            for piece in layout[name]:
                pending[file][piece.name] = full[start:start + piece.rows].contiguous()
                weight_map[piece.name] = file
                start += piece.rows
            if len(pending[file]) == needed[file]:
                save_file(pending.pop(file), os.path.join(partial, file),
                          metadata={"format": "pt"})
        if not writer:
            return
        if len(names) > 1:
            total = sum(sizes.values())
            with open(os.path.join(partial, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                          indent=2)
        with open(os.path.join(partial, "config.json"), "w") as f:
            json.dump(_hf_config_dict(model.config, dtype), f, indent=2)
        _write_manifest(partial, {"format": "huggingface", "tp": _tp_size(model)})
        _commit(partial, os.fspath(path))

    _everywhere(group, f"saving {path}", write_all)
    _barrier(group)


def _tp_size(model) -> int:
    tp = getattr(model, "tp", None)
    return 1 if tp is None else tp.size


# ---- sharded checkpoints through torch.distributed.checkpoint -----------------------------------

class _Chunk(torch.Tensor):
    """A DCP-checkpointable view of this rank's block of one unsharded tensor: DCP sees the
    global size and one chunk at ``offsets`` (the protocol DTensor implements), so the planner
    reshards between any two TP layouts. Blocks held by several ranks (replicated KV heads) are
    written once: DCP de-duplicates equal chunks."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: tuple[int, ...], size: tuple[int, ...]):
        chunk = torch.Tensor._make_wrapper_subclass(cls, size, dtype=local.dtype,
                                                    device=local.device)
        chunk._local, chunk._offsets = local, torch.Size(offsets)
        return chunk

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"_Chunk is a checkpoint view; {func} is not supported on it")

    def __create_write_items__(self, fqn: str, obj):
        from torch.distributed.checkpoint.metadata import (
            ChunkStorageMetadata, MetadataIndex, TensorProperties)
        from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
        return [WriteItem(index=MetadataIndex(fqn, self._offsets), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=self._offsets,
                                                         sizes=self._local.size()),
                              properties=TensorProperties.create_from_tensor(self._local),
                              size=self.size()))]

    def __create_chunk_list__(self):
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        return [ChunkStorageMetadata(offsets=self._offsets, sizes=self._local.size())]

    def __get_tensor_shard__(self, index) -> torch.Tensor:
        return self._local


def _dcp_state_dict(model) -> dict[str, torch.Tensor]:
    """Every tensor of ``model`` under its unsharded Hugging Face name(s): replicated tensors
    as themselves, this rank's rows of sharded ones as :class:`_Chunk` views."""
    from tp_ext.models.qwen2 import checkpoint_layout

    layout = checkpoint_layout(model.config, "qwen2")
    state = {}
    for name, tensor, spec, owner in state_entries(model):
        if model.config.tie_word_embeddings and name == "lm_head.weight":
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
                for piece, a, b in _row_reads(pieces, offset, length):
                    block = tensor.narrow(0, local_start, b - a)
                    _add_chunk(state, piece.name, block, (a,) + (0,) * (tensor.dim() - 1),
                               (piece.rows, *tensor.shape[1:]))
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
        raise CheckpointError(f"{name}: this rank holds two separate blocks of it, which the "
                              "sharded format cannot store")
    state[name] = _Chunk(block, offsets, size)


def save_sharded(model, path: str, step: Optional[int] = None) -> None:
    """Save ``model`` as a sharded DCP checkpoint in directory ``path`` (every rank calls it and
    writes only its own rows). Atomic: ``path`` is replaced only once the save is complete."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.group.WORLD if distributed else None  # DCP saves over every rank
    partial = _start_save(path, world)
    state = _dcp_state_dict(model)
    with _single_process_is_intended(distributed):
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(partial, save_distributed=True),
                 no_dist=not distributed)

    def commit():
        if world is not None and dist.get_rank() != 0:
            return
        _write_manifest(partial, {"format": "tp_ext-dcp-v1", "tp": _tp_size(model),
                                  "step": step, "config": _model_fields(model.config)})
        _commit(partial, os.fspath(path))

    _barrier(world)
    _everywhere(world, f"saving {path}", commit)


@contextlib.contextmanager
def _single_process_is_intended(distributed: bool):
    """Without a process group DCP warns that it assumes one process, which is what we mean."""
    with warnings.catch_warnings():
        if not distributed:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _model_fields(config) -> dict:
    import dataclasses
    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config)
            if f.name not in ("parallel", "optimizer")}


def load_sharded(model, path: str) -> dict:
    """Load a checkpoint written by :func:`save_sharded` at any TP degree into ``model`` (at
    its own). Checks the manifest, file sizes and model config first, on every rank. Returns
    the manifest (``tp`` it was saved at, ``step``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    distributed = dist.is_available() and dist.is_initialized()
    world = dist.group.WORLD if distributed else None

    def check():
        directory = complete_checkpoint(path)
        with open(os.path.join(directory, MANIFEST)) as f:
            info = json.load(f)
        if info.get("format") != "tp_ext-dcp-v1":
            raise CheckpointError(f"{directory} is a {info.get('format')!r} checkpoint, not a "
                                  "sharded one; use load_hf_checkpoint / from_pretrained")
        ours = _model_fields(model.config)
        saved = info.get("config", {})
        differ = [k for k in ours if k in saved and saved[k] != ours[k] and
                  k not in ("architecture",)]
        if differ:
            k = differ[0]
            raise CheckpointError(f"{directory} was saved from a model with {k}={saved[k]!r}; "
                                  f"this model has {k}={ours[k]!r}")
        return directory, info

    directory, info = _everywhere(world, f"loading {path}", check)
    state = _dcp_state_dict(model)
    try:
        with _single_process_is_intended(distributed):
            dcp.load(state, storage_reader=HuggingFaceStorageReader(directory),
                     no_dist=not distributed)
    except Exception as e:  # DCP already raises on every rank (it gathers failures)
        raise CheckpointError(f"loading {directory}: {e}") from e
    return info
