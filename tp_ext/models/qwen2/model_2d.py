"""Qwen2 on a P x Q grid of 2D tensor parallelism (SUMMA): ``Qwen2ForCausalLM.from_config(config,
parallel=init_parallel(tp=(P, Q)))`` builds this model.

Every weight and every activation is split over the whole grid (:mod:`tp_ext.layers.summa`):
sequences over the P rows, features over the Q columns, each weight ``[out, in]`` with ``out``
over the columns and ``in`` over the rows. Parameter names are transformers' (``model.
embed_tokens``, ``model.layers.N.self_attn.q_proj`` ..., ``lm_head``), so a Hugging Face
checkpoint loads by name, each rank reading only its blocks.

Not (yet) at 2D: tied embeddings (the embedding and the LM head hold different blocks of the
one matrix), pipeline parallelism (pp > 1), FSDP2, KV-cache decoding; each is refused by name.
"""

from __future__ import annotations

import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed.grid import TPGrid
from tp_ext.distributed.state import PROCESS
from tp_ext.layers.base import no_init
from tp_ext.layers.state_dict import full_state_dict, load_full_state_dict, tensor_specs
from tp_ext.layers.summa import Linear2D, gather_2d
from tp_ext.layers.summa_blocks import (
    DecoderLayer2D,
    Embedding2D,
    RMSNorm2D,
    cross_entropy_2d,
    kv_head_sizes,
)
from tp_ext.models.qwen2 import hf_checkpoint_map
from tp_ext.models.qwen2.config import Qwen2Config
from tp_ext.models.qwen2.init import draw_seed, init_weights
from tp_ext.sharding import StageSplit, shard_range, shard_sizes
from tp_ext.validation import as_torch_dtype

__all__ = ["Qwen2ForCausalLM2D"]


