"""A corpus into a token file: the documents of text, JSON-lines and parquet files, tokenized by a
transformers tokenizer in worker processes, written as one token file (:mod:`.tokens`' format)
with a sidecar JSON that says how (``tokens.bin`` -> ``tokens.bin.json``).

- Documents: a text file's lines (``.txt``: each non-empty line, as ``datasets``' text loader
  reads them), a JSON-lines file's objects (``.jsonl``, ``.json``, ``.ndjson``: the
  ``text_field`` of each), a parquet file's rows (the ``text_field`` column, read a row group's
  batch at a time through pyarrow). A line or row that cannot be read is an error naming its
  file and line (or row) number.
- Memory stays bounded: files are read as streams, in chunks of documents, and at most two
  chunks per worker are in flight; the tokens go to disk as each chunk comes back, in order.
- Why worker processes and not only the fast tokenizer's own threads: a chunk's Python work
  (reading, JSON, the encoding's Python objects) holds the GIL, and processes scale it.
- The output is written to a temporary file next to it, synced and renamed over it, and the
  sidecar likewise after it: an interrupted run leaves neither half-written.
"""

from __future__ import annotations

import collections
import itertools
import json
import multiprocessing
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import numpy as np

from tp_ext.data.tokens import TOKEN_DTYPES, atomic_file, sidecar_path

__all__ = ["CorpusError", "TokenizeReport", "tokenize_corpus"]

TEXT_SUFFIXES = (".txt", ".text")
JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet",)
CHUNK_BYTES = 1 << 20  # about a megabyte of text a chunk: enough to amortize a worker round trip


class CorpusError(ValueError):
    """A document that cannot be read, named by its file and line (or row)."""


@dataclass
class TokenizeReport:
    """What :func:`tokenize_corpus` wrote."""

    path: str
    documents: int
    tokens: int
    dtype: str
    vocab_size: int


# -- reading documents ----------------------------------------------------------------------------


def _kind(path: str) -> str:
    suffix = os.path.splitext(path)[1].lower()
    for kind, suffixes in (("text", TEXT_SUFFIXES), ("json", JSON_SUFFIXES)):
        if suffix in suffixes:
            return kind
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    known = ", ".join(TEXT_SUFFIXES + JSON_SUFFIXES + PARQUET_SUFFIXES)
    raise CorpusError(f"--input {path!r}: unknown file type {suffix or '(none)'!r}; use {known}")


def _text_documents(path: str, text_field: str) -> Iterator[tuple[int, str]]:
    """``(bytes read, document)`` of a text file: its non-empty lines."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError as e:
                raise CorpusError(f"{path}:{number}: not UTF-8 ({e.reason})") from None
            yield len(raw), line


def _json_documents(path: str, text_field: str) -> Iterator[tuple[int, str]]:
    """``(bytes read, document)`` of a JSON-lines file: each object's ``text_field``."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            if not raw.strip():
                yield len(raw), ""
                continue
            try:
                record = json.loads(raw)
            except ValueError as e:
                raise CorpusError(f"{path}:{number}: not a JSON object ({e})") from None
            yield len(raw), _field(record, text_field, f"{path}:{number}")


