"""Generation: ``tp_ext.generate`` against transformers' own ``generate`` on its native tensor
parallelism (``from_pretrained(path, distributed_config=DistributedConfig(tp_size=T))``), same
checkpoint, same left-padded batch, in the same processes; and against the unsharded model on
one process. Per case: tokens per second of the whole call (batch x new tokens / seconds; the
median of the repeats, each library's call in turn every round) and the time to the first token
(the same call with one new token), greedy, with the tokens of both checked against the
unsharded model's. ``--pp``: pipeline inference, several micro-batches in flight against one.

    python benchmarks/bench_generate.py [--tp 2 4] [--batch 8] [--new 128] [--repeats 3]
    python benchmarks/bench_generate.py --pp 2 [--micro-batches 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_vs_transformers import write_checkpoint  # noqa: E402
from benchmarks.common import append_rows, bench_interleaved, run_ranks  # noqa: E402

BENCH = "generate"
# hidden, heads, kv heads, intermediate, layers, vocab: a small Llama with a real vocabulary
SHAPE = (1024, 16, 4, 2816, 4, 32000)


def _checkpoint(directory: str) -> str:
    path = os.path.join(directory, "llama")
    return write_checkpoint("llama", path, SHAPE, max_positions=1024)


def _prompts(batch: int, longest: int = 64):
    """Left-padded prompts of lengths longest / 4 to longest (ids, mask)."""
    generator = torch.Generator().manual_seed(1)
    lengths = torch.linspace(longest // 4, longest, batch).long().tolist()
    width = max(lengths)
    ids = torch.zeros(batch, width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, width - n :] = torch.randint(3, SHAPE[-1], (n,), generator=generator)
        mask[row, width - n :] = 1
    return ids, mask


def _hf_generate(model, ids, mask, new):
    # no EOS (the checkpoint's is dropped): every row runs all max_new_tokens in both libraries
    model.generation_config.eos_token_id = None
    return model.generate(
        ids, attention_mask=mask, max_new_tokens=new, do_sample=False, pad_token_id=0
    )


def _tp_rank(path: str, batch: int, new: int, repeats: int) -> dict:
    """On every rank: tp_ext's converted model and transformers' native TP model, each one's
    tokens against the unsharded model's, then both generate calls timed in turn."""
    import transformers

    import tp_ext

    ids, mask = _prompts(batch)
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        expected = _hf_generate(load(path, dtype=torch.float32).eval(), ids, mask, new)
    size = torch.distributed.get_world_size()
    state = tp_ext.init_parallel(tp=size)
    ours = tp_ext.parallelize(load(path, dtype=torch.float32).eval(), "auto", parallel=state)
    ours.generation_config.eos_token_id = None  # as _hf_generate's: every row runs to the end
    out: dict = {}

    def tp_ext_call(n):
        return lambda: tp_ext.generate(ours, ids, mask, max_new_tokens=n)

    out["tp_ext_equal"] = bool(torch.equal(tp_ext_call(new)(), expected))
    calls = [tp_ext_call(new), tp_ext_call(1)]
    try:
        from transformers.distributed import DistributedConfig

        theirs = load(
            path, dtype=torch.float32, distributed_config=DistributedConfig(tp_size=size)
        ).eval()
        with torch.no_grad():
            out["transformers_equal"] = bool(
                torch.equal(_hf_generate(theirs, ids, mask, new), expected)
            )
        calls += [
            lambda: _hf_generate(theirs, ids, mask, new),
            lambda: _hf_generate(theirs, ids, mask, 1),
        ]
    except Exception:  # noqa: BLE001 - where transformers' mode fails is a result
        out["transformers_failed"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
    with torch.no_grad():
        times = bench_interleaved(*calls, warmup=1, repeats=repeats)
    out["tp_ext_s"], out["tp_ext_first_s"] = times[:2]
    if len(times) > 2:
        out["transformers_s"], out["transformers_first_s"] = times[2:]
    return out


def _single_rank(path: str, batch: int, new: int, repeats: int) -> dict:
    """One process: transformers' unsharded generate and tp_ext.generate at tp = 1."""
    import transformers

    import tp_ext

    ids, mask = _prompts(batch)
    reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    reference.eval()
    state = tp_ext.init_parallel(tp=1)
    import copy

    reference.generation_config.eos_token_id = None  # no row ends early, in either library
    ours = tp_ext.parallelize(copy.deepcopy(reference), "auto", parallel=state)
    with torch.no_grad():
        expected = _hf_generate(reference, ids, mask, new)
        equal = torch.equal(tp_ext.generate(ours, ids, mask, max_new_tokens=new), expected)
        times = bench_interleaved(
            lambda: tp_ext.generate(ours, ids, mask, max_new_tokens=new),
            lambda: tp_ext.generate(ours, ids, mask, max_new_tokens=1),
            lambda: _hf_generate(reference, ids, mask, new),
            lambda: _hf_generate(reference, ids, mask, 1),
            warmup=1,
            repeats=repeats,
        )
    return {
        "tp_ext_equal": bool(equal),
        "transformers_equal": True,
        "tp_ext_s": times[0],
        "tp_ext_first_s": times[1],
        "transformers_s": times[2],
        "transformers_first_s": times[3],
    }


def _pp_rank(path: str, batch: int, new: int, repeats: int, micro_batches, longest) -> dict:
    """Pipeline inference over every rank: tokens per second with m micro-batches in flight."""
    import transformers

    import tp_ext

    ids, mask = _prompts(batch, longest)
    load = transformers.AutoModelForCausalLM.from_pretrained
    with torch.no_grad():
        expected = _hf_generate(load(path, dtype=torch.float32).eval(), ids, mask, new)
    size = torch.distributed.get_world_size()
    state = tp_ext.init_parallel(tp=1, pp=size)
    ours = tp_ext.parallelize(load(path, dtype=torch.float32).eval(), "auto", parallel=state)
    ours.hf_model.generation_config.eos_token_id = None  # as _hf_generate's
    calls = [
        (lambda m: lambda: tp_ext.generate(ours, ids, mask, new, micro_batches=m))(m)
        for m in micro_batches
    ]
    equal = all(torch.equal(call(), expected) for call in calls)
    times = bench_interleaved(*calls, warmup=1, repeats=repeats)
    return {"equal": equal, "seconds": dict(zip(micro_batches, times))}


def _rows(case: str, r: dict, batch: int, new: int) -> list[dict]:
    def row(metric, value, unit="", baseline=""):
        return dict(
            benchmark=BENCH, case=case, metric=metric, value=value, unit=unit, baseline=baseline
        )

    rate = batch * new
    rows = [row("tp_ext_tokens_equal", int(r["tp_ext_equal"]))]
    if "transformers_failed" in r:
        return rows + [
            row("transformers_failed", r["transformers_failed"]),
            row("tp_ext_tokens_per_s", rate / r["tp_ext_s"], "tokens/s"),
        ]
    rows += [
        row("transformers_tokens_equal", int(r["transformers_equal"])),
        row("tokens_per_s", rate / r["tp_ext_s"], "tokens/s", rate / r["transformers_s"]),
        row("first_token_s", r["tp_ext_first_s"], "s", r["transformers_first_s"]),
    ]
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--single", action="store_true", help="also the unsharded model, 1 process")
    p.add_argument("--pp", type=int, default=None, help="instead: pipeline inference")
    p.add_argument("--micro-batches", type=int, nargs="+", default=None)
    p.add_argument("--prompt-len", type=int, default=64, help="the longest prompt (--pp)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        path = _checkpoint(d)
        if a.pp:
            ms = a.micro_batches or [1, a.pp]
            r = run_ranks(_pp_rank, a.pp, path, a.batch, a.new, a.repeats, ms, a.prompt_len)[0]
            print(f"pp{a.pp}: {r}")
            case = f"pp{a.pp}-prompt{a.prompt_len}-new{a.new}"
            rows = [dict(benchmark=BENCH, case=case, metric="tokens_equal", value=int(r["equal"]))]
            base = r["seconds"][ms[0]]
            for m in ms[1:]:
                rows.append(
                    dict(
                        benchmark=BENCH,
                        case=f"{case}-m{m}-vs-m{ms[0]}",
                        metric="tokens_per_s",
                        value=a.batch * a.new / r["seconds"][m],
                        unit="tokens/s",
                        baseline=a.batch * a.new / base,
                    )
                )
            append_rows(rows)
            return
        rows = []
        if a.single:
            r = run_ranks(_single_rank, 1, path, a.batch, a.new, a.repeats)[0]
            print(f"single: {r}")
            rows += _rows("single-process", r, a.batch, a.new)
        for tp in a.tp:
            r = run_ranks(_tp_rank, tp, path, a.batch, a.new, a.repeats)[0]
            print(f"tp{tp}: {r}")
            rows += _rows(f"tp{tp}", r, a.batch, a.new)
        append_rows(rows)


if __name__ == "__main__":
    main()
