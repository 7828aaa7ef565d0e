"""The 2D (SUMMA) layers of a decoder on a P x Q grid, built on :class:`Linear2D`: embedding,
the LM head tied to it, RMSNorm, the vocab-parallel cross-entropy on 2D logits, grouped-query
attention, the SwiGLU MLP and the decoder layer (Qwen2's).

Activations are ``[batch, seq, hidden]`` blocks: sequences over the P grid rows (so attention
needs no communication: every rank holds whole sequences), features over the Q columns
(attention heads whole: query heads follow their KV head). Token ids enter whole on every rank.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.grid import TPGrid
from tp_ext.layers.attention import KVCache, decoding_mask
from tp_ext.layers.base import check_int
from tp_ext.layers.context import context_attention
from tp_ext.layers.loss import vocab_parallel_cross_entropy
from tp_ext.layers.rotary import RotaryEmbedding
from tp_ext.layers.summa import (
    GridModule,
    Linear2D,
    linear_2d_shared_input,
    regrid,
    summa_product,
)
from tp_ext.sharding import GridBlock, shard_sizes

__all__ = [
    "Embedding2D",
    "TiedLMHead2D",
    "table_block",
    "RMSNorm2D",
    "cross_entropy_2d",
    "Attention2D",
    "MLP2D",
    "DecoderLayer2D",
]


class Embedding2D(GridModule):
    """Token embedding on a grid: rank (i, j) holds rows (tokens of the vocabulary) i of P and
    features j of Q of the table. ``forward(ids)`` takes the whole ``[batch, seq]`` ids (the same
    on every rank) and returns block (i, j) of ``[batch, seq, hidden]``: each rank looks up its
    vocabulary rows, and a reduce-scatter over the grid column sums the pieces and keeps grid
    row i's sequences."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        grid: Optional[TPGrid] = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        grid = self._setup_grid(grid)
        self.num_embeddings = check_int("num_embeddings", num_embeddings)
        self.embedding_dim = check_int("embedding_dim", embedding_dim)
        block = table_block(num_embeddings, embedding_dim, grid)
        self.vocab_sizes, self.feature_sizes = (split[1] for split in block.splits)
        self._new_param("weight", block, device, dtype)
        self.vocab_start = sum(self.vocab_sizes[: grid.row])
        self._init_from_full("weight", nn.init.normal_)  # torch.nn.Embedding's

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dim() < 1 or ids.dtype not in (torch.int32, torch.int64):
            raise ValueError(
                f"Embedding2D: ids must be an int tensor [batch, ...] (whole on every rank), got "
                f"{ids.dtype} of shape {tuple(ids.shape)}"
            )
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_sizes[self.grid.row])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        rows = shard_sizes(ids.size(0), self.grid.rows)
        return comm.reduce_scatter_to_sp(out, 0, rows, group=self.grid.col_group)


def table_block(vocab_size: int, hidden_size: int, grid: TPGrid) -> GridBlock:
    """The blocks of an embedding table ``[vocab, hidden]``: vocabulary over the grid rows,
    features over the columns (:class:`Embedding2D`'s, and a tied LM head's)."""
    vocab, features = shard_sizes(vocab_size, grid.rows), shard_sizes(hidden_size, grid.cols)
    return GridBlock((vocab_size, hidden_size), [("P", vocab), ("Q", features)])


