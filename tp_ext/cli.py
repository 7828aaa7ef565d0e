"""``tp-ext`` (also ``python -m tp_ext``): command-line entry points.

    torchrun --standalone --nproc-per-node 8 -m tp_ext run configs/qwen2-72b.yaml
    tp-ext plan configs/qwen2-72b.yaml --tp 8
    torchrun --standalone --nproc-per-node 4 -m tp_ext demo
"""

from __future__ import annotations

import argparse
import sys
import time


def _demo(args) -> int:
    """Every collective and Megatron pair on this process group, checked against a local
    single-process reference, with the communication accounting printed by rank 0."""
    import torch
    import torch.distributed as dist

    import tp_ext
    from tp_ext import comm

    torch.manual_seed(0)
    state = tp_ext.init_parallel(tp=args.tp or int(__import__("os").environ.get("WORLD_SIZE", 1)))
    r, w = state.tp_rank, state.tp
    say = print if state.rank == 0 else (lambda *a, **k: None)
    say(f"tp_ext demo: {dist.get_world_size()} ranks, backend {state.backend}, tp={w} "
        f"pp={state.pp} dp={state.dp}, torch {torch.__version__}")

    tokens, hidden, ffn = 2 * w + 1, 8, 3 * w + 1  # uneven on purpose
    g = torch.Generator().manual_seed(1)
    X = torch.randn(tokens, hidden, generator=g, dtype=torch.float64)
    W1 = torch.randn(ffn, hidden, generator=g, dtype=torch.float64)
    W2 = torch.randn(hidden, ffn, generator=g, dtype=torch.float64)
    checks = []

    def check(name, got, want):
        ok = torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        checks.append(ok)
        say(f"  {'ok  ' if ok else 'FAIL'} {name}: shape {tuple(got.shape)}")

    t0 = time.perf_counter()
    with comm.track() as stats:
        with comm.tag("collectives"):
            check("all_reduce", comm.all_reduce(X * (r + 1)), X * sum(range(1, w + 1)))
            piece = tp_ext.split_tensor(X, 0, w)[r]
            check("all_gather (uneven)", comm.all_gather(piece, 0, tp_ext.shard_sizes(tokens, w)),
                  X)
            check("reduce_scatter (uneven)", comm.reduce_scatter(X, 0), piece * w)
            check("broadcast", comm.broadcast(X * r, src=w - 1), X * (w - 1))
            check("all_to_all", comm.all_to_all(X, 0, 1),
                  torch.cat([tp_ext.split_tensor(X, 0, w)[r]] * w, 1))
        with comm.tag("tp_mlp"):
            # Megatron MLP with sequence parallelism: gather_from_sp -> column -> row -> reduce-scatter
            x = piece.clone().requires_grad_()
            w1 = tp_ext.split_tensor(W1, 0, w)[r].clone().requires_grad_()
            w2 = tp_ext.split_tensor(W2, 1, w)[r].clone().requires_grad_()
            h = comm.gather_from_sp(x, 0, tp_ext.shard_sizes(tokens, w))
            y = comm.reduce_scatter_to_sp(torch.relu(h @ w1.t()) @ w2.t(), 0)
            y.pow(2).sum().backward()
        Xr, W1r, W2r = (t.clone().requires_grad_() for t in (X, W1, W2))
        y_ref = torch.relu(Xr @ W1r.t()) @ W2r.t()
        y_ref.pow(2).sum().backward()
        check("TP MLP output", y.detach(), tp_ext.split_tensor(y_ref.detach(), 0, w)[r])
        check("TP MLP input grad", x.grad, tp_ext.split_tensor(Xr.grad, 0, w)[r])
        check("TP MLP w1 grad", w1.grad, tp_ext.split_tensor(W1r.grad, 0, w)[r])
        check("TP MLP w2 grad", w2.grad, tp_ext.split_tensor(W2r.grad, 1, w)[r])
    elapsed = time.perf_counter() - t0
    all_ok = comm.all_reduce(torch.tensor([float(all(checks))]), "min").item() == 1.0
    say("\ncommunication on rank 0:")
    say(stats.table())
    say(f"\n{'all checks passed' if all_ok else 'SOME CHECKS FAILED'} on {w} ranks "
        f"in {elapsed * 1e3:.1f} ms")
    tp_ext.parallel.destroy_parallel(destroy_process_group=True)
    return 0 if all_ok else 1


def _plan(args) -> int:
    """Per-rank parameters, bytes, KV cache and communication of a config, on the meta device."""
    import json

    from tp_ext.models import ConfigError, Qwen2Config
    from tp_ext.models.footprint import format_plan, model_plan

    try:
        config = Qwen2Config.from_file(args.config)
        plan = model_plan(config, args.tp if args.tp is not None else config.parallel.tp,
                          args.dtype)
    except (ConfigError, ValueError) as e:
        print(f"tp-ext plan: {e}", file=sys.stderr)
        return 2
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0


def _run(args) -> int:
    """The main job: see tp_ext/run.py."""
    from tp_ext.models import ConfigError
    from tp_ext.run import run

    overrides = {"tp": args.tp, "dp": args.dp, "dtype": args.dtype, "seed": args.seed,
                 "lr": args.lr, "weight_decay": args.weight_decay, "betas": args.betas}
    try:
        return run(args.config, overrides, small_path=args.small, workdir=args.workdir,
                   steps=args.steps, micro_batches=args.micro_batches,
                   max_new_tokens=args.max_new_tokens, max_grad_norm=args.max_grad_norm)
    except (ConfigError, ValueError) as e:
        print(f"tp-ext run: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="tp-ext", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run every collective and pair across ranks and check them "
                                       "(launch with torchrun)")
    demo.add_argument("--tp", type=int, default=None, help="TP degree (default: world size)")
    demo.set_defaults(func=_demo)
    plan = sub.add_parser("plan", help="per-rank parameters, bytes, KV cache and communication of "
                                       "a model config, without allocating it")
    plan.add_argument("config", help="tp_ext YAML/JSON config or a Hugging Face config.json")
    plan.add_argument("--tp", type=int, default=None, help="TP degree (default: the config's)")
    plan.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or float64 "
                                                    "(default: the config's parallel.dtype)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")
    plan.set_defaults(func=_plan)
    run = sub.add_parser("run", help="the main job (launch with torchrun): full-size plan, then a "
                                     "small model of the family loaded sharded, checked, "
                                     "trained, saved and sampled")
    run.add_argument("config", help="tp_ext YAML/JSON config or a Hugging Face config.json")
    run.add_argument("--small", default=None, help="config of the model actually run (default: "
                                                   "a tiny model of CONFIG's family)")
    run.add_argument("--workdir", default=None, help="where checkpoints are written (default: "
                                                     "a directory under the system temp dir)")
    group = run.add_argument_group("overrides of the config's parallel and optimizer settings")
    group.add_argument("--tp", type=int, default=None, help="TP degree (default: world size)")
    group.add_argument("--dp", type=int, default=None, help="data-parallel degree")
    group.add_argument("--dtype", default=None, help="dtype of the small model (default float32)")
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--lr", type=float, default=None)
    group.add_argument("--weight-decay", type=float, default=None)
    group.add_argument("--betas", type=float, nargs=2, default=None)
    run.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    run.add_argument("--micro-batches", type=int, default=2, help="gradient accumulation "
                                                                  "micro-batches per step")
    run.add_argument("--max-new-tokens", type=int, default=16)
    run.add_argument("--max-grad-norm", type=float, default=1.0)
    run.set_defaults(func=_run)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
