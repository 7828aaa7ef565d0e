"""3D training (pipeline x tensor x data parallel) of a small Qwen2 on CPU/gloo: tp_ext's Trainer
against torch-native 3D built the torchtitan way, and the pipeline bubble of every schedule.

Part ``compare``: one optimizer step (1F1B over the same micro-batches, AdamW, clipping at 1.0)
at (tp, pp, dp) layouts within 4 ranks. tp_ext: ``Qwen2ForCausalLM(config, parallel=state)`` +
``tp_ext.training.Trainer``. Torch-native: transformers' ``Qwen2ForCausalLM`` holding the same
weights, cut into this rank's pipeline stage (embedding + its decoder layers + norm / LM head,
modules of the Hugging Face model itself), TP by ``parallelize_module`` (ColwiseParallel q/k/v
and gate/up, RowwiseParallel o/down; the embedding RowwiseParallel over the vocabulary, the LM
head ColwiseParallel with vocabulary-sharded logits and the loss under ``loss_parallel()``, as
torchtitan does without sequence parallelism), ``PipelineStage`` + ``Schedule1F1B``, then DDP or
FSDP2 (``fully_shard`` per decoder layer and per stage) on the DP dimension, and a grad norm over
TP (DTensor) x DP x PP as torchtitan's ``clip_grad_norm_``. Both run in the same processes on
the same ``init_parallel`` mesh, one step of each in turn; the first step's global loss must
agree within 1e-4 relative or the benchmark fails.

Part ``bubble``: tp_ext's Trainer at tp=1, dp=1, pp in {2, 4}, every schedule of
``tp_ext.pipeline.SCHEDULES``, m micro-batches. The bubble is
``1 - m * t_stage / t_schedule``: ``t_stage`` the forward+backward time of one micro-batch
through the stage(s) a rank holds, timed alone (no communication, all ranks timing at once, as
in the steady state), ``t_schedule`` the wall time of the schedule's forward+backward of the
step (``PipelineRunner.step``; optimizer excluded), both from the busiest rank (largest
``t_stage``). Theory: (p-1)/(m+p-1) for GPipe/1F1B, (p-1)/(v*m+p-1) for Interleaved1F1B;
zero-bubble schedules are compared with 1F1B by step time.

Every rank runs one intra-op thread; the machine's cores are shared by the ranks.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

import torch
import torch.nn.functional as F
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from benchmarks.common import append_rows, run_ranks  # noqa: E402

BENCH_COMPARE = "3d_vs_torch_native"
BENCH_BUBBLE = "pipeline_bubble"
MODEL = dict(  # a small Qwen2: a step is tens to hundreds of ms on one CPU thread per rank
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=704,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
SEQ = 128
LR, MAX_NORM = 1e-3, 1.0
LAYOUTS = [  # (tp, pp, dp, data_parallel)
    (2, 2, 1, "ddp"),
    (1, 2, 2, "ddp"),
    (1, 2, 2, "fsdp"),
]
BUBBLE_SCHEDULES = {  # name: (virtual_stages, stage_order)
    "GPipe": (1, "loop"),
    "1F1B": (1, "loop"),
    "Interleaved1F1B": (2, "loop"),
    "InterleavedZeroBubble": (2, "loop"),
    "ZBVZeroBubble": (2, "v"),
    "DualPipeV": (2, "v"),
}


def _configs():
    import transformers

    from tp_ext.models.qwen2.config import Qwen2Config

    hf = transformers.Qwen2Config(**MODEL)
    hf._attn_implementation = "sdpa"
    return Qwen2Config(**MODEL), hf


def _hf_model(hf_config):
    import transformers

    torch.manual_seed(0)  # the same weights on every rank
    return transformers.Qwen2ForCausalLM(hf_config).float()


def _micro_batches(n, batch, seed=5):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, MODEL["vocab_size"], (batch, SEQ), generator=g) for _ in range(n)]


def _optimizer(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


# --------------------------------------------------------------------------- torch-native 3D


class NativeStage(nn.Module):
    """One pipeline stage of transformers' Qwen2ForCausalLM: its own modules (the embedding on
    the first stage, some decoder layers, the final norm and LM head on the last), as
    torchtitan's stages are the model with the other stages' modules removed."""

    def __init__(self, hf, layer_ids, first, last):
        super().__init__()
        self.embed_tokens = hf.model.embed_tokens if first else None
        self.layers = nn.ModuleDict({str(i): hf.model.layers[i] for i in layer_ids})
        self.rotary_emb = hf.model.rotary_emb
        self.norm = hf.model.norm if last else None
        self.lm_head = hf.lm_head if last else None

    def forward(self, x):
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.size(1), device=h.device)[None]
        rope = self.rotary_emb(h, positions)
        for layer in self.layers.values():
            # no mask: transformers' SDPA path runs causal attention (is_causal)
            h = layer(h, attention_mask=None, position_ids=positions, position_embeddings=rope)
        if self.lm_head is not None:
            h = self.lm_head(self.norm(h))
        return h


class NativeTrainer:
    """torch-native 3D training step of ``hf`` on ``state``'s mesh (torchtitan's recipe)."""

    def __init__(self, hf, state, layer_ids, data_parallel, n_micro, batch):
        from torch.distributed import pipelining as tpp
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        self.state = state
        pp, pp_rank = state.pp, state.pp_rank
        self.first, self.last = pp_rank == 0, pp_rank == pp - 1
        module = NativeStage(hf, layer_ids, self.first, self.last)
        self.loss_parallel = state.tp > 1
        if state.tp > 1:
            tp_mesh = state.mesh["tp"]
            plan = {}
            if self.first:
                plan["embed_tokens"] = RowwiseParallel(input_layouts=Replicate())
            if self.last:
                plan["lm_head"] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
            for i in layer_ids:
                for name in ("q_proj", "k_proj", "v_proj"):
                    plan[f"layers.{i}.self_attn.{name}"] = ColwiseParallel()
                plan[f"layers.{i}.self_attn.o_proj"] = RowwiseParallel()
                plan[f"layers.{i}.mlp.gate_proj"] = ColwiseParallel()
                plan[f"layers.{i}.mlp.up_proj"] = ColwiseParallel()
                plan[f"layers.{i}.mlp.down_proj"] = RowwiseParallel()
            parallelize_module(module, tp_mesh, plan)
        self.params = [p for p in module.parameters() if p.requires_grad]
        if state.dp > 1 and data_parallel == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            module = DistributedDataParallel(
                module, process_group=state.dp_group, broadcast_buffers=False
            )
        elif state.dp > 1:
            from torch.distributed.fsdp import fully_shard

            dp_mesh = state.mesh["dp"]
            for layer in module.layers.values():
                fully_shard(layer, mesh=dp_mesh)
            fully_shard(module, mesh=dp_mesh)
            self.params = [p for p in module.parameters() if p.requires_grad]
        self.module = module
        hidden, vocab = MODEL["hidden_size"], MODEL["vocab_size"]
        shape = (batch, SEQ)
        x = (
            torch.empty(shape, dtype=torch.long, device="meta")
            if self.first
            else torch.empty(*shape, hidden, device="meta", requires_grad=True)
        )
        out_size = (vocab // state.tp if self.loss_parallel else vocab) if self.last else hidden
        y = torch.empty(*shape, out_size, device="meta", requires_grad=True)
        stage = tpp.PipelineStage(
            module,
            pp_rank,
            pp,
            torch.device("cpu"),
            input_args=x,
            output_args=y,
            group=state.pp_group,
        )
        self.box = {}
        self.schedule = tpp.Schedule1F1B(
            stage, n_micro, loss_fn=lambda out, tgt: self.box["fn"](out, tgt), scale_grads=False
        )
        self.optimizer = _optimizer(self.params)

    def _loss_context(self):
        import contextlib

        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def step(self, micro_batches):
        import torch.distributed as dist

        state = self.state
        self.optimizer.zero_grad(set_to_none=True)
        ids = torch.cat(micro_batches)
        count = torch.tensor(float(ids[:, 1:].numel()))
        if state.dp > 1:
            dist.all_reduce(count, group=state.dp_group)
        denominator = count / state.dp  # DDP / FSDP2 average over DP
        sums = []

        def loss_fn(logits, target):
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), reduction="sum"
            )
            sums.append(loss.detach())
            return loss / denominator

        self.box["fn"] = loss_fn
        with self._loss_context():
            if self.first:
                self.schedule.step(ids, target=ids if self.last else None)
            else:
                self.schedule.step(target=ids if self.last else None)
        mine = torch.zeros(())
        if sums and state.tp_rank == 0:
            mine = torch.stack([_local(s) for s in sums]).sum()
        dist.all_reduce(mine)  # the global loss, on every rank
        self._clip()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return (mine / count).item()

    def _clip(self):
        """Clip to MAX_NORM by the global L2 norm of every gradient: DTensor gradients (TP,
        FSDP2) per mesh and placement, reduced by DTensor; plain ones (replicated) counted once;
        then summed over the pipeline stages (torchtitan's clip_grad_norm_ with a pp mesh)."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        groups = defaultdict(list)
        for p in self.params:
            g = p.grad
            if g is not None:
                key = (id(g.device_mesh), tuple(g.placements)) if isinstance(g, DTensor) else None
                groups[key].append(p)
        total = torch.zeros(())
        for params in groups.values():
            n = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
            if isinstance(n, DTensor):
                n = n.full_tensor()
            total = total + n.float() ** 2
        if self.state.pp > 1:
            dist.all_reduce(total, group=self.state.pp_group)
        norm = total.sqrt()
        for params in groups.values():
            torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, norm)
        return norm


