"""2D tensor parallelism (SUMMA) against 1D tensor parallelism at the same rank count, on CPU/gloo.

Part ``linear`` (benchmark ``summa_linear``): one ``Linear2D`` (hidden -> intermediate, T tokens)
forward + backward on each grid of 4 ranks (2x2, 1x4, 4x1): the payload bytes per rank that
``tp_ext.comm.track()`` records against the analytic SUMMA cost. Every panel of the input
features K is broadcast along the grid rows (x, T_i x |p|) and the grid columns (W, N_j x |p|);
backward broadcasts both again and reduces the two partial gradients, so a rank moves
``3 x (T_i [Q > 1] + N_j [P > 1]) x K`` elements.

Part ``model`` (benchmark ``summa_vs_1d``): a Qwen2 (hidden 512, 2 layers, vocab 4096, untied)
forward + backward of a batch of 8 x 128 tokens on 4 ranks, 1D ``tp=4`` against 2D ``tp=(2, 2)``
(and 1x4, 4x1): per rank, the payload bytes of every collective (``comm.track()``), the bytes on
the wire by the usual cost model (ring all-reduce 2 (R-1)/R n, reduce-scatter / all-gather
(R-1)/R n, a broadcast or reduce of n in a group of g: (g-1)/g n per rank on average), the
activation memory (bytes of the tensors autograd saves for backward in the forward, distinct
storages other than the parameters: what stays alive until backward), and the median step time.

Every rank runs one intra-op thread; 4 ranks share the machine's cores.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH_LINEAR = "summa_linear"
BENCH_MODEL = "summa_vs_1d"
MODEL = dict(
    vocab_size=4096,
    hidden_size=512,
    intermediate_size=1408,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
BATCH, SEQ = 8, 128
GRIDS = [(2, 2), (1, 4), (4, 1)]


def _linear_worker(rows: int, cols: int, tokens: int, k: int, n: int):
    import tp_ext
    from tp_ext.layers import Linear2D, split_2d

    state = tp_ext.init_parallel(tp=(rows, cols))
    grid = state.tp_grid
    torch.manual_seed(0)
    lin = Linear2D(k, n, False, grid)
    x = split_2d(torch.randn(tokens, k), grid).requires_grad_()
    with tp_ext.comm.track() as stats:
        lin(x).sum().backward()
    t_i, n_j = x.shape[0], lin.local_out_features
    analytic = 3 * (t_i * (cols > 1) + n_j * (rows > 1)) * k * 4
    return {"measured": stats.bytes(), "analytic": analytic}


def _saved_bytes(fn, params) -> int:
    """Bytes of the distinct storages autograd saves for backward while ``fn()`` runs, the
    parameters' own storages left out (they stay alive anyway; copies of them count)."""
    seen = {}
    skip = {p.untyped_storage().data_ptr() for p in params}

    def pack(t):
        if t.device.type != "meta" and t.untyped_storage().data_ptr() not in skip:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return sum(seen.values()), out


def _save_worker(path: str, model: dict) -> None:
    """One random Qwen2 written as a Hugging Face checkpoint: every layout loads these weights."""
    import tp_ext
    from tp_ext.models import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    state = tp_ext.init_parallel(tp=1)
    Qwen2ForCausalLM(Qwen2Config.from_dict(model), parallel=state).save_pretrained(path)


def _model_worker(layout, steps: int, path: str):
    import tp_ext
    from tp_ext.models import Qwen2ForCausalLM

    state = tp_ext.init_parallel(tp=layout)
    model = Qwen2ForCausalLM.from_pretrained(path, parallel=state, progress=False)
    config = model.config
    ids = torch.randint(
        0, config.vocab_size, (BATCH, SEQ), generator=torch.Generator().manual_seed(1)
    )
    grid = state.tp_grid

    def loss_of():
        logits = model(ids, local_logits=True)
        if grid is not None:
            return model.summed_loss(logits[:, :-1], ids[:, 1:])
        return tp_ext.layers.vocab_parallel_cross_entropy(
            logits[:, :-1], ids[:, 1:], reduction="sum"
        )

    # warm up, then the bytes and the saved activations of one step
    loss_of().backward()
    model.zero_grad(set_to_none=True)
    with tp_ext.comm.track() as stats:
        saved, loss = _saved_bytes(loss_of, model.parameters())
        loss.backward()
    model.zero_grad(set_to_none=True)
    # every recorded collective runs on a group of this size for the grids measured here (2x2:
    # rows and columns of 2; 1x4 and 4x1: groups of 4, groups of one never communicate)
    group = state.tp if grid is None else max(grid.rows, grid.cols)
    wire = stats.bus_bytes(group)
    times = []
    for _ in range(steps):
        torch.distributed.barrier()
        t0 = time.perf_counter()
        loss_of().backward()
        model.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    by_collective = {}
    for r in stats.records:
        by_collective[r.collective] = by_collective.get(r.collective, 0) + r.bytes
    return {
        "bytes": stats.bytes(),
        "wire": wire,
        "saved": saved,
        "step": statistics.median(times),
        "by_collective": by_collective,
        "params": sum(p.numel() for p in model.parameters()),
        "loss": loss.item(),
    }


