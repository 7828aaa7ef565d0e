"""What :func:`tp_ext.generate` needs of a model, one adapter per kind: tp_ext's native Qwen2
(:class:`NativeDecoder`, its own KV caches) and a Hugging Face causal LM converted by
``parallelize`` (:class:`HFDecoder`, a transformers ``StaticCache`` and the model's own forward,
which keeps what each architecture does around its layers: masks, rotary tables, sliding
windows, soft-capping; under context parallelism the cache split over the CP ranks instead),
and a Hugging Face encoder-decoder (:class:`Seq2SeqDecoder`: T5, BART; the encoder once, then
the decoder with its self- and cross-attention caches). Each runs one pipeline stage at a time;
the last stage gives this TP rank's vocabulary shard of the last position's logits.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Optional

import torch
from torch import nn

from tp_ext import ops
from tp_ext.contract import LossKind, ParallelModel
from tp_ext.distributed import comm
from tp_ext.distributed.mesh import parallel_state
from tp_ext.parallelize.context import new_context_cache
from tp_ext.parallelize.stages import StagedCausalLM, is_transformers_model, single_stage
from tp_ext.parallelize.transformers_names import cache_argument
from tp_ext.sharding import Partition, StageSplit, shard_sizes

__all__ = ["Decoder", "as_decoder"]


class Decoder:
    """One model's stages as the generation loop runs them."""

    def __init__(self, model: nn.Module, parallel, stage_split: StageSplit, stage_ids, config):
        self.model, self.parallel, self.config = model, parallel, config
        self.stage_split, self.stage_ids = stage_split, list(stage_ids)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.vocab_size = config.vocab_size

    @property
    def tp_group(self):
        """Every rank holding a part of this model replica's stage (they agree on the inputs)."""
        return self.parallel.tp_group if self.parallel is not None else self.model.tp

    @property
    def cp_group(self):
        """The CP ranks sharing each sequence (they agree on the inputs), or None."""
        return None

    @property
    def vocab_group(self):
        """The ranks holding the vocabulary's shards of the same rows' logits (merged to pick a
        token without gathering the logits)."""
        return self.tp_group

    def activation_shape(self, rows: int, length: int) -> tuple:
        """The hidden states a stage sends on for ``rows`` sequences of ``length`` new tokens."""
        return self.model.activation_shape(rows, length)

    @property
    def pp_group(self):
        return self.parallel.pp_group if self.stage_split.pp > 1 else None

    @property
    def pp_rank(self) -> int:
        return self.parallel.pp_rank if self.stage_split.pp > 1 else 0

    @property
    def max_positions(self) -> Optional[int]:
        return getattr(self.config, "max_position_embeddings", None)

    def new_cache(self, batch: int, length: int, stage: int):
        """A KV cache of ``length`` positions for ``batch`` rows and stage ``stage``'s layers
        (one per stage: a rank holding two stages keeps their caches apart)."""
        raise NotImplementedError

    def cache_bytes(self, cache) -> int:
        raise NotImplementedError

    # whether prompts must be left-padded (a causal LM's continue from their last position)
    left_padded_prompts = True

    def prefix(self, ids: torch.Tensor) -> torch.Tensor:
        """What the output holds before the new tokens: the prompts themselves (an
        encoder-decoder's: its decoder start token, as transformers' generate gives)."""
        return ids

    def generation_settings(self):
        """The model's own generation config (else its config), as transformers' generate reads
        it."""
        return getattr(self.model, "generation_config", None) or self.config

    def generation_defaults(self) -> tuple:
        """``(eos ids or None, pad id or None)`` the model's own generation settings give, as
        transformers' generate reads them when its arguments are None."""
        settings = self.generation_settings()
        return getattr(settings, "eos_token_id", None), getattr(settings, "pad_token_id", None)

    def forced_tokens(self) -> tuple:
        """``(forced first token, forced last token)`` of its generation settings, or None each
        (BART's ``forced_eos_token_id``: the token at the last step, as transformers forces
        them)."""
        settings = self.generation_settings()
        bos = getattr(settings, "forced_bos_token_id", None)
        return bos, getattr(settings, "forced_eos_token_id", None)

    def decoding(self):
        """A context around the whole decoding loop (entered by every rank together): what the
        model keeps while no weight changes."""
        return contextlib.nullcontext()

    def paged_step(self, step):
        """A context giving the cache this model's forward takes for one step over a paged KV
        cache (:class:`tp_ext.serving.kv_cache.PagedStep`: ``step.gather(layer, k, v)`` stores
        the step's keys and values of decoder layer ``layer`` and returns every row's, ``[rows,
        heads, length, head_dim]``; ``step.write`` stores them and returns the pools, for
        attention reading the slots itself)."""
        raise ValueError(
            f"a paged KV cache does not serve {type(self.model).__name__} yet: serve tp_ext's "
            "Qwen2 or a transformers decoder converted by parallelize (1D TP)"
        )

    def run(self, stage: int, x, cache, key_mask, position_ids, cache_position) -> torch.Tensor:
        """Stage ``stage`` on ``x`` (ids or hidden states, ``[batch, new]``): hidden states, or on
        the last stage this rank's vocabulary shard of the last position's logits
        ``[batch, V_r]``. ``key_mask`` ``[batch, cached + new]`` (1 at real tokens),
        ``position_ids`` ``[batch, new]``, ``cache_position`` ``[new]`` (their cache slots)."""
        raise NotImplementedError


