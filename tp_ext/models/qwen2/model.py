"""Qwen2 (and the original Qwen) causal language model on tp_ext layers.

Module names follow Hugging Face's Qwen2 where the layers are not fused: ``model.embed_tokens``,
``model.layers.N.{input_layernorm, post_attention_layernorm}``, ``model.norm``, ``lm_head``; the
fused projections are ``self_attn.qkv_proj`` (q; k; v stacked) and ``mlp.gate_up_proj`` (gate;
up). Where they live in Hugging Face checkpoints: :mod:`tp_ext.models.qwen2.hf_checkpoint_map`.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from tp_ext import checkpoint
from tp_ext.checkpoint.checkpoint_map import detect_checkpoint_map, expected_shapes
from tp_ext.checkpoint.hf import model_group
from tp_ext.checkpoint.safetensors_io import SafetensorsFiles, check_names_and_shapes
from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed import comm
from tp_ext.distributed.groups import resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.layers import (
    ParallelLMHead,
    ParallelModule,
    ParallelTransformerBlock,
    RMSNorm,
    VocabParallelEmbedding,
    no_init,
    tensor_specs,
)
from tp_ext.layers.context import CP_MODES, cp_positions
from tp_ext.models.qwen2 import hf_checkpoint_map
from tp_ext.models.qwen2.config import Qwen2Config
from tp_ext.models.qwen2.init import draw_seed, init_weights
from tp_ext.models.qwen2.model_2d import Qwen2ForCausalLM2D
from tp_ext.models.qwen2.stages import HeldStages, Layers, Stage
from tp_ext.parallelize.stages import pipelined_forward, tied_copies_group
from tp_ext.sharding import shard_sizes
from tp_ext.validation import ConfigError, as_torch_dtype, check_int

__all__ = ["Qwen2ForCausalLM"]


class _Qwen2Model(ParallelModule):
    def __init__(self, config: Qwen2Config, tp, device, dtype, layer_ids, embedding, norm):
        super().__init__()
        self._setup_tp(tp)
        kw = {"tp_group": tp, "device": device, "dtype": dtype}
        self.embed_tokens = (
            VocabParallelEmbedding(config.vocab_size, config.hidden_size, **kw)
            if embedding
            else None
        )
        self.layers = Layers(
            {
                str(i): ParallelTransformerBlock(
                    config.hidden_size,
                    config.num_attention_heads,
                    config.num_key_value_heads,
                    config.intermediate_size,
                    config.head_dim,
                    config.rms_norm_eps,
                    config.rope_theta,
                    qkv_bias=True,
                    attention_dropout=config.attention_dropout,
                    **kw,
                )
                for i in layer_ids
            }
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw) if norm else None


class Qwen2ForCausalLM(ParallelModule, ParallelModel):
    """``forward(input_ids)`` gives full-vocabulary logits ``[batch, seq, vocab]`` on every rank
    (``local_logits=True``: this rank's vocabulary shard, for the vocab-parallel loss);
    ``generate(input_ids, max_new_tokens)`` decodes greedily with a KV cache.

    :meth:`from_config` (and :meth:`from_pretrained`) with ``parallel`` from
    ``tp_ext.init_parallel(tp=(P, Q))`` build the 2D (SUMMA) model instead,
    :class:`tp_ext.models.qwen2.model_2d.Qwen2ForCausalLM2D`.

    ``parallel`` (from :func:`tp_ext.init_parallel`) builds this rank's part of a TP x PP x DP
    model: its TP slices of the layers of its pipeline stages only (:class:`StageSplit`:
    ``virtual_stages`` stages per rank in ``stage_order``, layers split by the one shard policy
    or by ``pipeline_split``). Stage 0 holds the embedding, the last stage the final norm and LM
    head. A tied LM head on a rank without the embedding keeps its own copy, loaded (or
    initialised) equal to it; the Trainer sums the two gradients, so they stay equal. Without
    ``parallel``, ``tp_group`` alone gives a TP-only model holding every layer.
    """

    @classmethod
    def from_config(cls, config: Qwen2Config, *, parallel=None, **kwargs):
        """The model for ``parallel``'s dims: :class:`Qwen2ForCausalLM2D` on a P x Q grid
        (``tp_ext.init_parallel(tp=(P, Q))``), else this class (1D TP x PP x DP, or ``tp_group``
        alone). ``kwargs`` are the constructor's (``tp_group``, ``device``, ``dtype``, the
        pipeline options)."""
        if _is_grid(parallel):
            return Qwen2ForCausalLM2D(config, parallel=parallel, **kwargs)
        return cls(config, parallel=parallel, **kwargs)

    def __init__(
        self,
        config: Qwen2Config,
        tp_group=None,
        device=None,
        dtype=None,
        *,
        parallel=None,
        virtual_stages: int = 1,
        pipeline_split=None,
        stage_order: str = "loop",
        cp_mode: str = "ring",
    ):
        super().__init__()
        dtype = as_torch_dtype(dtype)
        if cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be 'ring' or 'all_to_all', got {cp_mode!r}")
        if _is_grid(parallel):
            raise ValueError(
                f"Qwen2ForCausalLM: parallel has a 2D grid (tp={parallel.dims.grid}), which this "
                "1D class does not lay out; build the grid's model with "
                "Qwen2ForCausalLM.from_config(config, parallel=state) (a Qwen2ForCausalLM2D)"
            )
        if parallel is not None:
            if tp_group is not None:
                raise ValueError(
                    "pass parallel= (TP, PP and DP from tp_ext.init_parallel) or tp_group= "
                    "(TP only), not both"
                )
            tp_group = parallel.tp_group
        tp = self._setup_tp(tp_group)
        config.check_tp(tp.size)
        self.config = config
        self.parallel = parallel
        held = HeldStages.of(
            config.num_hidden_layers, parallel, virtual_stages, pipeline_split, stage_order
        )
        self.stage_split, self.stage_ids = held.split, held.stage_ids
        layer_ids, has_embedding, has_head = held.layer_ids, held.has_embedding, held.has_head
        pp = held.split.pp
        # Under pipelining a tied head keeps its own copy, even on the rank that also holds the
        # embedding (V-shaped schedules): each stage module then owns its parameters, as DDP
        # and FSDP2 need; the Trainer sums the two gradients, so the copies stay equal.
        self.tied_across_stages = config.tie_word_embeddings and pp > 1
        seed = draw_seed() if PROCESS.init_weights else None  # before any layer is built
        with no_init():  # the layers' own (torch.nn's) initialisation is replaced below
            self.model = _Qwen2Model(
                config, tp, device, dtype, sorted(layer_ids), has_embedding, has_head
            )
            self.lm_head = None
            if has_head:
                self.lm_head = ParallelLMHead(
                    config.vocab_size,
                    config.hidden_size,
                    tp_group=tp,
                    device=device,
                    dtype=dtype,
                    tie_to=self.model.embed_tokens
                    if config.tie_word_embeddings and not self.tied_across_stages
                    else None,
                )
        if seed is not None:  # a tied head's own copy draws the embedding's tensor
            init_weights(self, config, seed)
        self.activation_checkpointing = False
        self.cp_group = None  # context parallelism: the ranks that share each sequence
        # the whole sequence's length, which a stage after the first (its input this rank's
        # positions' hidden states) cannot see: set by whoever runs the stages
        self.sequence_length: Optional[int] = None
        if parallel is not None and parallel.dims.cp_enabled:
            self._use_context_parallel(parallel, cp_mode)

    def _use_context_parallel(self, parallel, cp_mode: str) -> None:
        """Every attention runs over the CP group, as a ring or by all-to-all
        (tp_ext.layers.context)."""
        if self.config.attention_dropout > 0:
            raise ValueError(
                "Qwen2ForCausalLM: attention dropout under context parallelism is not supported "
                "yet; set attention_dropout=0 in the config"
            )
        self.cp_group = resolve_group(parallel.cp_group)
        for i in self.model.layers.indices():
            attn = self.model.layers[i].self_attn
            attn.cp, attn.cp_mode = self.cp_group, cp_mode

    @property
    def is_pipelined(self) -> bool:
        return self.stage_split.pp > 1

    loss_kind = LossKind.VOCAB_SHARD  # the last stage gives this rank's vocabulary shard

    def local_sequence(self, length: int) -> int:
        """The positions of a ``length``-token sequence this rank's stages compute and send on:
        its CP positions (all of them without context parallelism)."""
        if self.cp_group is None:
            return length
        return len(cp_positions(length, group=self.cp_group))

    def loss_positions(self, length: int) -> Optional[torch.Tensor]:
        """This CP rank's positions, whose logits the last stage gives (None without CP)."""
        return None if self.cp_group is None else cp_positions(length, group=self.cp_group)

    def activation_shape(self, batch: int, length: int) -> tuple:
        return (batch, self.local_sequence(length), self.config.hidden_size)

    def output_shape(self, batch: int, length: int) -> tuple:
        positions = self.loss_positions(length)
        rows = length if positions is None else len(positions)
        return (batch, rows, self.local_vocab_size)

    def tied_weights(self) -> list[torch.Tensor]:
        """The copies of a tied embedding this rank holds under pipelining: the embedding's on
        its first stage, the head's on the last (both on a rank with both; none elsewhere, or
        when untied)."""
        if not self.tied_across_stages:
            return []
        held = [self.model.embed_tokens, self.lm_head]
        return [module.weight for module in held if module is not None]

    def tied_group(self):
        """The group joining the first and last stage's ranks when they differ, else None."""
        return tied_copies_group(self)

    def stage_modules(self) -> list[nn.Module]:
        """One module per pipeline stage this rank holds, in order, each owning the
        embedding / layers / norm and head of its stage (what PipelineStage, DDP and FSDP2
        wrap; the parameters are this model's, shared)."""
        return [Stage(self, stage) for stage in self.stage_ids]

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        tp_group=None,
        dtype=None,
        device=None,
        strict: bool = True,
        progress: bool = True,
        *,
        parallel=None,
        virtual_stages: int = 1,
        pipeline_split=None,
        stage_order: str = "loop",
    ) -> "Qwen2ForCausalLM":
        """Build the model from a Hugging Face checkpoint directory (config.json with
        model.safetensors or a sharded index; Qwen2 or original Qwen format), each rank reading
        only its own slices (under ``parallel``: of its own stages' tensors). ``dtype``: default
        the checkpoint's. ``model.load_report`` holds this rank's bytes read, shard bytes and
        peak host memory during the load."""
        if not os.path.isdir(path):
            missing = "does not exist" if not os.path.exists(path) else "is not a directory"
            raise ConfigError(
                f"from_pretrained: checkpoint directory {str(path)!r} {missing} (a Hugging "
                "Face checkpoint: config.json with model.safetensors or a sharded index)"
            )
        if _is_grid(parallel):  # tp=(P, Q): the 2D model
            stages = dict(
                virtual_stages=virtual_stages,
                pipeline_split=pipeline_split,
                stage_order=stage_order,
            )
            return Qwen2ForCausalLM2D.from_pretrained(
                path, parallel=parallel, dtype=dtype, device=device, **stages
            )
        checkpoint.import_readers()  # their code is mapped once, not counted against the load
        before = checkpoint.current_rss_bytes()
        checkpoint.reset_peak_rss()
        config = Qwen2Config.from_file(path)  # every field checked
        dtype = as_torch_dtype(dtype) or checkpoint.checkpoint_dtype(path)
        build = {
            "tp_group": tp_group,
            "parallel": parallel,
            "virtual_stages": virtual_stages,
            "pipeline_split": pipeline_split,
            "stage_order": stage_order,
        }
        # The checkpoint's files, names and shapes are checked against the model built on the
        # meta device (nothing allocated) before the real one: a checkpoint that disagrees with
        # its config.json fails at once, not after allocating the model.
        meta = cls(config, device="meta", dtype=dtype, **build)
        _check_checkpoint(meta, path, strict)
        del meta
        with no_init():
            model = cls(config, device=device, dtype=dtype, **build)
        if model.is_pipelined:  # each stage reads its own tensors; a failure on one fails all
            report = comm.everywhere(
                dist.group.WORLD,
                f"loading {path}",
                lambda: checkpoint.load_hf_checkpoint(model, path, strict=False, progress=progress),
                checkpoint.CheckpointError,
            )
        else:
            report = checkpoint.load_hf_checkpoint(model, path, strict=strict, progress=progress)
        report["peak_rss_increase_bytes"] = report["peak_rss_bytes"] - before
        model.load_report = report
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 1024**3) -> None:
        """A merged Hugging Face checkpoint that transformers' Qwen2ForCausalLM loads: every
        stage's tensors, every TP slice (every rank calls it; global rank 0 writes)."""
        checkpoint.save_hf_checkpoint(self, path, max_shard_bytes)

    @property
    def pipeline_group(self):
        """The pipeline group this rank's stages talk over (None without pipelining): what the
        checkpoint code gathers stages over."""
        return self.parallel.pp_group if self.is_pipelined else None

    # -- what the checkpoint code reads (tp_ext.checkpoint.checkpoint_map) ---------------------

    # "qwen2": transformers' Qwen2 names (what saves write); "qwen": the original Qwen's.
    checkpoint_formats = hf_checkpoint_map.FORMATS

    def checkpoint_map(self, fmt: Optional[str] = None):
        """This model's tensors in a Hugging Face checkpoint of format ``fmt`` (None: "qwen2")."""
        return hf_checkpoint_map.checkpoint_map(self.config, fmt or self.checkpoint_formats[0])

    def hf_config(self, dtype: torch.dtype) -> dict:
        return hf_checkpoint_map.hf_config(self.config, dtype)

    def forward(
        self, input_ids: torch.Tensor, local_logits: bool = False, kv_caches=None
    ) -> torch.Tensor:
        """Logits of ``input_ids`` ``[batch, seq]``. Under pipelining every rank of one pipeline
        passes the same ids; the stages run one after another (activations sent to the next
        stage's rank) and every rank returns the last stage's logits. That path is for
        inference (no autograd across ranks): train with :class:`tp_ext.training.Trainer`.
        Under context parallelism every CP rank passes the same whole sequence and gets the
        logits of its own positions, in the order of :func:`tp_ext.cp_positions`."""
        if self.is_pipelined:
            return self._pipelined_forward(input_ids, local_logits, kv_caches)
        h = self.stage_forward(0, input_ids, kv_caches)
        return h if local_logits else self.lm_head.gather_features(h)

    def stage_forward(
        self,
        stage: int,
        x: torch.Tensor,
        kv_caches=None,
        *,
        position_ids: Optional[torch.Tensor] = None,
        key_mask: Optional[torch.Tensor] = None,
        last_only: bool = False,
    ) -> torch.Tensor:
        """What pipeline stage ``stage`` computes: ids -> embedding on the first stage, its
        decoder layers, then norm and this rank's vocabulary shard of the logits on the last.
        ``kv_caches``: one per decoder layer of the full model, by global index. For decoding a
        batch of left-padded prompts (:func:`tp_ext.generate`): ``position_ids`` [batch, seq],
        ``key_mask`` [batch, cached + seq] (False at padding), and ``last_only`` (the logits of
        the last position only)."""
        split = self.stage_split
        if stage not in self.stage_ids:
            raise ValueError(
                f"stage {stage} is not on this rank; it holds stages {self.stage_ids} of "
                f"{split.num_stages}"
            )
        positions, seq_len = position_ids, None
        if self.cp_group is not None and position_ids is not None:
            raise ValueError("stage_forward: position_ids are given by context parallelism")
        if self.cp_group is not None:  # this CP rank's positions of the whole sequence
            seq_len = x.size(1) if stage == 0 else self.sequence_length
            if seq_len is None:
                raise RuntimeError(
                    f"stage {stage} under context parallelism needs the whole sequence's "
                    "length: set model.sequence_length (tp_ext's pipeline runner does)"
                )
            order = cp_positions(seq_len, group=self.cp_group).to(x.device)
            positions = order.unsqueeze(0)
            if stage == 0:  # token ids of the whole sequence in; later stages get our rows
                x = x[:, order]
        if stage == 0:
            x = self.model.embed_tokens(x)
        for i in split.layers_of(stage):
            layer, cache = self.model.layers[i], None if kv_caches is None else kv_caches[i]
            if self.activation_checkpointing and torch.is_grad_enabled():
                # recomputed in backward; the TP random stream is derived from torch's, which
                # checkpoint restores, so dropout masks repeat exactly
                x = recompute(layer, x, positions, cache, seq_len, key_mask, use_reentrant=False)
            else:
                x = layer(x, positions, cache, seq_len, key_mask)
        if stage == split.last_stage:
            x = self.lm_head(self.model.norm(x[:, -1:] if last_only else x))
        return x

    def _pipelined_forward(self, input_ids, local_logits, kv_caches) -> torch.Tensor:
        gather = self.lm_head.gather_features if self.lm_head is not None else None
        return pipelined_forward(
            self,
            input_ids,
            local_logits,
            lambda stage, x: self.stage_forward(stage, x, kv_caches),
            gather,
        )

    @property
    def _dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    @property
    def local_vocab_size(self) -> int:
        """This TP rank's share of the vocabulary (its columns of the logits)."""
        return shard_sizes(self.config.vocab_size, self.tp_size)[self.tp_rank]

    @torch.no_grad()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int) -> torch.Tensor:
        """Greedy decoding: the prompt once, then one token at a time through the KV caches
        (under pipelining each stage keeps the caches of its own layers)."""
        check_int("max_new_tokens", max_new_tokens, 0)
        if self.cp_group is not None:
            raise ValueError(
                f"generate: context parallelism (cp={self.cp_group.size}) does not decode yet; "
                "build the model with cp=1 for generation"
            )
        batch, prompt = input_ids.shape
        caches = [None] * self.config.num_hidden_layers
        for i in self.model.layers.indices():
            caches[i] = self.model.layers[i].self_attn.new_kv_cache(batch, prompt + max_new_tokens)
        tokens, step = input_ids, input_ids
        for _ in range(max_new_tokens):
            next_token = self(step, kv_caches=caches)[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_token], 1)
            step = next_token
        return tokens


def _is_grid(parallel) -> bool:
    """Whether a ParallelState lays tensor parallelism out on a P x Q grid."""
    return parallel is not None and parallel.dims.grid is not None


def _check_checkpoint(model: Qwen2ForCausalLM, path: str, strict: bool) -> None:
    """The checks load_hf_checkpoint makes before reading (files present and readable, every
    tensor the model needs with its full shape, no unused ones when ``strict``), on a
    meta-device ``model``; an error on any rank raises on all."""
    entries = list(tensor_specs(model))
    if model.is_pipelined:  # the strict check is against the whole model's tensors
        full = type(model)(model.config, tp_group=model.tp, device="meta", dtype=model._dtype)
        entries = list(tensor_specs(full))
    group = dist.group.WORLD if model.is_pipelined else model_group(model)

    def check():
        files = SafetensorsFiles(path)
        mapping = detect_checkpoint_map(model, files.names())
        check_names_and_shapes(files, expected_shapes(entries, mapping), strict)

    comm.everywhere(group, f"checking {path}", check, checkpoint.CheckpointError)