def _local(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


# --------------------------------------------------------------------------- part 1: compare


def _tp_ext_model(state, cfg, hf, virtual_stages=1, order="loop"):
    from tp_ext.models import Qwen2ForCausalLM, hf_to_tp_ext_names

    model = Qwen2ForCausalLM(cfg, parallel=state, virtual_stages=virtual_stages, stage_order=order)
    sd = {k: v.clone() for k, v in hf.state_dict().items()}
    model.load_full_state_dict(hf_to_tp_ext_names(sd, cfg), strict=False)
    return model


def _compare_worker(tp, pp, dp, data_parallel, n_micro, batch, warmup, steps):
    import torch.distributed as dist

    import tp_ext
    from tp_ext.training import Trainer

    torch.set_num_threads(1)
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp)
    cfg, hf_cfg = _configs()
    hf = _hf_model(hf_cfg)
    model = _tp_ext_model(state, cfg, hf)
    layer_ids = list(model.stage_split.layers_of(model.stage_ids[0]))
    ours = Trainer(
        model,
        optimizer=_optimizer,
        parallel=state,
        schedule="1F1B",
        max_grad_norm=MAX_NORM,
        data_parallel=data_parallel,
    )
    native = NativeTrainer(hf, state, layer_ids, data_parallel, n_micro, batch)
    everyone = _micro_batches(n_micro * dp, batch)
    mine = everyone[state.dp_rank * n_micro : (state.dp_rank + 1) * n_micro]
    losses = {"tp_ext": [], "native": []}
    times = {"tp_ext": [], "native": []}
    for i in range(warmup + steps):
        for name, run in (("tp_ext", ours.step), ("native", native.step)):
            dist.barrier()
            t0 = time.perf_counter()
            losses[name].append(run(mine))
            times[name].append(time.perf_counter() - t0)
    return {
        "losses": losses,
        "tp_ext": statistics.median(times["tp_ext"][warmup:]),
        "native": statistics.median(times["native"][warmup:]),
    }