class NativeDecoder(Decoder):
    """tp_ext's Qwen2 (TP, PP): a :class:`~tp_ext.layers.KVCache` per decoder layer this rank
    holds, allocated once for the batch, split by KV heads."""

    def __init__(self, model: nn.Module):
        super().__init__(model, model.parallel, model.stage_split, model.stage_ids, model.config)

    def new_cache(self, batch: int, length: int, stage: int):
        caches = [None] * self.config.num_hidden_layers
        for i in self.stage_split.layers_of(stage):
            caches[i] = self.model.model.layers[i].self_attn.new_kv_cache(batch, length)
        return caches

    def cache_bytes(self, cache) -> int:
        return sum(c.nbytes() for c in cache if c is not None)

    @contextlib.contextmanager
    def paged_step(self, step):
        caches = [None] * self.config.num_hidden_layers
        for stage in self.stage_ids:
            for i in self.stage_split.layers_of(stage):
                caches[i] = _PagedLayer(i, step.gather, step.past)
        yield caches

    def run(self, stage, x, cache, key_mask, position_ids, cache_position):
        out = self.model.stage_forward(
            stage,
            x,
            cache,
            position_ids=position_ids,
            key_mask=key_mask.bool(),
            last_only=True,
        )
        return out[:, -1] if stage == self.stage_split.last_stage else out


class GridDecoder(NativeDecoder):
    """tp_ext's 2D (SUMMA) Qwen2 (a P x Q grid, with PP): a KV cache per decoder layer, of this
    rank's grid row's sequences and grid column's KV heads. The last stage's logits block (its
    rows, its column's vocabulary) is gathered over the grid column into every row's logits of
    that vocabulary shard, which the grid row's ranks merge into tokens."""

    def __init__(self, model: nn.Module):
        super().__init__(model)
        self.grid = model.grid

    @property
    def tp_group(self):
        return self.grid.tp_group

    @property
    def vocab_group(self):
        return self.grid.row_group

    def new_cache(self, batch: int, length: int, stage: int):
        return self.model.new_kv_caches(batch, length, stage)

    def decoding(self):
        return self.model.decoding()  # a tied head's blocks exchanged once

    def run(self, stage, x, cache, key_mask, position_ids, cache_position):
        out = super().run(stage, x, cache, key_mask, position_ids, cache_position)
        if stage != self.stage_split.last_stage:
            return out
        rows = shard_sizes(key_mask.size(0), self.grid.rows)  # every grid row's sequences
        return comm.all_gather(out.contiguous(), 0, rows, group=self.grid.col_group)


