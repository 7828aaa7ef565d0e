"""What ``tp-ext run`` checks, one stage a method (:class:`SelfCheck`; the numbered stages of
:mod:`tp_ext.cli.run`'s docstring), on tp_ext's own Qwen2; :mod:`tp_ext.cli.run_hf` subclasses it
for a transformers model. Every check is agreed across ranks; rank 0 reports
(tp_ext.cli.logs.REPORT)."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_ext import checkpoint
from tp_ext.checkpoint import peak_rss_bytes
from tp_ext.cli.logs import REPORT
from tp_ext.config import JobConfig
from tp_ext.debug import trace
from tp_ext.dims import ParallelDims
from tp_ext.distributed import ResolvedGroup, comm
from tp_ext.layers import vocab_parallel_cross_entropy
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
from tp_ext.models.footprint import footprint, format_footprint
from tp_ext.training import Trainer, build_optimizer

__all__ = ["RunInputs", "SelfCheck", "toy_data", "whole_state_dict", "PROMPT"]


def _memory(device: torch.device) -> dict:
    out = {"peak_rss_mib": peak_rss_bytes() / 2**20}
    if device.type == "cuda":
        out["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    return out


def _gather_rows(values: list[float], device) -> list[list[float]]:
    """Every rank's ``values`` (same length everywhere), on every rank."""
    mine = torch.tensor([values], dtype=torch.float64, device=device)
    return comm.all_gather(mine, 0, group=dist.group.WORLD).tolist()


def toy_data(config, batch: int, seq: int, seed: int) -> torch.Tensor:
    """A learnable toy language: each sequence counts up from a random start by a random stride
    (mod the vocabulary), so next-token loss can fall within a few steps."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, config.vocab_size, (batch, 1), generator=g)
    stride = torch.randint(1, 4, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq)) % config.vocab_size


PROMPT = 8  # prompt tokens of the generation step
_SEQ = 32  # tokens per training sequence
_ROWS = 4  # sequences per micro-batch


@dataclasses.dataclass
class RunInputs:
    config_path: str
    job: JobConfig
    small_job: JobConfig
    small: Qwen2Config
    dtype: torch.dtype  # of the small model: --dtype, else float32 (parity exact to 1e-4)
    dims: ParallelDims  # resolved: every degree filled
    steps: int
    max_new_tokens: int
    max_grad_norm: float
    profile_dir: str | None = None  # a torch.profiler trace of the training steps goes here


def _stages_text(model) -> str:
    """Which pipeline rank holds which stages, layers, embedding and head."""
    split = model.stage_split
    parts = []
    for rank in range(split.pp):
        held = []
        for stage in split.stages_of(rank):
            layers = split.layers_of(stage)
            text = f"stage {stage} (layers {layers[0]}-{layers[-1]}"
            text += ", embedding" if stage == 0 else ""
            text += ", norm + lm_head" if stage == split.last_stage else ""
            held.append(text + ")")
        parts.append(f"pp rank {rank}: " + ", ".join(held))
    return "; ".join(parts)


def _reference_training(hf_dir, device, small_job, max_grad_norm, chunks, steps):
    """The single-process model from the same files, trained on every replica's micro-batches
    in one step each: what the TP x PP x DP job must equal."""
    reference = Qwen2ForCausalLM.from_pretrained(
        hf_dir, tp_group=ResolvedGroup.local(), device=device, progress=False
    )
    trainer = Trainer(
        reference, build_optimizer(reference, small_job.optimizer), max_grad_norm=max_grad_norm
    )
    return reference, [trainer.step(chunks) for _ in range(steps)]


def whole_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with FSDP2's DP-sharded tensors (DTensors) gathered whole (an
    all-gather over DP, in the same order on every rank)."""
    from torch.distributed.tensor import DTensor

    return {
        k: v.full_tensor() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()
    }


