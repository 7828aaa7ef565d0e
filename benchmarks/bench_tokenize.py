"""``tp-ext tokenize`` against the plain loop a user writes first: the tokenizer called on each
document, the ids gathered into one array and written. Same tokenizer (a byte-level BPE of
``--vocab`` ids trained on this repository's README), same corpus (the README's paragraphs,
shuffled into JSON lines until ``--mb`` megabytes), same output, checked equal.

Figures per worker count: documents per second and megabytes of text per second of each; the
ratio is tp_ext / the plain loop. Workers beyond the cores only add processes.

    python benchmarks/bench_tokenize.py --mb 16 --workers 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows  # noqa: E402

BENCH = "tokenize"


def _paragraphs() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return [p.replace("\n", " ").strip() for p in f.read().split("\n\n") if p.strip()]


def byte_bpe(path: str, vocab: int, texts: list[str]) -> str:
    """A byte-level BPE of ``vocab`` ids trained on ``texts``, saved at ``path`` as transformers
    saves a tokenizer (EOS ``<eos>``); returns ``path``. tests/test_tokenize.py uses it too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(texts, trainer)
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>").save_pretrained(path)
    return path


def _corpus(path: str, megabytes: float) -> int:
    """JSON lines of shuffled README paragraphs (3 a document) up to ``megabytes``; documents."""
    rng, paragraphs = random.Random(0), _paragraphs()
    size, count = 0, 0
    with open(path, "w", encoding="utf-8") as f:
        while size < megabytes * 2**20:
            line = json.dumps({"text": " ".join(rng.sample(paragraphs, 3))}) + "\n"
            f.write(line)
            size, count = size + len(line), count + 1
    return count


def _plain_loop(tokenizer: str, corpus: str, out: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer)
    ids: list[int] = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            ids += tok(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            ids.append(tok.eos_token_id)
    np.array(ids, dtype=np.uint16).tofile(out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=float, default=16.0, help="corpus size in megabytes")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--vocab", type=int, default=8000)
    args = parser.parse_args(argv)
    from tp_ext.data.corpus import tokenize_corpus

    with tempfile.TemporaryDirectory() as d:
        tokenizer = byte_bpe(os.path.join(d, "tokenizer"), args.vocab, _paragraphs())
        corpus = os.path.join(d, "corpus.jsonl")
        documents = _corpus(corpus, args.mb)
        megabytes = os.path.getsize(corpus) / 2**20
        start = time.perf_counter()
        _plain_loop(tokenizer, corpus, os.path.join(d, "loop.bin"))
        loop_s = time.perf_counter() - start
        want = np.fromfile(os.path.join(d, "loop.bin"), dtype=np.uint16)
        rows = []
        for workers in args.workers:
            out = os.path.join(d, f"tp_ext{workers}.bin")
            start = time.perf_counter()
            tokenize_corpus([corpus], out, tokenizer, append_eos=True, workers=workers)
            seconds = time.perf_counter() - start
            if not np.array_equal(np.fromfile(out, dtype=np.uint16), want):
                raise SystemExit(f"workers={workers}: the token file differs from the plain loop's")
            case = f"{megabytes:.0f}MB jsonl vocab{args.vocab} workers={workers}"
            for metric, unit, ours, theirs in (
                ("documents/s", "doc/s", documents / seconds, documents / loop_s),
                ("MB/s", "MB/s", megabytes / seconds, megabytes / loop_s),
            ):
                rows.append(dict(benchmark=BENCH, case=case, metric=metric, value=ours,
                                 unit=unit, baseline=theirs))  # fmt: skip
                print(f"{case} {metric}: tp_ext {ours:.1f}, plain loop {theirs:.1f} "
                      f"({ours / theirs:.2f}x)", flush=True)  # fmt: skip
        append_rows(rows)


if __name__ == "__main__":
    main()