class HFDecoder(Decoder):
    """A Hugging Face causal LM converted by ``parallelize`` (its stages, or at pp = 1 the model
    as one stage): the model's own forward with a transformers ``StaticCache``, whose layers
    take this rank's KV heads from the first keys they store (lazily, once)."""

    def __init__(self, staged: StagedCausalLM):
        super().__init__(
            staged, staged.parallel, staged.stage_split, staged.stage_ids, staged.config
        )

    @property
    def cp_group(self):
        return self.model.cp_group

    def new_cache(self, batch: int, length: int, stage: int):
        if self.model.cp_group is not None:  # each CP rank its share of the positions
            return new_context_cache(self.model.hf_model)
        return _stage_cache_class()(config=self.config, max_cache_len=length)

    @contextlib.contextmanager
    def paged_step(self, step):
        """On CPU the attention reads the keys from their slots (``tp_ext.ops.paged_attention``,
        through transformers' attention interface; no dense copy, no mask to build); elsewhere
        the model's own attention on the gathered keys."""
        if self.model.cp_group is not None:
            raise ValueError(
                "a paged KV cache does not serve a model converted with context parallelism "
                "(its cache is split over the CP ranks): convert it with cp=1"
            )
        layers = self.config.num_hidden_layers
        if self.device.type != "cpu":
            yield _paged_cache_class()(step.gather, step.past, step.length, layers)
            return
        config, before = self.model.hf_model.config, self.model.hf_model.config._attn_implementation
        token = _PAGED_STEP.set(step)
        config._attn_implementation = _paged_attention_name()
        try:
            yield _paged_cache_class()(step.write, step.past, step.length, layers)
        finally:
            config._attn_implementation = before
            _PAGED_STEP.reset(token)

    def generation_settings(self):
        return getattr(self.model.hf_model, "generation_config", None) or self.config

    def cache_bytes(self, cache) -> int:
        total = 0
        for layer in cache.layers:
            for name in ("keys", "values"):
                t = getattr(layer, name, None)
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return total

    def run(self, stage, x, cache, key_mask, position_ids, cache_position):
        out = self.model.stage_forward(
            stage,
            x,
            attention_mask=key_mask,
            position_ids=position_ids,
            cache_position=cache_position,
            **{cache_argument(): cache},
        )
        return out[:, -1] if stage == self.stage_split.last_stage else out


class _EncoderDecoderCache:
    """One micro-batch's state in an encoder-decoder: the encoder's output and mask, kept from
    the first step, and transformers' self- and cross-attention caches."""

    def __init__(self, cache) -> None:
        self.cache, self.encoded, self.encoder_mask = cache, None, None


class Seq2SeqDecoder(Decoder):
    """A transformers encoder-decoder (T5, BART) converted by ``parallelize`` at pp = 1: the
    first step runs the encoder once on the prompts (any padding: the encoder reads every
    position under its mask) and the decoder on its start token; every later step runs the
    decoder alone on the last token, its self-attention cache growing by one position and its
    cross-attention cache (the encoder's keys and values, this rank's heads) computed once.
    The model's logits are whole (its LM head gathers them); this rank's vocabulary shard goes
    to the shared token choice."""

    left_padded_prompts = False
    max_positions = None  # the encoder reads the prompt, the decoder the new tokens

    def __init__(self, model: nn.Module, parallel):
        parallel = parallel if parallel is not None else parallel_state()
        if parallel.pp > 1 or parallel.dims.cp_enabled:
            raise ValueError(
                f"generate: {type(model).__name__} (an encoder-decoder) decodes at pp = 1 and "
                f"cp = 1; this process's dims have pp={parallel.pp}, cp={parallel.dims.cp}"
            )
        super().__init__(model, parallel, StageSplit(1), [0], model.config)
        start = model.generation_config.decoder_start_token_id
        self.start = start if start is not None else self.config.decoder_start_token_id
        group = comm.resolve_group(self.tp_group)
        self.vocab, self.tp_rank = Partition.split(self.vocab_size, group.size), group.rank

    def prefix(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.full((ids.size(0), 1), self.start, dtype=torch.long, device=ids.device)

    def new_cache(self, batch: int, length: int, stage: int):
        from transformers import DynamicCache, EncoderDecoderCache

        return _EncoderDecoderCache(EncoderDecoderCache(DynamicCache(), DynamicCache()))

    def cache_bytes(self, cache) -> int:
        parts = [cache.cache.self_attention_cache, cache.cache.cross_attention_cache]
        tensors = [getattr(layer, n, None) for c in parts for layer in c.layers for n in _KV]
        return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))

    def run(self, stage, x, cache, key_mask, position_ids, cache_position):
        if cache.encoded is None:  # the first step: x is the prompts
            encoder = self.model.get_encoder()
            cache.encoded = encoder(input_ids=x, attention_mask=key_mask, return_dict=True)
            cache.encoder_mask = key_mask
            x = self.prefix(x)
        out = self.model(
            encoder_outputs=cache.encoded,
            attention_mask=cache.encoder_mask,
            decoder_input_ids=x,
            use_cache=True,
            return_dict=True,
            **{cache_argument(): cache.cache},
        )
        return self.vocab.local(out.logits[:, -1], -1, self.tp_rank)  # this rank's shard


