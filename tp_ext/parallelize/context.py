"""Context parallelism for Hugging Face decoders (Qwen2, Llama, Mistral, Qwen3, GPT-2, Gemma 2,
and the MoE Mixtral, Qwen2-MoE and Qwen3-MoE).

Every CP rank is called with the whole sequence's token ids, as the native Qwen2 is. A forward
pre-hook on the model keeps this rank's positions (:func:`tp_ext.cp_positions`: chunks r and
2C-1-r of 2C, the causal load balance) with their true position ids, so rotary embeddings (and
GPT-2's learned position embedding, read at those ids) are right for each chunk; every
attention then runs over the CP group through transformers' own attention interface
(``config._attn_implementation``), as a ring or by all-to-all (:mod:`tp_ext.layers.context`).
The model returns the logits of this rank's positions, in ``cp_positions`` order;
:class:`tp_ext.training.Trainer` scores them against the next tokens of the whole sequence and
sums the gradients over CP with DP.

A padded batch (``attention_mask`` [batch, seq], 0 at padding, on any side) is run as the
unsplit model runs it: no query of any rank attends to a padded key (each rank's keys' part of
the mask travels with them, :mod:`tp_ext.layers.context`), and the position ids are the model's
own (transformers' forward does not derive them from the mask; ``position_ids=`` given are cut
like the ids).

A layer's sliding window (transformers' ``sliding_window``: a query sees the keys less than that
many positions back; Mistral's, Gemma 2's every other layer) shorter than the sequence is a
window of the ring (a pair of chunks outside it skipped, one partly inside masked) or of the
all-to-all's attention. Gemma 2's attention logit soft-capping (``softcap``) caps the scores
inside the ring's online softmax and its backward (the all-to-all: by matmuls); its final-logit
soft-capping is the model's own, on this rank's logits.

Generation (transformers' ``generate``, ``use_cache=True``, a KV cache argument, and
:func:`tp_ext.generate`): the prompt's forward (the prefill) runs over the CP group as above,
each rank keeping its positions' keys and values in a :class:`~tp_ext.parallelize.
context_cache.ContextCache` (which takes the place of the cache transformers made); the model
then returns the last position's logits on every rank (its hidden state broadcast by the rank
holding it). Each later forward takes one new token, the same on every rank: each rank attends
its share of the cache and the partial results merge by log-sum-exp over the CP group
(:mod:`tp_ext.layers.context_decode`); the new token's keys stay on one rank, round-robin.

Only these architectures: their attention is causal softmax attention (over rotary-embedded
heads, or GPT-2's heads after its learned positions), which is what the ring and the all-to-all
compute. Others are refused by name.
"""

from __future__ import annotations

import inspect
import weakref
from typing import NamedTuple, Optional

import torch
from torch import nn

from tp_ext.distributed import comm
from tp_ext.distributed.groups import resolve_group
from tp_ext.layers.context import (
    CP_MODES,
    CP_TAG,
    all_to_all_attention,
    cp_positions,
    ring_attention,
)
from tp_ext.layers.context_decode import position_owner, split_kv_attention
from tp_ext.parallelize.transformers_names import cache_argument, take_cache

__all__ = ["CP_ARCHITECTURES", "use_context_parallel", "context_of", "new_context_cache"]

# config.model_type; the MoE ones (with expert parallelism too) share their dense cousins'
# attention
CP_ARCHITECTURES = (
    "qwen2", "llama", "mistral", "qwen3", "gpt2", "gemma2", "mixtral", "qwen2_moe", "qwen3_moe",
)  # fmt: skip
# per-position inputs a decoder takes beside the token ids: cut to this rank's positions too
_PER_POSITION = ("input_ids", "inputs_embeds", "token_type_ids")
ATTENTION = "tp_ext_context"  # the name it is registered under in transformers' interface
_SEQ_LEN = "tp_ext_seq_len"  # the keyword the pre-hook hands every attention call
_KEY_MASK = "tp_ext_key_mask"  # and this rank's key mask (padding), when the batch is padded
_DECODE = "tp_ext_decode"  # a decoding step's positions (a _Decoding) for every attention call
# the models parallelize converted to context parallelism, and their positions hook (a record
# kept here rather than attributes set on the user's model)
_CONVERTED: "weakref.WeakKeyDictionary[nn.Module, _PositionsOfThisRank]" = (
    weakref.WeakKeyDictionary()
)


