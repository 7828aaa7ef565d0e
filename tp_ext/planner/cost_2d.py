"""The 2D model's part of a training step on a P x Q grid of tensor parallelism (SUMMA):
:class:`GridStep`, a :class:`~tp_ext.planner.step.Step` whose shapes, activations, TP bytes and
compute are those of tp_ext's 2D Qwen2 (:mod:`tp_ext.models.qwen2.model_2d`). The rest of the
step is the Trainer's one core, as for 1D: the local loop or a pipeline schedule over the grid's
stages, DDP, FSDP2 (each rank's grid blocks sharded along dim 0 over its DP x CP replicas),
ZeRO-1 or ZeRO-2, context parallelism (each CP rank its positions of the grid row's sequences);
:mod:`.memory`, :mod:`.traffic` and :mod:`.timing` cost them for both.

As for 1D, the counts follow tp_ext's code: parameters are grid rank (0, 0)'s blocks of the
model built on the meta device (the shard policy gives the first row and column the larger
blocks), the activation bytes are what the 2D layers save for backward, the TP bytes what
``tp_ext.comm.track()`` records. Every activation is split over the whole grid: sequences over
the P rows, features over the Q columns (and positions over the CP ranks)."""

from __future__ import annotations

import functools

from tp_ext.distributed import ResolvedGroup
from tp_ext.distributed.grid import TPGrid
from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.models.qwen2.model_2d import Qwen2ForCausalLM2D
from tp_ext.planner.candidate import Candidate
from tp_ext.planner.counts import RankShapes
from tp_ext.planner.step import Step, split_backwards
from tp_ext.sharding import shard_sizes

__all__ = ["grid_problem", "grid_rank_shapes", "GridStep"]


def grid_problem(config, candidate: Candidate) -> str:
    """Why tp_ext cannot train ``config`` with this 2D candidate ("" when it can): the 2D
    model's own limits (tp_ext's Qwen2 only, whole KV heads per grid column)."""
    dims = candidate.dims
    if dims.grid is None:
        return f"tp={dims.tp!r} is one degree, not a grid (P, Q): the 1D cost model's case"
    if not isinstance(config, Qwen2Config):
        return "a 2D grid runs tp_ext's own Qwen2 (Qwen2ForCausalLM2D); use 1D TP (tp=N)"
    cols = dims.grid[1]
    if cols > config.num_key_value_heads:
        return (
            f"a grid of {cols} columns splits {config.num_key_value_heads} KV heads: every column "
            f"needs a whole KV head (Q <= {config.num_key_value_heads})"
        )
    return ""


@functools.lru_cache(maxsize=64)
def grid_rank_shapes(config: Qwen2Config, rows: int, cols: int) -> RankShapes:
    """Grid rank (0, 0)'s blocks of one decoder layer, of the embedding and of the final norm and
    head (the largest: the shard policy gives the first row and column the larger blocks)."""
    # rank (0, 0) of a grid with virtual groups: shapes only, nothing is communicated
    virtual = ResolvedGroup.virtual
    grid = TPGrid(rows, cols, 0, 0, virtual(cols, 0), virtual(rows, 0), virtual(rows * cols, 0))
    one = Qwen2ForCausalLM2D(config.replace(num_hidden_layers=1), grid=grid, device="meta")
    # a tied head counted as its own tensor (the last stage's copy), as 1D's rank_shapes does
    named = list(one.named_parameters(remove_duplicate=False))

    def part(*prefixes):
        return [p for n, p in named if n.startswith(prefixes)]

    def rows_of(*prefixes):
        return tuple((p.shape[0], p.numel()) for p in part(*prefixes))

    layer, embedding = part("model.layers.0."), part("model.embed_tokens")
    final = part("model.norm", "lm_head")
    attn, mlp = one.model.layers[0].self_attn, one.model.layers[0].mlp
    return RankShapes(
        embedding=sum(p.numel() for p in embedding),
        layer=sum(p.numel() for p in layer),
        final=sum(p.numel() for p in final),
        layer_tensors=len(layer),
        embedding_tensors=len(embedding),
        final_tensors=len(final),
        largest=max(p.numel() for _, p in named),
        layer_rows=rows_of("model.layers.0."),
        embedding_rows=rows_of("model.embed_tokens"),
        final_rows=rows_of("model.norm", "lm_head"),
        q_heads=attn.num_heads_local,
        kv_heads=attn.num_kv_heads_local,
        head_dim=attn.head_dim,
        intermediate=mlp.gate_proj.local_out_features,
        vocab=one.lm_head.out_sizes[0],  # column 0's vocabulary
    )