def run_compare(a, rows):
    for tp, pp, dp, kind in LAYOUTS:
        world = tp * pp * dp
        case = (
            f"tp={tp} pp={pp} dp={dp}{' ' + kind if dp > 1 else ''} 1F1B "
            f"m={a.micro} mb={a.batch}x{SEQ}"
        )
        res = run_ranks(
            _compare_worker, world, tp, pp, dp, kind, a.micro, a.batch, a.warmup, a.steps
        )
        first_ours, first_native = res[0]["losses"]["tp_ext"][0], res[0]["losses"]["native"][0]
        rel = abs(first_ours - first_native) / abs(first_native)
        last_rel = abs(res[0]["losses"]["tp_ext"][-1] - res[0]["losses"]["native"][-1]) / abs(
            res[0]["losses"]["native"][-1]
        )
        # the step ends when its slowest rank ends
        t_ours = max(r["tp_ext"] for r in res)
        t_native = max(r["native"] for r in res)
        print(
            f"{case}: tp_ext {t_ours * 1e3:.1f} ms, torch-native {t_native * 1e3:.1f} ms, "
            f"ratio {t_ours / t_native:.3f}; first-step loss {first_ours:.6f} vs "
            f"{first_native:.6f} (rel {rel:.2e}), last-step rel diff {last_rel:.2e}",
            flush=True,
        )
        rows += [
            dict(
                benchmark=BENCH_COMPARE,
                case=case,
                metric="step time",
                value=t_ours * 1e3,
                unit="ms",
                baseline=t_native * 1e3,
            ),
            dict(
                benchmark=BENCH_COMPARE,
                case=case,
                metric="first-step loss rel diff",
                value=rel,
                unit="",
            ),
            dict(
                benchmark=BENCH_COMPARE,
                case=case,
                metric=f"step-{a.warmup + a.steps} loss rel diff",
                value=last_rel,
                unit="",
            ),
        ]
        if not rel <= 1e-4:
            raise SystemExit(
                f"{case}: first-step losses differ: tp_ext {first_ours} vs torch-native "
                f"{first_native} (relative {rel:.3e} > 1e-4)"
            )