def context_of(model: nn.Module) -> Optional["_PositionsOfThisRank"]:
    """The context parallelism ``parallelize`` gave ``model`` (its hook: ``group``, and
    ``whole_length`` for pipeline stages after the first), or None."""
    return _CONVERTED.get(model)


def new_context_cache(model: nn.Module):
    """An empty KV cache for ``model`` (converted with cp > 1), split over its CP group: what
    :func:`tp_ext.generate` passes each forward (:mod:`tp_ext.parallelize.context_cache`)."""
    from tp_ext.parallelize.context_cache import ContextCache

    return ContextCache(_CONVERTED[model].group)


def check_context_parallel(model: nn.Module, parallel, cp_mode: str) -> None:
    """Refuses, before anything is converted, what context parallelism cannot run here."""
    cp = parallel.cp
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in CP_ARCHITECTURES:
        raise ValueError(
            f"parallelize: cp={cp} (context parallelism) supports Hugging Face "
            f"{', '.join(CP_ARCHITECTURES)} decoders; {type(model).__name__} "
            f"(model_type {kind!r}) is not one of them: use cp=1 for it"
        )
    if cp_mode not in CP_MODES:
        raise ValueError(f"parallelize: cp_mode must be 'ring' or 'all_to_all', got {cp_mode!r}")
    for field in ("attention_dropout", "attn_pdrop"):  # GPT-2 names it attn_pdrop
        if getattr(model.config, field, 0.0):
            raise ValueError(
                f"parallelize: attention dropout ({getattr(model.config, field)}) under context "
                f"parallelism is not supported yet; set config.{field}=0"
            )
    if getattr(model.config, "add_cross_attention", False):
        raise ValueError(
            f"parallelize: cp={cp} with cross-attention (config.add_cross_attention=True) is not "
            "supported: its keys are the encoder's, not this sequence's positions"
        )


def use_context_parallel(model: nn.Module, parallel, cp_mode: str, attentions) -> str:
    """Make ``model`` (checked by :func:`check_context_parallel`) run on this CP rank's
    positions, each of ``attentions`` (its Hugging Face attention modules) over the CP group by
    ``cp_mode``. Returns the report line."""
    group = resolve_group(parallel.cp_group)
    _register()
    for attention in attentions:
        attention.cp_attention = (group, cp_mode)
    model.config._attn_implementation = ATTENTION
    # on the decoder itself (pipeline stages before the last call it, not the causal LM)
    base = getattr(model, model.base_model_prefix)
    positions = _PositionsOfThisRank(base, group)
    base.register_forward_pre_hook(positions, with_kwargs=True)
    base.register_forward_hook(positions.last_position)
    model.register_forward_pre_hook(positions.causal_lm_arguments, with_kwargs=True)
    _CONVERTED[model] = positions
    return (
        f"context parallel over {group.size} ranks ({cp_mode}): this rank's positions "
        f"{group.rank} and {2 * group.size - 1 - group.rank} of {2 * group.size} chunks"
    )


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, _context_attention)


def _context_attention(
    module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs
):
    """transformers' attention interface: ``query`` [batch, heads, local, dim], ``key`` and
    ``value`` [batch, kv heads, local, dim] at this rank's positions (decoding: the new token's
    query, the keys this rank holds); returns [batch, local, heads, dim] and no weights."""
    seq_len, decoding = kwargs.get(_SEQ_LEN), kwargs.get(_DECODE)
    setting = getattr(module, "cp_attention", None)
    if setting is None or (seq_len is None and decoding is None):
        raise RuntimeError(
            f"{type(module).__name__}: attention {ATTENTION!r} runs inside a model converted by "
            "tp_ext.parallelize with cp > 1, called through that model's forward"
        )
    if attention_mask is not None:  # no mask is built for a custom attention: a user's own
        raise ValueError(
            "context parallelism: a custom attention mask is not supported; the attention is "
            "causal over the whole sequence"
        )
    if dropout:
        raise ValueError("context parallelism: attention dropout is not supported yet")
    window = kwargs.get("sliding_window")  # this layer's (None: full attention)
    softcap = kwargs.get("softcap")  # Gemma 2's attention logit soft-capping
    group, mode = setting
    if decoding is not None:
        out = split_kv_attention(
            query, key, value, decoding.query_positions, decoding.key_positions, group,
            scaling, key_mask=decoding.key_mask, window=window, softcap=softcap,
        )  # fmt: skip
        return out.transpose(1, 2).contiguous(), None
    attend = ring_attention if mode == "ring" else all_to_all_attention
    out = attend(
        query,
        key,
        value,
        seq_len,
        group,
        scale=scaling,
        key_mask=kwargs.get(_KEY_MASK),
        window=window if window is not None and window < seq_len else None,
        softcap=softcap,
    )
    return out.transpose(1, 2).contiguous(), None


