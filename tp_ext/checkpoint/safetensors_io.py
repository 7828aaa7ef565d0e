"""Reading Hugging Face safetensors checkpoints by slices: each rank reads only the rows (or
columns) it holds, straight into its tensors, so its peak host memory stays near its shard."""

from __future__ import annotations

import json
import os
from typing import Optional

import torch

from tp_ext.checkpoint.checkpoint_map import row_reads
from tp_ext.checkpoint.errors import CheckpointError
from tp_ext.validation import SAFETENSORS_DTYPE_NAMES, as_torch_dtype

__all__ = [
    "SINGLE_FILE",
    "INDEX_FILE",
    "SafetensorsFiles",
    "checkpoint_dtype",
    "load_local",
    "check_names_and_shapes",
    "file_inside",
    "header_dtypes",
    "READ_CHUNK_BYTES",
]

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some Hugging Face checkpoints carry that are recomputed, not loaded.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_dtype(path: str) -> torch.dtype:
    """The dtype of a Hugging Face checkpoint's floating-point tensors (its first one)."""
    files = SafetensorsFiles(path)
    for name in sorted(files.names()):
        dtype = SAFETENSORS_DTYPE_NAMES.get(files.dtype(name))
        if dtype is not None:
            return as_torch_dtype(dtype)
    raise CheckpointError(f"{path}: no floating-point tensors in this checkpoint")


def file_inside(root: str, name, source: str) -> str:
    """The path of file ``name`` that ``source`` (an index, a manifest) names in directory
    ``root``: it must exist and, symlinks resolved, lie inside ``root`` (or, for a Hugging Face
    hub snapshot, in its repository's ``blobs``, where the snapshot's symlinks point)."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{source} in {root} names {name!r} as a file; expected a file name")
    full = os.path.join(root, name)
    real, base = os.path.realpath(full), os.path.realpath(root)
    allowed = [base]
    if os.path.basename(os.path.dirname(base)) == "snapshots":
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(base)), "blobs"))
    if not any(real.startswith(a + os.sep) for a in allowed):
        raise CheckpointError(
            f"{source} in {root} names {name!r}, which is {real}, outside the checkpoint "
            "directory: only files inside it are read"
        )
    if not os.path.isfile(real):
        raise CheckpointError(f"checkpoint file {full} is missing")
    return full


def header_dtypes(path: str) -> dict[str, str]:
    """Every tensor's dtype in the header of safetensors file ``path`` ("BF16", "F32", ...)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, framework="pt", device="cpu") as handle:
            return {name: handle.get_slice(name).get_dtype() for name in handle.keys()}
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"checkpoint file {path} is corrupt or truncated: {e}") from None


class SafetensorsFiles:
    """The tensors of a checkpoint directory (single file or sharded index), opened lazily."""

    def __init__(self, path: str) -> None:
        path = os.fspath(path)
        if os.path.isfile(path) and path.endswith(".safetensors"):  # the file the user named
            self.root, files = os.path.dirname(path), {None: os.path.basename(path)}
            self._paths = {files[None]: path}
        elif os.path.isdir(path):
            self.root = path
            files = self._weight_map(path)
            source = INDEX_FILE if None not in files else "the directory"
            self._paths = {f: file_inside(path, f, source) for f in set(files.values())}
        else:
            raise CheckpointError(
                f"checkpoint path {path!r} does not exist (expected a directory "
                f"with {SINGLE_FILE} or {INDEX_FILE})"
            )
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
                raise CheckpointError(
                    f"{INDEX_FILE} lists {absent[0]!r} in {file}, but that "
                    f"file does not contain it ({len(absent)} such tensors)"
                )
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
                raise CheckpointError(
                    f"{index}: not a valid safetensors index ({e}); expected "
                    '{"weight_map": {tensor name: file name}}'
                ) from None
            if not isinstance(weight_map, dict):
                raise CheckpointError(f"{index}: weight_map must map tensor names to files")
            return weight_map
        if os.path.isfile(os.path.join(root, SINGLE_FILE)):
            return {None: SINGLE_FILE}
        raise CheckpointError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE} in this directory")

    def _open(self, file: str):
        from safetensors import SafetensorError, safe_open

        full = self._paths[file]
        if not os.path.isfile(full):
            raise CheckpointError(f"checkpoint file {full} is missing")
        try:
            return safe_open(full, framework="pt", device="cpu")
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"checkpoint file {full} is corrupt or truncated: {e}") from None

    def names(self) -> set[str]:
        return set(self.file_of)

    def where(self, name: str) -> str:
        return self._paths[self.file_of[name]]

    def paths(self) -> list[str]:
        """Every file this checkpoint's tensors are read from."""
        return sorted(set(self._paths.values()))

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def dtype(self, name: str) -> str:
        return self._dtypes[name]

    def read(self, name: str, index) -> torch.Tensor:
        """``tensor[index]`` of checkpoint tensor ``name``: a slice read of just those bytes."""
        with self._open(self.file_of[name]) as handle:
            return handle.get_slice(name)[index]

    def nbytes(self) -> int:
        return sum(os.path.getsize(p) for p in self.paths())


READ_CHUNK_BYTES = 16 * 2**20


