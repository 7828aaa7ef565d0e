"""``tp-ext tokenize`` (tp_ext/data/corpus.py): text, JSON-lines and parquet files give the token
file a plain loop over transformers' tokenizer gives, with one or several workers; the sidecar
records how; a bad line names its file and line; a failed run leaves nothing behind (and an
existing output as it was); ``tp-ext train --data`` takes the sidecar's dtype and refuses a
vocabulary larger than the model's."""

import json
import os

import numpy as np
import pytest

from tp_ext.data import TokenFile, read_sidecar
from tp_ext.data.corpus import CorpusError, tokenize_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "train-tiny.yaml")  # vocab_size 300


def _paragraphs() -> list[str]:
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        return [p.strip() for p in f.read().split("\n\n") if p.strip()][:120]


def _byte_bpe(directory, vocab_size: int) -> str:
    """A byte-level BPE tokenizer trained on the README, saved as transformers saves one."""
    from benchmarks.bench_tokenize import byte_bpe

    return byte_bpe(os.path.join(str(directory), f"bpe{vocab_size}"), vocab_size, _paragraphs())


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> str:
    return _byte_bpe(tmp_path_factory.mktemp("tok"), 1000)


def _corpus(directory) -> tuple[list[str], list[str]]:
    """Three files of the README's paragraphs (text, JSON lines, parquet) and their documents,
    in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    docs = [p.replace("\n", " ") for p in _paragraphs()]
    text, lines, table = docs[:40], docs[40:80], docs[80:]
    paths = [os.path.join(str(directory), n) for n in ("a.txt", "b.jsonl", "c.parquet")]
    with open(paths[0], "w", encoding="utf-8") as f:
        f.write("\n".join(text[:20]) + "\n\n" + "\n".join(text[20:]) + "\n")  # a blank line
    with open(paths[1], "w", encoding="utf-8") as f:
        for i, doc in enumerate(lines):
            f.write(json.dumps({"id": i, "text": doc}) + "\n")
    pq.write_table(pa.table({"text": table, "n": list(range(len(table)))}), paths[2])
    return paths, docs


def _plain_loop(tokenizer_dir: str, docs: list[str], eos: bool) -> np.ndarray:
    """The baseline: the tokenizer called on each document in a loop."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = []
    for doc in docs:
        ids += tok(doc, add_special_tokens=False)["input_ids"] + ([tok.eos_token_id] if eos else [])
    return np.array(ids)


@pytest.mark.parametrize("workers, eos", [(1, True), (2, False)])
def test_files_of_every_kind_give_the_plain_loops_tokens(tmp_path, tokenizer, workers, eos):
    paths, docs = _corpus(tmp_path)
    out = str(tmp_path / "tokens.bin")
    read = []
    report = tokenize_corpus(
        paths, out, tokenizer, append_eos=eos, workers=workers, progress=read.append
    )
    want = _plain_loop(tokenizer, docs, eos)
    tokens = TokenFile(out)
    assert tokens.dtype == "uint16" and len(tokens) == want.size
    assert np.array_equal(tokens.read(0, len(tokens)).numpy(), want)
    meta = read_sidecar(out)
    assert meta["dtype"] == "uint16" and meta["vocab_size"] == 1000
    assert meta["documents"] == report.documents == len(docs)
    assert meta["tokens"] == report.tokens == want.size
    assert meta["append_eos"] is eos and meta["tokenizer"] == os.path.abspath(tokenizer)
    assert sum(read) > 0.9 * sum(os.path.getsize(p) for p in paths), "progress counts bytes"
    assert sorted(os.listdir(tmp_path)) == sorted(
        [*map(os.path.basename, paths), "tokens.bin", "tokens.bin.json"]
    ), "no temporary file is left"


