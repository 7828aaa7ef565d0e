"""Expert parallelism: the experts of a mixture-of-experts layer spread over the ranks of an EP
group, each token sent to the ranks holding its chosen experts and back (all-to-all).

:class:`ExpertParallelMoE` replaces a Hugging Face sparse-MoE block (Qwen2-MoE with its shared
expert, Mixtral) and computes what it computes, on every rank's own tokens:

1. the model's own router (kept as is: softmax order, top-k, renormalisation; transformers
   records its logits for the load-balancing loss, so ``output_router_logits`` gives the model's
   own aux loss);
2. ``moe_route`` sorts the (token, choice) pairs by expert (a counting sort; with a capacity
   factor, choices beyond an expert's capacity are dropped and counted); ``moe_permute`` copies
   the tokens into that order, so each destination rank's rows are contiguous;
3. the counts go to the ranks that hold the experts (an all-to-all of a few integers), then the
   rows (``all_to_all_single``, uneven splits, under the comm tag ``"moe"``);
4. the received rows are regrouped by local expert (``moe_route`` again) and each local expert
   runs once on its contiguous group;
5. the reverse path, and ``moe_unpermute`` sums each token's expert outputs with its routing
   weights.

Experts are split over the EP group by :func:`tp_ext.shard_sizes` (8 experts over 3 ranks: 3, 3,
2). With TP, two cases, as ``init_parallel`` builds the EP group:

- taken from DP ranks (ep divides dp): each expert's intermediate dimension is split over the TP
  group too, and the TP ranks run the same tokens through their slices (partial sums, reduced);
- across TP ranks (ep > dp): TP ranks hold the same tokens, so each TP rank routes its share of
  them (:func:`tp_ext.shard_sizes` over the TP group) through whole experts and the TP group
  gathers the outputs. The router runs on every token, so its gradient is whole on every rank.

Either way every rank holds its share of the experts, no more. The state dict keeps the Hugging Face
names and full shapes through ``full_state_dict`` / ``load_full_state_dict``.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import ResolvedGroup, resolve_group
from tp_ext.distributed.state import PROCESS
from tp_ext.layers.base import ParallelModule, no_init
from tp_ext.layers.sequence import SequenceShards, sum_gradients_over
from tp_ext.sharding import Partition, shard_sizes

__all__ = [
    "ExpertParallelMoE",
    "ParallelExperts",
    "is_sparse_moe_block",
    "sequence_parallel_router",
    "expert_parameters",
    "expert_count",
    "experts_per_token",
    "MOE_TAG",
]

MOE_TAG = "moe"  # the comm tag of the dispatch and combine (tp_ext.comm.track())


def expert_count(config) -> int:
    """Routed experts per MoE layer of a transformers ``config`` (0 for a dense model)."""
    return _first_int(config, ("num_local_experts", "num_experts", "n_routed_experts"))


def experts_per_token(config) -> int:
    """Experts each token is routed to (top-k) in a transformers ``config`` (0: dense)."""
    return _first_int(config, ("num_experts_per_tok", "moe_topk", "top_k"))


def _first_int(config, fields) -> int:
    """The first of ``fields`` that ``config`` sets to an int (architectures name it apart)."""
    return next((v for v in (getattr(config, f, None) for f in fields) if isinstance(v, int)), 0)


def is_sparse_moe_block(module: nn.Module) -> bool:
    """A Hugging Face sparse-MoE block: a ``gate`` router with an ``[experts, hidden]`` weight and
    ``experts`` holding 3-D ``gate_up_proj`` / ``down_proj`` (Qwen2-MoE, Mixtral, ...)."""
    gate, experts = getattr(module, "gate", None), getattr(module, "experts", None)
    weight = getattr(gate, "weight", None)
    up, down = getattr(experts, "gate_up_proj", None), getattr(experts, "down_proj", None)
    return (
        isinstance(weight, torch.Tensor)
        and weight.dim() == 2
        and isinstance(up, torch.Tensor)
        and isinstance(down, torch.Tensor)
        and up.dim() == 3
        and down.dim() == 3
        and up.shape[0] == down.shape[0] == weight.shape[0]
        and up.shape[1] == 2 * down.shape[2]
    )


def sequence_parallel_router(block: nn.Module, sequence: SequenceShards, routes_shard: bool):
    """A sparse-MoE block's router and shared-expert gate under sequence parallelism (the block
    gathers the sequence and reduce-scatters its output): they run in full on every TP rank, on
    the whole sequence, or (``routes_shard``) the router on this rank's shard only.

    Their gradients are this rank's part (its tokens' or its experts' slices'): summed over TP.
    The router's logits, which transformers records for its load-balancing loss, are made every
    token's on every rank, with each rank's gradient through them its own tokens' part, so the
    loss is the one process's (statistics over all tokens) and counted once."""

    def whole_logits(module, args, output):
        if not isinstance(output, tuple):
            raise TypeError(
                f"{type(module).__name__}: a sparse-MoE router returns (logits, weights, "
                f"expert ids), got {type(output).__name__}"
            )
        logits = sequence.tokens(output[0], whole=not routes_shard)
        if routes_shard:
            logits = sequence.gather_replicated(logits)
        else:
            logits = sequence.own_gradient(logits)
        return (logits.reshape(-1, logits.size(-1)), *output[1:])

    # first: transformers' recorder may have hooked the router already (a traced forward)
    block.gate.register_forward_hook(whole_logits, prepend=True)
    for name in ("gate", "shared_expert_gate"):
        part = getattr(block, name, None)
        if part is not None:
            sum_gradients_over(part, sequence.tp)


