"""Pipeline stages of a Hugging Face causal LM: ``parallelize(model, "auto", parallel=state)`` at
``state.pp > 1`` keeps this rank's stages of the (tensor-parallel) model and returns them as a
:class:`StagedCausalLM`, which :class:`tp_ext.training.Trainer` trains with torch's schedules
as it trains the native Qwen2.

Each stage runs the model's *own* forward, so what an architecture does around its decoder
layers stays its own: position ids, rotary tables, causal and sliding-window masks (chosen by
the layer's global index), scaled embeddings (Gemma), learned positions (GPT-2), logit
soft-capping (Gemma 2). The layer list the forward iterates is, for the time of one stage's
forward, this stage's layers behind stand-ins for the layers before it; the last stand-in hands
over the hidden states the previous stage sent, so each layer sees its global index. A stage
other than the first calls the model with a zero ``inputs_embeds`` (the embedding is not there);
what the model adds to it before the layers (GPT-2's position embedding) is discarded by that
hand-over. Modules with parameters that run before the layers belong to the first stage, those
after them (final norm, LM head) to the last; which is which is seen by running the model once.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint as recompute

from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed.mesh import tied_embedding_group
from tp_ext.layers import ParallelLMHead
from tp_ext.layers.context import cp_positions
from tp_ext.parallelize.context import context_of
from tp_ext.parallelize.dataflow import example_token_inputs
from tp_ext.parallelize.decoder_parts import DecoderParts, find_decoder_parts
from tp_ext.sharding import StageSplit, shard_offsets, shard_sizes

__all__ = [
    "is_transformers_model",
    "StagedCausalLM",
    "single_stage",
    "pipelined_forward",
    "tied_copies_group",
]


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a transformers model (transformers is not imported to tell: a model
    can be one only once it is)."""
    transformers = sys.modules.get("transformers")
    return transformers is not None and isinstance(model, transformers.PreTrainedModel)


def single_stage(model: nn.Module, parallel) -> "StagedCausalLM":
    """A Hugging Face causal LM converted by ``parallelize(..., parallel=state)`` at pp = 1, as
    the one pipeline stage :class:`tp_ext.training.Trainer` trains (DDP or FSDP2 on it,
    activation checkpointing, gradient compression, checkpoints that reshard to pp > 1). The
    model stays runnable on its own: it keeps its layer list and its tied weights. Its decoder
    parts are found by running it once on a few tokens (every TP rank together)."""
    return StagedCausalLM(find_decoder_parts(model, example_token_inputs(model)), parallel)