_KV = ("keys", "values")


class _PagedLayer:
    """One layer of tp_ext's attention over a paged cache: what its ``KVCache`` answers."""

    def __init__(self, layer: int, store, past: int):
        self.layer, self.store, self.length = layer, store, past

    def update(self, k: torch.Tensor, v: torch.Tensor):
        return self.store(self.layer, k, v)


_PAGED_STEP: contextvars.ContextVar = contextvars.ContextVar("tp_ext_paged_step", default=None)
_PAGED_ATTENTION = "tp_ext_paged"
# attention arguments some models pass that change what attention computes in ways the paged
# attention does not (attention sinks): refused by name
_PAGED_UNSUPPORTED = ("s_aux",)


def _paged_attention_name() -> str:
    """The name of the paged attention in transformers' attention interface (registered once)."""
    from transformers import AttentionInterface

    if _PAGED_ATTENTION not in AttentionInterface._global_mapping:
        AttentionInterface.register(_PAGED_ATTENTION, _paged_attention_forward)
    return _PAGED_ATTENTION


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, **kwargs):
    """transformers' attention interface over the pools (``key``, ``value``: what the paged
    cache's ``write`` returned) and the step's slots: decode rows through the kernel; prompt
    chunks (many queries over the same keys: matmuls), sliding windows and soft-capping through
    the gathered keys (:func:`paged_attention_dense`)."""
    step = _PAGED_STEP.get()
    if step is None:
        raise RuntimeError("tp_ext's paged attention ran outside a serving step")
    for name in _PAGED_UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} passes {name} to its attention, which tp_ext's paged "
                "KV cache does not serve yet"
            )
    scale = scaling if scaling is not None else query.size(-1) ** -0.5
    window, softcap = kwargs.get("sliding_window"), kwargs.get("softcap")
    if window is None and softcap is None and query.size(2) == 1:  # decode rows: the kernel
        out = ops.paged_attention(query, key, value, step.read, step.key_mask, step.past, scale)
    else:
        out = paged_attention_dense(query, key, value, step, scale, window, softcap)
    return out.transpose(1, 2).contiguous(), None


def paged_attention_dense(query, key, value, step, scale, window=None, softcap=None):
    """``tp_ext.ops.paged_attention``'s rule on gathered keys, with a sliding window (a query
    sees the ``window`` latest positions, its own included) and tanh soft-capping of the
    scores."""
    group = query.size(1) // key.size(1)
    acc = torch.float64 if query.dtype == torch.float64 else torch.float32
    keys = key[step.read].permute(0, 2, 1, 3).repeat_interleave(group, 1).to(acc)
    values = value[step.read].permute(0, 2, 1, 3).repeat_interleave(group, 1).to(acc)
    columns = torch.arange(step.length, device=query.device)
    own = (torch.arange(query.size(2), device=query.device) + step.past).unsqueeze(1)
    allowed = columns <= own
    if window is not None:
        allowed = allowed & (own - columns < window)
    allowed = (allowed.unsqueeze(0) & step.key_mask.bool().unsqueeze(1)) | (columns == own)
    scores = query.to(acc) @ keys.transpose(-1, -2) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed.unsqueeze(1), float("-inf"))
    return (torch.softmax(scores, -1) @ values).to(query.dtype)


_PAGED_CACHE: list = []


def _paged_cache_class():
    """A transformers ``Cache`` over a paged cache for one step: each layer stores through
    ``store`` and reports ``length`` key columns (the step's rows left-padded alike), so the
    model's causal and sliding-window masks from ``cache_position`` and the key mask are each
    row's own."""
    if _PAGED_CACHE:
        return _PAGED_CACHE[0]
    from transformers.cache_utils import Cache, CacheLayerMixin

    class PagedLayer(CacheLayerMixin):
        is_compileable = False
        is_sliding = False

        def __init__(self, layer: int, store, past: int, length: int):
            super().__init__()
            self.layer, self.store, self.past, self.length = layer, store, past, length
            self.is_initialized = True

        def lazy_initialization(self, key_states, value_states) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            return self.store(self.layer, key_states, value_states)

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.length, 0

        def get_seq_length(self) -> int:
            return self.past

        def get_max_length(self) -> int:
            return -1

    class PagedCache(Cache):
        def __init__(self, store, past: int, length: int, layers: int):
            super().__init__(layers=[PagedLayer(i, store, past, length) for i in range(layers)])

    _PAGED_CACHE.append(PagedCache)
    return PagedCache


