"""``tp-ext demo`` (``make demo``): every collective and Megatron pair on this process group,
checked against a single-process reference, with rank 0's communication accounting printed.
An application on top of the library: it uses only public tp_ext names."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

import tp_ext
from tp_ext import comm
from tp_ext.cli.flags import add_field_flag
from tp_ext.cli.launch import one_process_unless_launched
from tp_ext.cli.logs import REPORT
from tp_ext.config import PARALLEL_FIELDS
from tp_ext.distributed import destroy_parallel
from tp_ext.sharding import divisors

__all__ = ["demo", "add_arguments", "main"]

HELP = "run every collective and pair across ranks and check them (launch with torchrun)"


def add_arguments(parser) -> None:
    add_field_flag(parser, "tp", PARALLEL_FIELDS["tp"], "world size")


def main(args) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.tp is not None and world % args.tp:
        raise ValueError(
            f"--tp {args.tp} does not divide the {world} ranks; use one of {divisors(world)}"
        )
    return demo(args.tp)


def demo(tp=None) -> int:
    """Run the demo under torchrun; returns the exit status (0: every check passed)."""
    torch.manual_seed(0)
    one_process_unless_launched("demo")
    state = tp_ext.init_parallel(tp=tp or int(os.environ.get("WORLD_SIZE", 1)))
    r, w = state.tp_rank, state.tp
    say = REPORT.info  # rank 0's (tp_ext.cli.logs)
    say(
        f"tp_ext demo: {dist.get_world_size()} ranks, backend {state.backend}, tp={w} "
        f"pp={state.pp} dp={state.dp}, torch {torch.__version__}"
    )

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
            check(
                "all_gather (uneven)", comm.all_gather(piece, 0, tp_ext.shard_sizes(tokens, w)), X
            )
            check("reduce_scatter (uneven)", comm.reduce_scatter(X, 0), piece * w)
            check("broadcast", comm.broadcast(X * r, src=w - 1), X * (w - 1))
            check(
                "all_to_all",
                comm.all_to_all(X, 0, 1),
                torch.cat([tp_ext.split_tensor(X, 0, w)[r]] * w, 1),
            )
        with comm.tag("tp_mlp"):
            # Megatron MLP, sequence parallel: gather_from_sp, column, row, reduce-scatter
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
    say(
        f"\n{'all checks passed' if all_ok else 'SOME CHECKS FAILED'} on {w} ranks "
        f"in {elapsed * 1e3:.1f} ms"
    )
    destroy_parallel(destroy_process_group=True)
    return 0 if all_ok else 1