class _Passthrough(nn.Module):
    """Stands in for a module this stage does not hold, or does not run now: returns its input
    (what a skipped decoder layer or final norm passes on)."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


_SKIPPED = _Passthrough()


class _AbsentEmbedding(nn.Module):
    """Stands in for an embedding a later stage does not hold (GPT-2's and OPT's position
    embeddings, which their forwards call even with ``inputs_embeds``): zeros shaped like its
    output (its first tensor argument's shape + ``dim``: ids, positions or OPT's attention mask),
    discarded by the hand-over to the received hidden states."""

    def __init__(self, dim: int, dtype: torch.dtype):
        super().__init__()
        self.dim, self.dtype = dim, dtype

    def forward(self, *args, **kwargs) -> torch.Tensor:
        first = next(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
        return torch.zeros(*first.shape, self.dim, device=first.device, dtype=self.dtype)


class _SequenceGather(nn.Module):
    """Stands in for the final norm of a sequence-parallel stage before the last: the hidden
    states all-gathered over the sequence (see StagedCausalLM._final_stand_in)."""

    def __init__(self, shards):
        super().__init__()
        self.shards = shards

    def forward(self, *args, **kwargs):
        return self.shards.gather(args[0] if args else next(iter(kwargs.values())))


class _HandOver(nn.Module):
    """The stand-in for the layer just before a stage's first: it returns the hidden states the
    previous stage sent, in place of what the model computed from its zero input."""

    def __init__(self, hidden: torch.Tensor):
        super().__init__()
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return self.hidden


class _Recomputed(nn.Module):
    """A decoder layer recomputed in backward (activation checkpointing)."""

    def __init__(self, layer: nn.Module):
        super().__init__()
        self.layer = layer

    def forward(self, *args, **kwargs):
        return recompute(self.layer, *args, use_reentrant=False, **kwargs)


class StagedCausalLM(nn.Module, ParallelModel):
    """This rank's pipeline stages of a Hugging Face causal LM (tensor-parallel inside), with
    what :class:`tp_ext.training.Trainer` and :mod:`tp_ext.pipeline` need: ``stage_split``,
    ``stage_ids``, :meth:`stage_modules`, :meth:`stage_forward` and the tied-embedding copies.

    Its parameters carry transformers' own names (its children are the model's, so
    ``tp_ext.layers.full_state_dict(stages)`` is this rank's part of the model's state dict,
    unsharded): decoder layers keep their global index. A tied LM head has its own copy on the
    last stage, equal to the embedding's; the Trainer sums the two gradients.
    :meth:`forward` runs the stages one after another for inference (no autograd between ranks).
    """

    def __init__(
        self,
        parts: DecoderParts,
        parallel,
        *,
        virtual_stages: int = 1,
        pipeline_split=None,
        stage_order: str = "loop",
        sequence_shards=None,
    ) -> None:
        super().__init__()
        model = parts.model
        object.__setattr__(self, "hf_model", model)  # the user's object, now pruned
        self.config, self.parallel = model.config, parallel
        self.stage_split = StageSplit(
            self.config.num_hidden_layers, parallel.pp, virtual_stages, pipeline_split, stage_order
        )
        self.stage_ids = self.stage_split.stages_of(parallel.pp_rank)
        self._parts = parts
        self.has_first = 0 in self.stage_ids
        self.has_last = self.stage_split.last_stage in self.stage_ids
        # one stage holds both ends of a tie: the model keeps its one tensor
        tied = bool(getattr(self.config, "tie_word_embeddings", False))
        self.tied_across_stages = tied and self.stage_split.num_stages > 1
        self.checkpoint_aliases: dict = {}
        # sequence parallelism: the hidden states between stages are this TP rank's sequence
        # shard; the whole length (set by whoever runs the stages) is what the model's own
        # positions and masks are computed for
        self._sequence_shards = sequence_shards
        self.sequence_length: Optional[int] = None
        self._untie_head()
        self._prune()
        for attr, child in model.named_children():  # transformers' names for the parameters
            self.add_module(attr, child)
        self.activation_checkpointing = False

    # -- building --------------------------------------------------------------------------------

    def _untie_head(self) -> None:
        """Under pipelining each stage owns its parameters (DDP and FSDP2 wrap stage modules):
        the LM head takes its own copy of a tied embedding."""
        head = self.hf_model.get_output_embeddings()
        if not self.tied_across_stages or head is None:
            self.tied_across_stages = False
            return
        # the checkpoint holds the tie once, under the embedding's name: the head's copy is
        # read from it, and a merged save writes it once (tp_ext.checkpoint.checkpoint_map)
        names = {id(m): n for n, m in self.hf_model.named_modules(remove_duplicate=False)}
        embedding = self.hf_model.get_input_embeddings()
        self.checkpoint_aliases = {f"{names[id(head)]}.weight": f"{names[id(embedding)]}.weight"}
        if not self.has_last:
            return
        if not isinstance(head, ParallelLMHead):
            raise ValueError(
                "pipeline parallelism with tied embeddings needs the LM head split by "
                f"vocabulary ('vocab' style); {type(self.hf_model).__name__}'s head is "
                f"{type(head).__name__}"
            )
        head.weight = nn.Parameter(head.weight.detach().clone())

    def _prune(self) -> None:
        parts = self._parts
        held = {i for s in self.stage_ids for i in self.stage_split.layers_of(s)}
        layers = parts.layers
        if len(held) < len(layers):  # one stage with every layer keeps the model runnable
            kept = nn.ModuleDict({str(i): layers[i] for i in sorted(held)})
            setattr(parts.layers_owner, parts.layers_name, kept)
        for parent, attr in [] if self.has_first else parts.before:
            setattr(parent, attr, self._absent_before(getattr(parent, attr)))
        head = self.hf_model.get_output_embeddings()
        for parent, attr in [] if self.has_last else parts.after:
            # the head is called only by the last stage's forward; a final norm passes through
            setattr(parent, attr, None if getattr(parent, attr) is head else self._final_stand_in())

    def _absent_before(self, child: nn.Module) -> nn.Module:
        """What stands in for a module before the layers (an embedding) on a later stage."""
        dim = getattr(child, "embedding_dim", None)
        dtype = next(child.parameters()).dtype
        return _AbsentEmbedding(dim, dtype) if dim else _Passthrough()

    def _final_stand_in(self) -> nn.Module:
        """What stands in for the final norm on a stage before the last: it passes the hidden
        states on; under sequence parallelism gathered over the sequence first, since the
        model's own code may reshape them to the whole sequence after the norm (GPT-2 does);
        the stage then sends its shard of them (:meth:`stage_forward`)."""
        shards = self._sequence_shards
        return _Passthrough() if shards is None else _SequenceGather(shards)

    # -- what the pipeline code reads -------------------------------------------------------------

    @property
    def layers(self) -> nn.Module:
        """This rank's decoder layers: a ModuleDict by global index, or the model's own
        ModuleList when it holds them all (one stage)."""
        return getattr(self._parts.layers_owner, self._parts.layers_name)

    def layer(self, index: int) -> nn.Module:
        layers = self.layers
        return layers[index] if isinstance(layers, nn.ModuleList) else layers[str(index)]

    def _head(self) -> Optional[nn.Module]:
        """This rank's LM head (None when it does not hold the last stage)."""
        return self.hf_model.get_output_embeddings() if self.has_last else None

    @property
    def is_pipelined(self) -> bool:
        return True

    loss_kind = LossKind.VOCAB_SHARD  # the last stage's head is split by vocabulary
    takes_attention_mask = True  # a padded batch's mask goes to the model's own forward
    local_logits = True  # the last stage gives this rank's vocabulary shard of the logits

    @property
    def cp_group(self):
        """The model's CP group when ``parallelize`` gave it context parallelism, else None."""
        context = context_of(self.hf_model)
        return None if context is None else context.group

    def loss_positions(self, length: int) -> Optional[torch.Tensor]:
        """This CP rank's positions, whose logits the last stage gives (None without CP)."""
        cp = self.cp_group
        return None if cp is None else cp_positions(length, group=cp)

    @property
    def sequence_parallel(self) -> bool:
        return self._sequence_shards is not None

    def local_sequence(self, length: int) -> int:
        """The sequence length of the hidden states a stage sends for ``length`` tokens: this
        TP rank's shard under sequence parallelism, this CP rank's positions under context
        parallelism, else all of them."""
        length = self._context_length(length)
        if not self.sequence_parallel:
            return length
        return shard_sizes(length, self.parallel.tp)[self.parallel.tp_rank]

    def _context_length(self, length: int) -> int:
        """The positions of a ``length``-token sequence this CP rank holds (all without CP)."""
        if self.cp_group is None:
            return length
        return len(cp_positions(length, group=self.cp_group))

    def activation_shape(self, batch: int, length: int) -> tuple:
        return (batch, self.local_sequence(length), self.config.hidden_size)

    def output_shape(self, batch: int, length: int) -> tuple:
        positions = self.loss_positions(length)
        rows = length if positions is None else len(positions)
        vocab = shard_sizes(self.config.vocab_size, self.parallel.tp)[self.parallel.tp_rank]
        return (batch, rows, vocab)

    def tied_weights(self) -> list[torch.Tensor]:
        """The copies of a tied embedding this rank holds (see the native model's)."""
        if not self.tied_across_stages:
            return []
        held = []
        if self.has_first:
            held.append(self.hf_model.get_input_embeddings().weight)
        if self.has_last:
            held.append(self._head().weight)
        return held

    def tied_group(self):
        return tied_copies_group(self)

    @property
    def pipeline_group(self):
        return self.parallel.pp_group

    def stage_modules(self) -> list[nn.Module]:
        return [_Stage(self, stage) for stage in self.stage_ids]

    def stage_parts(self, stage: int) -> list[tuple[str, nn.Module]]:
        """``(name, module)`` of what ``stage`` owns besides its decoder layers."""
        split = self.stage_split
        pairs = (self._parts.before if stage == 0 else []) + (
            self._parts.after if stage == split.last_stage else []
        )
        names = {id(m): n for n, m in self.named_modules()}
        return [(names[id(getattr(p, a))], getattr(p, a)) for p, a in pairs]

    # -- running a stage --------------------------------------------------------------------------

    def stage_forward(
        self, stage: int, x: torch.Tensor, attention_mask=None, **decode
    ) -> torch.Tensor:
        """Stage ``stage``: token ids (first stage) or the previous stage's hidden states in;
        hidden states, or this rank's vocabulary shard of the logits (last stage), out.
        ``attention_mask``: a padded batch's mask [batch, seq] (every stage is given the whole
        sequence's), for the model's own forward. ``decode``: what :func:`tp_ext.generate`
        passes the model's own forward for one step of decoding (with ``attention_mask``:
        ``position_ids``, ``cache_position`` and the KV cache); the last stage then gives
        the logits of the last position only."""
        if stage not in self.stage_ids:
            raise ValueError(
                f"stage {stage} is not on this rank; it holds stages {self.stage_ids} of "
                f"{self.stage_split.num_stages}"
            )
        inputs = self._stage_inputs(stage, x)
        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask
        inputs.update(decode, use_cache=bool(decode))
        with self._running(stage, None if stage == 0 else x), self._context_positions(stage):
            if stage == self.stage_split.last_stage:
                if decode and _takes(self.hf_model, "logits_to_keep"):
                    inputs["logits_to_keep"] = 1
                out = self.hf_model(**inputs).logits
                out = out[:, -1:] if decode else out
            else:
                base = getattr(self.hf_model, self.hf_model.base_model_prefix)
                out = base(**inputs).last_hidden_state
                if self.sequence_parallel:  # gathered by the final norm's stand-in
                    out = self._own_shard(out)
        # torch's stages detach their outputs in place after backward, which a view refuses
        # (GPT-2 returns its hidden states through .view)
        return out.clone() if out._is_view() else out

    def _stage_inputs(self, stage: int, x: torch.Tensor) -> dict:
        """The model's own inputs for stage ``stage`` (its first takes the ids); a later stage's
        zero input only carries the shape (see the module's docstring)."""
        return {"input_ids": x} if stage == 0 else {"inputs_embeds": self._zero_input(x)}

    def _own_shard(self, hidden: torch.Tensor) -> torch.Tensor:
        """This TP rank's sequence shard of the whole sequence's ``hidden`` states (its gradient
        flows back into those rows only; the gather before it sums the ranks' rows)."""
        tp, rank = self.parallel.tp, self.parallel.tp_rank
        length = hidden.size(-2)
        return hidden.narrow(-2, shard_offsets(length, tp)[rank], shard_sizes(length, tp)[rank])

    def _zero_input(self, received: torch.Tensor) -> torch.Tensor:
        """A later stage's stand-in input: zeros of the whole sequence's shape (under context
        parallelism: this CP rank's positions; ``received`` is this rank's sequence shard of
        them under sequence parallelism, whose sizes the norms' gathers are told)."""
        if not self.sequence_parallel:
            return torch.zeros_like(received)
        whole = self.sequence_length
        length = None if whole is None else self._context_length(whole)  # this CP rank's
        if length is None or self.local_sequence(whole) != received.size(-2):
            raise RuntimeError(
                f"a sequence-parallel stage received {received.size(-2)} positions, its shard of "
                f"sequence_length={whole}: set the stages' sequence_length to the token count "
                "(tp_ext's pipeline runner and forward do)"
            )
        self._sequence_shards.set_length(length, received.shape[:-2])
        shape = (*received.shape[:-2], length, received.size(-1))
        return received.new_zeros(shape)

    @contextlib.contextmanager
    def _context_positions(self, stage: int):
        """Under context parallelism a stage after the first receives this rank's positions
        already: the decoder's hook is told the whole sequence's length instead of cutting."""
        hook = context_of(self.hf_model)
        if hook is None or stage == 0:
            yield
            return
        if self.sequence_length is None:
            raise RuntimeError(
                f"stage {stage} under context parallelism needs the whole sequence's length: set "
                "the stages' sequence_length (tp_ext's pipeline runner and forward do)"
            )
        hook.whole_length = self.sequence_length
        try:
            yield
        finally:
            hook.whole_length = None

    @contextlib.contextmanager
    def _running(self, stage: int, received: Optional[torch.Tensor]):
        """For one forward: the layer list the model iterates is this stage's layers behind
        stand-ins (the last handing over ``received``); the final norm passes through on a
        stage before the last; the LM head gives this rank's vocabulary shard."""
        parts, split = self._parts, self.stage_split
        start = split.layers_of(stage).start
        stage_layers = [self.layer(i) for i in split.layers_of(stage)]
        if self.activation_checkpointing and torch.is_grad_enabled():
            stage_layers = [_Recomputed(layer) for layer in stage_layers]
        lead = [_SKIPPED] * max(start - 1, 0)  # one stateless stand-in, listed once per layer
        if start > 0:
            lead.append(_HandOver(received))
        owner, name = parts.layers_owner, parts.layers_name
        kept = getattr(owner, name)
        swapped = [(owner, name, kept)]
        owner._modules[name] = nn.ModuleList(lead + stage_layers)
        if stage != split.last_stage and self.has_last:  # the V order: both ends on one rank
            for parent, attr in parts.after:
                swapped.append((parent, attr, getattr(parent, attr)))
                parent._modules[attr] = self._final_stand_in()
        head = self._head() if stage == split.last_stage else None
        gather = getattr(head, "gather_output", None)
        local = self.local_logits and isinstance(head, ParallelLMHead)
        if local:
            head.gather_output = False
        try:
            yield
        finally:
            for parent, attr, module in reversed(swapped):
                parent._modules[attr] = module
            if local:
                head.gather_output = gather

    def forward(self, input_ids: torch.Tensor, local_logits: bool = False) -> torch.Tensor:
        """Logits of ``input_ids`` (every rank of a pipeline passes the same ids and gets the
        last stage's logits); inference only: train with :class:`tp_ext.training.Trainer`."""
        head = self._head()
        gather = head.gather_features if isinstance(head, ParallelLMHead) else None
        return pipelined_forward(self, input_ids, local_logits, self.stage_forward, gather)