_STAGE_CACHE: list = []
# where a transformers model converted at pp = 1 keeps the one stage generation runs (found once
# per model, since finding it runs the model); in the model's own dict, which lives as long
_ONE_STAGE = "_tp_ext_generation_stage"


def _stage_cache_class():
    """transformers' StaticCache for one pipeline stage (each stage its own, also two stages on
    one rank). The model's forward sizes its masks by the cache length of its first layer (of
    each attention kind), which a later stage does not hold (its cache layer never fills): such
    a query is answered by a layer of the same kind of this stage, all of whose layers have
    seen the same tokens."""
    if _STAGE_CACHE:
        return _STAGE_CACHE[0]
    from transformers import StaticCache

    class StageStaticCache(StaticCache):
        def _held(self, layer_idx: int) -> int:
            if layer_idx >= len(self.layers) or self.layers[layer_idx].is_initialized:
                return layer_idx
            kind = type(self.layers[layer_idx])
            for i, layer in enumerate(self.layers):
                if layer.is_initialized and type(layer) is kind:
                    return i
            return layer_idx

        def get_seq_length(self, layer_idx: int = 0) -> int:
            return super().get_seq_length(self._held(layer_idx))

        def get_mask_sizes(self, query_length: int, layer_idx: int):
            return super().get_mask_sizes(query_length, self._held(layer_idx))

    _STAGE_CACHE.append(StageStaticCache)
    return StageStaticCache


def as_decoder(model: nn.Module, parallel=None) -> Decoder:
    """The adapter for ``model``, or an error naming what it is and what works."""
    from tp_ext.models.qwen2 import Qwen2ForCausalLM

    if isinstance(model, Qwen2ForCausalLM):
        if model.cp_group is not None:
            raise ValueError(
                f"generate: context parallelism (cp={model.cp_group.size}) does not decode; "
                "build the model with cp=1 for generation"
            )
        return NativeDecoder(model)
    if isinstance(model, ParallelModel) and model.loss_kind is LossKind.GRID_BLOCK:
        return GridDecoder(model)
    if is_transformers_model(model) and getattr(model.config, "is_encoder_decoder", False):
        return Seq2SeqDecoder(model, parallel)
    staged = model if isinstance(model, StagedCausalLM) else _one_stage(model, parallel)
    if staged.sequence_parallel:
        raise ValueError(
            "generate: a model converted with sequence_parallel=True splits the sequence over "
            "the TP ranks, which one decoded token cannot be; convert it without sequence "
            "parallelism for generation"
        )
    if staged.cp_group is not None and staged.stage_split.pp > 1:
        raise ValueError(
            f"generate: context parallelism (cp={staged.cp_group.size}) inside pipeline stages "
            f"(pp={staged.stage_split.pp}) does not decode yet; convert the model with pp=1 "
            "for generation (cp > 1 decodes there)"
        )
    return HFDecoder(staged)


def _one_stage(model: nn.Module, parallel) -> StagedCausalLM:
    """A transformers causal LM converted by ``parallelize`` at pp = 1, as one stage."""
    if not is_transformers_model(model):
        raise TypeError(
            f"generate: model must be tp_ext's Qwen2ForCausalLM or a Hugging Face causal LM "
            f"(converted by tp_ext.parallelize), got {type(model).__name__}"
        )
    staged = model.__dict__.get(_ONE_STAGE)
    if staged is None:
        parallel = parallel if parallel is not None else parallel_state()
        if parallel.pp > 1:
            raise ValueError(
                "generate: this process's dims have pp > 1, but the model is not split into "
                "stages: convert it with tp_ext.parallelize(model, 'auto', parallel=state), "
                "which returns this rank's stages"
            )
        staged = single_stage(model, parallel)
        object.__setattr__(model, _ONE_STAGE, staged)  # not a submodule of the model
    return staged