class _Model2D(nn.Module):
    def __init__(self, config: Qwen2Config, grid: TPGrid, device, dtype):
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.embed_tokens = Embedding2D(config.vocab_size, config.hidden_size, grid, **kw)
        self.layers = nn.ModuleList(
            DecoderLayer2D(config, grid, **kw) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm2D(config.hidden_size, config.rms_norm_eps, grid, **kw)


class Qwen2ForCausalLM2D(nn.Module, ParallelModel):
    """Qwen2 causal LM on a grid. ``forward(input_ids)`` (the whole ``[batch, seq]`` ids on every
    rank) gives the full logits ``[batch, seq, vocab]`` on every rank, or with
    ``local_logits=True`` this rank's block (grid row i's sequences, column j's vocabulary);
    :meth:`summed_loss` takes that block to the loss without gathering it.

    As a :class:`~tp_ext.contract.ParallelModel` it is one stage whose output is its logits
    block (``LossKind.GRID_BLOCK``); the checkpoint and gradient-norm code read the parameters'
    ShardSpecs (grid blocks)."""

    loss_kind = LossKind.GRID_BLOCK
    stage_ids = [0]
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
        **unsupported,
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
        options = {k: v for k, v in unsupported.items() if v not in (None, 1, "loop")}
        if options:
            raise ValueError(
                f"{sorted(options)} are pipeline options; 2D tensor parallelism runs without "
                "pipelining (pp=1) for now"
            )
        if parallel is not None and parallel.pp > 1:
            raise ValueError(
                f"pp={parallel.pp}: 2D tensor parallelism runs without pipelining for now; use "
                "pp=1 (TP x DP), or 1D tensor parallelism with pipelining"
            )
        if config.tie_word_embeddings:
            raise ValueError(
                "tie_word_embeddings=True: at 2D the embedding and the LM head hold different "
                "blocks of the one matrix, which is not supported yet; use 1D tensor "
                "parallelism (tp=N) for tied models"
            )
        kv_head_sizes(config.num_key_value_heads, grid.cols)  # Q <= KV heads, said clearly
        self.config, self.parallel, self.grid = config, parallel, grid
        seed = draw_seed() if PROCESS.init_weights else None  # before any layer is built
        with no_init():  # the layers' own initialisation is replaced: the 1D model's weights
            self.model = _Model2D(config, grid, device, dtype)
            self.lm_head = Linear2D(
                config.hidden_size, config.vocab_size, False, grid, device=device, dtype=dtype
            )
        if seed is not None:
            init_weights(self, config, seed)
        self.activation_checkpointing = False
        self.stage_split = StageSplit(config.num_hidden_layers)

    # -- the model contract ------------------------------------------------------------------------

    def stage_modules(self) -> list[nn.Module]:
        return [_Stage2D(self)]

    def stage_forward(self, stage: int, x: torch.Tensor) -> torch.Tensor:
        return self(x, local_logits=True)

    def tied_weights(self) -> list:
        return []

    def tied_group(self):
        return None

    def local_sequence(self, length: int) -> int:
        return length

    def loss_positions(self, length: int):
        return None

    @property
    def local_vocab_size(self) -> int:
        return self.lm_head.out_sizes[self.grid.col]

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    # -- forward and loss -------------------------------------------------------------------------

    def forward(self, input_ids: torch.Tensor, local_logits: bool = False) -> torch.Tensor:
        if input_ids.dim() != 2:
            raise ValueError(
                f"input_ids must be [batch, seq] (whole, the same on every rank), got shape "
                f"{tuple(input_ids.shape)}"
            )
        batch, seq = input_ids.shape
        h = self.model.embed_tokens(input_ids)
        positions = torch.arange(seq, device=input_ids.device).expand(h.size(0), seq)
        for layer in self.model.layers:
            if self.activation_checkpointing and torch.is_grad_enabled():
                h = recompute(layer, h, positions, use_reentrant=False)
            else:
                h = layer(h, positions)
        logits = self.lm_head(self.model.norm(h))
        if local_logits:
            return logits
        rows = shard_sizes(batch, self.grid.rows)
        return gather_2d(logits, self.grid, 0, dim_sizes=rows, feature_sizes=self.lm_head.out_sizes)

    def rows_of(self, batch: int) -> tuple[int, int]:
        """(first sequence, count) of the batch that this rank's grid row computes."""
        return shard_range(batch, self.grid.rows, self.grid.row)

    def summed_loss(
        self, local_logits: torch.Tensor, labels: torch.Tensor, ignore_index: int = -100
    ) -> torch.Tensor:
        """The sum of the token losses of the whole batch (position t predicts
        ``labels[:, t + 1]``), the same on every rank, from this rank's logits block;
        ``labels`` is the whole ``[batch, seq]``."""
        start, count = self.rows_of(labels.size(0))
        mine = labels.narrow(0, start, count)
        return cross_entropy_2d(
            local_logits[:, :-1], mine[:, 1:], self.grid, ignore_index, reduction="sum"
        )

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
    def from_pretrained(cls, path: str, *, parallel=None, grid=None, dtype=None, device=None):
        """Build the model from a Hugging Face Qwen2 checkpoint directory (config.json and
        model.safetensors or a sharded index); each rank reads only its blocks."""
        from safetensors import safe_open

        config = Qwen2Config.from_file(path)
        files = _safetensors_files(path)
        model = cls(config, parallel=parallel, grid=grid, device=device, dtype=dtype)
        where = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():
                    where[name] = file
        entries = list(tensor_specs(model))
        missing = sorted({name for name, *_ in entries} - set(where))
        if missing:
            raise KeyError(
                f"{path}: the checkpoint lacks {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                "(2D loads transformers' Qwen2 names)"
            )
        with torch.no_grad():
            for name, param, spec, owner in entries:
                with safe_open(where[name], framework="pt") as f:
                    param.copy_(_read_block(f.get_slice(name), name, param, spec, owner, path))
        return model

    def save_pretrained(self, path: str) -> None:
        """A Hugging Face checkpoint (model.safetensors + config.json) that transformers'
        Qwen2ForCausalLM loads; every rank calls it, global rank 0 writes."""
        from safetensors.torch import save_file

        full = self.full_state_dict()
        if dist.is_initialized() and dist.get_rank() != 0:
            return
        os.makedirs(path, exist_ok=True)
        dtype = next(iter(full.values())).dtype
        save_file(
            {k: v.contiguous() for k, v in full.items()}, os.path.join(path, "model.safetensors")
        )
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(hf_checkpoint_map.hf_config(self.config, dtype), f, indent=2)


class _Stage2D(nn.Module):
    """The one stage of a :class:`Qwen2ForCausalLM2D` (what DDP and FSDP2 wrap): the model's
    modules, its decoder layers by index; ids in, this rank's logits block out."""

    def __init__(self, model: Qwen2ForCausalLM2D):
        super().__init__()
        object.__setattr__(self, "_model", model)  # the modules below are its own
        self.embed_tokens, self.norm = model.model.embed_tokens, model.model.norm
        self.layers = nn.ModuleDict({str(i): layer for i, layer in enumerate(model.model.layers)})
        self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model(x, local_logits=True)


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