def test_a_vocabulary_above_uint16_is_written_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {f"w{i}": i for i in range(70000)}
    backend = Tokenizer(models.WordLevel(words, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(tmp_path)
    (tmp_path / "in.txt").write_text("w5 w69999\nw70000 w65536\n")
    out = str(tmp_path / "t.bin")
    assert tokenize_corpus([str(tmp_path / "in.txt")], out, str(tmp_path)).dtype == "uint32"
    assert TokenFile(out).read(0, 4).tolist() == [5, 69999, 0, 65536]
    with pytest.raises(ValueError, match="holds uint32 ids .* set data.dtype to uint32"):
        TokenFile(out, "uint16")
    with pytest.raises(ValueError, match="--dtype uint16 holds ids up to 65535; the vocabulary"):
        tokenize_corpus([str(tmp_path / "in.txt")], out, str(tmp_path), dtype="uint16")


BAD = [  # (file name, content, the error)
    ("x.jsonl", '{"text": "a"}\n{"text": "b"}\n{"text": oops}\n', r"x.jsonl:3: not a JSON object"),
    ("x.jsonl", '{"text": "a"}\n{"body": "b"}\n', r"x.jsonl:2: no field 'text' \(--text-field\)"),
    ("x.jsonl", '{"text": "a"}\n[1, 2]\n', r"x.jsonl:2: a JSON list, not an object"),
    ("x.jsonl", '{"text": 5}\n', r"x.jsonl:1: 'text' is int, not text"),
    ("x.txt", b"fine\n\xff\xfe\n", r"x.txt:2: not UTF-8"),
    ("x.csv", "a,b\n", r"unknown file type '.csv'; use .txt, .text, .jsonl"),
    ("x.txt", "\n\n", r"no documents with text in them"),
]


@pytest.mark.parametrize("name, content, error", BAD)
def test_a_bad_line_names_its_file_and_line_and_leaves_the_output_as_it_was(
    tmp_path, tokenizer, name, content, error
):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    out = tmp_path / "tokens.bin"
    out.write_bytes(b"old!")
    with pytest.raises(CorpusError, match=error):
        tokenize_corpus([str(path)], str(out), tokenizer, workers=1)
    assert out.read_bytes() == b"old!" and sorted(os.listdir(tmp_path)) == sorted(
        [name, "tokens.bin"]
    )


def test_a_null_parquet_row_is_named(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a", None, "c"]}), tmp_path / "x.parquet")
    with pytest.raises(CorpusError, match=r"x.parquet: row 2: 'text' is null, not text"):
        tokenize_corpus([str(tmp_path / "x.parquet")], str(tmp_path / "t.bin"), tokenizer)
    with pytest.raises(CorpusError, match=r"no column 'body' \(--text-field\); it has \['text'\]"):
        tokenize_corpus(
            [str(tmp_path / "x.parquet")], str(tmp_path / "t.bin"), tokenizer, text_field="body"
        )


def test_the_command_writes_what_train_reads_and_train_refuses_a_larger_vocabulary(
    tmp_path, tokenizer, tp_ext_here
):
    paths, _ = _corpus(tmp_path)
    small = _byte_bpe(tmp_path, 300)  # the tiny model's vocabulary
    out = str(tmp_path / "small.bin")
    status, said, err = tp_ext_here(
        "tokenize", "--tokenizer", small, "--input", *paths, "--output", out, "--append-eos",
        "--workers", 1, "--quiet",
    )  # fmt: skip
    assert status == 0, err
    assert f"documents, {len(TokenFile(out))} tokens (uint16, vocabulary 300) in {out}" in said
    flags = ["--steps", 1, "--checkpoint-dir", tmp_path / "ckpt"]
    status, _, err = tp_ext_here("train", TINY, "--data", out, *flags)
    assert status == 0, err[-3000:]
    big = str(tmp_path / "big.bin")
    assert tp_ext_here("tokenize", "--tokenizer", tokenizer, "--input", paths[0], "--output",
                       big, "--quiet")[0] == 0  # fmt: skip
    status, _, err = tp_ext_here("train", TINY, "--data", big, *flags)
    assert status == 2
    assert f"--data {big}: tokenized with a vocabulary of 1000 ids ({tokenizer}), more than " in err
    assert "the model's vocab_size 300: tokenize with the model's own tokenizer" in err
    status, _, err = tp_ext_here("tokenize", "--tokenizer", tokenizer, "--input", paths[0],
                                 "--output", big, "--workers", 0)  # fmt: skip
    assert status == 2 and "argument --workers: must be an integer in [1, 256], got '0'" in err
    status, _, err = tp_ext_here("tokenize", "--tokenizer", tmp_path / "none", "--input",
                                 paths[0], "--output", big)  # fmt: skip
    assert status == 2 and f"--tokenizer '{tmp_path / 'none'}' is not a directory" in err