# Qwen2-72B's decoder layer (hidden, intermediate, KV width) for the analytic comparison
QWEN_72B = dict(hidden=8192, intermediate=29568, kv=8 * 128)


def analytic_layer_wire(tokens: int, rows: int, cols: int) -> tuple[float, float]:
    """Elements a rank sends per decoder layer, forward + backward, by the cost model above:
    (2D on a rows x cols grid, 1D Megatron TP on rows * cols ranks). 2D: SUMMA per product
    group (q/k/v and gate/up share their input's broadcasts), 3 x (the row broadcast of x's
    panels + the column broadcast of W's); 1D: four all-reduces of [tokens, hidden]."""
    h, i, kv = QWEN_72B["hidden"], QWEN_72B["intermediate"], QWEN_72B["kv"]
    products = [(h, h + 2 * kv), (h, h), (h, 2 * i), (i, h)]  # (K, N): qkv, o, gate/up, down
    two_d = sum(
        3 * ((cols - 1) / cols * tokens / rows * k + (rows - 1) / rows * n / cols * k)
        for k, n in products
    )
    p = rows * cols
    one_d = 4 * 2 * (p - 1) / p * tokens * h
    return two_d, one_d


def analytic_rows() -> list[dict]:
    rows = []
    for tokens in (4096, 32768):
        for grid in ((2, 2), (2, 4), (4, 4), (8, 8)):
            two_d, one_d = analytic_layer_wire(tokens, *grid)
            print(f"analytic T={tokens} {grid}: 2D {two_d:.3g} vs 1D {one_d:.3g} elements/layer")
            rows.append(
                dict(
                    benchmark="summa_analytic",
                    case=f"qwen2-72b layer T{tokens} {grid[0]}x{grid[1]} vs tp{grid[0] * grid[1]}",
                    metric="wire elements per rank (analytic)",
                    value=two_d,
                    unit="elements",
                    baseline=one_d,
                )
            )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("linear", "model", "analytic", "all"), default="all")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small shapes, nothing recorded")
    args = parser.parse_args()
    if args.quick:
        MODEL.update(hidden_size=128, intermediate_size=256, vocab_size=512)
    rows = []
    if args.part in ("linear", "all"):
        tokens, k, n = BATCH * SEQ, MODEL["hidden_size"], MODEL["intermediate_size"]
        for grid in GRIDS:
            res = run_ranks(_linear_worker, grid[0] * grid[1], *grid, tokens, k, n)
            measured = max(r["measured"] for r in res)
            analytic = max(r["analytic"] for r in res)
            exact = all(r["measured"] == r["analytic"] for r in res)
            print(f"linear {grid}: measured {measured} B/rank, analytic {analytic}, exact={exact}")
            rows.append(
                dict(
                    benchmark=BENCH_LINEAR,
                    case=f"{grid[0]}x{grid[1]} T{tokens} {k}->{n}",
                    metric="bytes per rank (measured vs analytic)",
                    value=float(measured),
                    unit="B",
                    baseline=float(analytic),
                )
            )
    if args.part in ("analytic", "all"):
        rows += analytic_rows()
    if args.part in ("model", "all"):
        path = tempfile.mkdtemp(prefix="bench_summa_")
        run_ranks(_save_worker, 1, path, MODEL)
        base = run_ranks(_model_worker, 4, 4, args.steps, path)
        b = {k: max(r[k] for r in base) for k in ("bytes", "wire", "saved", "step")}
        print(f"1D tp=4: {b} {base[0]['by_collective']}")
        for grid in GRIDS:
            res = run_ranks(_model_worker, 4, grid, args.steps, path)
            m = {k: max(r[k] for r in res) for k in ("bytes", "wire", "saved", "step")}
            assert abs(res[0]["loss"] - base[0]["loss"]) <= 1e-4 * abs(base[0]["loss"]), (
                res[0]["loss"],
                base[0]["loss"],
            )
            print(f"2D {grid}: {m} {res[0]['by_collective']}")
            case = f"{grid[0]}x{grid[1]} vs tp4"
            for metric, key, unit in (
                ("payload bytes per rank", "bytes", "B"),
                ("wire bytes per rank", "wire", "B"),
                ("activation bytes per rank", "saved", "B"),
                ("step_s (fwd+bwd)", "step", "s"),
            ):
                rows.append(
                    dict(
                        benchmark=BENCH_MODEL,
                        case=case,
                        metric=metric,
                        value=float(m[key]),
                        unit=unit,
                        baseline=float(b[key]),
                    )
                )
        shutil.rmtree(path, ignore_errors=True)
    if not args.quick:
        append_rows(rows)


if __name__ == "__main__":
    main()
