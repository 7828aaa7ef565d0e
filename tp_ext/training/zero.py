"""A distributed optimizer over the data-parallel ranks (ZeRO, Megatron's distributed optimizer):
each DP rank keeps fp32 master weights and optimizer state for its rows of every parameter only,
updates them, and the updated rows are all-gathered into every replica's parameters.

- ``data_parallel="zero1"``: gradients are all-reduced over DP (as DDP does), each rank steps its
  rows, the rows are all-gathered.
- ``data_parallel="zero2"``: gradients are reduce-scattered (each rank receives the sum of its
  rows only), then the same step and all-gather. The reduce-scatters run in buckets during the
  backward: a bucket's is issued once the last micro-batch's backward has written every gradient
  in it, and the whole gradients are freed as they are sent; they are received after the
  backward (a wait inside it could deadlock: a peer whose gradient comes later, an expert with
  no tokens there, may still need this rank for the rest of its backward).
  Schedules with a split weight backward (zero bubble) write weight gradients outside autograd's
  accumulation, where no hook sees them: there every bucket goes after the schedule.

The rows are the ones FSDP2 gives a DP rank (dim 0 of each parameter's TP-local tensor, split as
``torch.chunk`` splits it), and the state is exposed per model parameter as DTensors placed
``Shard(0)`` on the DP mesh, so tp_ext's checkpoints save each rank's rows under the parameter's
name and a checkpoint moves between ZeRO, DDP and FSDP2 runs at any DP degree. The fp32 master
rows of bf16 parameters are saved too (``master.<name>``), so a resumed ZeRO run continues from
them; a run without masters ignores them, and one resumed from a checkpoint without them starts
its masters from the saved weights. (Weights written into a bf16 model after the Trainer is
built are overwritten from the masters at the next step, unless loaded by
``Trainer.load_checkpoint``.) Under ZeRO-2 the
gradients left on the parameters are those rows too (DTensors, as FSDP2's), which the gradient
norm and clipping count once each.

torch's ``ZeroRedundancyOptimizer`` assigns whole parameters to ranks (the state per rank is
uneven, and its checkpoints hold per-rank parameter lists that do not load at another DP degree
or into DDP); hence this one.
"""

from __future__ import annotations

import inspect
from typing import Optional

import torch

from tp_ext.compression import OneBitAdam
from tp_ext.distributed import comm
from tp_ext.distributed.dtensors import is_dtensor
from tp_ext.distributed.groups import ResolvedGroup
from tp_ext.pipeline.data_parallel import Replicas, reduce_scatter_in
from tp_ext.training.zero_rows import (
    Backward,
    Bucket,
    StateView,
    as_rows,
    dim0,
    master_dtype,
    row_numel,
    rows_of,
)

__all__ = ["ShardedOptimizer"]

# ZeRO-2's gradient buckets (DDP's default cap); the first step builds them from the attribute
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# optimizers whose update of an element reads that element's gradient and state alone, so
# stepping a parameter's rows apart gives the whole parameter's update
ELEMENTWISE = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.RMSprop,
    OneBitAdam,
)


