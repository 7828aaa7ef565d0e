"""``tp-ext generate --model DIR``: batched generation from a transformers checkpoint directory
(any architecture ``parallelize(model, "auto")`` converts) under torchrun, each rank reading its
own slices of the weights; prints the text (with a tokenizer found in the directory) or the
token ids, tokens per second, the time to the first token and memory per rank.

    torchrun --standalone --nproc-per-node 4 -m tp_ext generate --model DIR --tp 2 --pp 2 \\
        --prompt-file prompts.txt --max-new-tokens 64 --do-sample --top-p 0.9 --seed 0

A prompt file holds one prompt per line: text with a tokenizer, else token ids separated by
spaces. ``--prompt`` (repeatable) gives prompts on the command line instead.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import torch
import torch.distributed as dist

from tp_ext.checkpoint import peak_rss_bytes
from tp_ext.cli.flags import add_field_flag
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.config import GENERATION_FIELDS, PARALLEL_FIELDS, GenerationSettings
from tp_ext.distributed import comm, destroy_parallel, init_parallel
from tp_ext.generation import generate
from tp_ext.parallelize.context import CP_ARCHITECTURES
from tp_ext.validation import ConfigError, as_torch_dtype

__all__ = ["add_arguments", "main", "checkpoint_tokenizer", "checkpoint_dtype_of"]

HELP = (
    "batched, greedy or sampled generation from a transformers checkpoint under TP x PP (x EP) "
    "or TP x CP: the text or token ids, tokens per second, time to first token and memory per "
    "rank"
)

# a directory holding one of these has a tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def add_arguments(parser) -> None:
    parser.add_argument("--model", required=True, help="a transformers checkpoint directory")
    dims = parser.add_argument_group("dims (the ranks left over are data replicas)")
    for name in ("tp", "pp", "ep", "cp"):
        add_field_flag(
            dims, name, PARALLEL_FIELDS[name], "" if name in ("ep", "cp") else "1", default=1
        )
    add_field_flag(dims, "cp_mode", PARALLEL_FIELDS["cp_mode"], default="ring")
    prompts = parser.add_argument_group("prompts")
    prompts.add_argument("--prompt-file", help="one prompt per line (text, or token ids)")
    prompts.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    decode = parser.add_argument_group("decoding (greedy unless --do-sample)")
    defaults = GenerationSettings()
    for name, rule in GENERATION_FIELDS.items():
        default = getattr(defaults, name)
        add_field_flag(decode, name, rule, "" if default is None else str(default), default=default)
    decode.add_argument(
        "--eos-token-id",
        type=int,
        action="append",
        default=None,
        help="stop a row at this token (repeatable; default: the checkpoint's)",
    )
    add_field_flag(parser, "dtype", PARALLEL_FIELDS["dtype"], "the checkpoint's", default=None)
    parser.add_argument("--ids", action="store_true", help="print token ids, not text")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def settings_of(args) -> GenerationSettings:
    """The decoding settings the flags give (each checked by its field's rule)."""
    fields = {name: getattr(args, name) for name in GENERATION_FIELDS}
    return GenerationSettings(**{**fields, "do_sample": bool(fields["do_sample"])})


def checkpoint_tokenizer(path: str):
    """The checkpoint's tokenizer (left padding), or None when the directory has none."""
    if not any(os.path.exists(os.path.join(path, name)) for name in TOKENIZER_FILES):
        return None
    try:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    except Exception:  # noqa: BLE001 - no tokenizer files: token ids in and out
        return None
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    return tokenizer


def _prompts(args, tokenizer) -> tuple[torch.Tensor, torch.Tensor, list[str]]:
    """``(ids, attention_mask, prompt lines)``: left-padded."""
    lines = list(args.prompt or [])
    if args.prompt_file:
        if not os.path.isfile(args.prompt_file):
            raise FileNotFoundError(f"--prompt-file {args.prompt_file!r} does not exist")
        with open(args.prompt_file, encoding="utf-8") as f:
            lines += [line.rstrip("\n") for line in f if line.strip()]
    if not lines:
        raise ValueError("give prompts: --prompt TEXT (repeatable) or --prompt-file FILE")
    if tokenizer is not None:
        batch = tokenizer(lines, return_tensors="pt", padding=True)
        return batch["input_ids"], batch["attention_mask"], lines
    rows = []
    for number, line in enumerate(lines, 1):
        try:
            rows.append([int(token) for token in line.split()])
        except ValueError:
            raise ValueError(
                f"prompt {number} ({line[:40]!r}) is not token ids, and {args.model!r} has no "
                "tokenizer to read text with: give ids separated by spaces"
            ) from None
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r) :] = torch.tensor(r)
        mask[i, width - len(r) :] = 1
    return ids, mask, lines


