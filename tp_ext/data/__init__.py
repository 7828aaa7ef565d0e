"""The data path of training: token files (:mod:`.tokens`: flat uint16/uint32 ids, memory-mapped,
with an optional sidecar JSON), the per-DP-rank micro-batches of every step with a resumable
position (:mod:`.batches`), and corpora of text, JSON-lines and parquet files tokenized into a
token file (:mod:`.corpus`, ``tp-ext tokenize``)."""

from tp_ext.data.batches import TokenBatches
from tp_ext.data.tokens import (
    TOKEN_DTYPES,
    TokenFile,
    byte_tokens,
    read_sidecar,
    write_token_file,
)

__all__ = [
    "TokenFile",
    "TokenBatches",
    "write_token_file",
    "byte_tokens",
    "read_sidecar",
    "TOKEN_DTYPES",
]
