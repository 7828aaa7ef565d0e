"""Random numbers under tensor parallelism.

Two kinds of draws:
- replicated regions (dropout on the residual stream, initialisation of full weights) draw from
  the default generators, seeded identically on every rank by :func:`manual_seed`, so every TP
  rank draws the same numbers;
- work on sharded activations (dropout on this rank's attention heads) must not repeat the same
  mask on every shard: inside ``with tp_rng():`` (also ``tp_ext.random.tp_rng``) the default
  generators draw from this rank's TP stream.

How the TP stream is made, and why: entering the outermost ``tp_rng()`` draws one 62-bit number
from the default CPU generator (the same on every TP rank, since that stream is replicated) and
seeds the default CPU generator, and the current CUDA device's when CUDA is in use, with that
number mixed with this rank's TP rank; leaving restores the default generators (advanced by that
one draw). The TP stream is therefore a function of the default stream's state, which
``torch.utils.checkpoint`` saves and restores around recomputation: recomputed dropout draws
exactly the forward's masks, with reentrant and non-reentrant checkpointing alike, without a
tp_ext checkpoint wrapper (Megatron's tracker keeps independent states and needs its own
checkpoint function for this). A nested ``tp_rng()`` continues the outer block's stream.

Every stream's state is in the default generators, so :func:`get_states` / :func:`set_states`
(plain tensors and ints: safetensors- or ``weights_only``-loadable) let a resumed run draw the
same numbers. Initialisation needs no TP stream: layers draw full tensors from the default
generator and keep their slice, so a model built at TP=k equals the same model built at TP=1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tp_ext.distributed.groups import resolve_group
from tp_ext.distributed.state import PROCESS

__all__ = ["manual_seed", "tp_rng", "get_states", "set_states", "TP_SEED_OFFSET"]

# Megatron's offset, so TP streams never coincide with the default stream's seed.
TP_SEED_OFFSET = 2718
_MAX_SEED = 2**63 - 1  # what torch.Generator.manual_seed accepts


def manual_seed(seed: int, tp_group=None) -> None:
    """Seed the default generators (CPU and every CUDA device) with ``seed`` on every rank, and
    make ``tp_rng()`` draw from this rank's TP stream of ``tp_group`` (default: the TP group of
    :func:`tp_ext.init_parallel`)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63 - 1], got {seed!r}")
    if PROCESS.tp_rng_depth:
        raise RuntimeError("tp_ext.random.manual_seed inside a tp_rng() block; call it outside")
    PROCESS.tp_rng_rank = resolve_group(tp_group).rank
    torch.manual_seed(seed)


def _cuda_in_use() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _stream_seed(draw: int, tp_rank: int) -> int:
    """This rank's seed for one tp_rng block: distinct per rank and per draw."""
    return (draw * 1_000_003 + TP_SEED_OFFSET + tp_rank) % _MAX_SEED


@contextlib.contextmanager
def tp_rng() -> Iterator[None]:
    """Draw from this rank's TP stream inside the block (see the module docstring)."""
    if PROCESS.tp_rng_rank is None:
        raise RuntimeError(
            "call tp_ext.random.manual_seed(seed) on every rank before tp_rng(): it fixes "
            "this rank's place in the TP stream"
        )
    if PROCESS.tp_rng_depth:  # nested: keep drawing from the outer block's stream
        PROCESS.tp_rng_depth += 1
        try:
            yield
        finally:
            PROCESS.tp_rng_depth -= 1
        return
    draw = int(torch.randint(0, 2**62, ()).item())  # the same on every TP rank
    seed = _stream_seed(draw, PROCESS.tp_rng_rank)
    outside_cpu = torch.get_rng_state()
    cuda = torch.cuda.current_device() if _cuda_in_use() else None
    outside_cuda = None if cuda is None else torch.cuda.get_rng_state(cuda)
    torch.default_generator.manual_seed(seed)
    if cuda is not None:
        torch.cuda.default_generators[cuda].manual_seed(seed)
    PROCESS.tp_rng_depth = 1
    try:
        yield
    finally:
        PROCESS.tp_rng_depth = 0
        torch.set_rng_state(outside_cpu)
        if cuda is not None:
            torch.cuda.set_rng_state(outside_cuda, cuda)


def get_states() -> dict:
    """Every random stream of this rank: ``{"cpu": uint8 tensor, "cuda": [uint8 tensor per
    device], "tp_rank": int or -1}``. Plain tensors and ints, so a checkpoint can hold them
    (safetensors or ``torch.load(weights_only=True)``); :func:`set_states` restores them."""
    if PROCESS.tp_rng_depth:
        raise RuntimeError("tp_ext.random.get_states inside a tp_rng() block; call it outside")
    cuda = (
        [torch.cuda.get_rng_state(d) for d in range(torch.cuda.device_count())]
        if (_cuda_in_use())
        else []
    )
    rank = -1 if PROCESS.tp_rng_rank is None else PROCESS.tp_rng_rank
    return {"cpu": torch.get_rng_state(), "cuda": cuda, "tp_rank": rank}


def set_states(states: dict) -> None:
    """Restore what :func:`get_states` returned (on the same rank): the next draws, replicated
    and TP, are those that followed the moment the states were taken."""
    if PROCESS.tp_rng_depth:
        raise RuntimeError("tp_ext.random.set_states inside a tp_rng() block; call it outside")
    if not isinstance(states, dict) or set(states) != {"cpu", "cuda", "tp_rank"}:
        got = sorted(states) if isinstance(states, dict) else type(states).__name__
        raise ValueError(
            f"states must be the dict tp_ext.random.get_states() returns (keys 'cpu', 'cuda', "
            f"'tp_rank'), got {got}"
        )
    cpu, cuda, rank = states["cpu"], states["cuda"], states["tp_rank"]
    if not isinstance(cpu, torch.Tensor) or cpu.dtype != torch.uint8 or cpu.dim() != 1:
        raise ValueError(f"states['cpu'] must be a 1-d uint8 tensor, got {cpu!r:.80}")
    devices = torch.cuda.device_count()
    if not isinstance(cuda, (list, tuple)) or len(cuda) not in (0, devices):
        raise ValueError(
            f"states['cuda'] must list one state per CUDA device ({devices} here) or none, "
            f"got {cuda!r:.80}"
        )
    if isinstance(rank, bool) or not isinstance(rank, int):
        raise ValueError(f"states['tp_rank'] must be an int, got {rank!r}")
    mine = -1 if PROCESS.tp_rng_rank is None else PROCESS.tp_rng_rank
    if mine != -1 and rank != -1 and rank != mine:
        raise ValueError(
            f"states['tp_rank']={rank} were taken on TP rank {rank}; this is TP rank {mine}: "
            "restore each rank's own states"
        )
    torch.set_rng_state(cpu)
    for device, state in enumerate(cuda):
        torch.cuda.set_rng_state(state, device)
    PROCESS.tp_rng_rank = None if rank == -1 else rank