# --------------------------------------------------------------------------- part 2: bubble


def _stage_time(model, trainer, batch, repeats):
    """Forward+backward of one micro-batch through every stage this rank holds, alone (no
    communication): the ids / a hidden-state input, the loss or a fixed output gradient."""
    from tp_ext.layers import vocab_parallel_cross_entropy

    stages = model.stage_modules()
    ids = _micro_batches(1, batch, seed=11)[0]
    hidden = torch.randn(batch, SEQ, MODEL["hidden_size"])

    def once():
        for stage, module in zip(model.stage_ids, stages):
            x = ids if stage == 0 else hidden.clone().requires_grad_()
            out = module(x)
            if stage == model.stage_split.last_stage:
                loss = vocab_parallel_cross_entropy(
                    out[:, :-1], ids[:, 1:], tp_group=trainer.tp, reduction="sum"
                )
                loss.backward()
            else:
                out.backward(torch.ones_like(out))
        model.zero_grad(set_to_none=True)

    once()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        once()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _bubble_worker(pp, schedules, micros, batch, warmup, steps):
    import torch.distributed as dist

    import tp_ext
    from tp_ext.training import Trainer

    torch.set_num_threads(1)
    state = tp_ext.init_parallel(tp=1, pp=pp, dp=1)
    cfg, hf_cfg = _configs()
    hf = _hf_model(hf_cfg)
    out = {}
    for name in schedules:
        v, order = BUBBLE_SCHEDULES[name]
        model = _tp_ext_model(state, cfg, hf, v, order)
        trainer = Trainer(
            model,
            optimizer=_optimizer,
            parallel=state,
            schedule=name,
            max_grad_norm=MAX_NORM,
            data_parallel=None,
        )
        dist.barrier()
        t_stage = _stage_time(model, trainer, batch, repeats=steps + 2)
        runner_step = trainer.runner.step
        box = {}

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            runner_step(*args, **kwargs)
            box["t"] = time.perf_counter() - t0

        trainer.runner.step = timed
        for m in micros:
            mbs = _micro_batches(m, batch)
            try:
                from tp_ext.pipeline.schedules import check_micro_batches

                check_micro_batches(trainer.runner.schedule, model.stage_split, m)
            except ValueError as e:
                out[(name, m)] = {"skip": str(e)}
                continue
            t_sched, t_step = [], []
            for i in range(warmup + steps):
                dist.barrier()
                t0 = time.perf_counter()
                trainer.step(mbs)
                if i >= warmup:
                    t_step.append(time.perf_counter() - t0)
                    t_sched.append(box["t"])
            out[(name, m)] = {
                "stage": t_stage,
                "schedule": statistics.median(t_sched),
                "step": statistics.median(t_step),
                "v": v,
            }
    return out