def _parquet_documents(path: str, text_field: str) -> Iterator[tuple[int, str]]:
    """``(bytes read, document)`` of a parquet file's rows: the ``text_field`` column."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise CorpusError(f"{path}: parquet needs pyarrow (pip install pyarrow)") from e
    try:
        table = pq.ParquetFile(path)
    except Exception as e:  # noqa: BLE001 - pyarrow's errors have no common base to name
        raise CorpusError(f"{path}: not a parquet file ({e})") from None
    names = table.schema_arrow.names
    if text_field not in names:
        raise CorpusError(f"{path}: no column {text_field!r} (--text-field); it has {names}")
    size, rows = os.path.getsize(path), max(1, table.metadata.num_rows)
    row = 0
    for batch in table.iter_batches(columns=[text_field], batch_size=1024):
        for value in batch.column(0).to_pylist():
            row += 1
            if not isinstance(value, str):
                got = "null" if value is None else type(value).__name__
                raise CorpusError(f"{path}: row {row}: {text_field!r} is {got}, not text")
            yield size // rows, value


def _field(record, text_field: str, where: str) -> str:
    if not isinstance(record, dict):
        raise CorpusError(f"{where}: a JSON {type(record).__name__}, not an object")
    if text_field not in record:
        keys = sorted(record)[:8]
        raise CorpusError(f"{where}: no field {text_field!r} (--text-field); it has {keys}")
    value = record[text_field]
    if not isinstance(value, str):
        raise CorpusError(f"{where}: {text_field!r} is {type(value).__name__}, not text")
    return value


_READERS = {"text": _text_documents, "json": _json_documents, "parquet": _parquet_documents}


def _chunks(paths: Sequence[str], text_field: str, progress) -> Iterator[list[str]]:
    """The non-empty documents of every file, in order, in chunks of about CHUNK_BYTES."""
    for path in paths:
        chunk: list[str] = []
        size = 0
        for read, text in _READERS[_kind(path)](path, text_field):
            progress(read)
            if text:
                chunk.append(text)
                size += len(text)
            if size >= CHUNK_BYTES:
                yield chunk
                chunk, size = [], 0
        if chunk:
            yield chunk


# -- tokenizing (in the workers) ------------------------------------------------------------------

_worker: dict = {}


def _load_tokenizer(directory: str):
    from transformers import AutoTokenizer

    if not os.path.isdir(directory):
        raise CorpusError(f"--tokenizer {directory!r} is not a directory")
    try:
        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CorpusError(f"--tokenizer {directory!r}: no transformers tokenizer there ({e})")


def _start_worker(directory: str, eos: Optional[int]) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # the processes are the parallelism
    _worker["tokenizer"], _worker["eos"] = _load_tokenizer(directory), eos


def _encode(texts: list[str]) -> np.ndarray:
    """The chunk's token ids, documents one after another (each followed by the EOS when asked):
    the ids ``tokenizer(text, add_special_tokens=False)`` gives each document. A fast tokenizer
    encodes the chunk in its Rust core directly (transformers' wrapping of each encoding in
    Python objects costs more than the encoding)."""
    tokenizer, eos = _worker["tokenizer"], _worker["eos"]
    if tokenizer.is_fast:
        encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
        docs = [e.ids for e in encodings]
    else:
        docs = tokenizer(texts, add_special_tokens=False)["input_ids"]
    tail = [] if eos is None else [eos]
    count = sum(len(d) for d in docs) + len(tail) * len(docs)
    flat = itertools.chain.from_iterable(itertools.chain(d, tail) for d in docs)
    return np.fromiter(flat, dtype=np.int64, count=count)


# -- the whole run --------------------------------------------------------------------------------


def tokenize_corpus(
    inputs: Sequence[str],
    output: str,
    tokenizer: str,
    *,
    text_field: str = "text",
    append_eos: bool = False,
    workers: int = 1,
    dtype: Optional[str] = None,
    progress: Callable[[int], None] = lambda read: None,
) -> TokenizeReport:
    """Tokenize the documents of ``inputs`` with the transformers tokenizer in directory
    ``tokenizer`` into token file ``output`` and its sidecar (``output + ".json"``).
    ``append_eos``: the tokenizer's EOS after each document. ``workers``: processes (1: this
    one). ``dtype``: the file's id type (None: uint16 when the vocabulary fits, else uint32).
    ``progress(bytes)``: called as input is read."""
    for path in inputs:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"--input {path!r} is not a file")
        _kind(path)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ValueError(f"--workers must be an int >= 1, got {workers!r}")
    here = _load_tokenizer(tokenizer)
    vocab = len(here)
    eos = None
    if append_eos:
        eos = here.eos_token_id
        if eos is None:
            raise CorpusError(f"--append-eos: the tokenizer in {tokenizer!r} has no EOS token")
    dtype = dtype or ("uint16" if vocab <= 2**16 else "uint32")
    if dtype not in TOKEN_DTYPES:
        raise ValueError(f"--dtype must be one of {list(TOKEN_DTYPES)}, got {dtype!r}")
    limit = int(np.iinfo(TOKEN_DTYPES[dtype]).max)
    if vocab - 1 > limit:
        raise ValueError(f"--dtype {dtype} holds ids up to {limit}; the vocabulary has {vocab}")
    output = os.fspath(output)
    counts = collections.Counter()
    chunks = _tokenized(inputs, text_field, tokenizer, here, eos, workers, progress, counts)
    with atomic_file(output, "wb") as out:
        for ids in chunks:
            out.write(ids.astype(TOKEN_DTYPES[dtype]).tobytes())
            counts["tokens"] += ids.size
        if counts["tokens"] == 0:
            raise CorpusError(f"--input {list(inputs)}: no documents with text in them")
        if os.path.exists(sidecar_path(output)):  # never a new file beside an old sidecar
            os.unlink(sidecar_path(output))
    meta = {
        "format": "tp_ext token file: flat token ids, native byte order, no header",
        "dtype": dtype,
        "vocab_size": vocab,
        "tokenizer": os.path.abspath(tokenizer),
        "tokenizer_class": type(here).__name__,
        "eos_token_id": here.eos_token_id,
        "append_eos": append_eos,
        "documents": counts["documents"],
        "tokens": counts["tokens"],
        "inputs": [os.path.abspath(p) for p in inputs],
        "text_field": text_field,
    }
    with atomic_file(sidecar_path(output), "w") as f:
        json.dump(meta, f, indent=2)
        f.write("\n")
    return TokenizeReport(output, counts["documents"], counts["tokens"], dtype, vocab)


def _tokenized(inputs, text_field, tokenizer, loaded, eos, workers, progress, counts):
    """Each chunk's ids, in the inputs' order (``loaded``: the tokenizer, in this process)."""
    chunks = _chunks(inputs, text_field, progress)
    if workers == 1:  # here, with the tokenizer's own threads
        _worker["tokenizer"], _worker["eos"] = loaded, eos
        for chunk in chunks:
            counts["documents"] += len(chunk)
            yield _encode(chunk)
        return
    # spawn: the parent holds torch's and the tokenizer's threads, which fork would copy
    context = multiprocessing.get_context("spawn")
    with context.Pool(workers, initializer=_start_worker, initargs=(tokenizer, eos)) as pool:
        pending: collections.deque = collections.deque()
        for chunk in chunks:
            counts["documents"] += len(chunk)
            pending.append(pool.apply_async(_encode, (chunk,)))
            if len(pending) >= 2 * workers:  # bounded: the reader waits for the oldest chunk
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
