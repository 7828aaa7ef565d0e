"""tp_ext against transformers' own native distributed mode, same checkpoint, same batch, in the
same processes: ``tp_ext.parallelize(model, "auto")`` vs ``from_pretrained(path,
distributed_config=DistributedConfig(tp_size=T))`` (transformers 5, DTensor underneath; it needs
the ``accelerate`` package, in benchmarks/requirements.txt).

Per case (architecture, shape, TP degree): the median forward+backward step time of each, called
in turn every round so load changes hit both alike (ratio = tp_ext / transformers), and each
one's logits against the unsharded model's (max relative error). A failure of either side is
recorded as such (metric ``failed``), not skipped.

    python benchmarks/bench_vs_transformers.py [--tp 2 4] [--shapes small large] [--arch llama]
    python benchmarks/bench_vs_transformers.py --pp 2  # pipeline inference (Llama, Gemma 2, GPT-2)
    python benchmarks/bench_vs_transformers.py --moe   # Mixtral with expert parallelism, 2 ranks
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import tempfile
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, bench_interleaved, run_ranks  # noqa: E402

BENCH = "vs_transformers"
SHAPES = {  # name: hidden, heads, kv_heads, intermediate, layers, vocab, batch, seq
    "small": (256, 8, 4, 704, 2, 1024, 1, 64),
    "large": (1024, 16, 4, 2816, 2, 4096, 1, 512),
}
CONFIGS = {"qwen2": "Qwen2Config", "llama": "LlamaConfig"}


def write_checkpoint(arch: str, path: str, sizes: tuple, max_positions: int = 2048) -> str:
    """A random fp32 ``arch`` ("qwen2" / "llama") checkpoint of ``sizes`` (hidden, heads,
    kv heads, intermediate, layers, vocab), untied, seeded: the same weights in every run."""
    import transformers

    hidden, heads, kv, inter, layers, vocab = sizes
    config = getattr(transformers, CONFIGS[arch])(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def _checkpoint(arch: str, shape: str, directory: str) -> str:
    path = os.path.join(directory, f"{arch}-{shape}")
    return write_checkpoint(arch, path, SHAPES[shape][:6])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _step(model, ids):
    def run():
        loss = model(ids, labels=ids).loss
        loss.backward()
        for p in model.parameters():
            p.grad = None
        return loss

    return run


def _rank(
    path: str, shape: str, repeats: int, overlap: bool = False, link: bool = False, sp: bool = False
) -> dict:
    """On every rank: both models from ``path``, their logits against the unsharded model's,
    then their steps timed in turn. ``overlap``: tp_ext's fused, overlapped linear ops (off by
    default on CPU: on one host the ranks share the cores the overlap would use). ``link``:
    the ranks talk over a throttled network link (benchmarks/netns.py): tp_ext's shared-memory
    channel is switched off, so its bytes cross the link as transformers' do. ``sp``: tp_ext with
    sequence parallelism (with ``overlap``, its ring-decomposed all-gather + GEMM and GEMM +
    reduce-scatter hide the forward's communication too; the same bytes as the all-reduces)."""
    import transformers

    import tp_ext

    tp_ext.comm.set_overlap(True if overlap else None)
    if link:
        tp_ext.comm.set_shared_memory(False)

    batch, seq = SHAPES[shape][6:]
    vocab = SHAPES[shape][5]
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        expected = reference(ids).logits
        expected_loss = reference(ids, labels=ids).loss
        del reference
    out: dict = {}
    state = tp_ext.init_parallel(tp=torch.distributed.get_world_size())
    ours = tp_ext.parallelize(
        transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        "auto",
        parallel=state,
        sequence_parallel=sp,
    )
    trained = _trainer_step(ours, state, ids)
    with torch.no_grad():
        out["tp_ext_error"] = _rel(ours(ids).logits, expected)
        out["tp_ext_trainer_loss_error"] = _rel(trained(), expected_loss)
    size = torch.distributed.get_world_size()
    theirs = _native(
        lambda config: transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, distributed_config=config(tp_size=size)
        ),
        ids,
        expected,
        out,
    )
    steps = [_step(ours, ids), trained] + ([] if theirs is None else [_step(theirs, ids)])
    times = bench_interleaved(*steps, warmup=2, repeats=repeats)
    out["tp_ext_s"], out["tp_ext_trainer_s"] = times[:2]
    if theirs is not None:
        out["transformers_s"] = times[2]
    return out