def load_local(
    files: SafetensorsFiles,
    pieces,
    spec,
    rank: int,
    dest: torch.Tensor,
    lossy_dtypes=False,
    experts: Optional[tuple[int, int]] = None,
) -> int:
    """Copy this rank's part of one model tensor into ``dest`` by slice reads, converting dtypes
    as :func:`converted` allows; returns the bytes read. ``experts``: (first, count) of the
    dim-0 rows this rank holds of a tensor split by expert over an EP group (its TP split, if
    any, along a later dim)."""
    reads = []  # (checkpoint name, first row, end row, columns or None, destination block)
    first = 0 if experts is None else experts[0]
    if spec is None:
        position = 0
        rows = sum(p.rows for p in pieces) if experts is None else experts[1]
        for piece, a, b in row_reads(pieces, first, rows):
            reads.append((piece.name, a, b, None, dest.narrow(0, position, b - a)))
            position += b - a
    else:
        dim, partition = spec
        if dim == 0 and experts is not None:
            raise CheckpointError(
                f"{pieces[0].name}: split by expert and by TP along the same dim 0; tp_ext splits "
                "an expert tensor over TP along a later dim"
            )
        position = 0
        for offset, length in partition.segments[rank]:
            if dim == 0:
                for piece, a, b in row_reads(pieces, offset, length):
                    reads.append((piece.name, a, b, None, dest.narrow(0, position, b - a)))
                    position += b - a
            else:  # one whole tensor, cut along a later dim (row-parallel weights): strided
                (piece,) = pieces
                columns = (slice(None),) * (dim - 1) + (slice(offset, offset + length),)
                a = piece.start + first
                b = a + (piece.rows if experts is None else experts[1])
                reads.append((piece.name, a, b, columns, dest.narrow(dim, position, length)))
                position += length
    total = 0
    for name, a, b, columns, block in reads:
        row_bytes = max(1, block[:1].numel() * block.element_size())
        step = max(1, READ_CHUNK_BYTES // row_bytes)
        for start in range(a, b, step):
            stop = min(b, start + step)
            index = (slice(start, stop),) + (columns or ())
            value = files.read(name, index)
            block.narrow(0, start - a, stop - start).copy_(
                converted(value, block.dtype, name, files.where(name), lossy_dtypes)
            )
            total += value.numel() * value.element_size()
    return total


def converted(value: torch.Tensor, dtype, name: str, where: str, lossy: bool) -> torch.Tensor:
    """``value`` (read from tensor ``name`` in file ``where``) in the model's ``dtype``:

    - a wider float type converts exactly (float16/bfloat16 -> float32 -> float64);
    - a narrower one rounds, which is what a lower-precision model means (e.g. from_pretrained
      with dtype=bfloat16 on a float32 checkpoint), but never overflows to inf;
    - float16 <-> bfloat16 hold different sets of values (a header edited from one to the other
      keeps the file's size): allowed only where every value converts exactly, or ``lossy``;
    - integer <-> floating point: an error."""
    if value.dtype == dtype:
        return value
    if not (value.is_floating_point() and dtype.is_floating_point):
        raise CheckpointError(
            f"tensor {name!r} in {where} is stored as {value.dtype}, the model's tensor is "
            f"{dtype}: no conversion between integer and floating-point types"
        )
    out = value.to(dtype)
    src_bits, dst_bits = torch.finfo(value.dtype).bits, torch.finfo(dtype).bits
    if dst_bits > src_bits:
        return out
    if dst_bits < src_bits or lossy:
        overflow = torch.isinf(out) & torch.isfinite(value)
        if overflow.any():
            raise CheckpointError(
                f"tensor {name!r} in {where} holds {value[overflow][0].item()}, beyond the "
                f"range of the model's {dtype}: build the model in {value.dtype}"
            )
        return out
    back = out.to(value.dtype)
    if not bool(((back == value) | (back.isnan() & value.isnan())).all()):
        raise CheckpointError(
            f"tensor {name!r} in {where} is stored as {value.dtype}, the model's tensor is "
            f"{dtype}, and its values do not convert exactly (is the file's header right?); "
            f"build the model in float32, or pass lossy_dtypes=True to round"
        )
    return out


def check_names_and_shapes(
    files: SafetensorsFiles, expected: dict, strict: bool, used_elsewhere: frozenset = frozenset()
) -> None:
    """Every tensor ``expected`` there with its shape; with ``strict``, no tensor that neither
    this model nor ``used_elsewhere`` (other pipeline stages' names) uses."""
    present = files.names()
    missing = sorted(set(expected) - present)
    if missing:
        raise CheckpointError(
            f"checkpoint {files.root} is missing tensor {missing[0]!r}"
            f"{f' (and {len(missing) - 1} more: {missing[1:4]})' if len(missing) > 1 else ''}; "
            "does the config match the checkpoint?"
        )
    extra = sorted(
        n for n in present - set(expected) - used_elsewhere if not n.endswith(_IGNORED_SUFFIXES)
    )
    if strict and extra:
        file = os.path.basename(files.where(extra[0]))
        raise CheckpointError(
            f"checkpoint {files.root} has tensor {extra[0]!r} (in {file}) that "
            f"this model does not use{f' (and {len(extra) - 1} more)' if len(extra) > 1 else ''}; "
            "pass strict=False to ignore unused tensors"
        )
    for name, shape in expected.items():
        found = files.shape(name)
        if found != shape:
            raise CheckpointError(
                f"tensor {name!r} in {files.where(name)} has shape {list(found)}, but the model's "
                f"config implies {list(shape)}: the config disagrees with the checkpoint"
            )