def expert_parameters(model: nn.Module) -> tuple[list[nn.Parameter], Optional[ResolvedGroup]]:
    """The parameters of ``model`` split by expert over an EP group, and that group (None when
    there are none): their gradients are summed over expert-DP, not DP, and their norms over EP."""
    params, group = [], None
    for module in model.modules():
        if isinstance(module, ParallelModule) and module.ep is not None:
            for name, param in module.named_parameters(recurse=False):
                if module.expert_spec(name) is not None:
                    params.append(param)
                    group = module.ep
    return params, group


def expert_group(group=None) -> ResolvedGroup:
    """``group`` as a ResolvedGroup; None is the EP group of :func:`tp_ext.init_parallel` (``ep=``),
    or a group of one when it made none."""
    if group is not None:
        return resolve_group(group)
    state = PROCESS.parallel
    return ResolvedGroup.local() if state is None else resolve_group(state.ep_group)


def tp_ranks_in_ep(tp: ResolvedGroup, ep: ResolvedGroup) -> int:
    """How many ranks of this rank's TP group its EP group holds: 1 when the EP group is taken
    from DP ranks only, more when ``init_parallel(ep > dp)`` took it across TP ranks too."""
    if tp.size == 1 or ep.size == 1 or tp.group is None or ep.group is None:
        return 1
    import torch.distributed as dist

    shared = set(dist.get_process_group_ranks(tp.group)) & set(
        dist.get_process_group_ranks(ep.group)
    )
    return len(shared)