def _native(load, ids, expected, out: dict):
    """transformers' native distributed model, ``load(DistributedConfig)``, with its logits'
    relative error against ``expected`` in ``out``; None when its mode fails (what failed, in
    ``out``: where transformers' mode fails is a result)."""
    try:
        from transformers.distributed import DistributedConfig

        theirs = load(DistributedConfig)
        with torch.no_grad():
            logits = theirs(ids).logits
        if hasattr(logits, "full_tensor"):
            logits = logits.full_tensor()
        out["transformers_error"] = _rel(logits, expected)
        return theirs
    except Exception:  # noqa: BLE001 - recorded, not raised
        out["transformers_failed"] = traceback.format_exc(limit=3).strip().splitlines()[-1]
        return None


def _trainer_step(model, state, ids):
    """tp_ext's forward+backward as its Trainer runs a converted model: one stage whose LM head
    leaves the logits split by vocabulary, and the vocabulary-parallel cross-entropy on them
    (no gather of the logits); returns the loss, the mean over next-token targets as
    transformers' ``labels=`` loss."""
    from tp_ext.layers import vocab_parallel_cross_entropy
    from tp_ext.parallelize.stages import single_stage

    stage = single_stage(model, state)

    def run():
        local = stage.stage_forward(0, ids)
        loss = vocab_parallel_cross_entropy(local[:, :-1], ids[:, 1:], tp_group=state.tp_group)
        if torch.is_grad_enabled():
            loss.backward()
            for p in model.parameters():
                p.grad = None
        return loss

    return run


PP_ARCHS = {  # tiny 4-layer decoders for the pipeline comparison (logits and forward time)
    "llama": ("LlamaConfig", {}),
    "gemma2": ("Gemma2Config", {"head_dim": 64, "sliding_window": 32}),
    "gpt2": ("GPT2Config", {}),
}


def _pp_checkpoint(arch: str, directory: str) -> str:
    import transformers

    name, extra = PP_ARCHS[arch]
    sizes = dict(vocab_size=1024, hidden_size=256, intermediate_size=704, num_hidden_layers=4)
    sizes.update(num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256)
    if arch == "gpt2":
        sizes = dict(vocab_size=1024, n_embd=256, n_layer=4, n_head=4, n_positions=256)
    torch.manual_seed(0)
    config = getattr(transformers, name)(**sizes, **extra)
    path = os.path.join(directory, f"pp-{arch}")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def _pp_rank(path: str, repeats: int) -> dict:
    """Pipeline parallelism over every rank, inference: tp_ext's stages (``parallelize`` at
    pp = world size) and transformers' ``DistributedConfig(pp_size=...)`` (forward only, naive),
    logits against the unsharded model's and the forward time of each."""
    import transformers

    import tp_ext

    size = torch.distributed.get_world_size()
    ids = torch.randint(0, 1024, (1, 128), generator=torch.Generator().manual_seed(1))
    load = functools.partial(transformers.AutoModelForCausalLM.from_pretrained, path)
    with torch.no_grad():
        expected = load(dtype=torch.float32)(ids).logits
    state = tp_ext.init_parallel(tp=1, pp=size)
    ours = tp_ext.parallelize(load(dtype=torch.float32), "auto", parallel=state)
    out: dict = {}
    with torch.no_grad():
        out["tp_ext_error"] = _rel(ours(ids), expected)
        steps = [lambda: ours(ids)]
        theirs = _native(
            lambda config: load(dtype=torch.float32, distributed_config=config(pp_size=size)),
            ids,
            expected,
            out,
        )
        if theirs is not None:
            steps.append(lambda: theirs(ids))
        times = bench_interleaved(*steps, warmup=2, repeats=repeats)
    out["tp_ext_s"] = times[0]
    if len(times) > 1:
        out["transformers_s"] = times[1]
    return out


# Mixtral (hidden 256, 8 experts, top 2, 2 layers, vocab 1024; 2 x 128 tokens per rank) on 2 ranks,
# as each library lays it out: (tp_ext's init_parallel degrees, transformers' DistributedConfig,
# whether the ranks share one batch)
MOE_LAYOUTS = {
    # experts over the 2 TP ranks (tp_ext: attention split over TP too; transformers: its
    # "all_reduce" EP, each rank's experts on the shared batch, outputs summed)
    "tp2-ep2": (dict(tp=2, ep=2), dict(tp_size=2, ep_size=2), True),
    # experts over 2 data-parallel ranks, each its own batch, tokens exchanged all-to-all
    # (transformers shards the dense weights with FSDP2 there: its step gathers them)
    "dp2-ep2": (dict(tp=1, dp=2, ep=2), dict(fsdp_size=2, ep_size=2), False),
}


def _moe_checkpoint(directory: str) -> str:
    import transformers

    config = transformers.MixtralConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=352,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    path = os.path.join(directory, "moe")
    transformers.AutoModelForCausalLM.from_config(config).float().save_pretrained(path)
    return path


