"""Random initial weights of a Qwen2 model built from its config, as transformers draws its
Qwen2's: linear and embedding weights from N(0, initializer_range), biases zero, norm weights
one. Each of transformers' tensors (q_proj, k_proj, ...) comes from a generator seeded by
the model's seed and that tensor's name, and a fused tensor (qkv_proj, gate_up_proj) stacks its
pieces' draws, so every set of dims (TP degree, 2D grid, pipeline stages) holds blocks of the same
model, whichever layers a rank builds. The layers' own initialisation (torch.nn's, drawn from
the default stream in construction order) could not give that under pipelining.
"""

from __future__ import annotations

import zlib

import torch
from torch import nn

from tp_ext.layers import RMSNorm, RMSNorm2D, init_from_full_tensors
from tp_ext.models.qwen2.config import Qwen2Config
from tp_ext.models.qwen2.hf_checkpoint_map import checkpoint_map

__all__ = ["draw_seed", "init_weights"]


def draw_seed() -> int:
    """The model's seed: one draw from the default generator, made before any layer is built
    (ranks seeded alike with torch.manual_seed draw the same)."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64))


def init_weights(model: nn.Module, config: Qwen2Config, seed: int) -> None:
    """Set ``model``'s parameters (1D or 2D, any stages) to this rank's blocks of the full
    initial tensors."""
    pieces = checkpoint_map(config)  # our fused or tied tensors -> transformers' tensors
    std = config.initializer_range

    def draw_hf(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        generator = torch.Generator().manual_seed((seed + zlib.crc32(name.encode())) % 2**63)
        return torch.empty(shape).normal_(0.0, std, generator=generator)

    def draw(name: str, shape: tuple[int, ...], owner: nn.Module) -> torch.Tensor:
        if name.endswith(".bias"):
            return torch.zeros(shape)
        if isinstance(owner, (RMSNorm, RMSNorm2D)):
            return torch.ones(shape)
        if name not in pieces:  # named as in transformers (the 2D model's projections)
            return draw_hf(name, shape)
        return torch.cat(
            [draw_hf(p.name, (p.start + p.rows, *shape[1:]))[p.start :] for p in pieces[name]]
        )

    init_from_full_tensors(model, draw)