class TiedLMHead2D(GridModule):
    """The LM head of a tied embedding on a grid: the logits block ``x @ E.T`` of ``x``'s block
    (i, j), with ``E`` the ``[vocab, hidden]`` table held in :class:`Embedding2D`'s blocks
    (rank (i, j): vocabulary i of P, features j of Q). The SUMMA product takes the transposed
    layout (:class:`Linear2D`'s: vocabulary j of Q, features i of P), which :func:`regrid`
    gives each forward, its backward bringing the head's gradient back to the table's blocks,
    where autograd sums it with the embedding's.

    Why an exchange of blocks: it is the cheapest exact read. One all-to-all over the grid moves
    each element once, V * H / (P * Q) per rank (on a square grid: the swap of blocks (i, j) and
    (j, i)). The blocks a rank needs lie in other grid rows and columns, so no all-gather along
    one grid axis reaches them, and one over the whole grid moves P * Q times as much. The
    product itself already brings V * H / Q of weight panels to each rank.

    ``tie_to``: the embedding whose parameter it shares; None: a parameter of its own in the
    same blocks (a pipeline's last stage without the embedding, kept equal to it by summing
    the two gradients). Within :meth:`held` (decoding: no gradient, fixed weights) the
    exchanged blocks are kept instead of exchanged at every step."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        grid: Optional[TPGrid] = None,
        *,
        tie_to: Optional[Embedding2D] = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        grid = self._setup_grid(grid)
        self.in_features = check_int("hidden_size", hidden_size)
        self.out_features = check_int("vocab_size", vocab_size)
        self.in_sizes = tuple(shard_sizes(hidden_size, grid.cols))
        self.out_sizes = tuple(shard_sizes(vocab_size, grid.cols))
        self.weight_in_sizes = tuple(shard_sizes(hidden_size, grid.rows))
        stored = table_block(vocab_size, hidden_size, grid)
        self.product_block = GridBlock(
            stored.full_shape, [("Q", self.out_sizes), ("P", self.weight_in_sizes)]
        )
        self._held: Optional[torch.Tensor] = None
        if tie_to is None:
            self._new_param("weight", stored, device, dtype)
            self._init_from_full("weight", nn.init.normal_)  # the embedding's
            return
        if (tie_to.num_embeddings, tie_to.embedding_dim) != (vocab_size, hidden_size):
            raise ValueError(
                f"TiedLMHead2D: tie_to has shape ({tie_to.num_embeddings}, "
                f"{tie_to.embedding_dim}); a tied head of ({vocab_size}, {hidden_size}) needs "
                "an embedding of that shape"
            )
        if tie_to.grid is not grid:
            raise ValueError("TiedLMHead2D: tie_to is on another grid; build both on one grid")
        self.weight = tie_to.weight
        self._set_block("weight", stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.in_sizes[self.grid.col]
        if x.dim() == 0 or x.size(-1) != local:
            raise ValueError(
                f"TiedLMHead2D: input block has shape {tuple(x.shape)}; its last dimension must "
                f"be {local} (this grid column's features)"
            )
        weight = self._held if self._held is not None else self._product_weight()
        return summa_product(x, weight, self.in_sizes, self.weight_in_sizes, self.grid)

    def _product_weight(self) -> torch.Tensor:
        stored = self.grid_block("weight")
        return regrid(self.weight, stored, self.product_block, self.grid)

    @contextlib.contextmanager
    def held(self):
        """Within: the product's blocks exchanged once and kept (every rank of the grid enters
        it together: the exchange is a collective). For decoding: no gradient flows, and the
        weights must not change inside."""
        with torch.no_grad():
            self._held = self._product_weight()
        try:
            yield
        finally:
            self._held = None

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.out_features}, hidden_size={self.in_features}, "
            f"grid={self.grid.rows}x{self.grid.cols}"
        )


class RMSNorm2D(GridModule):
    """Hugging Face's RMSNorm on feature blocks: the sum of squares is all-reduced over the grid
    row (forward and backward), the weight's piece of column j is replicated over the rows."""

    def __init__(
        self,
        hidden_size: int,
        eps: float = 1e-6,
        grid: Optional[TPGrid] = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        grid = self._setup_grid(grid)
        self.hidden_size = check_int("hidden_size", hidden_size)
        self.eps = float(eps)
        self.feature_sizes = tuple(shard_sizes(hidden_size, grid.cols))
        block = GridBlock((hidden_size,), [("Q", self.feature_sizes)])
        self._new_param("weight", block, device, dtype)
        self._init_from_full("weight", nn.init.ones_)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.size(-1) != self.feature_sizes[self.grid.col]:
            raise ValueError(
                f"RMSNorm2D: input block has shape {tuple(x.shape)}; its last dimension must be "
                f"{self.feature_sizes[self.grid.col]} (this grid column's features)"
            )
        row = self.grid.row_group
        h = x.float()
        squares = h.pow(2).sum(-1, keepdim=True)
        # every rank of the row uses the total: all-reduce forward and backward
        squares = comm.copy_to_tp(comm.reduce_from_tp(squares, group=row), group=row)
        h = h * torch.rsqrt(squares / self.hidden_size + self.eps)
        weight = comm.copy_to_tp(self.weight, group=self.grid.col_group)  # summed over rows
        return weight * h.to(x.dtype)


def cross_entropy_2d(
    logits_block: torch.Tensor,
    target: torch.Tensor,
    grid: TPGrid,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """Cross-entropy of 2D logits without gathering them: ``logits_block`` is block (i, j) of
    ``[tokens..., vocab]`` (vocabulary split over the columns by :func:`tp_ext.shard_sizes`),
    ``target`` the targets of grid row i's tokens (``logits_block.shape[:-1]``). The
    vocab-parallel loss runs over the grid row; "sum" and "mean" then add the rows' sums over
    the grid column (the same value on every rank; each rank's logits get their tokens'
    gradient). "none": the per-token loss of grid row i's tokens."""
    loss = vocab_parallel_cross_entropy(
        logits_block, target, grid.row_group, ignore_index=ignore_index, reduction="none"
    )
    if reduction == "none":
        return loss
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'none', 'sum' or 'mean'")
    total = comm.reduce_from_tp(loss.sum(), group=grid.col_group)
    if reduction == "sum":
        return total
    count = (target != ignore_index).sum().to(total.dtype)
    count = comm.all_reduce(count, "sum", group=grid.col_group) if grid.rows > 1 else count
    return total / count


def kv_head_sizes(num_kv_heads: int, cols: int) -> list[int]:
    """KV heads per grid column (whole heads, every column at least one)."""
    if cols > num_kv_heads:
        raise ValueError(
            f"a grid of {cols} columns splits {num_kv_heads} KV heads: every column needs a whole "
            f"KV head, so the grid may have at most {num_kv_heads} columns (use a grid (P, Q) "
            f"with Q <= {num_kv_heads})"
        )
    return shard_sizes(num_kv_heads, cols)


class Attention2D(GridModule):
    """Causal grouped-query attention on a grid: q, k, v and o as :class:`Linear2D` with whole
    heads per grid column (query heads with their KV head), RoPE and scaled dot-product
    attention on this rank's sequences and heads (no communication there)."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: Optional[int] = None,
        qkv_bias: bool = True,
        rope_theta: float = 10000.0,
        grid: Optional[TPGrid] = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        check_int("num_heads", num_heads)
        check_int("num_kv_heads", num_kv_heads)
        if num_heads % num_kv_heads:
            raise ValueError(
                f"num_heads={num_heads} must be a multiple of num_kv_heads={num_kv_heads}"
            )
        head_dim = head_dim or hidden_size // num_heads
        grid = self._setup_grid(grid)
        kv = kv_head_sizes(num_kv_heads, grid.cols)
        group = num_heads // num_kv_heads
        q_sizes = [n * group * head_dim for n in kv]
        kv_sizes = [n * head_dim for n in kv]
        kw = {"device": device, "dtype": dtype}
        self.q_proj = Linear2D(
            hidden_size, num_heads * head_dim, qkv_bias, grid, out_sizes=q_sizes, **kw
        )
        self.k_proj = Linear2D(
            hidden_size, num_kv_heads * head_dim, qkv_bias, grid, out_sizes=kv_sizes, **kw
        )
        self.v_proj = Linear2D(
            hidden_size, num_kv_heads * head_dim, qkv_bias, grid, out_sizes=kv_sizes, **kw
        )
        self.o_proj = Linear2D(
            num_heads * head_dim, hidden_size, False, grid, in_sizes=q_sizes, **kw
        )
        self.head_dim = head_dim
        self.num_kv_heads_local = kv[grid.col]
        self.num_heads_local = kv[grid.col] * group
        self.rotary = RotaryEmbedding(head_dim, rope_theta)
        # context parallelism: the ranks sharing each sequence, and how attention runs over them
        self.cp, self.cp_mode = None, "ring"

    def new_kv_cache(self, rows: int, max_length: int) -> KVCache:
        """A cache of this rank's KV heads for ``rows`` sequences (its grid row's)."""
        weight = self.k_proj.weight
        return KVCache(
            rows, max_length, self.num_kv_heads_local, self.head_dim, weight.device, weight.dtype
        )

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache: Optional[KVCache] = None,
        key_mask: Optional[torch.Tensor] = None,
        seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        """``x``: this rank's block (its grid row's sequences); ``position_ids``, ``key_mask``
        ([rows, past + seq]) and ``kv_cache`` those sequences' (decoding). Under context
        parallelism ``x`` holds this CP rank's positions (``position_ids``) of sequences of
        ``seq_len`` tokens, attended over the CP group."""
        batch, seq = x.shape[0], x.shape[1]
        q, k, v = linear_2d_shared_input(x, [self.q_proj, self.k_proj, self.v_proj])
        q = q.view(batch, seq, self.num_heads_local, self.head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.num_kv_heads_local, self.head_dim).transpose(1, 2)
        past = 0 if kv_cache is None else kv_cache.length
        if position_ids is None:
            position_ids = torch.arange(past, past + seq, device=x.device).expand(batch, seq)
        q, k = self.rotary.rotate(q, k, position_ids)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
        if self.cp is not None:  # (grouped heads: the ring and the all-to-all take them)
            out = context_attention(self.cp_mode, q, k, v, seq_len, self.cp)
        else:
            groups = self.num_heads_local // self.num_kv_heads_local
            if groups > 1:
                k = k.repeat_interleave(groups, dim=1)
                v = v.repeat_interleave(groups, dim=1)
            mask, causal = decoding_mask(q, k, past, key_mask)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        out = out.transpose(1, 2).reshape(batch, seq, self.num_heads_local * self.head_dim)
        return self.o_proj(out)


class MLP2D(GridModule):
    """Qwen2's SwiGLU MLP on a grid: gate and up (:class:`Linear2D`, hidden -> intermediate),
    the fused SwiGLU on the local block, down (intermediate -> hidden)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        grid: Optional[TPGrid] = None,
        *,
        device=None,
        dtype=None,
    ):
        super().__init__()
        grid = self._setup_grid(grid)
        kw = {"device": device, "dtype": dtype}
        self.gate_proj = Linear2D(hidden_size, intermediate_size, False, grid, **kw)
        self.up_proj = Linear2D(hidden_size, intermediate_size, False, grid, **kw)
        self.down_proj = Linear2D(intermediate_size, hidden_size, False, grid, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat(linear_2d_shared_input(x, [self.gate_proj, self.up_proj]), dim=-1)
        return self.down_proj(ops.swiglu(gate_up))


class DecoderLayer2D(GridModule):
    """Qwen2's decoder layer on a grid (pre-norm attention and MLP with residuals)."""

    def __init__(self, config, grid: Optional[TPGrid] = None, *, device=None, dtype=None):
        super().__init__()
        grid = self._setup_grid(grid)
        kw = {"device": device, "dtype": dtype}
        h = config.hidden_size
        self.self_attn = Attention2D(
            h,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
            True,
            config.rope_theta,
            grid,
            **kw,
        )
        self.mlp = MLP2D(h, config.intermediate_size, grid, **kw)
        self.input_layernorm = RMSNorm2D(h, config.rms_norm_eps, grid, **kw)
        self.post_attention_layernorm = RMSNorm2D(h, config.rms_norm_eps, grid, **kw)

    def forward(
        self,
        x: torch.Tensor,
        position_ids: Optional[torch.Tensor] = None,
        kv_cache=None,
        key_mask=None,
        seq_len: Optional[int] = None,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(x), position_ids, kv_cache, key_mask, seq_len
        )
        x = x + attended
        return x + self.mlp(self.post_attention_layernorm(x))