class ShardedOptimizer(torch.optim.Optimizer):
    """``template``'s optimizer (its class, parameter groups and settings; it has not stepped)
    run on this DP rank's rows of each parameter, with fp32 master rows (an fp32 parameter's
    rows are its own, updated in place; fp64 parameters keep fp64). ``param_groups`` are the
    template's (the LR schedule changes them; each step copies their settings to the inner
    optimizer). ``inner`` is the optimizer over the master rows: its state holds this rank's
    rows only. ``stage``: 1 (gradients all-reduced before :meth:`step`) or 2
    (reduce-scattered in buckets of about ``bucket_bytes`` during the backward that
    :meth:`expect_backward` announces, finished by :meth:`reduce_gradients`). ``meshes``: the
    1-d mesh (or None: held whole, no replicas) of parameters replicated over other ranks than
    ``dp_mesh``'s (experts: over the ranks holding the same experts)."""

    def __init__(
        self,
        template: torch.optim.Optimizer,
        dp_mesh,
        stage: int,
        grad_reduce_dtype: Optional[torch.dtype] = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        meshes: Optional[dict] = None,
    ):
        if stage not in (1, 2):
            raise ValueError(f"stage must be 1 or 2 (ZeRO-1 or ZeRO-2), got {stage!r}")
        if type(template) not in ELEMENTWISE:  # exactly: a subclass may step otherwise
            names = ", ".join(sorted(cls.__name__ for cls in ELEMENTWISE))
            raise ValueError(
                f"data_parallel='zero{stage}' steps each rank's rows of a parameter on their own, "
                f"which gives the whole parameter's update only for element-wise optimizers "
                f"({names}); {type(template).__name__} is not one of them: use "
                "data_parallel='ddp' or 'fsdp'"
            )
        if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
        self.stage, self.dp_mesh = stage, dp_mesh
        self.grad_reduce_dtype = grad_reduce_dtype
        self.bucket_bytes = bucket_bytes  # read when the first step builds the buckets
        self._buckets: Optional[list] = None
        self._backward: Optional[Backward] = None  # the backward announced, until reduced
        self.buckets_sent_in_backward = 0  # of the last step: the reduce-scatters overlapped
        self._order: list = []  # the model's parameter order (follow_model_order)
        self._gathering: list = []  # [bucket's parameters, all-gather handle or None]
        self._gather_of: dict = {}  # parameter -> its entry in _gathering, until written
        self._gather_hooks: list = []  # with overlap_gather_with_forward
        self.dp = comm.resolve_group(dp_mesh.get_group())
        groups = [dict(g) for g in template.param_groups]
        super().__init__(groups, template.defaults)
        self.inner_type = type(template)
        params = [p for group in self.param_groups for p in group["params"]]
        for param in params:
            if param.dim() == 0:
                raise ValueError(
                    f"data_parallel='zero{stage}': a 0-d parameter has no rows to share out; "
                    "give it shape [1], or use data_parallel='ddp'"
                )
        # model parameter -> (its replicas' group, their mesh (None: no replicas))
        self._replicas = {p: (self.dp, dp_mesh) for p in params}
        for param, mesh in (meshes or {}).items():
            if param in self._replicas:
                group = comm.resolve_group(mesh.get_group()) if mesh is not None else None
                self._replicas[param] = (group, mesh)
        # the replica groups' asynchronous collectives set up now, in one order on every rank,
        # not inside the first step (on gloo: a companion group each, tp_ext.comm.prepare_async)
        groups = {g.name: g for g, _ in self._replicas.values() if g is not None}
        for name in sorted(groups):
            comm.prepare_async(groups[name])
        if stage == 2:  # no DDP to start the replicas equal: rank 0's weights, once
            self._broadcast(params)
        self._master: dict = {}  # model parameter -> its master rows (a leaf tensor)
        self._rows: dict = {}  # model parameter -> (first row, row count)
        inner_groups = [
            {**{k: v for k, v in group.items() if k != "params"}, "params": self._masters(group)}
            for group in self.param_groups
        ]
        # every group carries every setting; the constructor takes the ones it names (AdamW's
        # defaults hold keys its __init__ does not take)
        accepted = inspect.signature(self.inner_type.__init__).parameters
        defaults = {k: v for k, v in template.defaults.items() if k in accepted}
        self.inner = self.inner_type(inner_groups, **defaults)
        self.state = StateView(self)

    def _masters(self, group: dict) -> list:
        """The master rows of a parameter group's parameters (this replica's rows of each)."""
        masters = []
        for param in group["params"]:
            if is_dtensor(param):
                raise ValueError(
                    "ShardedOptimizer: a DTensor parameter (FSDP2 already shards it); use "
                    "data_parallel='zero1' or 'zero2' without FSDP2"
                )
            g = self._group(param)
            start, count = rows_of(dim0(param), g.size, g.rank)
            self._rows[param] = (start, count)
            rows = as_rows(param.detach())[start : start + count]
            if param.dtype == master_dtype(param):  # fp32 already: its own rows, in place
                master = rows.requires_grad_(param.requires_grad)
            else:  # bf16 / fp16 parameters: fp32 master rows beside them
                master = rows.to(master_dtype(param)).requires_grad_(param.requires_grad)
            self._master[param] = master
            masters.append(master)
        return masters

    def _group(self, param):
        """The group ``param``'s replicas are on (a group of one where it has none)."""
        group = self._replicas[param][0]
        return group if group is not None else ResolvedGroup.local()

    def _by_group_and_dtype(self, params) -> list:
        """``params`` as lists of one replica group and dtype, in a fixed order (every rank of a
        group issues their collectives alike)."""
        lists: dict = {}
        for p in params:
            g = self._group(p)
            lists.setdefault((g.name, g.size > 1, p.dtype), (g, []))[1].append(p)
        return list(lists.values())

    @torch.no_grad()
    def _broadcast(self, params) -> None:
        """Every replica's parameters from its group's first rank's (one broadcast per group
        and dtype)."""
        for g, members in self._by_group_and_dtype(params):
            if g.size == 1:
                continue
            flat = torch.cat([p.detach().reshape(-1) for p in members])
            flat = comm.broadcast(flat, 0, group=g)
            offset = 0
            for p in members:
                p.data.copy_(flat[offset : offset + p.numel()].view_as(p))
                offset += p.numel()

    # -- what tp_ext's checkpoints and the Trainer read ----------------------------------------

    @property
    def saved_type_name(self) -> str:
        """The optimizer a checkpoint says it holds the state of: the inner one's class (the
        state is the same numbers as that optimizer's in a DDP or FSDP2 run)."""
        return self.inner_type.__name__

    def state_bytes(self) -> int:
        """Bytes of this rank's optimizer state and master rows (those of fp32 parameters are
        the parameters' own rows, not counted)."""
        total = sum(
            m.numel() * m.element_size() for p, m in self._master.items() if m.dtype != p.dtype
        )
        for state in self.inner.state.values():
            for value in state.values():
                if torch.is_tensor(value):
                    total += value.numel() * value.element_size()
        return total

    def _as_param_state(self, param, value):
        """A per-element state tensor of ``param`` as its DTensor (rows on the mesh of its
        replicas; a parameter without replicas: the tensor itself); a scalar (Adam's step) as
        it is."""
        if not torch.is_tensor(value) or value.dim() == 0:
            return value
        from torch.distributed.tensor import DTensor, Shard

        local = value.view(self._local_shape(param))
        mesh = self._replicas[param][1]
        if mesh is None:
            return local
        return DTensor.from_local(
            local,
            mesh,
            [Shard(0)],
            run_check=False,
            shape=param.shape,
            stride=param.stride(),
        )

    def _local_shape(self, param) -> tuple:
        count = self._rows[param][1]
        return (count, *param.shape[1:]) if param.dim() else (count,)

    # -- the step ------------------------------------------------------------------------------

    # -- ZeRO-2: the gradients' reduce-scatter, in buckets during the backward ---------------

    def expect_backward(self, micro_batches: int, divide_by: float = 1.0) -> None:
        """Announce a backward over ``micro_batches`` micro-batches (each parameter's gradient
        accumulated that many times): a bucket's reduce-scatter is issued as soon as the last
        accumulation into each of its gradients is done. The sums are divided by ``divide_by``.
        :meth:`reduce_gradients` finishes what the backward did not send."""
        if self.stage != 2:
            return
        if self._buckets is None:
            self._buckets = self._make_buckets()
            for index, bucket in enumerate(self._buckets):
                for p in bucket.params:
                    if p.requires_grad:
                        p.register_post_accumulate_grad_hook(self._accumulated)
                    self._bucket_of[p] = index
        if self._backward is not None and self._backward.in_flight:  # a step that raised
            for _, handle in self._backward.in_flight_buckets:
                if handle is not None:
                    handle.wait()  # its sends paired with the other ranks': drop the sums
        self._backward = Backward(micro_batches, divide_by, len(self._buckets))
        self.buckets_sent_in_backward = 0

    @property
    def model_order(self) -> list:
        """The parameters in the model's order (:meth:`follow_model_order`; else the optimizer's
        groups'), which the forward uses them in and the backward reverses."""
        order = [p for p in self._order if p in self._master]
        return order + [p for p in self._master if p not in set(order)]

    def follow_model_order(self, model) -> None:
        """Bucket the parameters in ``model.parameters()``'s order, not the parameter groups'
        (which put, say, every norm last): buckets then fill as the backward goes. Before the
        first step."""
        self._order = list(model.parameters())

    @property
    def bucket_count(self) -> int:
        """ZeRO-2's gradient buckets (0 before the first step builds them)."""
        return len(self._buckets or ())

    def _make_buckets(self) -> list:
        """The parameters in the order the backward writes their gradients (the reverse of the
        model's), one replica group and dtype per bucket, each bucket up to ``bucket_bytes``
        of gradients (one parameter at least). Every replica has the same buckets and sends
        them in index order, so their collectives pair up."""
        self._bucket_of: dict = {}
        return self._bucketed(reversed(self.model_order), self.bucket_bytes)

    def _accumulated(self, param) -> None:
        """A post-accumulate-grad hook: the bucket's reduce-scatter goes once every gradient in
        it has had its last accumulation (and the buckets before it have gone)."""
        backward = self._backward
        if backward is None or not backward.in_flight or param.numel() == 0:
            return  # a backward the Trainer did not announce; an empty parameter is not waited
        count = backward.count[param] = backward.count.get(param, 0) + 1
        if count != backward.micro_batches:
            if count > backward.micro_batches:
                backward.overflow.append(param)
            return
        index = self._bucket_of[param]
        backward.ready[index] += 1
        while (
            backward.next_to_send < len(self._buckets)
            and backward.ready[backward.next_to_send] == self._buckets[backward.next_to_send].waited
        ):
            self._send(backward.next_to_send)
            self.buckets_sent_in_backward += 1

    @torch.no_grad()
    def _send(self, index: int) -> None:
        """Issue bucket ``index``'s reduce-scatter (its gradients' rows, each rank's piece in
        rank order) and free the whole gradients (:meth:`reduce_gradients` receives it)."""
        backward, bucket = self._backward, self._buckets[index]
        g = bucket.group
        # every trainable parameter, a missing gradient as zeros: the replicas' pieces must
        # match even where one rank's parameter got no gradient (an expert without tokens)
        members = [p for p in bucket.params if p.requires_grad and not is_dtensor(p.grad)]
        pieces, sizes = [], []
        for r in range(g.size):
            for p in members:
                start, count = rows_of(dim0(p), g.size, r)
                grad = p.grad if p.grad is not None else torch.zeros_like(p)
                pieces.append(as_rows(grad)[start : start + count].reshape(-1))
            sizes.append(sum(rows_of(dim0(p), g.size, r)[1] * row_numel(p) for p in members))
        handle = None
        if members:
            flat = torch.cat(pieces)
            wire = self.grad_reduce_dtype or flat.dtype
            with comm.tag("train.dp_sync"):
                if wire == flat.dtype:
                    handle = comm.reduce_scatter(flat, 0, sizes, "sum", group=g, async_op=True)
                else:  # sent in the wire's dtype, added in the gradients' own
                    handle = reduce_scatter_in(flat, sizes, wire, g, async_op=True)
            for p in members:
                p.grad = None  # sent: the rows come back at the receive
        backward.in_flight_buckets.append((members, handle))
        backward.next_to_send = index + 1

    @torch.no_grad()
    def _receive_oldest(self) -> None:
        """Wait for the oldest bucket in flight; its rows become its parameters' gradients
        (DTensors, Shard(0) on the DP mesh)."""
        backward = self._backward
        members, handle = backward.in_flight_buckets.pop(0)
        if handle is None:
            return
        with comm.tag("train.dp_sync"):
            mine = handle.wait()
        if backward.divide_by != 1.0:
            mine.div_(backward.divide_by)
        offset = 0
        for p in members:
            numel = self._rows[p][1] * row_numel(p)
            rows = mine[offset : offset + numel].view(self._local_shape(p))
            offset += numel
            p.grad = self._as_param_state(p, rows)

    @torch.no_grad()
    def reduce_gradients(self, divide_by: float = 1.0) -> None:
        """ZeRO-2, after the backward: each parameter's gradient summed over DP and divided by
        ``divide_by`` (that of :meth:`expect_backward` when announced), of which this rank keeps
        its rows, left on the parameter as a DTensor (Shard(0) on the DP mesh). Sends the buckets
        the backward did not (a gradient written outside autograd's accumulation, as a split
        weight backward may, or an unannounced backward), in index order, and receives them
        all. The wire carries ``grad_reduce_dtype`` when set."""
        if self._buckets is None:
            self.expect_backward(0, divide_by)
        backward = self._backward
        if backward is None or not backward.in_flight:
            backward = self._backward = Backward(0, divide_by, len(self._buckets))
        if backward.overflow:
            names = sorted({tuple(p.shape) for p in backward.overflow})
            backward.in_flight = False
            raise RuntimeError(
                f"ZeRO-2: parameters of shapes {names} received more gradient accumulations "
                f"than the {backward.micro_batches} micro-batches announced, after their "
                "reduce-scatter was sent; run backward only inside Trainer.step"
            )
        try:
            while backward.next_to_send < len(self._buckets):
                self._send(backward.next_to_send)
            while backward.in_flight_buckets:
                self._receive_oldest()
        finally:
            backward.in_flight = False

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("ShardedOptimizer.step takes no closure")
        for outer, inner in zip(self.param_groups, self.inner.param_groups):
            for key, value in outer.items():  # the LR schedule's changes
                if key != "params":
                    inner[key] = value
            for param in outer["params"]:
                master = self._master[param]
                grad = param.grad
                if grad is None:
                    master.grad = None
                    continue
                if is_dtensor(grad):  # ZeRO-2 (or clipped): this rank's rows already
                    rows = grad.to_local()
                else:
                    start, count = self._rows[param]
                    rows = as_rows(grad)[start : start + count]
                master.grad = rows.reshape(master.shape).to(master.dtype)
        self.inner.step()
        self._gather_parameters()

    @torch.no_grad()
    def _gather_parameters(self) -> None:
        """Every replica's parameters from every rank's updated master rows: one all-gather per
        replica group and parameter dtype; with :meth:`overlap_gather_with_forward`, one per
        bucket, waited for by the first forward (or state_dict) that needs its parameters."""
        self.finish_gather()  # (a bucket the last forward did not use)
        cap = self.bucket_bytes if self._gather_hooks else None
        for bucket in self._gather_buckets(cap):
            g, members = bucket.group, bucket.params
            dtype = members[0].dtype
            mine = torch.cat([self._master[p].reshape(-1).to(dtype) for p in members])
            sizes = [
                sum(rows_of(dim0(p), g.size, r)[1] * row_numel(p) for p in members)
                for r in range(g.size)
            ]
            with comm.tag("train.zero_gather"):
                handle = comm.all_gather(mine, 0, sizes, group=g, async_op=True)
            entry = [members, handle]
            self._gathering.append(entry)
            for p in members:
                self._gather_of[p] = entry
        if not self._gather_hooks:
            self.finish_gather()

    def _gather_buckets(self, cap: Optional[int]) -> list:
        """The parameters in the forward's order (the model's), one replica group and dtype per
        bucket, each up to ``cap`` bytes (None: one bucket per group and dtype)."""
        return self._bucketed(self.model_order, cap)

    def _bucketed(self, params, cap: Optional[int]) -> list:
        """``params`` in order into buckets of one replica group and dtype each, up to ``cap``
        bytes (one parameter at least; None: no limit)."""
        buckets, open_by_kind = [], {}
        for p in params:
            g = self._group(p)
            kind = (g.name, g.size > 1, p.dtype)
            bucket = open_by_kind.get(kind)
            nbytes = p.numel() * p.element_size()
            full = cap is not None and bucket is not None and bucket.nbytes + nbytes > cap
            if bucket is None or (bucket.nbytes and full):
                bucket = Bucket(p.dtype, g)
                buckets.append(bucket)
                open_by_kind[kind] = bucket
            bucket.params.append(p)
            bucket.nbytes += nbytes
        return buckets

    @torch.no_grad()
    def _finish(self, entry) -> None:
        """Wait for one bucket's all-gather and write every rank's rows into its parameters."""
        members, handle = entry
        if handle is None:
            return
        entry[1] = None
        with comm.tag("train.zero_gather"):
            everyone = handle.wait()
        g = self._group(members[0])
        offset = 0
        for r in range(g.size):
            for p in members:
                start, count = rows_of(dim0(p), g.size, r)
                numel = count * row_numel(p)
                piece = everyone[offset : offset + numel]
                offset += numel
                if numel:
                    as_rows(p.data)[start : start + count].copy_(
                        piece.view(count, *as_rows(p).shape[1:])
                    )
        for p in members:
            self._gather_of.pop(p, None)

    def finish_gather(self) -> None:
        """Wait for every all-gather of the updated parameters still in flight (with
        :meth:`overlap_gather_with_forward`: before reading parameters other than by a forward
        or ``state_dict()``)."""
        while self._gathering:
            self._finish(self._gathering.pop(0))

    @property
    def gathers_in_flight(self) -> int:
        """Buckets of parameters whose all-gather has not been waited for yet."""
        return sum(1 for _, handle in self._gathering if handle is not None)

    def overlap_gather_with_forward(self, model) -> None:
        """Leave each bucket's all-gather of the updated parameters in flight after
        :meth:`step` (buckets of ``bucket_bytes`` in the forward's order), each waited for by
        the first forward pre-hook (or ``state_dict`` pre-hook) of a ``model`` module holding
        one of its parameters: the gathers overlap the data loading and the forward of the
        layers before. A parameter read otherwise (``p.data``) needs :meth:`finish_gather`
        first; the Trainer's checkpoints, ``fit`` and ``whole_parameters`` do it."""
        if self._gather_hooks:
            return
        for module in model.modules():
            own = [p for p in module.parameters(recurse=False) if p in self._master]
            if not own:
                continue
            self._gather_hooks.append(
                module.register_forward_pre_hook(lambda m, args, own=own: self._before_use(own))
            )
            self._gather_hooks.append(
                module.register_state_dict_pre_hook(
                    lambda m, prefix, keep_vars, own=own: self._before_use(own)
                )
            )

    def _before_use(self, params) -> None:
        if not self._gather_of:
            return
        for p in params:
            entry = self._gather_of.get(p)
            if entry is not None:
                self._finish(entry)
        self._gathering = [e for e in self._gathering if e[1] is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.param_groups:  # ZeRO-2's row gradients: a backward cannot add to them
            for p in group["params"]:
                if is_dtensor(p.grad):
                    p.grad = None
        super().zero_grad(set_to_none=set_to_none)
        self.inner.zero_grad(set_to_none=True)

    def master_weights(self, param) -> Optional[torch.Tensor]:
        """``param``'s fp32 master rows as a DTensor shaped like it (Shard(0) on the DP mesh,
        sharing their storage: a checkpoint load writes into them), or None for a parameter
        that is its own master (fp32, fp64)."""
        master = self._master.get(param)
        if master is None or master.dtype == param.dtype:
            return None
        return self._as_param_state(param, master.detach())

    @property
    def has_separate_masters(self) -> bool:
        """Whether any parameter (bf16, fp16) keeps fp32 master rows beside it."""
        return any(m.dtype != p.dtype for p, m in self._master.items())

    @torch.no_grad()
    def refresh_masters(self) -> None:
        """Master rows from the parameters (after a checkpoint load wrote the parameters and
        held no master rows)."""
        for param, master in self._master.items():
            start, count = self._rows[param]
            master.copy_(as_rows(param.detach())[start : start + count].reshape(master.shape))


def sharded_optimizer_for(
    optimizer, parallel, stage: int, grad_reduce_dtype=None, experts=()
) -> "ShardedOptimizer":
    """The :class:`ShardedOptimizer` of ``optimizer`` (built over the model's parameters, not
    stepped) at ZeRO ``stage`` (1 or 2) over ``parallel``'s replicas of the dense weights (the DP
    ranks, and the CP ranks beside them: they hold the same weights); ``experts``
    (expert-parallel parameters) over the ranks holding the same experts."""
    if any(optimizer.state.values()):
        raise ValueError(
            f"data_parallel='zero{stage}': the optimizer has stepped already (its state is "
            "whole); pass it before its first step (or a callable that builds it)"
        )
    replicas = Replicas.of(parallel, experts)
    meshes = {p: replicas.expert_mesh for p in experts}
    return ShardedOptimizer(optimizer, replicas.mesh, stage, grad_reduce_dtype, meshes=meshes)


def is_sharded(optimizer) -> bool:
    return isinstance(optimizer, ShardedOptimizer)
