"""Token files: a flat array of token ids (uint16 or uint32, native byte order, no header), the
format nanoGPT's ``train.bin`` and Megatron's indexed datasets' ``.bin`` use. Read through a
read-only memory map, so a file far larger than memory is never loaded whole.

A token file may have a sidecar JSON beside it (``tokens.bin.json``, written by ``tp-ext
tokenize``) that says its dtype, the tokenizer's vocabulary size, the tokenizer and the document
count; a file without one is read as the dtype it is given (uint16 by default)."""

from __future__ import annotations

import json
import os
from contextlib import contextmanager
from typing import Optional, Union

import numpy as np
import torch

__all__ = [
    "TOKEN_DTYPES",
    "TokenFile",
    "write_token_file",
    "byte_tokens",
    "read_sidecar",
    "sidecar_path",
    "atomic_file",
]

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def _dtype(dtype: str):
    if dtype not in TOKEN_DTYPES:
        raise ValueError(
            f"dtype must be one of {sorted(TOKEN_DTYPES)} (the token file's id type), got {dtype!r}"
        )
    return TOKEN_DTYPES[dtype]


def sidecar_path(path: Union[str, os.PathLike]) -> str:
    """The sidecar JSON of token file ``path``."""
    return os.fspath(path) + ".json"


def read_sidecar(path: Union[str, os.PathLike]) -> Optional[dict]:
    """The sidecar of token file ``path`` (None when it has none)."""
    side = sidecar_path(path)
    if not os.path.isfile(side):
        return None
    try:
        with open(side, encoding="utf-8") as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"the token file's sidecar {side!r} is not readable JSON: {e}") from e
    if not isinstance(meta, dict) or meta.get("dtype") not in TOKEN_DTYPES:
        raise ValueError(f"the token file's sidecar {side!r} has no dtype of {list(TOKEN_DTYPES)}")
    return meta


class TokenFile:
    """The token ids of file ``path``, as a read-only memory map: ``len(tokens)`` ids,
    ``tokens.read(start, count)`` an int64 tensor of ``count`` ids from ``start``. ``dtype``:
    the ids' type (None: the sidecar's, else uint16); one that disagrees with the sidecar is an
    error. ``meta``: the sidecar (None without one)."""

    def __init__(self, path: Union[str, os.PathLike], dtype: Optional[str] = None) -> None:
        self.path = os.fspath(path)
        if not os.path.isfile(self.path):
            raise FileNotFoundError(f"token file {self.path!r} does not exist")
        self.meta = read_sidecar(self.path)
        written = None if self.meta is None else self.meta["dtype"]
        if dtype is not None and written is not None and dtype != written:
            raise ValueError(
                f"token file {self.path!r} holds {written} ids (its sidecar "
                f"{sidecar_path(self.path)!r} says so), not {dtype}: set data.dtype to {written}, "
                "or leave it out"
            )
        self.dtype = dtype or written or "uint16"
        np_dtype = _dtype(self.dtype)
        size = os.path.getsize(self.path)
        itemsize = np.dtype(np_dtype).itemsize
        if size == 0:
            raise ValueError(f"token file {self.path!r} is empty")
        if size % itemsize:
            raise ValueError(
                f"token file {self.path!r} has {size} bytes, not a multiple of {itemsize} (the "
                f"size of {self.dtype}): a truncated file, or written with another dtype"
            )
        self._ids = np.memmap(self.path, dtype=np_dtype, mode="r")

    def __len__(self) -> int:
        return int(self._ids.shape[0])

    def read(self, start: int, count: int) -> torch.Tensor:
        """``count`` ids from position ``start``, as int64."""
        return torch.from_numpy(np.asarray(self._ids[start : start + count]).astype(np.int64))

    def __repr__(self) -> str:
        return f"TokenFile({self.path!r}, dtype={self.dtype!r}, tokens={len(self)})"


def write_token_file(path: Union[str, os.PathLike], ids, dtype: str = "uint16") -> None:
    """Write ``ids`` (a 1-d tensor, array or list of ints) as a token file of ``dtype``. Atomic:
    written to a temporary file next to ``path``, then renamed over it."""
    np_dtype = _dtype(dtype)
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    array = np.asarray(ids)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(
            f"ids must be a 1-d sequence of integer token ids, got {array.dtype} of shape "
            f"{array.shape}"
        )
    limit = np.iinfo(np_dtype).max
    if array.size and (array.min() < 0 or array.max() > limit):
        bad = int(array.min()) if array.min() < 0 else int(array.max())
        raise ValueError(
            f"token id {bad} does not fit {dtype} (0..{limit}); use dtype='uint32' for "
            "vocabularies above 65536"
        )
    with atomic_file(path, "wb") as f:
        f.write(array.astype(np_dtype).tobytes())


@contextmanager
def atomic_file(path: Union[str, os.PathLike], mode: str = "wb"):
    """A file object whose content replaces ``path`` only when the block ends without an
    error: written to a temporary file next to it, synced, then renamed over it (an error
    removes the temporary file and leaves ``path`` as it was)."""
    path = os.fspath(path)
    temp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(temp, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(temp, path)
    finally:
        if os.path.exists(temp):
            os.unlink(temp)


def byte_tokens(text: Union[str, bytes]) -> np.ndarray:
    """Byte-level token ids (0..255) of ``text`` (UTF-8 if a str), as uint16."""
    data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
    return np.frombuffer(data, dtype=np.uint8).astype(np.uint16)