class SelfCheck:
    """The stages of the job (1-6 in the module's docstring), one method each, and the checks
    they record. Every rank runs every stage; rank 0 reports (tp_ext.cli.logs.REPORT)."""

    def __init__(self, state, inputs: RunInputs, workdir: str, keep: bool, world: int) -> None:
        self.state, self.inputs, self.workdir, self.keep, self.world = (
            state,
            inputs,
            workdir,
            keep,
            world,
        )
        self.device = state.device
        self.is_main = state.rank == 0
        self.checks: list[tuple[str, bool]] = []
        dtype = inputs.dtype
        self.tolerance = 1e-4 if dtype in (torch.float32, torch.float64) else 3e-2
        # After AdamW steps: AdamW divides each gradient entry by its own running scale, so the
        # rounding of a sharded sum (other order than the single process's) in the smallest
        # entries moves those weights by up to lr; at transformers' initial scale (std 0.02)
        # that reached 1.3e-4 of the logits after 3 steps at pp=2 x tp=2.
        self.trained_tolerance = 10 * self.tolerance
        self.autocast = None
        if dtype == torch.float16:
            # float16 training is mixed precision: float32 parameters (AdamW's eps of 1e-8 is 0
            # in float16, so its first step would turn float16 weights into NaN) under float16
            # autocast with the Trainer's dynamic loss scale
            self.autocast, dtype = torch.float16, torch.float32
        self.dtype = dtype
        self.build = {
            "parallel": state,
            "virtual_stages": inputs.dims.virtual_stages,
            "stage_order": inputs.job.parallel.stage_order,
        }

    # -- what differs between model families (tp_ext.cli.run_hf overrides these) ---------------

    def logits(self, model, ids: torch.Tensor) -> torch.Tensor:
        return model(ids)

    def greedy(self, model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
        """Greedy generation with the KV cache (the job's model or the reference)."""
        return model.generate(prompt, new_tokens)

    def reference_training(self, hf_dir: str, chunks: list) -> tuple:
        """(the single-process model from ``hf_dir``, its losses) trained on every replica's
        micro-batches ``chunks``, one step each: what the TP x PP x DP job must equal."""
        inputs = self.inputs
        return _reference_training(
            hf_dir, self.device, inputs.small_job, inputs.max_grad_norm, chunks, inputs.steps
        )

    load_note = (
        "the load adds the shard plus at most one 16 MiB read piece, see docs/checkpoints.md"
    )

    def generation_kind(self) -> str:
        return "with the KV cache"

    def load_export(self, path: str):
        """The merged export at ``path``, loaded whole in this process."""
        return Qwen2ForCausalLM.from_pretrained(
            path, tp_group=ResolvedGroup.local(), device=self.device, progress=False
        )

    export_check = "the merged Hugging Face export holds the trained model"

    def check_export(self, export: str, ids, trained, scale) -> None:
        """[5] The export's logits (rank 0 loads it) against the trained model's."""

        def read_export() -> float:
            if not self.is_main:
                return 0.0
            with torch.no_grad():
                return (self.logits(self.load_export(export), ids) - trained).abs().max().item()

        diff = comm.everywhere(dist.group.WORLD, f"reading the export {export}", read_export)
        if self.is_main:
            self.check(
                self.export_check,
                diff <= self.tolerance * scale,
                f"max |diff| {diff:.2e} of its logits",
            )

    def compare_logits(self, model, reference, ids, reference_name: str) -> torch.Tensor:
        """Check ``model``'s logits of ``ids`` against ``reference``'s (relative to their
        scale); returns the reference's."""
        with torch.no_grad():
            logits, expected = self.logits(model, ids), self.logits(reference, ids)
        scale = expected.abs().max().item()
        diff = (logits - expected).abs().max().item()
        self.check(
            f"logits equal {reference_name}",
            diff <= self.tolerance * scale,
            f"max |diff| {diff:.2e} (logit scale {scale:.2f})",
        )
        return expected

    def trainer_for(self, model, autocast_dtype=None) -> Trainer:
        """The Trainer the job's config describes for ``model``: the small model's optimizer
        settings, the job's parallel ones."""
        inputs = self.inputs
        job = dataclasses.replace(inputs.small_job, parallel=inputs.job.parallel)
        return Trainer.from_config(
            job,
            model,
            self.state,
            max_grad_norm=inputs.max_grad_norm,
            autocast_dtype=autocast_dtype,
        )

    def check(self, name: str, ok: bool, detail: str = "") -> None:
        self.checks.append((name, bool(ok)))
        REPORT.info(f"  {'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}")

    def show_footprint(self) -> None:
        """[1] The full-size config's footprint at this TP degree, on the meta device."""
        state, full = self.state, self.inputs.job.model
        REPORT.info(
            f"tp-ext run: {self.world} ranks (tp={state.tp}, pp={state.pp}, dp={state.dp}), "
            f"backend {state.backend}, torch {torch.__version__}, device {self.device}"
        )
        REPORT.info(f"  {self.inputs.job.parallel.describe(self.inputs.dims)}")
        REPORT.info(
            f"\n[1] footprint of {os.path.basename(self.inputs.config_path)} "
            f"({full.architecture}) at TP={state.tp}, on the meta device"
            + (
                f" (pipelining splits its layers further over pp={state.pp})"
                if state.pp > 1
                else ""
            )
            + ":"
        )
        if REPORT.isEnabledFor(logging.INFO):  # rank 0: 9 full-size models built on meta
            REPORT.info(format_footprint(footprint(full, state.tp, self.inputs.job.parallel.dtype)))

    def write_small_checkpoint(self) -> str:
        """[2] A small random checkpoint of the same family in Hugging Face format (rank 0)."""
        small, hf_dir = self.inputs.small, os.path.join(self.workdir, "hf")
        torch.manual_seed(self.inputs.small_job.parallel.seed)
        if self.is_main:
            source = Qwen2ForCausalLM(small, tp_group=ResolvedGroup.local(), dtype=self.dtype)
            source.save_pretrained(hf_dir, max_shard_bytes=200_000)
            del source
        comm.barrier(dist.group.WORLD)
        files = sorted(os.listdir(hf_dir))
        REPORT.info(
            f"\n[2] small {small.architecture} model (vocab {small.vocab_size}, hidden "
            f"{small.hidden_size}, {small.num_attention_heads} heads / "
            f"{small.num_key_value_heads} KV heads, {small.num_hidden_layers} layers, "
            f"{self.dtype}) written to {hf_dir}: "
            f"{len([f for f in files if f.endswith('.safetensors')])} safetensors files + index"
        )
        return hf_dir

    def load_and_compare(self, hf_dir: str):
        """[3] Sharded load; logits, loss and greedy tokens against the single-process model.
        Returns the model and the input ids the later stages compare on."""
        state, small, device = self.state, self.inputs.small, self.device
        t0 = time.perf_counter()
        model = Qwen2ForCausalLM.from_pretrained(hf_dir, device=device, **self.build)
        load_s = time.perf_counter() - t0
        report = self.load_report = model.load_report
        reference = Qwen2ForCausalLM.from_pretrained(
            hf_dir, tp_group=ResolvedGroup.local(), device=device, progress=False
        )
        REPORT.info(
            f"\n[3] loaded across {state.tp * state.pp} ranks per replica in {load_s:.2f} s; "
            f"rank 0 read {report['read_bytes']:,} of {report['checkpoint_bytes']:,} bytes (its "
            f"shard: {report['shard_bytes']:,})"
        )
        if state.pp > 1:
            REPORT.info(f"    {_stages_text(model)}")
        ids = toy_data(small, 4, 24, seed=self.inputs.small_job.parallel.seed + 1).to(device)
        expected = self.compare_logits(model, reference, ids, "the single-process model")
        with torch.no_grad():
            loss_tp = vocab_parallel_cross_entropy(
                model(ids[:, :-1], local_logits=True), ids[:, 1:], tp_group=state.tp_group
            )
            loss_ref = F.cross_entropy(
                expected[:, :-1].reshape(-1, small.vocab_size).float(), ids[:, 1:].reshape(-1)
            )
        self.check(
            "vocab-parallel loss equals F.cross_entropy",
            abs(loss_tp.item() - loss_ref.item()) <= self.tolerance * max(1.0, loss_ref.item()),
            f"{loss_tp.item():.6f} vs {loss_ref.item():.6f}",
        )
        prompt = ids[:, :6]
        same = torch.equal(model.generate(prompt, 8), reference.generate(prompt, 8))
        self.check("greedy tokens equal the single-process model", same)
        return model, ids

    def train(self, model):
        """[4] The training steps through the pipeline schedule, DDP or FSDP2, with clipping:
        the loss is the same on every rank and goes down. Returns the trainer, the losses, the
        whole batch (every replica's) and the training throughput."""
        state, inputs, settings = self.state, self.inputs, self.inputs.job.parallel
        small_job, micro_batches = inputs.small_job, settings.pipeline_micro_batches
        trainer = self.trainer_for(model, autocast_dtype=self.autocast)
        seed = small_job.parallel.seed + 2
        batch = toy_data(inputs.small, _ROWS * micro_batches * state.dp, _SEQ, seed=seed)
        mine = batch.chunk(state.dp)[state.dp_rank].to(self.device)  # this replica's own data
        chunks = list(mine.chunk(micro_batches))
        losses = []
        tracing = trace(inputs.profile_dir) if inputs.profile_dir else contextlib.nullcontext()
        t0 = time.perf_counter()
        with tracing:
            for _ in range(inputs.steps):
                losses.append(trainer.step(chunks))
        tokens_per_s = batch.numel() * inputs.steps / (time.perf_counter() - t0)
        if inputs.profile_dir:
            REPORT.info(
                f"\n    profiler trace of the training steps: {inputs.profile_dir}/"
                "trace_rank<r>.json"
            )
        REPORT.info(
            f"\n[4] {inputs.steps} training steps (AdamW lr {small_job.optimizer.lr:g}, schedule "
            f"{settings.schedule}, {micro_batches} micro-batches of {_ROWS} x {_SEQ} tokens per "
            f"replica per step, {state.dp} replica{'s' * (state.dp > 1)}, clip "
            f"{inputs.max_grad_norm}): loss " + " -> ".join(f"{x:.3f}" for x in losses)
        )
        every_rank = _gather_rows(losses, self.device)
        self.check(
            "training loss is the same on every rank",
            all(row == every_rank[0] for row in every_rank),
            f"{len(every_rank)} ranks",
        )
        self.check(
            "training loss goes down at every step",
            all(b < a for a, b in zip(losses, losses[1:])),
            f"{losses[0]:.3f} -> {losses[-1]:.3f}",
        )
        return trainer, losses, batch, tokens_per_s

    def compare_training(self, hf_dir, trainer, model, losses, batch, ids):
        """[4] The losses and the trained logits against the single-process model trained on
        every replica's micro-batches (on rank 0; an error there is raised on every rank).
        Returns that reference (None off rank 0), the trained logits and their scale."""
        inputs, device, is_main = self.inputs, self.device, self.is_main
        micro_batches = inputs.job.parallel.pipeline_micro_batches
        all_chunks = list(batch.to(device).chunk(micro_batches * self.state.dp))
        reference, expected_losses = comm.everywhere(
            dist.group.WORLD,
            "training the single-process reference",
            lambda: self.reference_training(hf_dir, all_chunks) if is_main else (None, None),
        )
        if is_main:
            worst = max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(losses, expected_losses))
            self.check(
                "training losses equal the single-process model trained on every replica's data",
                worst <= self.tolerance,
                f"max relative diff {worst:.1e}",
            )
        # Inference reads whole parameters (gathered under FSDP2).
        with trainer.whole_parameters():
            with torch.no_grad():
                trained = self.logits(model, ids)
                expected = self.logits(reference, ids) if is_main else torch.empty_like(trained)
            expected = comm.broadcast(expected.contiguous(), 0, group=dist.group.WORLD)
            scale = expected.abs().max().item()
            diff = comm.all_reduce(
                (trained - expected).abs().max().reshape(1), "max", group=dist.group.WORLD
            ).item()
            self.check(
                "after training, every replica's logits equal the single-process model's",
                diff <= self.trained_tolerance * scale,
                f"max |diff| {diff:.2e} over {self.world} ranks",
            )
        return reference, trained, scale

    def save_and_reload(self, trainer, model, ids, trained, scale) -> None:
        """[5] A sharded (DCP) save and bitwise reload, and a merged Hugging Face export that
        holds the trained model."""
        small, device, steps = self.inputs.small, self.device, self.inputs.steps
        sharded = os.path.join(self.workdir, "sharded")
        whole_state = whole_state_dict(model)
        saved = model
        if trainer.data_parallel == "fsdp":
            # FSDP2's parameters are DP-sharded DTensors, which the checkpoint code (TP slices
            # of plain tensors) does not read: the checkpoints are written from a plain copy.
            saved = Qwen2ForCausalLM(small, device=device, dtype=self.dtype, **self.build)
            saved.load_state_dict(whole_state)
        checkpoint.save_sharded(saved, sharded, step=steps)
        fresh = Qwen2ForCausalLM(small, device=device, dtype=self.dtype, **self.build)
        info = checkpoint.load_sharded(fresh, sharded)
        bitwise = all(
            torch.equal(a, b) for a, b in zip(whole_state.values(), fresh.state_dict().values())
        )
        self.check("sharded DCP checkpoint reloads bitwise", bitwise and info["step"] == steps)
        del fresh
        export = os.path.join(self.workdir, "export")
        saved.save_pretrained(export)  # one merged export of every stage and TP slice

        self.check_export(export, ids, trained, scale)
        del saved
        REPORT.info(
            f"\n[5] saved {sharded} (DCP, one file per rank)"
            + f" and a merged Hugging Face export in {export}"
            + ("" if self.keep else " (temporary; --workdir keeps them)")
        )

    def generate(self, trainer, model, reference, ids) -> tuple[int, float]:
        """[6] Greedy generation with the KV cache, its tokens against the single-process
        model's. Returns the tokens generated and the seconds it took."""
        max_new_tokens, device = self.inputs.max_new_tokens, self.device
        with trainer.whole_parameters():
            prompt = ids[:, :PROMPT]
            t0 = time.perf_counter()
            tokens = self.greedy(model, prompt, max_new_tokens)
            gen_s = time.perf_counter() - t0
            self.check(
                "generation produced every token",
                tokens.shape == (prompt.size(0), PROMPT + max_new_tokens),
            )
            # After training in 16 bits the two models' logits differ by rounding (checked
            # above within its tolerance), enough to flip a near tie: tokens are compared at
            # 32 and 64.
            if self.dtype in (torch.float32, torch.float64):
                wanted = (
                    self.greedy(reference, prompt, max_new_tokens)
                    if self.is_main
                    else torch.empty_like(tokens)
                )
                wanted = comm.broadcast(wanted, 0, group=dist.group.WORLD)
                agree = comm.all_reduce(
                    torch.tensor([float(torch.equal(tokens, wanted))], device=device),
                    "min",
                    group=dist.group.WORLD,
                ).item()
                self.check(
                    "after training, greedy tokens equal the single-process model's",
                    agree == 1.0,
                )
        REPORT.info(
            f"\n[6] generated {max_new_tokens} tokens x {prompt.size(0)} sequences "
            f"{self.generation_kind()}; first sequence: {tokens[0, PROMPT:].tolist()}"
        )
        return tokens.numel() - prompt.numel(), gen_s

    def throughput_and_memory(self, model, tokens_per_s, generated, gen_s) -> None:
        """[6] Tokens per second, and every rank's memory (a table on rank 0)."""
        state, device, report = self.state, self.device, self.load_report
        memory = _memory(device)
        rows = _gather_rows(
            [
                memory["peak_rss_mib"],
                memory.get("peak_gpu_mib", 0.0),
                report["shard_bytes"] / 2**20,
                report["peak_rss_increase_bytes"] / 2**20,
            ],
            device,
        )
        max_new_tokens = self.inputs.max_new_tokens
        REPORT.info(
            f"    training {tokens_per_s:,.0f} tokens/s; generation "
            f"{generated / gen_s:,.1f} tokens/s ({gen_s / max_new_tokens * 1e3:.1f} ms per step)"
        )
        gpu = device.type == "cuda"
        REPORT.info(
            "    rank  tp pp dp  peak host MiB"
            + ("  peak GPU MiB" if gpu else "")
            + "  shard MiB  host MiB added while loading"
        )
        coords = _gather_rows([state.tp_rank, state.pp_rank, state.dp_rank], device)
        for r, ((rss, gpu_mib, shard, load), (t, pp_r, d)) in enumerate(zip(rows, coords)):
            REPORT.info(
                f"    {r:>4}  {int(t):>2} {int(pp_r):>2} {int(d):>2}  {rss:>13.1f}"
                + (f"  {gpu_mib:>12.1f}" if gpu else "")
                + f"  {shard:>9.3f}  {load:>10.1f}"
            )
        REPORT.info(
            f"    (peak host memory is mostly the Python and torch runtime; {self.load_note})"
        )

    def passed_everywhere(self) -> bool:
        """Whether every check passed on every rank."""
        ok = min((ok for _, ok in self.checks), default=True)
        flags = torch.tensor([ok], dtype=torch.float32, device=self.device)
        return comm.all_reduce(flags, "min", group=dist.group.WORLD).item() == 1.0
