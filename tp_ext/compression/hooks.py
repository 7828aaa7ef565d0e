"""DDP communication hooks that send compressed gradients: int8 (a scale per chunk of 512) and
1-bit (signs and a scale per chunk of 1024), both with error feedback; plus torch's PowerSGD
behind the same switch (:func:`register`).

How a parameter's n gradients are averaged over the w ranks of the group (a compressed
all-reduce, as 1-bit Adam's): every rank adds its residual to them and quantises them
(``tp_ext.ops.quantize_*_ef``, which keeps what was not sent as the new residual), the codes
are cut into w segments on chunk boundaries, and an all-to-all sends segment k of every rank to
rank k; rank k dequantises the w pieces, averages them, quantises the average again and an
all-gather gives every rank every averaged segment, which it dequantises. Both exchanges carry
the compressed bytes: per rank 2 (w-1)/w of the payload, against 2 (w-1)/w of n x 4 bytes for
an fp32 ring all-reduce (0.25x for int8, 1/32 for 1-bit, plus the scales).

Error feedback is exact, on both quantisations: each rank keeps a residual of what it did not
send, and rank k a second, "server" residual of its segment's averages (added to the next
step's average before it is quantised again; 1-bit Adam's worker and server errors). After any
number of steps the sum of what the hook returned, plus the ranks' mean residual, plus the
server residuals, is the sum of the true mean gradients, to fp32 rounding
(tests/test_compression.py). Kept apart, the server's error does not inflate what rank k's
own quantiser sees (folded into rank k's residual, it cost 1-bit Adam about 3% more loss in
bench_compression). Each parameter keeps its own chunks, scales and residuals, while one
all-to-all and one all-gather carry a whole DDP bucket: DDP rebuilding its buckets after the
first step changes no number, a resumed run is bitwise the uninterrupted one, and
:meth:`CompressionState.state_dict` saves the residuals by parameter name.

With a :class:`~tp_ext.compression.OneBitAdam` attached, the 1-bit hook is 1-bit Adam's
communication (see :func:`averages`).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch

from tp_ext import ops
from tp_ext.compression.onebit_adam import OneBitAdam
from tp_ext.compression.powersgd import register_powersgd
from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike, resolve_group
from tp_ext.sharding import shard_sizes
from tp_ext.validation import check_int

__all__ = [
    "METHODS",
    "CHUNK_SIZES",
    "CompressionState",
    "averages",
    "compressed_averages",
    "int8_hook",
    "onebit_hook",
    "register",
]

METHODS = ("int8", "1bit", "powersgd")
# elements per scale: its 4 bytes add 4/512 (int8) and 4/1024 (1-bit) bytes per element
CHUNK_SIZES = {"int8": 512, "1bit": 1024}


SERVER = ".server_residual"  # state_dict key suffix of a parameter's server residual


class CompressionState:
    """What the int8 / 1-bit hooks keep between steps: the process group they average over and,
    per parameter, fp32 residuals (created at zero when first seen): this rank's, and the
    server residual of the segment this rank averages.

    ``named_parameters``: the model's (name, parameter) pairs, so :meth:`state_dict` can name the
    residuals; ``chunk_size``: elements per scale (default :data:`CHUNK_SIZES` of the method)."""

    def __init__(
        self,
        process_group: GroupLike = None,
        method: str = "int8",
        named_parameters: Optional[Iterable] = None,
        chunk_size: Optional[int] = None,
        optimizer: Optional[OneBitAdam] = None,
    ) -> None:
        if method not in CHUNK_SIZES:
            raise ValueError(f"method must be one of {sorted(CHUNK_SIZES)}, got {method!r}")
        chunk = CHUNK_SIZES[method] if chunk_size is None else chunk_size
        check_int("chunk_size", chunk)
        if method == "1bit" and chunk % 8:
            raise ValueError(
                f"chunk_size={chunk} with method='1bit': it must be a multiple of 8 (each chunk "
                "starts on a byte of signs)"
            )
        self.group = resolve_group(process_group)
        self.method = method
        self.chunk_size = chunk
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}
        self.server_residuals: dict[torch.Tensor, torch.Tensor] = {}
        self._names = {p: n for n, p in (named_parameters or [])}
        self._pending: dict[str, torch.Tensor] = {}  # loaded before the parameter was seen
        self.optimizer = None
        if optimizer is not None:
            self.attach(optimizer)

    def attach(self, optimizer: OneBitAdam) -> None:
        """Run as 1-bit Adam's communication with ``optimizer``: uncompressed during its
        warm-up, then its momentum sent compressed (see :func:`average`)."""
        if not isinstance(optimizer, OneBitAdam):
            raise TypeError(
                f"CompressionState: the optimizer to send momenta for must be a "
                f"tp_ext.compression.OneBitAdam, got {type(optimizer).__name__}"
            )
        if self.method != "1bit":
            raise ValueError(
                f"OneBitAdam goes with method='1bit', not {self.method!r} (int8 keeps Adam's "
                "variance close enough to compress the gradients themselves)"
            )
        self.optimizer = optimizer

    # -- residuals by parameter -----------------------------------------------------------------

    def _created(self, table: dict, param: torch.Tensor, key: str, numel: int) -> torch.Tensor:
        r = table.get(param)
        if r is None:
            saved = self._pending.pop(key, None)
            r = torch.zeros(numel, dtype=torch.float32, device=param.device)
            if saved is not None:
                r.copy_(saved.reshape(-1))
            table[param] = r
        return r

    def residual_of(self, param: torch.Tensor) -> torch.Tensor:
        """This rank's residual of ``param`` (created, with its server residual, when first
        asked for)."""
        name = self._names.get(param, "")
        self._created(self.server_residuals, param, name + SERVER, self.segment_numel(param))
        return self._created(self.residuals, param, name, param.numel())

    def server_residual_of(self, param: torch.Tensor) -> torch.Tensor:
        self.residual_of(param)
        return self.server_residuals[param]

    def segment_numel(self, param: torch.Tensor) -> int:
        """Elements of ``param`` this rank averages (its segment)."""
        start, end = _segments(param.numel(), self.chunk_size, self.group.size)[self.group.rank]
        return end - start

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residuals by parameter name, and its server residuals under
        ``<name>.server_residual`` (each rank's differ: save them per rank)."""
        if self.residuals and not self._names:
            raise ValueError(
                "CompressionState(named_parameters=model.named_parameters()) is needed to name "
                "the residuals in a state_dict"
            )
        out = {self._names[p]: r for p, r in self.residuals.items()}  # references, as torch's
        out.update({self._names[p] + SERVER: r for p, r in self.server_residuals.items()})
        out.update(self._pending)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        by_name = {n: p for p, n in self._names.items()}
        expected = {}  # key -> (parameter, its tensor table, elements)
        for name, p in by_name.items():
            expected[name] = (p, self.residuals, p.numel())
            expected[name + SERVER] = (p, self.server_residuals, self.segment_numel(p))
        unknown = sorted(set(state) - set(expected))
        if unknown:
            raise ValueError(
                f"residuals for parameters this model does not have: {unknown[:5]}"
                + (" ..." if len(unknown) > 5 else "")
            )
        for key, saved in state.items():
            param, table, numel = expected[key]
            if saved.numel() != numel:
                raise ValueError(
                    f"residual {key!r} has {saved.numel()} elements; these dims' has {numel} "
                    "(saved at other dims?)"
                )
            if param in table:
                table[param].copy_(saved.reshape(-1))
            else:
                self._pending[key] = saved.detach().clone()