def _theory(name, p, v, m):
    if name in ("GPipe", "1F1B"):
        return (p - 1) / (m + p - 1)
    if name == "Interleaved1F1B":
        return (p - 1) / (v * m + p - 1)
    return None


def run_bubble(a, rows):
    for pp in a.pp:
        res = run_ranks(_bubble_worker, pp, pp, a.schedules, a.micros, a.bubble_batch, 1, a.steps)
        base = {}
        for name in a.schedules:
            for m in a.micros:
                per_rank = [r[(name, m)] for r in res]
                case = f"pp={pp} {name} m={m} mb={a.bubble_batch}x{SEQ}"
                if "skip" in per_rank[0]:
                    print(f"{case}: skipped ({per_rank[0]['skip']})", flush=True)
                    continue
                busiest = max(per_rank, key=lambda r: r["stage"])
                v = busiest["v"]
                t_sched = max(r["schedule"] for r in per_rank)
                t_step = max(r["step"] for r in per_rank)
                ideal = m * busiest["stage"]
                bubble = 1 - ideal / t_sched
                theory = _theory(name, pp, v, m)
                if name == "1F1B":
                    base[m] = t_step
                print(
                    f"{case}: stage fwd+bwd {busiest['stage'] * 1e3:.1f} ms x {m} = "
                    f"{ideal * 1e3:.0f} ms, schedule {t_sched * 1e3:.0f} ms, step "
                    f"{t_step * 1e3:.0f} ms, bubble {bubble:.3f}"
                    + (f" (theory {theory:.3f})" if theory is not None else ""),
                    flush=True,
                )
                rows.append(
                    dict(
                        benchmark=BENCH_BUBBLE,
                        case=case,
                        metric="bubble fraction",
                        value=bubble,
                        unit="",
                        baseline=theory if theory is not None else "",
                    )
                )
                rows.append(
                    dict(
                        benchmark=BENCH_BUBBLE,
                        case=case,
                        metric="schedule time",
                        value=t_sched * 1e3,
                        unit="ms",
                        baseline=ideal * 1e3,
                    )
                )
                if m in base:
                    rows.append(
                        dict(
                            benchmark=BENCH_BUBBLE,
                            case=case,
                            metric="step time vs 1F1B",
                            value=t_step * 1e3,
                            unit="ms",
                            baseline=base[m] * 1e3,
                        )
                    )


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--parts", nargs="+", default=["compare", "bubble"])
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step (compare)")
    p.add_argument("--batch", type=int, default=2, help="rows per micro-batch (compare)")
    p.add_argument("--bubble-batch", type=int, default=1, help="rows per micro-batch (bubble)")
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--micros", type=int, nargs="+", default=[4, 8])
    p.add_argument(
        "--schedules", nargs="+", default=list(BUBBLE_SCHEDULES), choices=list(BUBBLE_SCHEDULES)
    )
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--no-save", action="store_true")
    a = p.parse_args()
    from tp_ext.pipeline.schedules import SCHEDULES, weight_split_supported

    refused = [s for s in a.schedules if SCHEDULES[s].weight_split and not weight_split_supported()]
    if refused:  # tp_ext refuses them on this torch (wrong weight gradients there)
        print(f"skipping {refused}: zero-bubble, refused on torch {torch.__version__} (< 2.13)")
        a.schedules = [s for s in a.schedules if s not in refused]
    if "1F1B" in a.schedules:  # the reference of the zero-bubble gains: measured first
        a.schedules = ["1F1B"] + [s for s in a.schedules if s != "1F1B"]
    rows = []
    try:
        if "compare" in a.parts:
            run_compare(a, rows)
        if "bubble" in a.parts:
            run_bubble(a, rows)
    finally:
        if rows and not a.no_save:
            append_rows(rows)


if __name__ == "__main__":
    main()
