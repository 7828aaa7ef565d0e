"""Random numbers under tensor parallelism.

Two streams per process:
- the default generator, seeded identically on every rank: replicated regions (dropout on the
  residual stream, initialisation of full weights) draw the same numbers on every TP rank;
- a TP stream, seeded differently on each TP rank: work on sharded activations (dropout on this
  rank's attention heads) must not repeat the same mask on every shard.

``with tp_rng():`` (also ``tp_ext.random.tp_rng``) swaps the TP stream in (for the CPU and, when
used, the current CUDA device) and swaps back afterwards, so the default stream is not advanced
by it.
Initialisation needs no TP stream: layers draw full tensors from the default generator and keep
their slice, so a model built at TP=k equals the same model built at TP=1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tp_ext.distributed.groups import resolve_group
from tp_ext.distributed.state import PROCESS

__all__ = ["manual_seed", "tp_rng", "TP_SEED_OFFSET"]

# Megatron's offset, so TP streams never coincide with the default stream's seed.
TP_SEED_OFFSET = 2718


def manual_seed(seed: int, tp_group=None) -> None:
    """Seed the default generator with ``seed`` on every rank, and this rank's TP stream with
    ``seed + 2718 + tp_rank``."""
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    tp_rank = resolve_group(tp_group).rank
    torch.manual_seed(seed)
    PROCESS.tp_seed = seed + TP_SEED_OFFSET + tp_rank
    PROCESS.tp_rng_states.clear()
    PROCESS.tp_rng_states["cpu"] = torch.Generator().manual_seed(PROCESS.tp_seed).get_state()


def _get_state(device: str) -> torch.Tensor:
    if device == "cpu":
        return torch.get_rng_state()
    return torch.cuda.get_rng_state()


def _set_state(device: str, state: torch.Tensor) -> None:
    if device == "cpu":
        torch.set_rng_state(state)
    else:
        torch.cuda.set_rng_state(state)


@contextlib.contextmanager
def tp_rng() -> Iterator[None]:
    """Draw from this rank's TP stream inside the block."""
    states = PROCESS.tp_rng_states
    if PROCESS.tp_seed is None:
        raise RuntimeError(
            "call tp_ext.distributed.rng.manual_seed(seed) on every rank before tp_rng()"
        )
    devices = ["cpu"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices.append("cuda")
        if "cuda" not in states:
            saved = torch.cuda.get_rng_state()
            torch.cuda.manual_seed(PROCESS.tp_seed)
            states["cuda"] = torch.cuda.get_rng_state()
            torch.cuda.set_rng_state(saved)
    outside = {d: _get_state(d) for d in devices}
    for d in devices:
        _set_state(d, states[d])
    try:
        yield
    finally:
        for d in devices:
            states[d] = _get_state(d)
            _set_state(d, outside[d])