def _check(args) -> None:
    if not os.path.isdir(args.model):
        raise FileNotFoundError(f"--model {args.model!r} is not a checkpoint directory")


def _check_context_parallel(args, kind: str) -> None:
    """--cp > 1: an architecture context parallelism runs, without pipeline stages."""
    if args.cp == 1:
        return
    if kind not in CP_ARCHITECTURES:
        raise ConfigError(
            f"--cp {args.cp}: context parallelism runs transformers' "
            f"{', '.join(CP_ARCHITECTURES)} decoders; this model is {kind!r}: use --cp 1 with it"
        )
    if args.pp > 1:
        raise ConfigError(
            f"--cp {args.cp} with --pp {args.pp}: generation under context parallelism runs "
            "without pipeline stages: use --pp 1 with --cp"
        )


def main(args) -> int:
    from tp_ext.models.hf.source import HFModelSource

    _check(args)
    settings = settings_of(args)
    source = HFModelSource.from_path(args.model)
    _check_context_parallel(args, source.hf_config.model_type)
    tokenizer = checkpoint_tokenizer(args.model)
    ids, mask, lines = _prompts(args, tokenizer)
    eos = args.eos_token_id  # None: the checkpoint's generation config's, as transformers'
    pad = None if tokenizer is None else tokenizer.pad_token_id
    one_process_unless_launched("generate")
    state = init_parallel(tp=args.tp, pp=args.pp, ep=args.ep, cp=args.cp)
    try:
        dtype = as_torch_dtype(args.dtype) if args.dtype else checkpoint_dtype_of(source)
        started = time.perf_counter()
        model, _ = source.build_and_load(state, dtype=dtype, seed=0, cp_mode=args.cp_mode)
        model.eval()
        load_s = time.perf_counter() - started
        out, report = generate(
            model,
            ids.to(state.device),
            mask.to(state.device),
            **dataclasses.asdict(settings),
            eos_token_id=eos,
            pad_token_id=pad,
            return_report=True,
        )
        memory = _memory_per_rank(state)
        if dist.get_rank() == 0:
            _print(args, tokenizer, lines, ids, out, report, memory, load_s, state)
    finally:
        destroy_parallel(destroy_process_group=True)
    return 0


def checkpoint_dtype_of(source) -> torch.dtype:
    from tp_ext.checkpoint import checkpoint_dtype

    return checkpoint_dtype(source.weights) if source.weights else torch.float32


def _memory_per_rank(state) -> list[dict]:
    """Every rank's peak memory (host RSS, and CUDA's peak allocation on a GPU)."""
    cuda = torch.cuda.max_memory_allocated() if torch.cuda.is_available() else 0
    mine = torch.tensor([peak_rss_bytes(), cuda], dtype=torch.float64, device=state.device)
    everyone = comm.all_gather(mine.unsqueeze(0), dim=0, group=dist.group.WORLD)
    return [
        {"rank": r, "peak_rss_bytes": int(a), "cuda_peak_bytes": int(c)}
        for r, (a, c) in enumerate(everyone.tolist())
    ]


def _print(args, tokenizer, lines, ids, out, report, memory, load_s, state) -> None:
    width = ids.size(1)
    texts = None
    if tokenizer is not None and not args.ids:
        texts = tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)
    result = {
        "dims": state.dims.as_dict(),
        "new_tokens": report["new_tokens"],
        "tokens_per_s": report["tokens_per_s"],
        "first_token_s": report["first_token_s"],
        "seconds": report["seconds"],
        "load_s": load_s,
        "kv_cache_bytes_rank0": report["kv_cache_bytes"],
        "micro_batches": report["micro_batches"],
        "memory": memory,
    }
    if args.json:
        result["outputs"] = texts if texts is not None else out[:, width:].tolist()
        print(json.dumps(result))
        return
    for i, line in enumerate(lines):
        new = texts[i] if texts is not None else " ".join(map(str, out[i, width:].tolist()))
        print(f"[{i}] {line}\n    -> {new}")
    print(
        f"{report['new_tokens']} new tokens in {report['seconds']:.3f} s: "
        f"{report['tokens_per_s']:,.1f} tokens/s, first token after "
        f"{report['first_token_s'] * 1e3:.1f} ms ({report['micro_batches']} micro-batches in "
        f"flight; loading took {load_s:.2f} s)"
    )
    print(f"KV cache on rank 0: {report['kv_cache_bytes'] / 2**20:.2f} MiB")
    for m in memory:
        line = f"rank {m['rank']}: peak host memory {m['peak_rss_bytes'] / 2**20:,.0f} MiB"
        if m["cuda_peak_bytes"]:
            line += f", GPU {m['cuda_peak_bytes'] / 2**20:,.0f} MiB"
        print(line)
