"""A Hugging Face model a job trains (``tp-ext train --model DIR_OR_CONFIG``, or a job config whose
``model:`` is such a path): its config, and the checkpoint its weights come from, if any. Built
on every rank by :meth:`HFModelSource.build`: the model of the config (the same random weights
on every rank for a seed, so at any dims), converted by ``parallelize(model, "auto",
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
from tp_ext.checkpoint.checkpoint_map import own_names_map
from tp_ext.checkpoint.hf_conversions import converted_files
from tp_ext.checkpoint.safetensors_io import SafetensorsFiles
from tp_ext.models.hf.config import load_hf_config, max_positions, tp_problem
from tp_ext.models.hf.shards import expert_count, full_plan, meta_model, model_shards
from tp_ext.parallelize import parallelize
from tp_ext.parallelize.decoder_parts import decoder_parts_by_name
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
        transformers initialises them (the whole model on every rank, so equal at any
        dims)."""
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
        checkpoint directory other than the source's. When the files carry the modules' names,
        or a form transformers' conversion mapping turns into them by stacking experts
        (Mixtral's experts one tensor each: read through
        :func:`~tp_ext.checkpoint.hf_conversions.converted_files`), the model is built on the
        meta device, converted there, and only this rank's shards are allocated and read from
        the files (no rank ever holds the whole model); a checkpoint in any other form
        transformers converts on load is read whole by its ``from_pretrained`` on every rank
        first, then sliced."""
        from transformers import AutoModelForCausalLM

        weights = self.weights if weights is None else weights
        view = None if weights is None else self._files_view(weights)
        if weights is not None and view is not False:  # each rank reads its slices
            model = self._build_on_meta(parallel, dtype, stage_options)
            return model, self._load(model, weights, view)
        torch.manual_seed(seed)
        if weights is not None:
            model = AutoModelForCausalLM.from_pretrained(weights, dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_config(self.hf_config).to(dtype)
        model.train()
        model = parallelize(model, "auto", parallel=parallel, **stage_options)
        if weights is None:
            return model, None
        size = SafetensorsFiles(weights).nbytes()
        return model, {"read_bytes": size, "checkpoint_bytes": size, "read_whole": True}

    def _build_on_meta(self, parallel, dtype: torch.dtype, stage_options: dict) -> nn.Module:
        """This rank's shards of the model, allocated on ``parallel.device`` but not filled: the
        model is built and converted on the meta device by the plan "auto" takes on a narrow
        copy of the architecture (a model on the meta device cannot run its own trace;
        ``tp-ext plan`` counts shards the same way), then materialised."""
        from transformers import AutoModelForCausalLM

        structure = model_shards(self.hf_config).structure
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.hf_config, dtype=dtype)
        model.train()
        parts = None
        if parallel.pp > 1:
            parts = decoder_parts_by_name(
                model, structure.layers_path, structure.first, structure.last
            )
        plan = full_plan(structure, model)
        model = parallelize(model, plan, parallel=parallel, decoder_parts=parts, **stage_options)
        materialize(model, parallel.device)
        return model

    @functools.cached_property
    def _meta_names(self) -> tuple[frozenset, frozenset]:
        """(the checkpoint names the whole model's tensors are read from, its state_dict keys),
        from one build on the meta device (shared by the checks of a load)."""
        model = meta_model(self.hf_config)
        cmap = own_names_map(model)
        pieces = frozenset(piece.name for pieces in cmap.values() for piece in pieces)
        return pieces, frozenset(model.state_dict().keys())

    def _files_view(self, path: str):
        """How the checkpoint at ``path`` is read by slices (``load_hf_checkpoint``'s
        ``files_view``): None when it holds every tensor under its module's name; a function
        giving the :func:`~tp_ext.checkpoint.hf_conversions.converted_files` view when
        transformers' conversion mapping (experts one tensor each) gives them; False when
        neither does (read whole by transformers)."""
        files = SafetensorsFiles(path)
        if self._meta_names[0] <= files.names():
            return None
        model = meta_model(self.hf_config)
        view = converted_files(files, model)
        if view is not None and self._meta_names[0] <= view.names():
            return functools.partial(converted_files, model=model)
        return False

    def load_weights(self, model: nn.Module, path: Optional[str] = None) -> dict:
        """This rank's slices of the checkpoint at ``path`` (default: the source's) read into
        ``model`` (built by :meth:`build`), through transformers' conversion mapping where the
        files hold another form; a pipeline stage's model checks the files against the whole
        model's tensor names. Returns load_hf_checkpoint's report."""
        path = self.weights if path is None else path
        return self._load(model, path, self._files_view(path))

    def _load(self, model: nn.Module, path: str, view) -> dict:
        whole = ()
        if getattr(model, "pipeline_group", None) is not None:
            whole = self._meta_names[1]
        return load_hf_checkpoint(
            model, path, progress=False, used_elsewhere=whole, files_view=view or None
        )


def _materialized(param: nn.Parameter, device) -> nn.Parameter:
    """``param`` with storage on ``device`` (a new Parameter: a meta tensor's data cannot be
    swapped in place), keeping what ``parallelize`` put on it: its gradient hooks (the TP
    all-reduce of per-head and sequence-parallel norms) and its attributes."""
    data = torch.empty_like(param, device=device) if param.is_meta else param.detach().to(device)
    new = nn.Parameter(data, requires_grad=param.requires_grad)
    new.__dict__.update(param.__dict__)
    for hook in (param._backward_hooks or {}).values():
        new.register_hook(hook)
    for hook in (getattr(param, "_post_accumulate_grad_hooks", None) or {}).values():
        new.register_post_accumulate_grad_hook(hook)
    return new


def materialize(model: nn.Module, device) -> None:
    """Give every tensor of ``model`` left on the meta device storage on ``device`` (contents
    undefined until a checkpoint fills them; tied parameters stay one tensor), move the others
    there, and recompute the non-persistent buffers a checkpoint does not hold (rotary tables)
    by transformers' own ``_init_weights``, as its ``from_pretrained`` does after building a
    model on the meta device."""
    hf_model = getattr(model, "hf_model", model)
    made: dict = {}  # id of a meta parameter -> its materialised one (ties stay tied)
    rebuilt = []  # modules whose buffers were on the meta device
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is None:
                continue
            if id(param) not in made:
                made[id(param)] = _materialized(param, device)
            module._parameters[name] = made[id(param)]
        for name, buffer in module._buffers.items():
            if buffer is None:
                continue
            if buffer.is_meta:
                rebuilt.append(module)
                module._buffers[name] = torch.empty_like(buffer, device=device)
            else:
                module._buffers[name] = buffer.to(device)
    with torch.no_grad():
        for module in dict.fromkeys(rebuilt):
            hf_model._init_weights(module)
