"""Qwen2 on a P x Q grid of 2D tensor parallelism (SUMMA): ``Qwen2ForCausalLM.from_config(config,
parallel=init_parallel(tp=(P, Q)))`` builds this model.

Every weight and every activation is split over the whole grid (:mod:`tp_ext.layers.summa`):
sequences over the P rows, features over the Q columns, each weight ``[out, in]`` with ``out``
over the columns and ``in`` over the rows. Parameter names are transformers' (``model.
embed_tokens``, ``model.layers.N.self_attn.q_proj`` ..., ``lm_head``), so a Hugging Face
checkpoint loads by name, each rank reading only its blocks.

Tied embeddings (``tie_word_embeddings=True``): one parameter in the embedding's blocks, which
the LM head reads in its own layout by an exchange of blocks over the grid
(:class:`~tp_ext.layers.summa_blocks.TiedLMHead2D`); under pipelining the last stage holds a
copy in the same blocks, its gradient summed with the first stage's (``tied_weights``).
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Optional

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from tp_ext.checkpoint.hf import save_hf_checkpoint
from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed.grid import TPGrid
from tp_ext.distributed.groups import resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.layers.base import no_init
from tp_ext.layers.context import CP_MODES, cp_positions
from tp_ext.layers.state_dict import full_state_dict, load_full_state_dict, tensor_specs
from tp_ext.layers.summa import Linear2D, gather_2d
from tp_ext.layers.summa_blocks import (
    DecoderLayer2D,
    Embedding2D,
    RMSNorm2D,
    TiedLMHead2D,
    cross_entropy_2d,
    kv_head_sizes,
)
from tp_ext.models.qwen2 import hf_checkpoint_map
from tp_ext.models.qwen2.config import Qwen2Config
from tp_ext.models.qwen2.init import draw_seed, init_weights
from tp_ext.models.qwen2.stages import HeldStages, Layers, Stage
from tp_ext.parallelize.stages import pipelined_forward, tied_copies_group
from tp_ext.sharding import shard_range, shard_sizes
from tp_ext.validation import as_torch_dtype

__all__ = ["Qwen2ForCausalLM2D"]


class _Model2D(nn.Module):
    def __init__(self, config: Qwen2Config, grid: TPGrid, device, dtype, held: HeldStages):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = None
        if held.has_embedding:
            self.embed_tokens = Embedding2D(config.vocab_size, config.hidden_size, grid, **kw)
        self.layers = Layers({str(i): DecoderLayer2D(config, grid, **kw) for i in held.layer_ids})
        self.norm = None
        if held.has_head:
            self.norm = RMSNorm2D(config.hidden_size, config.rms_norm_eps, grid, **kw)


class Qwen2ForCausalLM2D(nn.Module, ParallelModel):
    """Qwen2 causal LM on a grid. ``forward(input_ids)`` (the whole ``[batch, seq]`` ids on every
    rank) gives the full logits ``[batch, seq, vocab]`` on every rank, or with
    ``local_logits=True`` this rank's block (grid row i's sequences, column j's vocabulary);
    :meth:`summed_loss` takes that block to the loss without gathering it.

    As a :class:`~tp_ext.contract.ParallelModel` its last stage's output is its logits block
    (``LossKind.GRID_BLOCK``); with ``parallel.pp > 1`` it holds this rank's pipeline stages
    (``virtual_stages`` per rank in ``stage_order``, layers split by ``pipeline_split`` or the
    one shard policy), their hidden states grid blocks too. The checkpoint and gradient-norm
    code read the parameters' ShardSpecs (grid blocks)."""

    loss_kind = LossKind.GRID_BLOCK
    sequence_length = None

    def __init__(
        self,
        config: Qwen2Config,
        tp_group=None,
        device=None,
        dtype=None,
        *,
        parallel=None,
        grid: Optional[TPGrid] = None,
        virtual_stages: int = 1,
        pipeline_split=None,
        stage_order: str = "loop",
        cp_mode: str = "ring",
    ):
        super().__init__()
        dtype = as_torch_dtype(dtype)
        if tp_group is not None:
            raise ValueError("a 2D model takes parallel= (or grid=), not tp_group=")
        if grid is None and parallel is not None:
            grid = parallel.tp_grid
        if grid is None:
            raise ValueError(
                "Qwen2ForCausalLM2D needs a grid: parallel=tp_ext.init_parallel(tp=(P, Q)) or grid="
            )
        kv_head_sizes(config.num_key_value_heads, grid.cols)  # Q <= KV heads, said clearly
        self.config, self.parallel, self.grid = config, parallel, grid
        held = HeldStages.of(
            config.num_hidden_layers, parallel, virtual_stages, pipeline_split, stage_order
        )
        self.stage_split, self.stage_ids = held.split, held.stage_ids
        # Under pipelining a tied head keeps its own copy (in the embedding's blocks), as the
        # 1D model's does: each stage module owns its parameters; the Trainer sums the grads.
        self.tied_across_stages = config.tie_word_embeddings and held.split.pp > 1
        # the checkpoint holds the tie once, under the embedding's name
        tied = {"lm_head.weight": "model.embed_tokens.weight"}
        self.checkpoint_aliases = tied if config.tie_word_embeddings else {}
        seed = draw_seed() if PROCESS.init_weights else None  # before any layer is built
        with no_init():  # the layers' own initialisation is replaced: the 1D model's weights
            self.model = _Model2D(config, grid, device, dtype, held)
            self.lm_head = self._head(device, dtype) if held.has_head else None
        if seed is not None:
            init_weights(self, config, seed)
        self.activation_checkpointing = False
        self.cp_group = None  # context parallelism: the ranks that share each sequence
        if parallel is not None and parallel.dims.cp_enabled:
            self._use_context_parallel(parallel, cp_mode)

    def _head(self, device, dtype) -> nn.Module:
        """The LM head: a Linear2D, or one reading the tied embedding's blocks (or its copy)."""
        config, kw = self.config, {"device": device, "dtype": dtype}
        vocab, hidden = config.vocab_size, config.hidden_size
        if not config.tie_word_embeddings:
            return Linear2D(hidden, vocab, False, self.grid, **kw)
        tie_to = None if self.tied_across_stages else self.model.embed_tokens
        return TiedLMHead2D(vocab, hidden, self.grid, tie_to=tie_to, **kw)

    def _use_context_parallel(self, parallel, cp_mode: str) -> None:
        """Every attention runs over the CP group, as a ring or by all-to-all; the model takes
        this CP rank's positions of each whole sequence (tp_ext.cp_positions)."""
        if cp_mode not in CP_MODES:
            raise ValueError(f"cp_mode must be 'ring' or 'all_to_all', got {cp_mode!r}")
        self.cp_group = resolve_group(parallel.cp_group)
        for layer in self.model.layers:
            layer.self_attn.cp, layer.self_attn.cp_mode = self.cp_group, cp_mode

    # -- the model contract ------------------------------------------------------------------------

    def stage_modules(self) -> list[nn.Module]:
        return [Stage(self, stage) for stage in self.stage_ids]

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
        """Stage ``stage``: the whole ids (stage 0) or this rank's block of the hidden states
        in; the hidden states' block, or on the last stage the logits' block, out. For decoding
        a batch of left-padded prompts (:func:`tp_ext.generate`): ``kv_caches`` (one per decoder
        layer of the full model, by global index: :meth:`new_kv_caches`), ``position_ids`` and
        ``key_mask`` of the whole batch ([batch, seq], [batch, cached + seq]; this grid row's
        sequences are taken), ``last_only`` (the logits of the last position only)."""
        split = self.stage_split
        if stage not in self.stage_ids:
            raise ValueError(
                f"stage {stage} is not on this rank; it holds stages {self.stage_ids} of "
                f"{split.num_stages}"
            )
        seq_len, order = None, None
        if self.cp_group is not None:  # this CP rank's positions of the whole sequence
            if kv_caches is not None or position_ids is not None:
                raise ValueError(
                    "stage_forward: decoding under context parallelism is not supported yet"
                )
            seq_len = x.size(1) if stage == 0 else self.sequence_length
            order = cp_positions(seq_len, group=self.cp_group).to(x.device)
            x = x[:, order] if stage == 0 else x  # later stages receive our positions
        if stage == 0:
            x = self.model.embed_tokens(x)
        positions, mask = self._rows(position_ids), self._rows(key_mask)
        if order is not None:
            positions = order.expand(x.size(0), order.numel())
        elif positions is None:
            past = 0 if kv_caches is None else kv_caches[split.layers_of(stage)[0]].length
            positions = torch.arange(past, past + x.size(1), device=x.device)
            positions = positions.expand(x.size(0), x.size(1))
        for i in split.layers_of(stage):
            layer, cache = self.model.layers[i], None if kv_caches is None else kv_caches[i]
            if self.activation_checkpointing and torch.is_grad_enabled():
                x = recompute(layer, x, positions, cache, mask, seq_len, use_reentrant=False)
            else:
                x = layer(x, positions, cache, mask, seq_len)
        if stage == split.last_stage:
            x = self.lm_head(self.model.norm(x[:, -1:] if last_only else x))
        return x

    def _rows(self, whole: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """This grid row's sequences of a tensor over the whole batch (None stays None)."""
        if whole is None:
            return None
        start, count = self.rows_of(whole.size(0))
        return whole.narrow(0, start, count)

    def new_kv_caches(self, batch: int, max_length: int, stage: int) -> list:
        """KV caches of ``stage``'s decoder layers (by global index; None elsewhere) for a batch
        of ``batch`` sequences, of which this rank keeps its grid row's."""
        rows = self.rows_of(batch)[1]
        caches = [None] * self.config.num_hidden_layers
        for i in self.stage_split.layers_of(stage):
            caches[i] = self.model.layers[i].self_attn.new_kv_cache(rows, max_length)
        return caches

    def tied_weights(self) -> list:
        """The copies of a tied embedding this rank holds under pipelining (the embedding's on
        the first stage, the head's on the last, both in the embedding's blocks); [] else."""
        if not self.tied_across_stages:
            return []
        return [m.weight for m in (self.model.embed_tokens, self.lm_head) if m is not None]

    def tied_group(self):
        """The group joining the first and last stage's ranks at this grid place, else None."""
        return tied_copies_group(self)

    def decoding(self):
        """A context for decoding (no gradient, fixed weights): a tied head's blocks exchanged
        once, not at every step (every rank of the grid enters it together)."""
        if self.lm_head is None or not self.config.tie_word_embeddings:
            return contextlib.nullcontext()
        return self.lm_head.held()

    def local_sequence(self, length: int) -> int:
        """This CP rank's positions of a ``length``-token sequence (all of them without CP)."""
        return length if self.cp_group is None else len(self.loss_positions(length))

    def loss_positions(self, length: int):
        return None if self.cp_group is None else cp_positions(length, group=self.cp_group)

    def activation_shape(self, batch: int, length: int) -> tuple:
        """Grid row i's sequences (this CP rank's positions of them), column j's features."""
        rows = shard_sizes(batch, self.grid.rows)[self.grid.row]
        features = shard_sizes(self.config.hidden_size, self.grid.cols)[self.grid.col]
        return (rows, self.local_sequence(length), features)

    def output_shape(self, batch: int, length: int) -> tuple:
        """Grid row i's sequences (this CP rank's positions of them), column j's vocabulary."""
        rows = shard_sizes(batch, self.grid.rows)[self.grid.row]
        vocab = shard_sizes(self.config.vocab_size, self.grid.cols)[self.grid.col]
        return (rows, self.local_sequence(length), vocab)

    @property
    def is_pipelined(self) -> bool:
        return self.stage_split.num_stages > 1

    @property
    def pipeline_group(self):
        """The pipeline group this rank's stages talk over (None without pipelining)."""
        return self.parallel.pp_group if self.stage_split.pp > 1 else None

    # -- forward and loss -------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, local_logits: bool = False) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq] (whole, the same on every rank), got shape "
                f"{tuple(input_ids.shape)}"
            )
        batch = input_ids.size(0)

        def gathered(logits: torch.Tensor) -> torch.Tensor:  # every rank's block: the whole
            rows, out = shard_sizes(batch, self.grid.rows), self.lm_head.out_sizes
            return gather_2d(logits, self.grid, 0, dim_sizes=rows, feature_sizes=out)

        if self.is_pipelined:  # the stages one after another, for inference
            return pipelined_forward(self, input_ids, local_logits, self.stage_forward, gathered)
        logits = self.stage_forward(0, input_ids)
        return logits if local_logits else gathered(logits)

    def rows_of(self, batch: int) -> tuple[int, int]:
        """(first sequence, count) of the batch that this rank's grid row computes."""
        return shard_range(batch, self.grid.rows, self.grid.row)

    def summed_loss(
        self, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """The sum of the token losses of the whole batch, the same on every rank of the grid,
        from this rank's ``logits`` block of the scored positions; ``targets`` is the whole
        ``[batch, positions]`` of those positions' next tokens."""
        start, count = self.rows_of(targets.size(0))
        mine = targets.narrow(0, start, count)
        return cross_entropy_2d(logits, mine, self.grid, ignore_index, reduction="sum")

    # -- state -------------------------------------------------------------------------------------

    def checkpoint_map(self, fmt: Optional[str] = None):
        """The 1D model's fusions of these tensors (q, k, v; gate, up): what keeps training
        checkpoints of the two interchangeable (:mod:`tp_ext.checkpoint.dcp`)."""
        return hf_checkpoint_map.checkpoint_map(self.config, fmt or "qwen2")

    def load_full_state_dict(self, full, strict: bool = True) -> None:
        load_full_state_dict(self, full, strict)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        return full_state_dict(self)

    @classmethod
    def from_pretrained(
        cls, path: str, *, parallel=None, grid=None, dtype=None, device=None, **stages
    ):
        """Build the model from a Hugging Face Qwen2 checkpoint directory (config.json and
        model.safetensors or a sharded index); each rank reads only its blocks."""
        from safetensors import safe_open

        config = Qwen2Config.from_file(path)
        files = _safetensors_files(path)
        model = cls(config, parallel=parallel, grid=grid, device=device, dtype=dtype, **stages)
        where = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    where[name] = file
        # a tied head is read from the embedding's tensor, and a tensor under two names once
        entries = {
            id(t): (model.checkpoint_aliases.get(n, n), t, *rest)
            for n, t, *rest in tensor_specs(model)
        }
        missing = sorted({name for name, *_ in entries.values()} - set(where))
        if missing:
            raise KeyError(
                f"{path}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                "(2D loads transformers' Qwen2 names)"
            )
        with torch.no_grad():
            for name, param, spec, owner in entries.values():
                with safe_open(where[name], framework="pt") as f:
                    param.copy_(_read_block(f.get_slice(name), name, param, spec, owner, path))
        return model

    def save_pretrained(self, path: str, max_shard_bytes: int = 5 * 1024**3) -> None:
        """A Hugging Face checkpoint that transformers' Qwen2ForCausalLM loads: every stage's
        blocks gathered (every rank calls it; global rank 0 writes)."""
        save_hf_checkpoint(self, path, max_shard_bytes)

    def hf_config(self, dtype: torch.dtype) -> dict:
        return hf_checkpoint_map.hf_config(self.config, dtype)


def _read_block(piece, name: str, param, spec, owner, path: str) -> torch.Tensor:
    """This rank's block of checkpoint tensor ``name`` (a safetensors slice), read alone."""
    shape = tuple(piece.get_shape())
    expected = tuple(param.shape) if spec is None else spec.full_shape_of(param.shape)
    if shape != expected:
        raise ValueError(f"{path}: {name} has shape {shape}, the config says {expected}")
    if spec is None:
        return piece[:].to(param.dtype)
    (box,) = spec.boxes(owner.shard_coord, tuple(param.shape))  # a grid block is one box
    return piece[tuple(slice(o, o + n) for o, n in box)].to(param.dtype)


def _safetensors_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            names = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, n) for n in names]
    single = os.path.join(path, "model.safetensors")
    if not os.path.exists(single):
        raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json")
    return [single]
