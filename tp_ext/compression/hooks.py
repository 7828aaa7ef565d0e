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

Error feedback is exact: the second quantisation's error (rank k's, on its segment) is folded
into rank k's own residual, multiplied by w (the average divides by w), so after any number of
steps the sum of what the hook returned plus the ranks' mean residual is the sum of the true
mean gradients, to fp32 rounding (tests/test_compression.py). The hooks average parameter by
parameter and keep residuals per parameter, not per bucket: DDP rebuilding its buckets after
the first step changes nothing, a resumed run is bitwise the uninterrupted one, and
:meth:`CompressionState.state_dict` saves the residuals by parameter name.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import torch
import torch.distributed as dist

from tp_ext import ops
from tp_ext.distributed import comm
from tp_ext.distributed.groups import GroupLike, resolve_group
from tp_ext.sharding import shard_sizes

__all__ = [
    "METHODS",
    "CHUNK_SIZES",
    "CompressionState",
    "int8_hook",
    "onebit_hook",
    "register",
]

METHODS = ("int8", "1bit", "powersgd")
# elements per scale: its 4 bytes add 4/512 (int8) and 4/1024 (1-bit) bytes per element
CHUNK_SIZES = {"int8": 512, "1bit": 1024}


class CompressionState:
    """What the int8 / 1-bit hooks keep between steps: the process group they average over and
    one fp32 residual per parameter (created at zero when first seen).

    ``named_parameters``: the model's (name, parameter) pairs, so :meth:`state_dict` can name the
    residuals; ``chunk_size``: elements per scale (default :data:`CHUNK_SIZES` of the method)."""

    def __init__(
        self,
        process_group: GroupLike = None,
        method: str = "int8",
        named_parameters: Optional[Iterable] = None,
        chunk_size: Optional[int] = None,
    ) -> None:
        if method not in CHUNK_SIZES:
            raise ValueError(f"method must be one of {sorted(CHUNK_SIZES)}, got {method!r}")
        chunk = CHUNK_SIZES[method] if chunk_size is None else chunk_size
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
            raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
        if method == "1bit" and chunk % 8:
            raise ValueError(
                f"chunk_size={chunk} with method='1bit': it must be a multiple of 8 (each chunk "
                "starts on a byte of signs)"
            )
        self.group = resolve_group(process_group)
        self.method = method
        self.chunk_size = chunk
        self.residuals: dict[torch.Tensor, torch.Tensor] = {}
        self._names = {p: n for n, p in (named_parameters or [])}
        self._pending: dict[str, torch.Tensor] = {}  # loaded before the parameter was seen

    # -- residuals by parameter -----------------------------------------------------------------

    def residual_of(self, param: torch.Tensor) -> torch.Tensor:
        r = self.residuals.get(param)
        if r is None:
            saved = self._pending.pop(self._names.get(param, ""), None)
            r = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if saved is not None:
                r.copy_(saved.reshape(-1))
            self.residuals[param] = r
        return r

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's residuals by parameter name (each rank's differ: save them per rank)."""
        if self.residuals and not self._names:
            raise ValueError(
                "CompressionState(named_parameters=model.named_parameters()) is needed to name "
                "the residuals in a state_dict"
            )
        out = {self._names[p]: r for p, r in self.residuals.items()}  # references, as torch's
        out.update(self._pending)
        return out

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        by_name = {n: p for p, n in self._names.items()}
        unknown = sorted(set(state) - set(by_name))
        if unknown:
            raise ValueError(
                f"residuals for parameters this model does not have: {unknown[:5]}"
                + (" ..." if len(unknown) > 5 else "")
            )
        for name, saved in state.items():
            param = by_name[name]
            if saved.numel() != param.numel():
                raise ValueError(
                    f"residual of {name!r} has {saved.numel()} elements; the parameter has "
                    f"{param.numel()} (saved at another layout?)"
                )
            if param in self.residuals:
                self.residuals[param].copy_(saved.reshape(-1))
            else:
                self._pending[name] = saved.detach().clone()


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


def compressed_average(state: CompressionState, grad: torch.Tensor, param) -> torch.Tensor:
    """The average over ``state.group`` of every rank's ``grad`` (``param``'s gradient), sent
    compressed with error feedback into ``param``'s residual; fp32, ``grad``'s shape."""
    g = state.group
    world, rank = g.size, g.rank
    residual = state.residual_of(param)
    codes, scales = _quantize(state, grad.reshape(-1), residual)
    numel = grad.numel()
    if world == 1:
        return _dequantize(state, codes, scales, numel).view(grad.shape)
    segments = _segments(numel, state.chunk_size, world)
    pieces = [_pack(*_slice(state, codes, scales, s, e)) for s, e in segments]
    sizes = [p.numel() for p in pieces]  # every rank cuts the same segments: the same sizes
    # rank k receives segment k of every rank (all the same size: its own)
    mine = comm.all_to_all(torch.cat(pieces), 0, 0, sizes, group=g).view(world, sizes[rank])
    start, end = segments[rank]
    total = torch.zeros(end - start, dtype=torch.float32, device=grad.device)
    for piece in mine:
        total += _dequantize(state, *_unpack(state, piece, end - start), end - start)
    server = torch.zeros_like(total)
    seg_codes, seg_scales = _quantize(state, total / world, server)
    # the second quantisation's error, in units of one rank's gradient, into this rank's
    # residual: it is sent again next step (what keeps the feedback exact)
    residual[start:end].add_(server, alpha=world)
    gathered = comm.all_gather(_pack(seg_codes, seg_scales), 0, sizes, group=g)
    averaged = torch.empty(numel, dtype=torch.float32, device=grad.device)
    for (s, e), payload in zip(segments, gathered.split(sizes)):
        averaged[s:e] = _dequantize(state, *_unpack(state, payload, e - s), e - s)
    return averaged.view(grad.shape)


def _hook(state: CompressionState, bucket) -> torch.futures.Future:
    # One compressed average per parameter, as tp_ext's plain DDP hook all-reduces per
    # parameter: the chunks (hence the scales and the rounding) then follow each parameter, not
    # the bucket, which DDP rebuilds after the first step, so a run resumed from a checkpoint
    # (its first step on the initial buckets) computes what the uninterrupted run did.
    buffer = bucket.buffer()
    offset = 0
    for grad, param in zip(bucket.gradients(), bucket.parameters()):
        n = grad.numel()
        buffer[offset : offset + n].copy_(compressed_average(state, grad.reshape(-1), param))
        offset += n
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


def _powersgd_in_order(state, bucket):
    """torch's PowerSGD hook, each bucket finished before DDP starts the next one's.

    Why: the hook's later all-reduces are issued from callbacks of its first one, which gloo
    runs on its own thread; with several buckets in flight, ranks then issue the next bucket's
    all-reduce and the previous bucket's second one in different orders, and gloo pairs
    collectives of different sizes (seen as "Received data size doesn't match expected size").
    """
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    future = powersgd.powerSGD_hook(state, bucket)
    future.wait()
    return future


def register(
    ddp,
    method: Optional[str],
    process_group: GroupLike = None,
    named_parameters: Optional[Iterable] = None,
    **options,
):
    """Install ``method``'s hook on the DDP module ``ddp`` ("int8", "1bit", "powersgd", or None:
    DDP's own all-reduce) and return its state. ``named_parameters`` name the residuals
    (default ``ddp.module``'s); ``options``: ``chunk_size`` for int8 / 1-bit, PowerSGDState's
    keyword arguments for "powersgd" (default rank 1, compressing from the second step)."""
    if method is None:
        return None
    if method not in METHODS:
        raise ValueError(f"gradient compression must be one of {METHODS} or None, got {method!r}")
    group = process_group if process_group is not None else ddp.process_group
    if method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

        pg = resolve_group(group).group
        kwargs = {"matrix_approximation_rank": 1, "start_powerSGD_iter": 2, **options}
        state = powersgd.PowerSGDState(process_group=pg, **kwargs)
        gloo = dist.get_backend(pg) == "gloo"
        ddp.register_comm_hook(state, _powersgd_in_order if gloo else powersgd.powerSGD_hook)
        return state
    named = ddp.module.named_parameters() if named_parameters is None else named_parameters
    state = CompressionState(group, method, named, **options)
    ddp.register_comm_hook(state, int8_hook if method == "int8" else onebit_hook)
    return state
