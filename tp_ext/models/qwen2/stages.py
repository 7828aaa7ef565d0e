"""What a Qwen2 model (1D or 2D) builds for its pipeline stages: which stages this rank holds,
which decoder layers they run, whether it holds the embedding and the head, and the decoder
layers by their index in the full model."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tp_ext.sharding import StageSplit

__all__ = ["Layers", "HeldStages", "Stage"]


class Layers(nn.ModuleDict):
    """Decoder layers keyed by their index in the full model, so a pipeline stage that holds
    layers 4..7 names them ``model.layers.4`` .. ``model.layers.7`` as the checkpoint does.
    Indexing takes the global index; iteration yields the layers in order."""

    def __getitem__(self, index) -> nn.Module:
        return super().__getitem__(str(index))

    def __iter__(self):
        return iter(self.values())

    def indices(self) -> list[int]:
        return [int(key) for key in self.keys()]


@dataclasses.dataclass(frozen=True)
class HeldStages:
    """This rank's part of a pipeline over ``num_layers`` decoder layers: ``split`` (the
    StageSplit), ``stage_ids`` (the stages it holds), ``layer_ids`` (their layers),
    ``has_embedding`` (stage 0), ``has_head`` (the last stage)."""

    split: StageSplit
    stage_ids: list
    layer_ids: list
    has_embedding: bool
    has_head: bool

    @classmethod
    def of(cls, num_layers: int, parallel, virtual_stages=1, pipeline_split=None, order="loop"):
        """Those of the pipeline rank ``parallel`` places this process at (all stages without
        ``parallel``)."""
        pp, pp_rank = (1, 0) if parallel is None else (parallel.pp, parallel.pp_rank)
        split = StageSplit(num_layers, pp, virtual_stages, pipeline_split, order)
        stage_ids = split.stages_of(pp_rank)
        layer_ids = sorted(i for s in stage_ids for i in split.layers_of(s))
        return cls(split, stage_ids, layer_ids, 0 in stage_ids, split.last_stage in stage_ids)


class Stage(nn.Module):
    """Pipeline stage ``stage`` of a Qwen2 model, 1D or 2D (what PipelineStage, DDP and FSDP2
    wrap): the embedding on the first stage, the stage's decoder layers by index, the norm and
    head on the last; its forward is ``model.stage_forward``."""

    def __init__(self, model: nn.Module, stage: int):
        super().__init__()
        object.__setattr__(self, "_model", model)  # not a child: its other stages are not ours
        self.stage = stage
        split = model.stage_split
        if stage == 0:
            self.embed_tokens = model.model.embed_tokens
        self.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in split.layers_of(stage)})
        if stage == split.last_stage:
            self.norm, self.lm_head = model.model.norm, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._model.stage_forward(self.stage, x)
