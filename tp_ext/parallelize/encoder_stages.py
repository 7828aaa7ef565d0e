"""Pipeline stages of a Hugging Face encoder with a task head (BERT and RoBERTa: masked LM,
sequence and token classification; ViT: image classification), for
:class:`tp_ext.training.Trainer` with a ``loss_fn``: ``parallelize(model, "auto",
parallel=state)`` at ``state.pp > 1`` returns a :class:`StagedEncoder`.

The stages are a causal LM's (:class:`~tp_ext.parallelize.stages.StagedCausalLM`: the model's
own forward over this stage's layers behind stand-ins, the tied embedding's copies, the
schedules), with what differs for an encoder:

- the first stage takes the model's own input (token ids, or an image's ``pixel_values``); a later
  stage calls the model with zeros of that shape, and what stands in for the modules before the
  layers (the embeddings) gives zeros shaped like the hidden states it received, while reading
  as the module it replaces (ViT's forward reads its patch projection's dtype);
- the last stage gives the head's whole output (masked-LM logits gathered over the vocabulary,
  or class logits), which the Trainer's ``loss_fn`` scores (``LossKind.MODEL_OUTPUT``).
"""

from __future__ import annotations

import torch
from torch import nn

from tp_ext.contract import LossKind
from tp_ext.parallelize.dataflow import example_token_inputs
from tp_ext.parallelize.decoder_parts import DecoderParts
from tp_ext.parallelize.stages import StagedCausalLM

__all__ = ["StagedEncoder", "is_encoder"]


def is_encoder(model: nn.Module) -> bool:
    """A transformers model that does not generate and has no decoder: an encoder with a head."""
    config = getattr(model, "config", None)
    generates = getattr(model, "can_generate", lambda: True)()
    return not generates and not getattr(config, "is_encoder_decoder", False)


class _AbsentBefore(nn.Module):
    """Stands in for a module before the layers (an embedding) on a later stage: zeros shaped like
    the hidden states the stage received (which the hand-over puts back), while reading as the
    module it replaces, moved to the meta device, unregistered (ViT's forward reads its patch
    projection's dtype; BERT's its token-type buffer)."""

    def __init__(self, replaced: nn.Module, owner: "StagedEncoder"):
        super().__init__()
        object.__setattr__(self, "_replaced", replaced.to("meta"))  # this rank's copy: freed
        object.__setattr__(self, "_owner", owner)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_replaced"), name)

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.zeros_like(self._owner._received)


class StagedEncoder(StagedCausalLM):
    """This rank's pipeline stages of a Hugging Face encoder with a task head (see the module's
    docstring). ``input_name``: the model's input (``input_ids`` or ``pixel_values``)."""

    loss_kind = LossKind.MODEL_OUTPUT
    local_logits = False  # the head's whole output, for the user's loss

    def __init__(self, parts: DecoderParts, parallel, **options) -> None:
        if options.get("sequence_shards") is not None:
            raise ValueError(
                f"parallelize: sequence_parallel=True with pp={parallel.pp} on "
                f"{type(parts.model).__name__}: an encoder's stages do not split the sequence "
                "yet; use sequence_parallel=False, or pp=1 (ViT's sequence splits there)"
            )
        _, kwargs = example_token_inputs(parts.model)
        output_dims, image_tokens = _traced_shapes(parts.model, parts, kwargs)  # still whole
        super().__init__(parts, parallel, **options)
        self.input_name = "pixel_values" if "pixel_values" in kwargs else "input_ids"
        self._output_dims, self._image_tokens = output_dims, image_tokens
        object.__setattr__(self, "_received", None)  # a later stage's input, for the stand-ins

    def _absent_before(self, child: nn.Module) -> nn.Module:
        return _AbsentBefore(child, self)

    def _stage_inputs(self, stage: int, x: torch.Tensor) -> dict:
        if stage == 0:
            return {self.input_name: x}
        object.__setattr__(self, "_received", x)  # what the stand-ins give zeros like
        batch = x.size(0)
        if self.input_name == "pixel_values":
            config = self.config
            size = config.image_size
            height, width = (size, size) if isinstance(size, int) else tuple(size)
            shape = (batch, config.num_channels, height, width)
            return {"pixel_values": x.new_zeros(shape)}
        return {"input_ids": torch.zeros(x.shape[:2], dtype=torch.long, device=x.device)}

    def activation_shape(self, batch: int, length: int) -> tuple:
        tokens = self._image_tokens if self._image_tokens is not None else length
        return (batch, tokens, self.config.hidden_size)

    def output_shape(self, batch: int, length: int) -> tuple:
        """The head's output: ``[batch, classes]`` (a sequence's or an image's classes) or
        ``[batch, tokens, classes]`` (masked-LM logits over the vocabulary, token classes)."""
        *per_token, classes = self._output_dims
        if not per_token:
            return (batch, classes)
        tokens = self._image_tokens if self._image_tokens is not None else length
        return (batch, tokens, classes)

    def forward(self, *args, **kwargs):
        raise RuntimeError(
            f"{type(self).__name__}: the pipeline stages of an encoder run under "
            "tp_ext.training.Trainer(model, parallel=state, loss_fn=...); for inference, "
            "convert the model with pp=1"
        )


def _traced_shapes(model: nn.Module, parts: DecoderParts, kwargs: dict) -> tuple:
    """``(the head's output dims after the batch, the layers' positions for an image model or
    None)``, from one forward on the example inputs (every TP rank runs it together)."""
    seen = {}

    def first_layer(module, inputs, output):
        seen.setdefault("tokens", inputs[0].size(1))

    handle = parts.layers[0].register_forward_hook(first_layer)
    try:
        with torch.no_grad():
            logits = model(**kwargs).logits
    finally:
        handle.remove()
    image = "pixel_values" in kwargs
    return tuple(logits.shape[1:]), seen["tokens"] if image else None
