"""A Hugging Face model a job trains (``tp-ext train --model DIR_OR_CONFIG``, or a job config whose
``model:`` is such a path): its config, and the checkpoint its weights come from, if any. Built
on every rank by :meth:`HFModelSource.build`: the model of the config (the same random weights
on every rank for a seed, so at every layout), converted by ``parallelize(model, "auto",
parallel=state)`` into this rank's shards (its pipeline stages at pp > 1), then, from a
checkpoint directory, each rank's own slices read from the safetensors files
(:func:`tp_ext.checkpoint.load_hf_checkpoint`)."""

from __future__ import annotations

import dataclasses
import functools
import glob
import os
from typing import Any, Optional

import torch
from torch import nn

from tp_ext.checkpoint import load_hf_checkpoint
from tp_ext.checkpoint.layout import own_names_map
from tp_ext.checkpoint.safetensors_io import SafetensorsFiles
from tp_ext.models.hf.config import load_hf_config, max_positions, tp_problem
from tp_ext.models.hf.shards import expert_count, meta_model
from tp_ext.parallelize import parallelize
from tp_ext.validation import ConfigError

__all__ = ["HFModelSource"]


@dataclasses.dataclass(frozen=True)
class HFModelSource:
    """``path``: the directory or config.json given; ``hf_config``: its transformers config;
    ``weights``: the directory holding its safetensors (None: random initialisation)."""

    path: str
    hf_config: Any
    weights: Optional[str] = None

    @classmethod
    def from_path(cls, path: str) -> "HFModelSource":
        path = os.fspath(path)
        config = load_hf_config(path)
        weights = None
        if os.path.isdir(path) and glob.glob(os.path.join(path, "*.safetensors")):
            weights = path
        return cls(path, config, weights)

    # -- what the job code reads of a model config (as of tp_ext's Qwen2Config) --------------

    @property
    def architecture(self) -> str:
        return type(self.hf_config).__name__.removesuffix("Config")

    @property
    def num_hidden_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def max_position_embeddings(self) -> int:
        return max_positions(self.hf_config)

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer (0: a dense model)."""
        return expert_count(self.hf_config)

    def check_tp(self, tp: int) -> None:
        """Attention heads split in whole heads over ``tp`` ranks (KV heads shared by ranks
        where fewer), and at least one vocabulary row per rank."""
        problem = tp_problem(self.hf_config, tp)
        if problem is not None:
            raise ConfigError(f"tp={tp} does not fit {self.architecture}: {problem}")

    # -- building it on this rank ----------------------------------------------------------------

    def build(self, parallel, *, dtype: torch.dtype, seed: int, **stage_options) -> nn.Module:
        """This rank's part of the model (``stage_options``: virtual_stages, stage_order,
        pipeline_split), its weights the checkpoint's or, without one, drawn from ``seed`` as
        transformers initialises them (the whole model on every rank, so equal at every
        layout)."""
        return self.build_and_load(parallel, dtype=dtype, seed=seed, **stage_options)[0]

    def build_and_load(
        self,
        parallel,
        *,
        dtype: torch.dtype,
        seed: int,
        weights: Optional[str] = None,
        **stage_options,
    ) -> tuple[nn.Module, Optional[dict]]:
        """(:meth:`build`'s model, the load's report: None without a checkpoint). ``weights``: a
        checkpoint directory other than the source's. Each rank reads its own slices of the
        files when they carry the modules' names; a checkpoint transformers saved in an older
        form it converts on load (Mixtral's experts one tensor each) is read whole by
        transformers' ``from_pretrained`` on every rank first, then sliced."""
        from transformers import AutoModelForCausalLM

        weights = self.weights if weights is None else weights
        torch.manual_seed(seed)
        whole = weights is not None and not self._slices_readable(weights)
        if whole:
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config).to(dtype)
        model.train()
        model = parallelize(model, "auto", parallel=parallel, **stage_options)
        if weights is None:
            return model, None
        if whole:
            files = SafetensorsFiles(weights)
            size = files.nbytes()
            return model, {"read_bytes": size, "checkpoint_bytes": size, "read_whole": True}
        return model, self.load_weights(model, weights)

    @functools.cached_property
    def _meta_names(self) -> tuple[frozenset, frozenset]:
        """(the checkpoint names the whole model's tensors are read from, its state_dict keys),
        from one build on the meta device (shared by the checks of a load)."""
        model = meta_model(self.hf_config)
        layout = own_names_map(model)
        pieces = frozenset(piece.name for pieces in layout.values() for piece in pieces)
        return pieces, frozenset(model.state_dict().keys())

    def _slices_readable(self, path: str) -> bool:
        """Whether the checkpoint at ``path`` holds every tensor under its module's name."""
        return self._meta_names[0] <= SafetensorsFiles(path).names()

    def load_weights(self, model: nn.Module, path: Optional[str] = None) -> dict:
        """This rank's slices of the checkpoint at ``path`` (default: the source's) read into
        ``model`` (built by :meth:`build`); a pipeline stage's model checks the files against
        the whole model's tensor names. Returns load_hf_checkpoint's report."""
        path = self.weights if path is None else path
        whole = ()
        if getattr(model, "pipeline_group", None) is not None:
            whole = self._meta_names[1]
        return load_hf_checkpoint(model, path, progress=False, used_elsewhere=whole)
