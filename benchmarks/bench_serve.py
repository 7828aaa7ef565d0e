"""Serving under load: tp_ext's engine (continuous batching over a paged KV cache, as ``tp-ext
serve`` runs it, without the HTTP layer) against transformers' own continuous batching
(``init_continuous_batching``, its paged cache, with its native TP) and against tp_ext's static
``generate`` batches, on the same checkpoint and the same request trace.

The trace: ``--requests`` requests arriving as a Poisson process at each ``--rates`` (requests
per second; ``inf``: all at once), prompt lengths uniform in [16, 256] and output lengths in
[16, 128], seeded, so every side gets the same requests at the same times. Both engines get the
same cache (``--blocks`` blocks of 16 positions per rank), token budget a step (256) and running
requests (16). Outputs are greedy with EOS ignored, so every side generates the same number of
tokens.

Figures per (TP, rate, side): output tokens per second (from the first arrival to the last
token), time to first token p50/p99 and inter-token latency p50/p99 (ms), and for tp_ext the
most KV blocks in use. The ratio column is tp_ext / transformers (static: its tokens/s only,
its tokens all arrive at a batch's end).

    python benchmarks/bench_serve.py --tp 2 --rates 4 inf
    python benchmarks/bench_serve.py --tp 4 --rates inf   # 16 cores: a core per rank
    python benchmarks/bench_serve.py --mbit 300           # TP=2 across a throttled link (root)

``--mbit`` puts the two ranks in network namespaces joined by a link of that rate
(benchmarks/netns.py), so every collective of every side crosses it.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.bench_vs_transformers import write_checkpoint  # noqa: E402
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH = "serve"
SHAPE = (512, 8, 4, 1408, 4, 8192)  # hidden, heads, kv heads, intermediate, layers, vocab
PAGE, BUDGET, SEQS = 16, 256, 16


def make_trace(rate: float, count: int, seed: int = 0) -> list:
    """``[(arrival s, prompt ids, output tokens)]``, Poisson arrivals at ``rate`` per second."""
    g = torch.Generator().manual_seed(seed)
    gaps = torch.zeros(count)
    if not math.isinf(rate):
        gaps.exponential_(rate, generator=g)
    arrivals = torch.cumsum(gaps, 0).tolist()
    trace = []
    for at in arrivals:
        n = int(torch.randint(16, 257, (1,), generator=g))
        prompt = torch.randint(1, SHAPE[5], (n,), generator=g).tolist()
        trace.append((at, prompt, int(torch.randint(16, 129, (1,), generator=g))))
    return trace


def _feed(trace, submit) -> float:
    """Submit each request at its arrival time (from now); returns the start time."""
    start = time.perf_counter()
    for i, (at, prompt, new) in enumerate(trace):
        delay = start + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        submit(i, prompt, new)
    return start


def _tp_ext(path: str, trace: list, blocks: int) -> dict:
    import tp_ext
    from tp_ext.models.hf.source import HFModelSource
    from tp_ext.serving import Engine, SamplingParams
    from tp_ext.serving.coordinator import EngineLoop

    state = tp_ext.init_parallel(tp=torch.distributed.get_world_size())
    model, _ = HFModelSource.from_path(path).build_and_load(state, dtype=torch.float32, seed=0)
    engine = Engine(model.eval(), parallel=state, num_blocks=blocks, block_size=PAGE,
                    max_num_seqs=SEQS, max_num_batched_tokens=BUDGET)  # fmt: skip
    loop = EngineLoop(engine)
    times: dict = {i: [] for i in range(len(trace))}
    done = threading.Event()
    peak = [0]

    def listener(i):
        def on(out):
            if out.token is not None:
                times[i].append(time.perf_counter())
                peak[0] = max(peak[0], engine.pool.used)
            if out.finish_reason is not None and all(len(times[j]) == trace[j][2] for j in times):
                done.set()

        return on

    def submit(i, prompt, new):
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
        loop.submit(str(i), prompt, params, listener(i))

    result = {}

    def drive():
        result["start"] = _feed(trace, submit)
        done.wait()
        loop.stop()

    if torch.distributed.get_rank() == 0:
        threading.Thread(target=drive, daemon=True).start()
    loop.run()
    return {**result, "times": times, "peak_blocks": peak[0]}


def _transformers(path: str, trace: list, blocks: int) -> dict:
    from transformers import AutoModelForCausalLM, ContinuousBatchingConfig, GenerationConfig
    from transformers.distributed import DistributedConfig

    tp = torch.distributed.get_world_size()
    extra = {"distributed_config": DistributedConfig(tp_size=tp)} if tp > 1 else {}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **extra).eval()
    generation = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=0,
                                  max_new_tokens=128)  # fmt: skip
    config = ContinuousBatchingConfig(page_size=PAGE, num_blocks=blocks, max_batch_tokens=BUDGET,
                                      max_requests_per_batch=SEQS)  # fmt: skip
    # the end is agreed on a group of its own: transformers' thread runs collectives on the
    # default group meanwhile
    finished = torch.distributed.new_group(backend="gloo")
    manager = model.init_continuous_batching(generation, config)
    manager.start()
    out = {}
    if torch.distributed.get_rank() == 0:
        submit = lambda i, prompt, new: manager.add_request(  # noqa: E731
            prompt, request_id=str(i), max_new_tokens=new, record_timestamps=True
        )
        out["start"] = _feed(trace, submit)
        times = {}
        while len(times) < len(trace):
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError("transformers' continuous batching stopped early")
            if result.is_finished():
                times[int(result.request_id)] = list(result.timestamps)
        out["times"] = times
    torch.distributed.barrier(group=finished)
    manager.stop(block=True)
    return out


def _static(path: str, trace: list, blocks: int) -> dict:
    """tp_ext's ``generate`` in static batches of up to SEQS requests (each batch takes the
    requests arrived by the time the last one ended, padded to its longest prompt and output)."""
    import tp_ext
    from tp_ext.models.hf.source import HFModelSource

    state = tp_ext.init_parallel(tp=torch.distributed.get_world_size())
    model, _ = HFModelSource.from_path(path).build_and_load(state, dtype=torch.float32, seed=0)
    start, times, i = time.perf_counter(), {}, 0
    while i < len(trace):
        now = time.perf_counter() - start
        ready = [j for j in range(i, min(i + SEQS, len(trace))) if trace[j][0] <= now] or [i]
        box = [ready]  # rank 0's clock decides; every rank runs the same batch
        torch.distributed.broadcast_object_list(box, src=0)
        ready = box[0]
        time.sleep(max(0.0, trace[ready[-1]][0] - now))
        prompts = [trace[j][1] for j in ready]
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(ready), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :], mask[row, width - len(p) :] = torch.tensor(p), 1
        new = max(trace[j][2] for j in ready)
        tp_ext.generate(model.eval(), ids, mask, max_new_tokens=new)  # the config has no EOS
        end = time.perf_counter()
        for j in ready:  # every token of the batch arrives at its end
            times[j] = [end] * trace[j][2]
        i = ready[-1] + 1
    return {"start": start, "times": times}


def _figures(trace: list, run: dict) -> dict:
    start, times = run["start"], run["times"]
    tokens = sum(len(t) for t in times.values())
    last = max(t[-1] for t in times.values())
    first = sorted(times[i][0] - (start + trace[i][0]) for i in times)
    gaps = sorted(b - a for t in times.values() for a, b in zip(t, t[1:]))

    def pct(values, q):
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    figures = {
        "output tokens/s": (tokens / (last - start), "tok/s"),
        "ttft p50": (pct(first, 0.5), "ms"),
        "ttft p99": (pct(first, 0.99), "ms"),
    }
    if any(gaps):  # static batches hand every token out at once: no inter-token latency
        figures["itl p50"], figures["itl p99"] = (pct(gaps, 0.5), "ms"), (pct(gaps, 0.99), "ms")
    return figures


SIDES = {"tp_ext": _tp_ext, "transformers": _transformers, "static": _static}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--rates", type=float, nargs="+", default=[4.0, math.inf])
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--blocks", type=int, default=256, help="KV blocks of 16 positions a rank")
    parser.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    link_help = "TP=2 over a link of this many Mbit/s (needs root: netns + tc)"
    parser.add_argument("--mbit", type=float, default=0.0, help=link_help)
    args = parser.parse_args(argv)
    if args.mbit:
        from benchmarks import netns

        why = netns.why_not()
        if why:
            raise SystemExit(f"--mbit: no throttled link here: {why}")
        if args.tp != [2]:
            raise SystemExit(f"--mbit: the throttled link joins 2 ranks; --tp {args.tp} needs [2]")
    with tempfile.TemporaryDirectory() as d:
        path = write_checkpoint("qwen2", os.path.join(d, "model"), SHAPE)
        for tp in args.tp:
            for rate in args.rates:
                _case(path, tp, rate, args)


def _throttled_side(side: str, path: str, trace: list, blocks: int) -> dict:
    """One side on a rank of the throttled pair (benchmarks/netns.py runs it; JSON in and out)."""
    run = SIDES[side](path, trace, blocks)
    if "times" in run:
        run["times"] = {str(i): t for i, t in run["times"].items()}
    return run


def _run_side(side: str, path: str, tp: int, trace: list, args) -> dict:
    """Rank 0's record of one side: its start time and each request's token times."""
    if not args.mbit:
        return run_ranks(SIDES[side], tp, path, trace, args.blocks)[0]
    from benchmarks import netns

    module = "benchmarks.bench_serve"
    run = netns.run_throttled(module, "_throttled_side", args.mbit, side, path, trace, args.blocks)
    run = run[0]
    run["times"] = {int(i): t for i, t in run["times"].items()}
    return run


def _case(path: str, tp: int, rate: float, args) -> None:
    trace = make_trace(rate, args.requests)
    figures = {}
    link = f" {args.mbit:g}mbit" if args.mbit else ""
    for side in args.sides:
        run = _run_side(side, path, tp, trace, args)
        figures[side] = _figures(trace, run)
        if side == "tp_ext":
            figures[side]["kv blocks used max"] = (run["peak_blocks"], "blocks")
    base = figures.get("transformers", {})
    rows = []
    for side, values in figures.items():
        for metric, (value, unit) in values.items():
            row = dict(benchmark=BENCH, case=f"tp={tp}{link} rate={rate:g} {side}", metric=metric,
                       value=float(value), unit=unit)  # fmt: skip
            if side != "transformers" and metric in base:
                row["baseline"] = float(base[metric][0])
            rows.append(row)
            print(f"tp={tp}{link} rate={rate:g} {side:>12} {metric:>20}: {value:10.2f} {unit}")
    append_rows(rows)


if __name__ == "__main__":
    main()
