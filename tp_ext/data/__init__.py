"""The data path of training: token files (:mod:`.tokens`: flat uint16/uint32 ids, memory-mapped)
and the per-DP-rank micro-batches of every step with a resumable position (:mod:`.batches`)."""

from tp_ext.data.batches import TokenBatches
from tp_ext.data.tokens import TOKEN_DTYPES, TokenFile, byte_tokens, write_token_file

__all__ = ["TokenFile", "TokenBatches", "write_token_file", "byte_tokens", "TOKEN_DTYPES"]