def _moe_rank(path: str, layout: str, repeats: int) -> dict:
    """Mixtral with expert parallelism in both libraries (``MOE_LAYOUTS``): each one's logits
    against the unsharded model's on this rank's batch, and their forward+backward steps timed
    in turn."""
    import transformers

    import tp_ext

    ours_degrees, theirs_config, shared = MOE_LAYOUTS[layout]
    seed = 1 if shared else 1 + torch.distributed.get_rank()
    ids = torch.randint(0, 1024, (2, 128), generator=torch.Generator().manual_seed(seed))
    load = functools.partial(
        transformers.AutoModelForCausalLM.from_pretrained, path, dtype=torch.float32
    )
    with torch.no_grad():
        expected = load()(ids).logits
    state = tp_ext.init_parallel(**ours_degrees)
    ours = tp_ext.parallelize(load(), "auto", parallel=state)
    out: dict = {}
    with torch.no_grad():
        out["tp_ext_error"] = _rel(ours(ids).logits, expected)
    theirs = _native(
        lambda config: load(distributed_config=config(**theirs_config)), ids, expected, out
    )
    steps = [_step(ours, ids)] + ([] if theirs is None else [_step(theirs, ids)])
    times = bench_interleaved(*steps, warmup=2, repeats=repeats)
    out["tp_ext_s"] = times[0]
    if theirs is not None:
        out["transformers_s"] = times[1]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, nargs="+", default=[2])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--arch", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--overlap", action="store_true", help="tp_ext's overlapped linear ops")
    parser.add_argument("--sp", action="store_true", help="tp_ext with sequence parallelism")
    parser.add_argument(
        "--pp", type=int, default=0, help="instead: pipeline inference over this many ranks"
    )
    parser.add_argument(
        "--moe", action="store_true", help="instead: Mixtral with expert parallelism, 2 ranks"
    )
    parser.add_argument(
        "--mbit",
        type=float,
        default=0.0,
        help="TP=2 across a link throttled to this many Mbit/s (network namespaces, root)",
    )
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        if args.moe:
            path = _moe_checkpoint(directory)
            for layout in MOE_LAYOUTS:
                result = run_ranks(_moe_rank, 2, path, layout, args.repeats)[0]
                rows += _rows(f"mixtral-{layout}", result)
                print(f"mixtral {layout}: {result}", flush=True)
            append_rows(rows)
            return
        if args.pp:
            for arch in PP_ARCHS:
                result = run_ranks(_pp_rank, args.pp, _pp_checkpoint(arch, directory), 5)[0]
                rows += _rows(f"{arch}-pp{args.pp}-forward", result)
                print(f"{arch} pp={args.pp}: {result}", flush=True)
            append_rows(rows)
            return
        if args.mbit:
            from benchmarks import netns

            why = netns.why_not()
            if why:
                raise SystemExit(f"--mbit: no throttled link here: {why}")
        for arch in args.arch:
            for shape in args.shapes:
                path = _checkpoint(arch, shape, directory)
                for tp in [2] if args.mbit else args.tp:
                    case = f"{arch}-{shape}-tp{tp}" + ("-overlap" if args.overlap else "")
                    case += "-sp" if args.sp else ""
                    if args.mbit:
                        result = netns.run_throttled(
                            "benchmarks.bench_vs_transformers", "_rank", args.mbit,
                            path, shape, args.repeats, args.overlap, True, args.sp,
                        )[0]  # fmt: skip
                        case += f"-{args.mbit:g}mbit"
                    else:
                        result = run_ranks(
                            _rank, tp, path, shape, args.repeats, args.overlap, False, args.sp
                        )[0]
                    rows += _rows(case, result)
                    print(f"{case}: {result}", flush=True)
    append_rows(rows)


def _rows(case: str, r: dict) -> list[dict]:
    def row(metric, value, unit="", baseline=""):
        return dict(
            benchmark=BENCH, case=case, metric=metric, value=value, unit=unit, baseline=baseline
        )

    rows = [row("tp_ext_logits_rel_error", r["tp_ext_error"])]
    if "tp_ext_trainer_loss_error" in r:
        rows.append(row("tp_ext_trainer_loss_rel_error", r["tp_ext_trainer_loss_error"]))
    if "transformers_failed" in r:  # what failed, and tp_ext's time alone
        return rows + [
            row("transformers_failed", r["transformers_failed"]),
            row("tp_ext_step_s", r["tp_ext_s"], "s"),
        ]
    rows += [
        row("transformers_logits_rel_error", r["transformers_error"]),
        row("step_s", r["tp_ext_s"], "s", r["transformers_s"]),  # ratio filled by append_rows
    ]
    if "tp_ext_trainer_s" in r:  # tp_ext's Trainer loss path against the same step of theirs
        rows.append(row("trainer_step_s", r["tp_ext_trainer_s"], "s", r["transformers_s"]))
    return rows


if __name__ == "__main__":
    main()