def regrid_numel(vocab: int, hidden: int, rows: int, cols: int) -> int:
    """Elements a tied head's exchange of blocks (:func:`tp_ext.layers.summa.regrid`) sends
    per micro-batch on the grid rank sending the most: forward, the part of its table block
    ``[vocab i of P, features j of Q]`` outside its product block ``[vocab j of Q, features i
    of P]``; backward, the product block's gradient outside the table block, sent back."""
    table = shard_sizes(vocab, rows), shard_sizes(hidden, cols)
    product = shard_sizes(vocab, cols), shard_sizes(hidden, rows)

    def box(sizes, index):
        return sum(sizes[:index]), sizes[index]

    most = 0
    for i in range(rows):
        for j in range(cols):
            (v0, vn), (f0, fn) = box(table[0], i), box(table[1], j)
            (w0, wn), (g0, gn) = box(product[0], j), box(product[1], i)
            vs = max(0, min(v0 + vn, w0 + wn) - max(v0, w0))
            fs = max(0, min(f0 + fn, g0 + gn) - max(f0, g0))
            most = max(most, vn * fn + wn * gn - 2 * vs * fs)
    return most


class GridStep(Step):
    """One training step of a 2D candidate on grid rank (0, 0) of each pipeline rank: grid row
    0's sequences of each micro-batch (the most), column 0's features."""

    def __init__(self, config, candidate: Candidate, seq_len, hardware, gpus_per_node):
        self.rows, self.cols = candidate.dims.grid
        self.hidden = shard_sizes(config.hidden_size, self.cols)[0]  # column 0's features
        self._tp_parts: dict = {}
        super().__init__(config, candidate, seq_len, hardware, gpus_per_node)

    # ---- the model's shapes and what it saves ------------------------------------------------

    def _sequences(self) -> int:
        return shard_sizes(self.micro_batch, self.rows)[0]

    def _shapes(self) -> RankShapes:
        return grid_rank_shapes(self.config, self.rows, self.cols)

    def _hidden_features(self) -> int:
        return self.hidden

    def _layer_activations(self) -> int:
        """What one 2D decoder layer saves for backward on grid rank (0, 0) (counted from its
        code): each RMSNorm2D its input, the normalised input and its output (the next
        linear's input), its fp32 inverse RMS per token, and (P > 1) its weight's copy; q after
        RoPE, k and v as attention sees them (repeated to the query heads; under context
        parallelism the ring and the all-to-all take them grouped), attention's output (o_proj's
        input, a view) and log-sum-exp, RoPE's cos and sin; the residual stream between
        attention and MLP; gate/up's output and SwiGLU's; and the concatenated weight blocks of
        q/k/v and of gate/up (one SUMMA product each, which keeps its weight operand)."""
        s, config, b, seq = self.s, self.config, self.b, self.local_seq
        h, q, kv = self.hidden, s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        t = b * seq
        repeated = s.q_heads > s.kv_heads and self.cp == 1
        kv_seen = q if repeated else kv  # k and v as attention sees them
        per_token = 6 * h + 2 * q + 2 * kv_seen + 3 * s.intermediate
        weight_rows = shard_sizes(config.hidden_size, self.rows)[0]  # the weights' K block
        weights = (q + 2 * kv + 2 * s.intermediate) * weight_rows
        norm_weights = 2 * h if self.rows > 1 else 0
        rope = 2 * b * seq * s.head_dim
        fp32 = 2 * t * 4 + b * s.q_heads * seq * 4
        return (t * per_token + rope + weights + norm_weights) * self.e + fp32

    def head_bytes(self) -> int:
        """1D's, and a tied head's exchanged blocks (the product keeps its weight operand)."""
        logits = self.tokens * self.logits_vocab * self.e
        saved = 2 * self.hidden_bytes + logits + 8 * self.loss_tokens + 4 * self.cols
        return saved + (self.head_weight_numel() * self.e if self.config.tie_word_embeddings else 0)

    def head_gradient_bytes(self) -> int:
        """The product's weight gradient and, tied, that gradient exchanged back into the
        table's blocks (before it is summed into the embedding's)."""
        tied = self.s.embedding * self.e if self.config.tie_word_embeddings else 0
        return self.head_weight_numel() * self.e + tied

    def head_weight_numel(self) -> int:
        """The head's block: column 0's vocabulary, row 0's features."""
        return self.s.vocab * shard_sizes(self.config.hidden_size, self.rows)[0]

    def ids_on(self, r: int) -> int:
        """The whole ids, on every rank of the first stage (under context parallelism also its
        positions of them, the whole batch)."""
        if not self.first_on(r):
            return 0
        whole = self.micro_batch * self.seq_len * 8
        return whole + (self.micro_batch * self.local_seq * 8 if self.cp > 1 else 0)

    # ---- the model's communication and compute -----------------------------------------------

    def _panels(self, k: int, n: int) -> int:
        """Bytes of one summa_linear's panels: per panel of K, x's broadcast along the grid row
        ([T, K] in all) and the weight's along the grid column ([N, K]). Its forward sends them
        once; its backward again, and reduces the two gradients' panels back (3 x in all)."""
        x = self.tokens * k if self.cols > 1 else 0
        w = n * k if self.rows > 1 else 0
        return (x + w) * self.e

    def _norm(self) -> int:
        """RMSNorm2D: the sum of squares (fp32, a value per token) all-reduced along the
        row forward and backward; the weight's gradient summed along the column."""
        row = 2 * self.tokens * 4 if self.cols > 1 else 0
        return row + (self.hidden * self.e if self.rows > 1 else 0)

    def tp_bytes_on(self, r: int) -> int:
        """Bytes per step, as track() counts them, on grid rank (0, 0) of pipeline rank r: its
        stages' (:meth:`_stage_tp_bytes`) for each micro-batch. A weight-split (zero-bubble)
        schedule computes a stage's input gradients and then its weight gradients in two
        passes, and summa_linear's backward runs in both, its collectives too
        (:func:`~tp_ext.planner.step.split_backwards`: on which micro-batches)."""
        if self.tp == 1:
            return 0
        total = 0
        for stage in self.stages.stages_of(r):
            split = split_backwards(self.candidate.schedule, self.pp, self.m, stage)
            total += split * self._stage_tp_bytes(stage, True)
            total += (self.m - split) * self._stage_tp_bytes(stage, False)
        return total

    def _stage_tp_bytes(self, stage: int, twice: bool) -> int:
        """One micro-batch's TP bytes of a stage (``twice``: the products' backward runs
        twice): its decoder layers', the embedding's on the first stage and the head's on the
        last (:meth:`_parts`)."""
        layer, embedding, head = self._parts(twice)
        total = len(self.stages.layers_of(stage)) * layer
        total += embedding if stage == 0 else 0
        return total + (head if stage == self.stages.last_stage else 0)

    def _parts(self, twice: bool) -> tuple[int, int, int]:
        """(a decoder layer's, the embedding's, the head's) TP bytes of one micro-batch: the
        layer's four SUMMA products (q/k/v, o, gate/up, down), its two norms and its biases'
        gradients (summed along the column), recomputed the products' forward and the norms'
        sums again; the embedding's reduce-scatter forward and all-gather backward of its whole
        [micro_batch, positions, h_j] lookup; the final norm, the head's product and the loss
        (the vocab-parallel loss along the row, the sums along the column)."""
        if twice not in self._tp_parts:
            s, config, h, e = self.s, self.config, self.config.hidden_size, self.e
            q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
            heads_dim = config.num_attention_heads * s.head_dim
            sends = 5 if twice else 3  # forward, backward (and the weight pass's backward)
            panels = self._panels(h, q + 2 * kv) + self._panels(heads_dim, self.hidden)
            panels += self._panels(h, 2 * s.intermediate)
            panels += self._panels(config.intermediate_size, self.hidden)
            layer = 2 * self._norm() + sends * panels
            layer += (q + 2 * kv) * e if self.rows > 1 else 0  # the biases' gradients
            if self.recompute:  # the layer's forward runs again in backward, its collectives too
                layer += panels + (2 * self.tokens * 4 if self.cols > 1 else 0)
            rows = self.rows > 1  # reduce-scatter forward, all-gather backward
            embedding = 2 * self.micro_batch * self.local_seq * self.hidden * e if rows else 0
            n = self.loss_tokens  # the loss's tokens on this grid row
            loss = (n + self.cols) * 4 + 3 * n * 4 if self.cols > 1 else 0
            loss += 4 if self.rows > 1 else 0
            head = self._norm() + sends * self._panels(h, s.vocab) + loss
            if config.tie_word_embeddings:  # the table's blocks exchanged, their gradient back
                head += regrid_numel(config.vocab_size, h, self.rows, self.cols) * e
            self._tp_parts[twice] = (layer, embedding, head)
        return self._tp_parts[twice]

    def flops_on(self, r: int) -> float:
        """FLOPs of this rank's blocks (each linear multiplies its [T, K] panels by the column's
        [N, K] weight rows), its share of attention's pairs under context parallelism."""
        s, config, h = self.s, self.config, self.config.hidden_size
        q, kv = s.q_heads * s.head_dim, s.kv_heads * s.head_dim
        hidden, heads_dim = self.hidden, config.num_attention_heads * s.head_dim
        weights = h * (q + 2 * kv) + heads_dim * hidden + 2 * h * s.intermediate
        weights += config.intermediate_size * hidden
        tokens = self.b * self.seq_len
        attention = 12 * tokens * self.seq_len * s.q_heads * s.head_dim
        recompute = 4 / 3 if self.recompute else 1
        flops = self.layers_on(r) * (6 * tokens * weights + attention) * recompute
        if self.last_on(r):
            flops += 6 * tokens * h * s.vocab
        return flops / self.cp

    def tp_seconds(self, tp_bytes: float, layers: int, crosses: bool) -> float:
        """Each SUMMA product runs about P + Q - 1 panels, two broadcasts each forward and four
        collectives backward; the norms' and the loss's all-reduces on top."""
        if self.tp == 1:
            return 0.0
        panels = self.rows + self.cols - 1
        collectives = layers * (4 * 6 * panels + 6) + 6 * panels + 6
        hw = self.hardware
        return tp_bytes / hw.link(crosses) + collectives * hw.latency