def _segments(numel: int, chunk: int, world: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's segment of a buffer: whole chunks, shared out by the one
    shard policy."""
    chunks = shard_sizes(-(-numel // chunk), world)
    out, start = [], 0
    for n in chunks:
        end = min(numel, start + n * chunk)
        out.append((start, end))
        start = end
    return out


def _quantize(state: CompressionState, values: torch.Tensor, residual: torch.Tensor):
    if state.method == "int8":
        return ops.quantize_int8_ef(values, residual, state.chunk_size)
    return ops.quantize_1bit_ef(values, residual, state.chunk_size)


def _dequantize(state: CompressionState, codes, scales, numel: int) -> torch.Tensor:
    if state.method == "int8":
        return ops.dequantize_int8(codes, scales, state.chunk_size)
    return ops.dequantize_1bit(codes, scales, state.chunk_size, numel)


def _pack(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A segment's bytes: its scales, then its codes."""
    return torch.cat([scales.view(torch.uint8), codes.view(torch.uint8)])


def _slice(state: CompressionState, codes, scales, start: int, end: int):
    """The codes and scales of elements [start, end) (chunk-aligned) of a quantised buffer."""
    chunk = state.chunk_size
    if end == start:  # an empty segment: no codes, no scales
        return codes[:0], scales[:0]
    part = codes[start:end] if state.method == "int8" else codes[start // 8 : -(-end // 8)]
    return part, scales[start // chunk : -(-end // chunk)]


def _unpack(state: CompressionState, payload: torch.Tensor, numel: int):
    """(codes, scales) of a segment of ``numel`` elements from its bytes."""
    chunks = -(-numel // state.chunk_size)
    scales = payload[: 4 * chunks].clone().view(torch.float32)
    codes = payload[4 * chunks :]
    return (codes.view(torch.int8) if state.method == "int8" else codes), scales


def compressed_averages(state: CompressionState, grads, params) -> list[torch.Tensor]:
    """The averages over ``state.group`` of every rank's ``grads`` (of ``params``), sent
    compressed with error feedback into each parameter's residuals (fp32, each grad's shape), in
    one all-to-all and one all-gather: each parameter keeps its own chunks, scales and residuals
    (the result does not depend on which parameters travel together)."""
    if not grads:
        return []
    g = state.group
    world, rank = g.size, g.rank
    quantized = [
        _quantize(state, grad.reshape(-1), state.residual_of(p)) for grad, p in zip(grads, params)
    ]
    if world == 1:
        return [
            _dequantize(state, c, sc, grad.numel()).view(grad.shape)
            for (c, sc), grad in zip(quantized, grads)
        ]
    segments = [_segments(grad.numel(), state.chunk_size, world) for grad in grads]
    # pieces[k][i]: parameter i's segment k, packed; rank k receives segment k of every rank
    pieces = [
        [_pack(*_slice(state, c, sc, *segs[k])) for (c, sc), segs in zip(quantized, segments)]
        for k in range(world)
    ]
    sizes = [[p.numel() for p in row] for row in pieces]  # the same on every rank
    totals = [sum(row) for row in sizes]
    send = torch.cat([p for row in pieces for p in row])
    mine = comm.all_to_all(send, 0, 0, totals, group=g).view(world, totals[rank])
    # average this rank's segment of each parameter, quantise it again (the server residual)
    replies = []
    for source_parts in zip(*(row.split(sizes[rank]) for row in mine)):
        i = len(replies)
        start, end = segments[i][rank]
        total = torch.zeros(end - start, dtype=torch.float32, device=grads[i].device)
        for piece in source_parts:
            total += _dequantize(state, *_unpack(state, piece, end - start), end - start)
        server = state.server_residual_of(params[i])
        replies.append(_pack(*_quantize(state, total / world, server)))
    gathered = comm.all_gather(torch.cat(replies), 0, totals, group=g).split(totals)
    out = [torch.empty(grad.numel(), dtype=torch.float32, device=grad.device) for grad in grads]
    for k, payload in enumerate(gathered):
        for i, part in enumerate(payload.split(sizes[k])):
            s, e = segments[i][k]
            out[i][s:e] = _dequantize(state, *_unpack(state, part, e - s), e - s)
    return [o.view(grad.shape) for o, grad in zip(out, grads)]


def averages(state: CompressionState, grads, params) -> list[torch.Tensor]:
    """What each parameter's averaged gradient over ``state.group`` is taken to be: the
    compressed average of its ``grad``; or, with a :class:`OneBitAdam` attached, 1-bit Adam's
    exchange: the plain fp32 average during the optimizer's warm-up, then each rank's momentum
    ``m_r = beta1 m + (1 - beta1) grad`` (``m``: the optimizer's ``exp_avg``, equal on every
    rank) averaged compressed, returned as the gradient ``(mean(m_r) - beta1 m) / (1 - beta1)``
    whose momentum update gives that average (clipping it, as a Trainer may, stays consistent:
    every rank clips the same tensor)."""
    opt = state.optimizer
    if opt is None:
        return compressed_averages(state, grads, params)
    out: list = [None] * len(grads)
    warm = [i for i, p in enumerate(params) if not opt.compressing(p)]
    for i in warm:  # the warm-up: fp32, as DDP's own all-reduce
        out[i] = comm.all_reduce(grads[i].float(), "sum", group=state.group).div_(state.group.size)
    rest = [i for i in range(len(grads)) if out[i] is None]
    momenta = [opt.momentum_of(params[i]).reshape(grads[i].shape).float() for i in rest]
    betas = [opt.group_of(params[i])["betas"][0] for i in rest]
    local = [torch.lerp(m, grads[i].float(), 1 - b) for i, m, b in zip(rest, momenta, betas)]
    averaged = compressed_averages(state, local, [params[i] for i in rest])
    for i, a, m, b in zip(rest, averaged, momenta, betas):
        out[i] = a.sub_(m, alpha=b).div_(1 - b)
    return out


def _hook(state: CompressionState, bucket) -> torch.futures.Future:
    # Each parameter keeps its own chunks (hence scales and rounding), not the bucket's, which
    # DDP rebuilds after the first step: a run resumed from a checkpoint (its first step on the
    # initial buckets) computes what the uninterrupted run did.
    buffer = bucket.buffer()
    grads = [grad.reshape(-1) for grad in bucket.gradients()]
    offset = 0
    for avg in averages(state, grads, bucket.parameters()):
        buffer[offset : offset + avg.numel()].copy_(avg)
        offset += avg.numel()
    future: torch.futures.Future = torch.futures.Future()
    future.set_result(buffer)
    return future


# (no return annotation on the hooks: DDP rejects the string one this module's future import
# would make of Future[Tensor])
def int8_hook(state: CompressionState, bucket):
    """DDP comm hook: the bucket's average over ``state.group``, sent as int8 codes with a
    scale per chunk, with error feedback (``state``: a :class:`CompressionState` of method
    "int8")."""
    if state.method != "int8":
        raise ValueError(f"int8_hook needs CompressionState(method='int8'), got {state.method!r}")
    return _hook(state, bucket)


def onebit_hook(state: CompressionState, bucket):
    """DDP comm hook: the bucket's average over ``state.group``, sent as sign bits with a scale
    (mean magnitude) per chunk, with error feedback (``state``: method "1bit")."""
    if state.method != "1bit":
        raise ValueError(f"onebit_hook needs CompressionState(method='1bit'), got {state.method!r}")
    return _hook(state, bucket)


def register(
    ddp,
    method: Optional[str],
    process_group: GroupLike = None,
    named_parameters: Optional[Iterable] = None,
    optimizer: Optional[OneBitAdam] = None,
    **options,
):
    """Install ``method``'s hook on the DDP module ``ddp`` ("int8", "1bit", "powersgd", or None:
    DDP's own all-reduce) and return its state. ``named_parameters`` name the residuals
    (default ``ddp.module``'s); ``optimizer``: a :class:`OneBitAdam` to run 1-bit Adam with
    ("1bit" only); ``options``: ``chunk_size`` for int8 / 1-bit, PowerSGDState's keyword
    arguments for "powersgd" (default rank 1, compressing from the second step)."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"gradient compression must be one of {METHODS} or None, got {method!r}")
    group = process_group if process_group is not None else ddp.process_group
    named = ddp.module.named_parameters() if named_parameters is None else named_parameters
    if method == "powersgd":
        if optimizer is not None:
            raise ValueError("register: optimizer= is 1-bit Adam's; PowerSGD takes none")
        return register_powersgd(ddp, resolve_group(group), named, **options)
    state = CompressionState(group, method, named, optimizer=optimizer, **options)
    ddp.register_comm_hook(state, int8_hook if method == "int8" else onebit_hook)
    return state
