"""The KV cache of a Hugging Face decoder under context parallelism (imported once a model
converted by ``parallelize`` with cp > 1 is given a cache: it needs transformers).

Why the cache stays split (and is not all-gathered after the prefill): each CP rank then holds
only its share of a long prompt's keys and values, as it did for the prefill, at the price of
one small all-gather per layer and decoded token (:func:`tp_ext.layers.context_decode.
split_kv_attention`); gathering the cache would put the whole prompt's KV on every rank, which
is what context parallelism is there to avoid.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.layers.context import cp_positions
from tp_ext.layers.context_decode import decode_owner
from tp_ext.parallelize.transformers_names import cache_argument

__all__ = ["ContextCache", "held_cache"]


class ContextCache(Cache):
    """This CP rank's share of a decoder's KV cache: after the prefill the keys and values of
    its :func:`~tp_ext.cp_positions` of the prompt, then of each decoded token it keeps
    (:func:`~tp_ext.layers.context_decode.decode_owner`). ``held``: the sequence positions of
    what it holds, in the order it holds them; ``get_seq_length()``: the positions the whole
    cache covers (every rank's together), as the model's own code expects."""

    def __init__(self, group: ResolvedGroup) -> None:
        super().__init__(layer_class_to_replicate=DynamicLayer)
        self.group = group
        self.seen = 0
        self.held = torch.zeros(0, dtype=torch.long)
        self.storing = True  # whether this forward's keys are kept here

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def prefill(self, seq_len: int, device) -> torch.Tensor:
        """The prompt's ``seq_len`` positions go in: returns this rank's (kept here)."""
        mine = cp_positions(seq_len, group=self.group).to(device)
        self.held, self.seen, self.storing = mine, seq_len, True
        return mine

    def decode(self, device) -> int:
        """One new token goes in: returns its position (kept here if this rank owns it)."""
        position = self.seen
        self.storing = decode_owner(position, self.group.size) == self.group.rank
        if self.storing:
            new = torch.tensor([position], device=device)
            self.held = torch.cat([self.held.to(device), new])
        self.seen += 1
        return position

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        """The keys and values this rank holds for layer ``layer_idx`` (this forward's, when it
        keeps them, appended)."""
        while len(self.layers) <= layer_idx:
            self.layers.append(DynamicLayer())
        layer = self.layers[layer_idx]
        if not self.storing:
            if layer.is_initialized:
                return layer.keys, layer.values
            key_states, value_states = key_states[..., :0, :], value_states[..., :0, :]
        return layer.update(key_states, value_states)

    def crop(self, tokens_to_remove: int) -> None:
        raise ValueError(
            "context parallelism: a KV cache split over the CP ranks cannot be cropped "
            "(assisted or speculative decoding): generate without an assistant"
        )


def held_cache(given, group: ResolvedGroup, adopted) -> ContextCache:
    """The :class:`ContextCache` a forward given the KV cache ``given`` fills: ``given``
    itself, or the one that took the place of the caller's empty cache (``adopted``: a weak
    dict, so that a caller passing that cache again gets the same), or a new one. A cache
    filled without context parallelism cannot be continued under it."""
    if isinstance(given, ContextCache):
        return given
    if given is None:
        return ContextCache(group)
    if isinstance(given, Cache) and given in adopted:
        return adopted[given]
    if not isinstance(given, Cache) or given.get_seq_length() > 0:
        what = type(given).__name__
        raise ValueError(
            f"context parallelism: {cache_argument()}={what} is not supported: pass an empty "
            "transformers Cache (or none, with use_cache=True), or the cache a "
            "forward under context parallelism returned"
        )
    adopted[given] = ContextCache(group)
    return adopted[given]