class ParallelExperts(ParallelModule):
    """This rank's experts: ``gate_up_proj`` ``[local experts, 2 * inter_local, hidden]`` and
    ``down_proj`` ``[local experts, hidden, inter_local]`` (Hugging Face's layout, gate rows then
    up rows), split by expert over ``ep`` and by intermediate dim over ``tp_group``.
    ``forward(rows, group_sizes)`` runs local expert e on the e-th contiguous group of rows; with
    TP the result is this rank's partial sum (the caller reduces it)."""

    def __init__(
        self,
        num_experts: int,
        hidden_size: int,
        intermediate_size: int,
        act_fn: nn.Module,
        ep=None,
        tp_group=None,
        dtype: Optional[torch.dtype] = None,
        device=None,
    ) -> None:
        super().__init__()
        tp = self._setup_tp(tp_group)
        ep = expert_group(ep)
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        self.expert_partition = Partition.split(num_experts, ep.size)
        gate_up = Partition.merged([intermediate_size, intermediate_size], tp.size)
        down = Partition.split(intermediate_size, tp.size)
        local_experts = self.expert_partition.local_size(ep.rank)
        inter = down.local_size(tp.rank)
        self.first_expert = sum(shard_sizes(num_experts, ep.size)[: ep.rank])
        kw = {"dtype": dtype, "device": device}
        self.gate_up_proj = nn.Parameter(torch.empty(local_experts, 2 * inter, hidden_size, **kw))
        self.down_proj = nn.Parameter(torch.empty(local_experts, hidden_size, inter, **kw))
        self.act_fn = act_fn
        self._set_shard("gate_up_proj", 1, gate_up)
        self._set_shard("down_proj", 2, down)
        self._set_expert_shard("gate_up_proj", 0, self.expert_partition, ep)
        self._set_expert_shard("down_proj", 0, self.expert_partition, ep)
        if PROCESS.init_weights and self.down_proj.device.type != "meta":
            # transformers' initialisation (normal, std 0.02) of the full experts, this rank's
            # share kept: the same weights at every EP and TP degree for one seed
            full = {
                "gate_up_proj": torch.empty(num_experts, 2 * intermediate_size, hidden_size, **kw),
                "down_proj": torch.empty(num_experts, hidden_size, intermediate_size, **kw),
            }
            for t in full.values():
                nn.init.normal_(t, std=0.02)
            self.load_full_state_dict(full)

    @property
    def num_local_experts(self) -> int:
        return self.gate_up_proj.shape[0]

    def forward(self, rows: torch.Tensor, group_sizes: list[int]) -> torch.Tensor:
        # Every local expert runs, even on no rows: its weights then get a zero gradient (not
        # None), so every rank's gradients have the same structure for the DP reduction.
        fused = isinstance(self.act_fn, nn.SiLU)
        # unbind, not [e]: one stack of the experts' gradients in backward, not a full-size
        # zero tensor per expert
        gate_ups, downs = self.gate_up_proj.unbind(0), self.down_proj.unbind(0)
        # split, not slices: one concatenation of the groups' gradients in backward, not a
        # zero-filled full-size gradient per group summed up
        outs = []
        for e, x in enumerate(rows.split(list(group_sizes))):
            gate_up = ops.linear(x, gate_ups[e])
            if fused:
                h = ops.swiglu(gate_up)
            else:
                gate, up = gate_up.chunk(2, dim=-1)
                h = self.act_fn(gate) * up
            outs.append(ops.linear(h, downs[e]))
        # no local experts (fewer experts than EP ranks): the empty rows themselves, so the
        # output stays on the graph and this rank joins the backward's all-to-alls
        return torch.cat(outs) if outs else rows[:0]

    def extra_repr(self) -> str:
        return (
            f"experts {self.first_expert}..{self.first_expert + self.num_local_experts - 1} of "
            f"{self.num_experts}, hidden={self.hidden_size}, intermediate "
            f"{self.down_proj.shape[2]} of {self.intermediate_size}"
        )


