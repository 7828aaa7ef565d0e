"""``--auto`` for ``tp-ext run`` and ``tp-ext train``: the dims and run settings of the
planner's best training candidate that fits this job's ranks (WORLD_SIZE, LOCAL_WORLD_SIZE
per node), this machine's devices and the job's batch, as the overrides those flags would
give."""

from __future__ import annotations

import os

import torch

from tp_ext.cli.logs import LOG
from tp_ext.planner import plan

__all__ = ["auto_overrides", "CHOSEN_FLAGS", "this_machine"]

# what --auto decides, so a flag may not also give it
CHOSEN_FLAGS = (
    "tp",
    "pp",
    "dp",
    "ep",
    "schedule",
    "virtual_stages",
    "data_parallel",
    "micro_batches",
    "activation_checkpointing",
)


def this_machine(local_ranks: int) -> tuple[str, int]:
    """The hardware table entry of this machine's devices and the memory one rank may use."""
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        name = props.name.upper()
        kind = "h200" if "H200" in name else "a100" if "A100" in name else "h100"
        if kind == "h100" and "PCIE" in name:
            kind = "h100-pcie"
        return kind, props.total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return "cpu", host // max(local_ranks, 1)


def auto_overrides(model_config, data, overrides: dict, dtype: str, parallel=None) -> dict:
    """``overrides`` with the planner's choice for ``model_config`` trained on ``data``'s
    batches (seq_len, global_batch, micro_batch_size). Refuses those flags given beside
    --auto, and says what was chosen and why (logged). The CP degree (``--cp``, else the job's
    ``parallel.cp``: ``parallel``, its parallel section) is kept: every candidate takes it."""
    given = [f"--{k.replace('_', '-')}" for k in CHOSEN_FLAGS if overrides.get(k) is not None]
    if given:
        raise ValueError(
            f"--auto chooses the dims itself; drop {', '.join(given)} (or drop --auto)"
        )
    cp = overrides.get("cp") or (parallel.cp if parallel is not None else 1)
    cp_mode = overrides.get("cp_mode") or (parallel.cp_mode if parallel is not None else "ring")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    hardware, memory = this_machine(local)
    ranked = plan(
        model_config,
        gpus=world,
        gpus_per_node=local if world % local == 0 else world,
        gpu_memory=memory,
        seq_len=data.seq_len,
        global_batch=data.global_batch,
        micro_batch=data.micro_batch_size,
        hardware=hardware,
        dtype=dtype,
        top=None,
        grids=False,  # the commands build 1D models (parallel.tp is a degree)
        cp=cp,  # kept: the planner places the rest around it
        cp_mode=cp_mode,
    )
    best = next((e for e in ranked if e.fits), None)
    if best is None:
        closest = ranked[0].reason
        raise ValueError(f"--auto: no candidate of {world} ranks fits; the closest: {closest}")
    chosen = best.candidate
    LOG.info(f"tp-ext: --auto chose {chosen.describe()} ({best.reason})")
    dims = chosen.dims
    return {
        **overrides,
        "tp": dims.tp,
        "pp": dims.pp,
        "dp": dims.dp,
        "ep": dims.ep,
        "cp": dims.cp,
        "cp_mode": cp_mode,
        "virtual_stages": dims.virtual_stages,
        # the candidate's run settings carry the config's (and the flags') names
        "schedule": chosen.schedule,
        "data_parallel": chosen.data_parallel,
        "activation_checkpointing": chosen.activation_checkpointing,
    }
