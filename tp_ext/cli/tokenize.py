"""``tp-ext tokenize --tokenizer DIR --input FILES --output tokens.bin``: text, JSON-lines and
parquet files into the token file ``tp-ext train --data`` reads, with its sidecar JSON
(:mod:`tp_ext.data.corpus`).

    tp-ext tokenize --tokenizer DIR --input books/*.txt web.jsonl --output tokens.bin \\
        --append-eos --workers 4
"""

from __future__ import annotations

import os
import sys

from tp_ext.cli.flags import TOKENIZE_FIELDS, add_field_flag
from tp_ext.data import TOKEN_DTYPES

__all__ = ["add_arguments", "main"]

HELP = "text, JSON-lines and parquet files into a token file for tp-ext train (with a sidecar)"


def add_arguments(parser) -> None:
    parser.add_argument("--tokenizer", required=True, help="a transformers tokenizer directory")
    parser.add_argument(
        "--input",
        required=True,
        nargs="+",
        help="files to read, in order: .txt (a document per non-empty line), .jsonl/.json/"
        ".ndjson (an object per line), .parquet",
    )
    parser.add_argument("--output", required=True, help="the token file to write")
    parser.add_argument(
        "--text-field", default="text", help="the documents' field or column (default: text)"
    )
    parser.add_argument(
        "--append-eos", action="store_true", help="the tokenizer's EOS after each document"
    )
    # 1 by default: this process, with the fast tokenizer's own threads, was the fastest on 2
    # cores (BENCHMARKS.md, bench_tokenize.py); more processes pay when the reading and JSON
    # parsing, which hold the GIL, are the bottleneck on many cores
    add_field_flag(parser, "workers", TOKENIZE_FIELDS["workers"], "1", default=1)
    parser.add_argument(
        "--dtype",
        choices=list(TOKEN_DTYPES),
        default=None,
        help="the token ids' type (default: uint16 when the vocabulary fits, else uint32)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def main(args) -> int:
    from tqdm import tqdm

    from tp_ext.data.corpus import tokenize_corpus

    total = sum(os.path.getsize(p) for p in args.input if os.path.isfile(p))
    bar = tqdm(total=total, unit="B", unit_scale=True, disable=args.quiet or None, file=sys.stderr)
    with bar:
        report = tokenize_corpus(
            args.input,
            args.output,
            args.tokenizer,
            text_field=args.text_field,
            append_eos=args.append_eos,
            workers=args.workers,
            dtype=args.dtype,
            progress=bar.update,
        )
    print(
        f"tp-ext tokenize: {report.documents} documents, {report.tokens} tokens "
        f"({report.dtype}, vocabulary {report.vocab_size}) in {report.path}"
    )
    return 0