class ExpertParallelMoE(ParallelModule):
    """A sparse-MoE block with its experts spread over an expert-parallel group.

    Build it from a Hugging Face block with :meth:`from_block` (``tp_ext.parallelize`` does, for
    ``parallel`` states with ``ep > 1``), or from parts. ``router(x [T, H])`` returns ``(logits,
    weights [T, k], expert ids [T, k])`` as transformers' routers do. ``shared_expert`` (and
    ``shared_expert_gate``, a sigmoid gate) run on every token locally. ``capacity_factor``:
    None routes every choice (dropless); a number keeps at most ``ceil(factor * T * k / E)``
    choices per expert on each rank, in token order, and drops the rest (their weight is lost,
    as in Switch / GShard); ``dropped_tokens`` counts them. ``tokens_per_expert`` holds the last
    forward's routing counts on this rank (``[E]``, before drops). With the EP group across TP
    ranks (``tokens_split_over_tp``), T is this TP rank's share of the tokens for the capacity
    and ``dropped_tokens``; ``tokens_per_expert`` counts all of them.

    ``sequence`` (a :class:`~tp_ext.layers.sequence.SequenceShards`): sequence parallelism; the
    layer takes and returns this TP rank's sequence shard (:meth:`_forward_shard`), the router's
    and shared-expert gate's gradients summed over TP (:func:`sequence_parallel_router`). A
    shared expert must then give this rank's partial sum (its row-parallel linear built with
    ``reduce_output=False``, as parallelize does): the layer reduce-scatters it with the routed
    experts'. With the EP group across TP ranks the shard is this rank's share of the tokens,
    and ``tokens_per_expert`` counts its own.
    """

    def __init__(
        self,
        router: nn.Module,
        experts: ParallelExperts,
        ep_group=None,
        tp_group=None,
        shared_expert: Optional[nn.Module] = None,
        shared_expert_gate: Optional[nn.Module] = None,
        jitter_noise: float = 0.0,
        capacity_factor: Optional[float] = None,
        sequence: Optional[SequenceShards] = None,
    ) -> None:
        super().__init__()
        tp = self._setup_tp(tp_group)
        ep = expert_group(ep_group)
        object.__setattr__(self, "ep", ep)
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(
                f"ExpertParallelMoE: capacity_factor={capacity_factor!r} must be a positive "
                "number (1.0: each expert takes its even share of choices), or None for dropless"
            )
        # EP across TP ranks (ep > dp): those ranks hold the same tokens, so each takes its
        # share of them through the experts (whole experts, not split over TP) and the TP group
        # gathers the results; else the experts are split over TP as the layer is.
        self.tokens_split_over_tp = tp_ranks_in_ep(tp, ep) > 1
        experts_tp = (
            (ResolvedGroup.local().name, 1) if self.tokens_split_over_tp else (tp.name, tp.size)
        )
        if (experts.tp.name, experts.tp_size) != experts_tp or experts.ep.size != ep.size:
            want = "no TP group" if self.tokens_split_over_tp else f"TP {tp}"
            raise ValueError(
                f"ExpertParallelMoE: experts are split over TP {experts.tp} and EP {experts.ep}, "
                f"but this layer (TP {tp}, EP {ep}) needs them built with {want} and EP {ep}"
            )
        self.gate = router
        self.experts = experts
        if shared_expert is not None:
            self.shared_expert = shared_expert
        if shared_expert_gate is not None:
            self.shared_expert_gate = shared_expert_gate
        self.jitter_noise = jitter_noise
        self.capacity_factor = capacity_factor
        self.num_experts = experts.num_experts
        self.expert_sizes = shard_sizes(self.num_experts, ep.size)
        self.register_buffer(
            "tokens_per_expert", torch.zeros(self.num_experts, dtype=torch.int64), persistent=False
        )
        self.dropped_tokens = 0
        self.sequence = sequence if tp.size > 1 else None  # (no sequence split at TP 1)
        if self.sequence is not None:
            sequence_parallel_router(self, self.sequence, self.tokens_split_over_tp)

    # -- construction from a Hugging Face block ---------------------------------------------------

    @classmethod
    @torch.no_grad()
    def from_block(
        cls, block: nn.Module, ep_group=None, tp_group=None, capacity_factor=None, sequence=None
    ) -> "ExpertParallelMoE":
        """The block's router, shared expert and gate are kept (the same modules); its experts
        are replaced by this rank's share of them (copied from the block's full weights).
        ``sequence``: as in the constructor."""
        if not is_sparse_moe_block(block):
            raise ValueError(
                f"ExpertParallelMoE.from_block: {type(block).__name__} is not a sparse-MoE block "
                "(a `gate` router with an [experts, hidden] weight and `experts` with 3-D "
                "gate_up_proj / down_proj)"
            )
        full = block.experts
        num_experts, hidden, inter = full.down_proj.shape
        ep = expert_group(ep_group)
        experts_tp = resolve_group(tp_group)
        if tp_ranks_in_ep(experts_tp, ep) > 1:
            experts_tp = ResolvedGroup.local()  # EP across TP ranks: whole experts (see __init__)
        with no_init():  # loaded from the block's weights just below
            experts = ParallelExperts(
                num_experts,
                hidden,
                inter,
                full.act_fn,
                ep,
                experts_tp,
                dtype=full.down_proj.dtype,
                device=full.down_proj.device,
            )
        experts.load_full_state_dict(
            {"gate_up_proj": full.gate_up_proj.detach(), "down_proj": full.down_proj.detach()}
        )
        for name in ("gate_up_proj", "down_proj"):
            getattr(experts, name).requires_grad_(getattr(full, name).requires_grad)
        layer = cls(
            block.gate,
            experts,
            ep,
            tp_group,
            getattr(block, "shared_expert", None),
            getattr(block, "shared_expert_gate", None),
            float(getattr(block, "jitter_noise", 0.0) or 0.0),
            capacity_factor,
            sequence,
        )
        layer.train(block.training)
        return layer

    # -- forward -----------------------------------------------------------------------------------

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.sequence is not None:
            return self._forward_shard(hidden_states)
        shape = hidden_states.shape
        x = self._jitter(hidden_states).reshape(-1, shape[-1])
        _, weights, expert_ids = self.gate(x)
        out = self._routed(x, expert_ids, weights)
        shared = self._shared(x)
        return (out if shared is None else out + shared).reshape(shape)

    def _forward_shard(self, x: torch.Tensor) -> torch.Tensor:
        """Under sequence parallelism: ``x`` is this TP rank's sequence shard ``[..., seq_r,
        hidden]``, and so is the result.

        Experts split over TP: the whole sequence is gathered once (for the shared expert too)
        and every TP rank routes all of it. Routing the gathered sequence, not each shard and
        then gathering the choices: the router's matmul (hidden x experts a token) is small
        next to the experts', and every TP rank gets the same choices from the same tokens with
        no collective of its own. The routed and shared experts' partial sums are then
        reduce-scattered back to the shards in one collective, where without sequence
        parallelism each is all-reduced. With the EP group across TP ranks the shard is this
        rank's share of the tokens: it is routed as it is, through whole experts, and only the
        shared expert (if any) needs the whole sequence."""
        x = self._jitter(x)  # each rank its own positions: the gathered tokens agree
        hidden, has_shared = x.size(-1), getattr(self, "shared_expert", None) is not None
        whole = None
        if has_shared or not self.tokens_split_over_tp:
            whole = self.sequence.gather(x, type(self).__name__)
        out = partial = None
        if self.tokens_split_over_tp:
            mine = x.reshape(-1, hidden)
            _, weights, expert_ids = self.gate(mine)
            out = self._routed_tokens(mine, expert_ids, weights).view_as(x)
        else:
            tokens = whole.reshape(-1, hidden)
            _, weights, expert_ids = self.gate(tokens)
            partial = self._routed_tokens(tokens, expert_ids, weights, reduce=False)
        if has_shared:
            shared = self._shared(whole.reshape(-1, hidden))
            partial = shared if partial is None else partial + shared
        if partial is not None:
            reduced = self.sequence.scatter(partial.view_as(whole))
            out = reduced if out is None else out + reduced
        return out

    def _jitter(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and self.jitter_noise > 0:  # Mixtral's router noise, as its block
            noise = torch.empty_like(x).uniform_(1.0 - self.jitter_noise, 1.0 + self.jitter_noise)
            return x * noise
        return x

    def _shared(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The shared expert's output on ``x`` (None without one), through its sigmoid gate."""
        shared = getattr(self, "shared_expert", None)
        if shared is None:
            return None
        out = shared(x)
        gate = getattr(self, "shared_expert_gate", None)
        return out if gate is None else torch.sigmoid(gate(x)) * out

    def _routed(self, x: torch.Tensor, expert_ids: torch.Tensor, weights: torch.Tensor):
        if not self.tokens_split_over_tp:
            return self._routed_tokens(x, expert_ids, weights)
        # This TP rank's share of the tokens (the router ran on all of them, so its gradients
        # are whole on every TP rank: the backward of the split gathers the shares' gradients).
        with torch.no_grad():
            self.tokens_per_expert.copy_(
                torch.bincount(expert_ids.flatten().long(), minlength=self.num_experts)
            )
        sizes = shard_sizes(x.shape[0], self.tp_size)
        first = sum(sizes[: self.tp_rank])
        mine = comm.scatter_to_tp(x, 0, sizes, self.tp)
        my_weights = comm.scatter_to_tp(weights, 0, sizes, self.tp)
        my_ids = expert_ids[first : first + sizes[self.tp_rank]]
        out = self._routed_tokens(mine, my_ids, my_weights, count=False)
        return comm.gather_from_tp(out, 0, sizes, self.tp)

    def _routed_tokens(self, x, expert_ids, weights, count: bool = True, reduce: bool = True):
        """The routed experts' output for tokens ``x``. Experts split over TP: the TP ranks'
        sums reduced, or (``reduce=False``, sequence parallelism) left this rank's partial sum,
        ``x`` and ``weights`` the whole sequence's, their gradients partial sums too."""
        tokens, top_k = expert_ids.shape
        with torch.no_grad():
            row_map, counts = ops.moe_route(expert_ids, self.num_experts)
            if count:
                self.tokens_per_expert.copy_(counts)
            if self.capacity_factor is not None:
                row_map, counts = self._drop_over_capacity(expert_ids, row_map, counts)
        split_experts = self.tp_size > 1 and not self.tokens_split_over_tp and reduce
        if split_experts:  # replicated over TP; the experts' slices give partial sums
            x = comm.copy_to_tp(x, self.tp)
            weights = comm.copy_to_tp(weights, self.tp)
        rows = ops.moe_permute(x, row_map, None, tokens * top_k)
        with comm.tag(MOE_TAG):
            y = self._dispatch_and_run(rows, counts)
        out = ops.moe_unpermute(y, row_map, weights)  # fp32 math, whatever the weights' dtype
        return comm.reduce_from_tp(out, self.tp) if split_experts else out

    def _dispatch_and_run(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """rows [T * k, H], sorted by expert (dropped rows last) -> the experts' outputs, in the
        same order (zeros for dropped rows)."""
        ep, sizes = self.ep.size, self.expert_sizes
        local = sizes[self.ep.rank]
        # Counts to the ranks holding the experts: from each rank, its rows for my experts.
        received_counts = comm.all_to_all_single(counts, sizes, [local] * ep, self.ep)
        per_rank, start = [], 0
        counts_list = counts.tolist()
        for n in sizes:
            per_rank.append(sum(counts_list[start : start + n]))
            start += n
        from_rank = received_counts.view(ep, local).sum(1).tolist()
        sent = sum(per_rank)
        received = comm.all_to_all_single(rows[:sent], per_rank, from_rank, self.ep)
        if local == 1:  # one local expert: the received rows are already its group
            back = self.experts(received, [received.shape[0]])
        else:
            # Received rows are ordered by source rank, then expert: regroup by local expert.
            local_ids = torch.repeat_interleave(
                torch.arange(local, device=rows.device).repeat(ep), received_counts
            )
            regroup, group_sizes = ops.moe_route(local_ids.unsqueeze(1), max(local, 1))
            grouped = ops.moe_permute(received, regroup, None, received.shape[0])
            out = self.experts(grouped, group_sizes.tolist()[:local])
            back = ops.moe_unpermute(out, regroup, None)  # source-rank order again
        returned = comm.all_to_all_single(back, from_rank, per_rank, self.ep)
        if sent < rows.shape[0]:  # dropped rows: zeros
            returned = F.pad(returned, (0, 0, 0, rows.shape[0] - sent))
        return returned

    @torch.no_grad()
    def _drop_over_capacity(self, expert_ids, row_map, counts):
        tokens, top_k = expert_ids.shape
        capacity = math.ceil(self.capacity_factor * tokens * top_k / self.num_experts)
        ids = expert_ids.to(torch.int64)
        first_row = torch.cumsum(counts, 0) - counts  # each expert's first row
        position = row_map - first_row[ids]  # place of the choice in its expert's queue
        kept = torch.where(position < capacity, ids, torch.full_like(ids, -1))
        self.dropped_tokens = int((position >= capacity).sum())
        return ops.moe_route(kept, self.num_experts)

    def extra_repr(self) -> str:
        return (
            f"experts={self.num_experts}, ep={self.ep.size} (this rank: "
            f"{self.expert_sizes[self.ep.rank]}), tp={self.tp_size}"
            f"{' (tokens split over it)' if self.tokens_split_over_tp else ''}, capacity_factor="
            f"{self.capacity_factor}"
        )