class _Stage(nn.Module):
    """Pipeline stage ``stage`` of a :class:`StagedCausalLM`: the module torch's PipelineStage,
    DDP and FSDP2 wrap (it owns the stage's decoder layers, in ``layers``, and its embedding or
    final norm and head)."""

    def __init__(self, model: StagedCausalLM, stage: int):
        super().__init__()
        object.__setattr__(self, "_model", model)
        self.stage = stage
        self.layers = nn.ModuleDict(
            {str(i): model.layer(i) for i in model.stage_split.layers_of(stage)}
        )
        for name, module in model.stage_parts(stage):
            self.add_module(name.replace(".", "_"), module)

    def forward(self, x: torch.Tensor, attention_mask=None) -> torch.Tensor:
        return self._model.stage_forward(self.stage, x, attention_mask)


def _takes(module: nn.Module, argument: str) -> bool:
    """Whether ``module``'s forward has a parameter named ``argument`` (read once per class:
    decoding asks at every step)."""
    return argument in _forward_parameters(type(module))


@functools.lru_cache(maxsize=None)
def _forward_parameters(cls) -> frozenset:
    return frozenset(inspect.signature(cls.forward).parameters)


def tied_copies_group(model):
    """The group over which ``model``'s two copies of a tied embedding (first and last stage) sum
    their gradients; None when untied, or when both copies are on pipeline rank 0."""
    split = model.stage_split
    if not model.tied_across_stages or split.rank_of(split.last_stage) == 0:
        return None
    return tied_embedding_group(model.parallel)