def _call_arguments(signature: inspect.Signature, args, kwargs) -> dict:
    """A forward call's arguments by name (its ``**kwargs`` merged in)."""
    call = dict(signature.bind_partial(*args, **kwargs).arguments)
    for name, p in signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            call.update(call.pop(name, {}))
    return call


class _Decoding(NamedTuple):
    """What every attention call of a decoding step needs: the new token's position, the
    positions of the keys this rank holds (the new one's too when it keeps it) and their
    padding mask (None: no padding)."""

    query_positions: torch.Tensor
    key_positions: torch.Tensor
    key_mask: Optional[torch.Tensor]


class _PositionsOfThisRank:
    """The decoder's forward pre-hook: the whole sequence in, this rank's positions on; with a
    KV cache, the prefill's or a decoding step's inputs. ``whole_length``: set while a pipeline
    stage after the first runs (its input already holds this rank's positions; the stages
    runner knows the whole sequence's length). Its :meth:`last_position` (the decoder's
    forward hook) hands a prefill's last hidden state to every rank."""

    def __init__(self, base: nn.Module, group) -> None:
        self.group = group
        self.signature = inspect.signature(base.forward)
        self.whole_length = None
        self.adopted = weakref.WeakKeyDictionary()  # a caller's empty cache -> the one in use
        self.keep_last = False  # the causal LM's logits_to_keep=1: the last position's only
        self.last: Optional[tuple] = None  # then (rank, index) of the last position

    def causal_lm_arguments(self, model, args, kwargs):
        """The causal LM's forward pre-hook: what its own forward would do wrong under CP, and
        whether it wants the last position's logits only (``logits_to_keep=1``, as generation
        asks: then on every rank)."""
        call = _call_arguments(inspect.signature(model.forward), args, kwargs)
        if call.get("labels") is not None:
            raise ValueError(
                "context parallelism: labels= is not supported: the loss spans the CP ranks: "
                "score the returned logits (this rank's positions, tp_ext.cp_positions order) "
                "or train with tp_ext.training.Trainer"
            )
        keep = call.get("logits_to_keep", 0)
        if not (isinstance(keep, int) and keep in (0, 1)):
            raise ValueError(
                f"context parallelism: logits_to_keep={keep!r} is not supported; every rank "
                "returns the logits of its own positions (0), or of the last position (1)"
            )
        self.keep_last = keep == 1

    def __call__(self, base, args, kwargs):
        call = _call_arguments(self.signature, args, kwargs)
        self._refuse(call)
        tokens = call.get("input_ids")
        if tokens is None:
            tokens = call.get("inputs_embeds")
        if tokens is None:
            raise ValueError("context parallelism: pass input_ids (or inputs_embeds)")
        self.last, keep_last, self.keep_last = None, self.keep_last, False
        cache = self._cache(call)
        if keep_last:
            _check_inference("logits_to_keep=1")
        if cache is not None and cache.seen:
            return (), self._decoding(call, tokens, cache)
        seq_len = tokens.size(1) if self.whole_length is None else self.whole_length
        mine = cp_positions(seq_len, group=self.group).to(tokens.device)
        for name in _PER_POSITION:
            if call.get(name) is not None and self.whole_length is None:
                call[name] = call[name][:, mine]
        # the position ids the unsplit model would use: its default (0, 1, ...: transformers
        # does not derive them from a padding mask in a forward) or the ones given, at mine
        given = call.get("position_ids")
        call["position_ids"] = (
            mine.unsqueeze(0).expand(tokens.size(0), -1) if given is None else given[..., mine]
        )
        # no mask is built (a custom attention gets none): a padded batch's key mask goes to
        # every attention call instead, this rank's keys' part of it
        mask = call.pop("attention_mask", None)
        if mask is not None:
            _check_mask(mask, tokens.size(0), seq_len)
            if not bool(mask.all()):
                call[_KEY_MASK] = mask[:, mine].bool()
        call["use_cache"] = cache is not None
        if cache is not None:  # the prefill: this rank's keys kept here
            cache.prefill(seq_len, tokens.device)
            call[cache_argument()] = cache
        if cache is not None or keep_last:  # the last position's hidden state on every rank
            self.last = position_owner(seq_len - 1, seq_len, self.group.size)
        call[_SEQ_LEN] = seq_len
        return (), call

    def _cache(self, call: dict):
        """The :class:`ContextCache` this forward fills (None without a cache): the one given,
        or the one that took the place of a caller's empty cache, or a new one."""
        given = take_cache(call)
        if given is None and not call.get("use_cache"):
            return None
        if self.whole_length is not None:
            raise ValueError(
                "context parallelism: a KV cache inside pipeline stages is not supported yet: "
                "generate with pp=1"
            )
        _check_inference(f"a KV cache (use_cache=True, {cache_argument()}=)")
        from tp_ext.parallelize.context_cache import held_cache

        return held_cache(given, self.group, self.adopted)

    def _decoding(self, call: dict, tokens: torch.Tensor, cache) -> dict:
        """A decoding step's inputs: one new token (every rank's), its position in the cache."""
        batch, new = tokens.shape[:2]
        if new != 1:
            raise ValueError(
                f"context parallelism: a filled KV cache ({cache.seen} positions) takes one new "
                f"token per forward (decoding), got {new}: prefill the whole prompt in one "
                "forward (chunked prefill and continuing a cache by several tokens are not "
                "supported)"
            )
        position = cache.decode(tokens.device)
        if call.get("position_ids") is None:  # the model's own default
            call["position_ids"] = torch.full((batch, 1), position, device=tokens.device)
        mask = call.pop("attention_mask", None)
        key_mask = None
        if mask is not None:
            _check_mask(mask, batch, position + 1)
            key_mask = None if bool(mask.all()) else mask[:, cache.held].bool()
        query = torch.tensor([position], device=tokens.device)
        call[_DECODE] = _Decoding(query, cache.held, key_mask)
        call["use_cache"], call[cache_argument()] = True, cache
        return call

    def last_position(self, base, args, output):
        """The decoder's forward hook: after a prefill (or for ``logits_to_keep=1``), the last
        position's hidden state [batch, 1, hidden] on every rank (broadcast by the rank holding
        it) in place of this rank's positions', so that the model returns the logits
        generation needs."""
        if self.last is None:
            return output
        rank, index = self.last
        self.last = None
        hidden = output[0]
        mine = hidden[:, index : index + 1]
        if rank != self.group.rank:
            mine = hidden.new_empty(hidden.size(0), 1, hidden.size(-1))
        with comm.tag(CP_TAG):
            last = comm.broadcast(mine.contiguous(), rank, self.group)
        if isinstance(output, tuple):  # return_dict=False
            return (last, *output[1:])
        output["last_hidden_state"] = last
        return output

    def _refuse(self, call: dict) -> None:
        mask = call.get("attention_mask")
        if mask is not None and not (isinstance(mask, torch.Tensor) and mask.dim() == 2):
            shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(
                f"context parallelism: attention_mask of shape {shape} is not supported: pass "
                "a padding mask [batch, seq] (1: a token, 0: padding); the attention is causal"
            )


def _check_inference(what: str) -> None:
    """The decoding attention and the last position's hand-over have no backward: refused
    (on every rank alike) where autograd would need one."""
    if torch.is_grad_enabled():
        raise ValueError(
            f"context parallelism: a forward with {what} is inference only: run it under "
            "torch.no_grad() (generate does)"
        )


def _check_mask(mask: torch.Tensor, batch: int, seq_len: int) -> None:
    """A padding mask must cover the whole sequence (every CP rank is given all of it)."""
    if tuple(mask.shape) != (batch, seq_len):
        raise ValueError(
            f"context parallelism: attention_mask has shape {tuple(mask.shape)}; it must be "
            f"[batch, seq] = {(batch, seq_len)}: the whole sequence's padding mask"
        )
