"""The main job for a transformers model: ``tp-ext run --model DIR_OR_CONFIG`` (or a job config
whose ``model:`` names one), under torchrun. The steps of :mod:`tp_ext.cli.run` for any decoder
``parallelize(model, "auto")`` converts, against transformers itself:

1. The full-size model's footprint at these dims (built on the meta device).
2. Rank 0 writes a small random checkpoint of the same family (the narrow copy's widths and
   counts, a layer or more per stage, no dropout) with transformers' ``save_pretrained``, in
   several safetensors files.
3. Every rank builds its shards (its pipeline stages at pp > 1) and reads its own slices of the
   files; logits and greedy tokens against transformers' single-process model.
4. Training steps through the pipeline schedule, DDP or FSDP2 (EP for MoE models): the loss
   equals transformers' model trained by a plain loop on every replica's data.
5. A sharded (DCP) save of the training state, reloaded bitwise into a fresh model, and a
   merged export that transformers' ``from_pretrained`` loads with the trained logits.
6. Greedy generation (transformers' ``generate`` with its KV cache at pp = 1; at pp > 1
   ``tp_ext.generate``, KV caches on each stage), its tokens against the single-process
   model's.
"""

from __future__ import annotations

import logging
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tp_ext.checkpoint import current_rss_bytes, peak_rss_bytes, save_hf_checkpoint
from tp_ext.cli.logs import REPORT
from tp_ext.cli.self_check import SelfCheck, toy_data, whole_state_dict
from tp_ext.distributed import comm
from tp_ext.generation import generate
from tp_ext.models.footprint import format_pipeline_footprint
from tp_ext.models.hf.footprint import hf_pipeline_footprint
from tp_ext.models.hf.source import HFModelSource
from tp_ext.training import build_optimizer

__all__ = ["HFSelfCheck"]


def _hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """Logits of a transformers model (its output's ``.logits``) or of pipeline stages (a
    tensor: the last stage's, on every rank)."""
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _shard_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


