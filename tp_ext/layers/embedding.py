"""Vocabulary-parallel embedding and LM head: the vocabulary is split over the TP group by
:func:`tp_ext.shard_sizes` (any size, no padding rows)."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tp_ext.distributed import comm
from tp_ext.layers.base import InitFn, ParallelModule, check_int
from tp_ext.layers.linear import ColumnParallelLinear
from tp_ext.sharding import Partition

__all__ = ["VocabParallelEmbedding", "ParallelLMHead", "HeadParallelEmbedding"]


class VocabParallelEmbedding(ParallelModule):
    """torch.nn.Embedding with its rows (the vocabulary) split over the TP group.

    Each rank looks up the ids that fall in its vocabulary range (others give zero rows), and
    the partial results are all-reduced; with ``sequence_parallel`` they are reduce-scattered
    into sequence shards instead (the output is then ``[..., seq_local, dim]``).
    ``output_scale`` multiplies the looked-up rows, in the weight's dtype (Gemma's scaled
    embedding).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: Optional[int] = None,
        sequence_parallel: bool = False,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
        output_scale: Optional[float] = None,
    ):
        super().__init__()
        self._setup_tp(tp_group)
        self.output_scale = None if output_scale is None else float(output_scale)
        self.num_embeddings = check_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_int("embedding_dim", embedding_dim)
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"padding_idx={padding_idx} must be in "
                    f"[{-num_embeddings}, {num_embeddings - 1}]"
                )
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.sequence_parallel = sequence_parallel
        self.partition = Partition.split(num_embeddings, self.tp_size)
        ((self.vocab_start, n_local),) = self.partition.segments[self.tp_rank] or ((0, 0),)
        self.vocab_end = self.vocab_start + n_local
        self.num_embeddings_local = n_local
        self.weight = nn.Parameter(torch.empty(n_local, embedding_dim, device=device, dtype=dtype))
        self._set_shard("weight", 0, self.partition)
        local_pad = None
        if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end:
            local_pad = padding_idx - self.vocab_start
        self._local_padding_idx = local_pad
        self.reset_parameters(init_method)

    def reset_parameters(self, init_method: Optional[InitFn] = None) -> None:
        def default(t: torch.Tensor) -> None:  # torch.nn.Embedding's
            nn.init.normal_(t)
            if self.padding_idx is not None:
                t[self.padding_idx].zero_()

        self._init_from_full("weight", init_method or default)

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{type(self).__name__}: ids must be int64 or int32, got {ids.dtype}")
        if torch.compiler.is_compiling() or ids.numel() == 0:
            return
        if ids.device.type == "cpu":
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.num_embeddings:
                bad = low if low < 0 else high
                raise ValueError(
                    f"{type(self).__name__}: token id {bad} is outside the "
                    f"vocabulary [0, {self.num_embeddings})"
                )
        else:  # no host sync on accelerators: a device-side assert
            torch._assert_async(
                ((ids >= 0) & (ids < self.num_embeddings)).all(), "token id outside the vocabulary"
            )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self._check_ids(ids)
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight, self._local_padding_idx)
        else:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
            if self.num_embeddings_local == 0:  # more ranks than tokens in the vocabulary
                out = self.weight.new_zeros(*ids.shape, self.embedding_dim) + self.weight.sum()
            else:
                out = F.embedding(local_ids, self.weight, self._local_padding_idx)
                out = out.masked_fill(outside.unsqueeze(-1), 0)
        if self.output_scale is not None:  # the scale rounded to the weight's dtype, as Gemma's
            out = out * torch.tensor(self.output_scale, dtype=out.dtype)
        if self.sequence_parallel:
            if out.dim() < 2:
                raise ValueError(
                    f"{type(self).__name__}: sequence-parallel ids must be "
                    f"[..., seq], got shape {tuple(ids.shape)}"
                )
            return self._scatter_sequence(out)
        return comm.reduce_from_tp(out, self.tp)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim} (local rows "
            f"[{self.vocab_start}, {self.vocab_end})), tp={self.tp_size}, "
            f"sequence_parallel={self.sequence_parallel}"
        )


class HeadParallelEmbedding(ParallelModule):
    """torch.nn.Embedding whose columns are attention heads (T5's relative position bias: one
    column per head, looked up by relative-position bucket), its columns split over the TP group
    as the attention's heads are (``partition``, over the heads). Each rank looks up its own
    heads' columns, which only its heads read: nothing is exchanged, and each column's gradient
    is whole on the rank holding it."""

    def __init__(
        self,
        num_embeddings: int,
        partition: Partition,
        tp_group=None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        self._setup_tp(tp_group)
        self.num_embeddings = check_int("num_embeddings", num_embeddings)
        self.embedding_dim = partition.full
        local = partition.local_size(self.tp_rank)
        self.weight = nn.Parameter(torch.empty(num_embeddings, local, device=device, dtype=dtype))
        self._set_shard("weight", 1, partition)
        self._init_from_full("weight", nn.init.normal_)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)

    def extra_repr(self) -> str:
        heads, local = self.embedding_dim, self.weight.shape[1]
        return f"{self.num_embeddings}, {heads} ({local} heads here), tp={self.tp_size}"


class ParallelLMHead(ColumnParallelLinear):
    """The output projection onto the vocabulary, split by vocabulary like the embedding.

    By default it returns this rank's vocabulary shard of the logits, for
    :func:`vocab_parallel_cross_entropy`; ``gather_output=True`` returns full logits. With
    ``tie_to=embedding`` it shares the embedding's weight (same vocabulary split); a bias, tied
    or not, is split over the vocabulary with the weight.
    With ``sequence_parallel`` its input is this rank's sequence shard (gathered here).
    """

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        bias: bool = False,
        gather_output: bool = False,
        sequence_parallel: bool = False,
        tie_to: Optional[VocabParallelEmbedding] = None,
        tp_group=None,
        device=None,
        dtype=None,
        init_method: Optional[InitFn] = None,
        input_is_gathered: bool = False,
    ):
        if tie_to is not None:
            if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, hidden_size):
                raise ValueError(
                    f"tie_to has shape ({tie_to.num_embeddings}, {tie_to.embedding_dim}); a tied "
                    f"head needs ({vocab_size}, {hidden_size})"
                )
            tp_group = tie_to.tp if tp_group is None else tp_group
        super().__init__(
            hidden_size,
            vocab_size,
            bias,
            gather_output,
            False,
            sequence_parallel,
            tp_group,
            device,
            dtype,
            init_method,
            input_is_gathered=input_is_gathered,
        )
        self.vocab_size = vocab_size
        if tie_to is not None:
            self._check_same_group(tie_to)
            self.weight = tie_to.weight