def _run_stages(model, input_ids, stage_forward):
    """This rank's stages of ``model`` on ``input_ids``, in order, receiving each from and
    sending it to the neighbour ranks (shaped as the model's ``activation_shape``); the last
    stage's output where this rank holds it."""
    split, group, me = model.stage_split, model.parallel.pp_group, model.parallel.pp_rank
    param = next(model.parameters())
    h = None
    for stage in range(split.num_stages):
        if split.rank_of(stage) != me:
            continue
        if stage > 0 and split.rank_of(stage - 1) != me:
            shape = model.activation_shape(*input_ids.shape)
            h = torch.empty(shape, device=param.device, dtype=param.dtype)
            dist.recv(h, dist.get_global_rank(group, split.rank_of(stage - 1)), group=group)
        h = stage_forward(stage, input_ids if stage == 0 else h)
        if stage < split.last_stage and split.rank_of(stage + 1) != me:
            dist.send(
                h.contiguous(), dist.get_global_rank(group, split.rank_of(stage + 1)), group=group
            )
    return h


def pipelined_forward(model, input_ids, local_logits: bool, stage_forward, gather_logits):
    """Run ``model``'s stages one after another over its pipeline group for inference (the
    hidden states sent to the next stage's rank) and return the last stage's logits on every
    rank of the pipeline (full, or this rank's part of them with ``local_logits``: the model's
    ``output_shape``). ``stage_forward(stage, x)`` runs one stage; ``gather_logits`` (on the
    last stage's rank) gathers the parts into full logits."""
    if torch.is_grad_enabled() and any(p.requires_grad for p in model.parameters()):
        raise RuntimeError(
            "forward of a pipelined model runs the stages for inference only (no autograd "
            "between ranks): call it under torch.no_grad(), or train with "
            "tp_ext.training.Trainer(model, parallel=state)"
        )
    split, group, me = model.stage_split, model.parallel.pp_group, model.parallel.pp_rank
    batch, seq = input_ids.shape
    param = next(model.parameters())
    model.sequence_length = seq  # what the stages after the first cannot see
    try:
        h = _run_stages(model, input_ids, stage_forward)
    finally:
        model.sequence_length = None  # this forward's, not the next one's
    owner = split.rank_of(split.last_stage)
    if me == owner and not local_logits:
        h = gather_logits(h)
    if me != owner:  # under CP: the logits of this rank's positions
        positions = model.loss_positions(seq)
        rows = seq if positions is None else len(positions)
        whole = (batch, rows, model.config.vocab_size)
        shape = model.output_shape(batch, seq) if local_logits else whole
        h = torch.empty(shape, device=input_ids.device, dtype=param.dtype)
    h = h.contiguous()
    dist.broadcast(h, dist.get_global_rank(group, owner), group=group)
    return h