class HFSelfCheck(SelfCheck):
    """The main job's steps for a transformers model (``inputs.small``: its small config)."""

    def __init__(self, *args, **kwargs) -> None:
        from transformers.utils import logging as transformers_logging

        super().__init__(*args, **kwargs)
        transformers_logging.disable_progress_bar()  # the job reports its own steps

    def source(self) -> HFModelSource:
        return HFModelSource(self.inputs.config_path, self.inputs.small)

    def build_model(self):
        """This rank's shards of the small model (random weights: a checkpoint is read after)."""
        return self.source().build(self.state, **self.build_options())

    def build_options(self) -> dict:
        p = self.inputs.job.parallel
        return {
            "dtype": self.dtype,
            "seed": p.seed,
            "virtual_stages": self.inputs.dims.virtual_stages,
            "stage_order": p.stage_order,
        }

    def transformers_model(self, path: str):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(path, dtype=self.dtype).to(self.device)

    # -- the family hooks of SelfCheck ------------------------------------------------------

    load_note = (
        "each rank builds the model on the meta device and allocates only its shards, which its "
        "slices of the files fill (experts one tensor each included; a form transformers "
        "converts otherwise on load is read whole first)"
    )

    def generation_kind(self) -> str:
        if self.state.pp == 1:
            return "with transformers' generate and its KV cache"
        return "with tp_ext.generate: KV caches on each stage, micro-batches in flight"

    export_check = "transformers loads the merged export with the trained logits"

    def load_export(self, path: str):
        return self.transformers_model(path)

    def logits(self, model, ids):
        return _hf_logits(model, ids)

    @torch.no_grad()
    def greedy(self, model, prompt, new_tokens):
        if not hasattr(model, "stage_ids"):  # transformers' model, or converted at pp = 1
            return model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
        # stop where transformers' generate does: at the config's EOS ids inside the vocabulary
        # (a narrow copy keeps the family's EOS id, which its small vocabulary may not reach)
        eos = getattr(model.config, "eos_token_id", None)
        eos = [
            e for e in ([eos] if isinstance(eos, int) else eos or []) if e < model.config.vocab_size
        ]
        return generate(model, prompt, max_new_tokens=new_tokens, eos_token_id=eos or None)

    def reference_training(self, hf_dir, chunks):
        """transformers' model trained by a plain loop: per step the mean next-token loss over
        every token of every micro-batch, clipped, AdamW as the job's optimizer section."""
        reference = self.transformers_model(hf_dir)
        reference.train()
        optimizer = build_optimizer(reference, self.inputs.small_job.optimizer)
        tokens = sum(c[:, 1:].numel() for c in chunks)
        losses = []
        for _ in range(self.inputs.steps):
            optimizer.zero_grad()
            total = 0.0
            for ids in chunks:
                logits = _hf_logits(reference, ids)[:, :-1].float()
                loss = F.cross_entropy(
                    logits.reshape(-1, logits.size(-1)), ids[:, 1:].reshape(-1), reduction="sum"
                )
                (loss / tokens).backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(reference.parameters(), self.inputs.max_grad_norm)
            optimizer.step()
            losses.append(total / tokens)
        reference.eval()
        return reference, losses

    # -- the steps ------------------------------------------------------------------------------

    def show_footprint(self) -> None:
        """[1] The full-size model's footprint at these dims, on the meta device."""
        state, inputs = self.state, self.inputs
        full = inputs.job.model
        REPORT.info(
            f"tp-ext run: {self.world} ranks (tp={state.tp}, pp={state.pp}, dp={state.dp}"
            + (f", ep={state.ep}" if state.ep > 1 else "")
            + f"), backend {state.backend}, torch {torch.__version__}, device {self.device}"
        )
        REPORT.info(f"  {inputs.job.parallel.describe(inputs.dims)}")
        REPORT.info(
            f"\n[1] footprint of {full.path} (transformers {full.architecture}) at these dims, "
            "on the meta device:"
        )
        if REPORT.isEnabledFor(logging.INFO):  # rank 0: the full model built on meta
            fp = hf_pipeline_footprint(
                full.hf_config,
                tp=state.tp,
                pp=state.pp,
                dp=state.dp,
                ep=state.ep,
                virtual_stages=inputs.dims.virtual_stages,
                stage_order=inputs.job.parallel.stage_order,
                dtype=inputs.job.parallel.dtype,
            )
            REPORT.info(format_pipeline_footprint(fp))

    def write_small_checkpoint(self) -> str:
        """[2] A small random checkpoint of the same family (rank 0, transformers' writer)."""
        from transformers import AutoModelForCausalLM

        small, hf_dir = self.inputs.small, os.path.join(self.workdir, "hf")
        if self.is_main:
            torch.manual_seed(self.inputs.small_job.parallel.seed)
            source = AutoModelForCausalLM.from_config(small).to(self.dtype)
            source.save_pretrained(hf_dir, max_shard_size="40KB")
            del source
        comm.barrier(dist.group.WORLD)
        files = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
        hidden = getattr(small, "hidden_size", None) or getattr(small, "n_embd", None)
        REPORT.info(
            f"\n[2] small {type(small).__name__.removesuffix('Config')} model (vocab "
            f"{small.vocab_size}, hidden {hidden}, {small.num_attention_heads} heads, "
            f"{small.num_hidden_layers} layers, {self.dtype}) written to {hf_dir} by "
            f"transformers: {len(files)} safetensors files"
        )
        return hf_dir

    def load_and_compare(self, hf_dir: str):
        """[3] This rank's shards read from the files; logits and greedy tokens against
        transformers' single-process model."""
        t0, rss = time.perf_counter(), current_rss_bytes()
        options = self.build_options()
        model, report = self.source().build_and_load(self.state, weights=hf_dir, **options)
        load_s = time.perf_counter() - t0
        self.load_report = dict(
            report,
            shard_bytes=_shard_bytes(model),
            peak_rss_increase_bytes=max(0, peak_rss_bytes() - rss),
        )
        REPORT.info(
            f"\n[3] built and loaded across {self.state.tp * self.state.pp} ranks per replica in "
            f"{load_s:.2f} s; rank 0 read {report['read_bytes']:,} bytes (its shard: "
            f"{self.load_report['shard_bytes']:,})"
            + (
                "; the files are in a form transformers converts on load (read whole by "
                "from_pretrained, then sliced)"
                if report.get("read_whole")
                else ""
            )
        )
        reference = self.transformers_model(hf_dir)
        small = self.inputs.small
        ids = toy_data(small, 4, 24, seed=self.inputs.small_job.parallel.seed + 1).to(self.device)
        model.eval()
        self.compare_logits(model, reference, ids, "transformers' single-process model")
        prompt = ids[:, :6]
        same = torch.equal(self.greedy(model, prompt, 8), self.greedy(reference, prompt, 8))
        self.check("greedy tokens equal transformers' single-process model", same)
        model.train()
        return model, ids

    def save_and_reload(self, trainer, model, ids, trained, scale) -> None:
        """[5] The training state through DCP into a fresh model (bitwise), and a merged
        export transformers loads."""
        sharded = os.path.join(self.workdir, "sharded")
        whole_state = whole_state_dict(model)
        trainer.save_checkpoint(sharded)
        fresh = self.build_model()
        fresh_trainer = self.trainer_for(fresh)
        info = fresh_trainer.load_checkpoint(sharded)
        fresh_state = whole_state_dict(fresh)
        differ = [k for k in whole_state if not torch.equal(whole_state[k], fresh_state.get(k))]
        bitwise = fresh_state.keys() == whole_state.keys() and not differ
        self.check(
            "sharded DCP checkpoint reloads bitwise into a fresh model",
            bitwise and info["step"] == self.inputs.steps,
            f"{len(differ)} tensors differ: {differ[:3]}" if differ else "",
        )
        export = os.path.join(self.workdir, "export")
        save_hf_checkpoint(model, export)  # gathered over TP, DP (FSDP2) and the stages
        self.check_export(export, ids, trained, scale)
        REPORT.info(
            f"\n[5] saved {sharded} (DCP) and a merged export for from_pretrained in {export}"
            + ("" if self.keep else " (temporary; --workdir keeps them)")
        )
