"""The candidates worth running, best first: every (tp, pp, dp) that multiplies to the GPU count
and that the model accepts (tp a TP degree, or a 2D grid (P, Q) of tp_ext's Qwen2), with each
micro-batch size, schedule, activation checkpointing setting and DP engine (DDP, FSDP2, ZeRO-1,
ZeRO-2), costed by :func:`tp_ext.planner.cost.estimate`; the ones that fit ranked by step time,
then the ones that do not by how far over they are; each with a sentence saying why."""

from __future__ import annotations

import os
from typing import Optional, Union

from tp_ext.dims import ParallelDims
from tp_ext.layers.context import CP_MODES
from tp_ext.models.hf import is_hf_config_dict, load_hf_config
from tp_ext.models.qwen2 import Qwen2Config
from tp_ext.pipeline.schedules import SCHEDULES, weight_split_supported
from tp_ext.planner.candidate import (
    ROUTING_IMBALANCE,
    Candidate,
    Estimate,
    check_imbalance,
    usable_memory,
)
from tp_ext.planner.cost import estimate
from tp_ext.planner.cost_2d import grid_problem
from tp_ext.planner.hardware import Hardware, load_hardware
from tp_ext.planner.hf_model import HFModel
from tp_ext.sharding import divisors
from tp_ext.validation import (
    DTYPE_BYTES,
    JOB_DEFAULT_DTYPE,
    check_dtype_name,
    check_int,
    read_mapping,
)

__all__ = ["plan", "plan_dims", "parse_bytes"]

_UNITS = {"": 1, "b": 1, "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "kib": 1024,
          "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}  # fmt: skip


def parse_bytes(text: Union[str, int, float]) -> int:
    """``"80GiB"``, ``"80 GB"``, ``"1.5e9"`` or a number of bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        raw = str(text).strip().lower().replace(" ", "")
        number = raw.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = raw[len(number) :]
        try:
            value = int(float(number) * _UNITS[unit])
        except (KeyError, ValueError):
            raise ValueError(
                f"gpu_memory={text!r} is not a size; write e.g. 80GiB, 80GB or 85899345920"
            ) from None
    if value <= 0:
        raise ValueError(f"gpu_memory={text!r} must be above 0 bytes")
    return value


def _gib(n: float) -> str:
    return f"{n / 1024**3:.1f} GiB"


def _grids(config: Qwen2Config, gpus: int):
    """The 2D grids (P, Q) worth costing on ``gpus`` devices: P and Q of 2 or more (a 1 x Q
    grid is 1D TP with more communication), every one the 2D model accepts."""
    for size in divisors(gpus):
        for rows in divisors(size):
            grid = (rows, size // rows)
            probe = Candidate(ParallelDims(tp=grid, dp=gpus // size), 1, 1)
            if min(grid) >= 2 and not grid_problem(config, probe):
                yield grid


def _dims(config: Qwen2Config, gpus: int, global_batch: int, grids: bool):
    """Every ParallelDims of ``gpus`` ranks the model accepts whose dp divides the batch: a TP
    degree the model takes, or a 2D grid, times a pipeline degree of at most one stage per
    decoder layer."""
    valid_tp = set(config.valid_tp_sizes())
    tps = [tp for tp in divisors(gpus) if tp in valid_tp]
    if grids and isinstance(config, Qwen2Config):  # 2D TP is the native model's
        tps += list(_grids(config, gpus))
    for tp in tps:
        size = tp if isinstance(tp, int) else tp[0] * tp[1]
        for pp in divisors(gpus // size):
            dims = ParallelDims(tp=tp, pp=pp).resolve(gpus)
            if pp <= config.num_hidden_layers and global_batch % dims.dp == 0:
                yield dims
                yield from _expert_dims(config, dims)


def _expert_dims(config, dims: ParallelDims):
    """An MoE model's EP degrees on these dims: taken from the DP ranks of a stage (ep
    dividing dp)."""
    if getattr(config, "is_moe", False):
        for ep in divisors(dims.dp)[1:]:
            yield dims.replace(ep=ep)


def _schedules(config: Qwen2Config, pp: int, m: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) worth trying: 1F1B and GPipe; interleaved and the V with two
    stages per rank where the layers split evenly."""
    if pp == 1:
        return [("1F1B", 1)]  # one stage: the local loop (the schedule is not used)
    schedules = [("1F1B", 1), ("GPipe", 1)]
    if config.num_hidden_layers % (2 * pp) == 0 and m % pp == 0:
        schedules.append(("Interleaved1F1B", 2))
        if weight_split_supported():  # a torch whose zero-bubble gradients are exact
            schedules.append(("ZBVZeroBubble", 2))
    return schedules


def _engines(dims: ParallelDims) -> tuple:
    """The DP engines worth costing on these dims: none to choose with one replica of the
    dense weights (DP x CP ranks); else DDP, FSDP2, ZeRO-1 and ZeRO-2 (on 2D grids, with
    experts and with context parallelism too)."""
    if dims.replicas == 1:
        return ("ddp",)
    return ("ddp", "fsdp", "zero1", "zero2")


def _candidates(config: Qwen2Config, gpus: int, global_batch: int, dtype: str, micro_batch,
                grids: bool, cp: int = 1, cp_mode: str = "ring",
                routing_imbalance: float = ROUTING_IMBALANCE):  # fmt: skip
    # context parallelism runs with 1D TP and 2D grids, pipelining, EP and every DP engine
    for dims in _dims(config, gpus // cp, global_batch, grids):
        dims = dims.replace(cp=cp)
        per_replica = global_batch // dims.dp
        for mb in (1, 2, 4, 8) if micro_batch is None else (micro_batch,):
            m = per_replica // mb
            if per_replica % mb or (dims.pp > 1 and m < dims.pp):
                continue  # torch's schedules need at least pp micro-batches
            engines = _engines(dims)
            for schedule, v in _schedules(config, dims.pp, m):
                for checkpointing in (False, True):
                    for engine in engines:
                        if engine == "fsdp" and SCHEDULES[schedule].weight_split:
                            continue  # the Trainer refuses: torch writes their weight
                            # gradients outside autograd, where FSDP2 never sees them
                        yield Candidate(
                            dims.replace(virtual_stages=v),
                            micro_batch=mb,
                            num_micro_batches=m,
                            schedule=schedule,
                            activation_checkpointing=checkpointing,
                            data_parallel=engine,
                            dtype=dtype,
                            cp_mode=cp_mode,
                            routing_imbalance=routing_imbalance,
                        )


def _reason(est: Estimate, best: Optional[Estimate], gpus_per_node: int) -> str:
    """One sentence: what this candidate is, why it ranks where it does, what limits it."""
    lay, mem, d = est.candidate.dims, est.memory_bytes, est.detail
    limit = est.memory_limit
    where = []
    if lay.tp_size > 1:
        tp = lay.tp if lay.grid is None else f"{lay.grid[0]}x{lay.grid[1]} (2D, SUMMA)"
        where.append(f"TP {tp} {'across nodes' if d['tp_crosses_nodes'] else 'inside a node'}")
    if lay.pp > 1:
        where.append(f"PP {lay.pp} {'across nodes' if d['pp_crosses_nodes'] else 'in a node'}")
    if lay.cp > 1:
        where.append(f"CP {lay.cp} ({est.candidate.cp_mode})")
    if lay.replicas > 1:  # the DP engine runs over the DP x CP ranks
        ranks = f"{lay.dp}" if lay.cp == 1 else f"{lay.dp} x CP {lay.cp}"
        where.append(
            f"DP {ranks} ({est.candidate.data_parallel}"
            f"{', across nodes' if d['dp_crosses_nodes'] else ''})"
        )
    head = ", ".join(where) or "one rank"
    usable = usable_memory(limit) if limit else None
    if not est.fits:
        return (
            f"{head}: does not fit, {_gib(mem['total'])} per rank against {_gib(usable)} usable "
            f"of {_gib(limit)} ({_gib(mem['total'] - usable)} over; params+grads+optimizer "
            f"{_gib(mem['params'] + mem['grads'] + mem['optimizer'])}, activations "
            f"{_gib(mem['activations'])})"
        )
    parts = [
        f"{head}: {_gib(mem['total'])} "
        + (f"of {_gib(usable)} usable per rank" if limit else "per rank (no memory limit given)"),
        f"step {est.step_time_s:.3g} s (compute {d['compute_s']:.3g} s, TP comm {d['tp_s']:.3g} s"
        + (f", bubble {est.bubble:.1%}" if lay.pp > 1 else "")
        + (f", DP exposed {d['dp_exposed_s']:.3g} s" if lay.replicas > 1 else "")
        + ")",
    ]
    if est.candidate.activation_checkpointing:
        parts.append("recomputes activations to fit (a third more compute)")
    if best is not None and best is not est:
        parts.append(f"{est.step_time_s / best.step_time_s:.2f}x the best step time")
    elif 1 < lay.tp_size <= gpus_per_node:
        parts.append("TP stays on the node's fast links, what remains goes to PP and DP")
    return "; ".join(parts)


def _against_alternatives(best: Estimate, estimates: list[Estimate]) -> str:
    """Why not the nearest other choices: the best candidate at each other TP degree, and
    without pipelining."""
    notes = []

    def best_of(pred):
        pool = [e for e in estimates if pred(e.candidate.dims)]
        fit = [e for e in pool if e.fits]
        if fit:
            return min(fit, key=lambda e: e.step_time_s)
        return min(pool, key=lambda e: e.memory_bytes["total"]) if pool else None

    lay = best.candidate.dims
    one_d = {e.candidate.dims.tp for e in estimates if e.candidate.dims.grid is None}
    for tp in sorted(one_d - {lay.tp}):
        if tp not in (lay.tp_size // 2, lay.tp_size * 2):
            continue
        other = best_of(lambda x, tp=tp: x.tp == tp)
        if other is None:
            continue
        if other.fits:
            notes.append(
                f"TP {tp} at best {other.step_time_s:.3g} s ({other.candidate.describe()}, TP comm "
                f"{other.detail['tp_s']:.3g} s)"
            )
        else:
            notes.append(f"TP {tp} does not fit ({_gib(other.memory_bytes['total'])} per rank)")
    grid = best_of(lambda x: x.grid is not None and x.tp != lay.tp)
    if grid is not None and grid.fits:
        notes.append(
            f"2D TP at best {grid.step_time_s:.3g} s ({grid.candidate.describe()}, TP comm "
            f"{grid.detail['tp_s']:.3g} s)"
        )
    if lay.pp > 1:
        flat = best_of(lambda x: x.tp == lay.tp and x.pp == 1)
        if flat is not None and not flat.fits:
            notes.append(f"without PP it does not fit ({_gib(flat.memory_bytes['total'])})")
        elif flat is not None:
            notes.append(f"without PP {flat.step_time_s:.3g} s ({flat.candidate.describe()})")
    return "; against: " + ", ".join(notes) if notes else ""


def plan(
    config: Union[Qwen2Config, str, os.PathLike],
    gpus: int,
    gpus_per_node: Optional[int] = None,
    gpu_memory: Union[str, int, None] = None,
    seq_len: int = 4096,
    global_batch: int = 512,
    hardware: Union[str, Hardware] = "h100",
    dtype: Optional[str] = None,
    top: Optional[int] = 10,
    micro_batch: Optional[int] = None,
    grids: bool = True,
    cp: int = 1,
    cp_mode: str = "ring",
    routing_imbalance: float = ROUTING_IMBALANCE,
) -> list[Estimate]:
    """The candidates for training ``config`` (a Qwen2Config, or a config file's path) on
    ``gpus`` devices (``gpus_per_node`` per node, ``gpu_memory`` each: bytes or "80GiB"; default
    the hardware's), for steps of ``global_batch`` sequences of ``seq_len`` tokens, best first:
    candidates that fit ranked by estimated step time, then those that do not by how much they
    miss. ``top``: how many (None: all); ``micro_batch``: sequences per micro-batch (None: 1,
    2, 4 or 8, whichever ranks best); ``grids``: 2D TP grids (P, Q) of tp_ext's Qwen2 among the
    candidates (with pipelining, every DP engine and context parallelism, as 1D TP). ``cp``:
    the context-parallel degree every candidate takes (``gpus`` split into tp x cp x pp x
    dp), its attention by ``cp_mode``. ``routing_imbalance``: with experts, the busiest EP
    rank's routed rows over its even share (:class:`Candidate`).
    ``dtype``: the parameters' (None: a job file's ``parallel.dtype``, float32 when it names
    none, as the job trains; a Hugging Face config's ``torch_dtype``; else bfloat16)."""
    config, dtype = _model_config(config, dtype)
    for name, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch)):
        check_int(name, value)
    check_int("cp", cp)
    if gpus % cp:
        raise ValueError(f"cp={cp} does not divide gpus={gpus}: use a divisor of {gpus}")
    if cp_mode not in CP_MODES:
        raise ValueError(f"cp_mode must be 'ring' or 'all_to_all', got {cp_mode!r}")
    check_imbalance(routing_imbalance)
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    gpus_per_node = _check_nodes(gpus, gpus_per_node)
    if micro_batch is not None:
        check_int("micro_batch", micro_batch)
    check_dtype_name(dtype)
    memory = parse_bytes(gpu_memory) if gpu_memory is not None else hw.memory
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} is above the model's max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    estimates = [
        estimate(
            config,
            candidate,
            seq_len=seq_len,
            hardware=hw,
            gpu_memory=memory,
            gpus_per_node=gpus_per_node,
        )
        for candidate in _candidates(
            config, gpus, global_batch, dtype, micro_batch, grids, cp, cp_mode, routing_imbalance
        )
    ]
    if not estimates:
        raise ValueError(
            f"no tp x pp x dp of {gpus} GPUs works for this model with "
            f"global_batch={global_batch}: TP sizes it accepts are {config.valid_tp_sizes()}, "
            "and dp must divide the batch"
        )
    ranked = _ranked(estimates, gpus_per_node)
    return ranked[:top] if top else ranked


def plan_dims(
    config: Union[Qwen2Config, str, os.PathLike],
    dims: ParallelDims,
    seq_len: int,
    hardware: Union[str, Hardware] = "h100",
    gpu_memory: Union[str, int, None] = None,
    dtype: Optional[str] = None,
    cp_mode: str = "ring",
    micro_batch: int = 1,
    micro_batches: int = 1,
    routing_imbalance: float = ROUTING_IMBALANCE,
) -> list[Estimate]:
    """What the given dims cost (``dims`` resolved: tp, cp, pp, dp), for a step of
    ``micro_batches`` micro-batches of ``micro_batch`` sequences of ``seq_len`` tokens per DP
    rank (under pipelining at least ``pp``, as torch's schedules need): its estimates
    without and with activation checkpointing (``fits`` against ``gpu_memory``, default the
    hardware's). What ``tp-ext plan --cp C --seq-len N`` prints, beside the same at cp = 1."""
    config, dtype = _model_config(config, dtype)
    check_int("seq_len", seq_len)
    check_int("micro_batches", micro_batches)
    if dims.pp > micro_batches:
        raise ValueError(
            f"plan_dims: micro_batches={micro_batches} with pp={dims.pp}: torch's schedules "
            f"need at least {dims.pp} micro-batches"
        )
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} is above the model's max_position_embeddings="
            f"{config.max_position_embeddings}"
        )
    hw = load_hardware(hardware) if isinstance(hardware, str) else hardware
    memory = parse_bytes(gpu_memory) if gpu_memory is not None else hw.memory
    return [
        estimate(
            config,
            Candidate(
                dims,
                micro_batch,
                micro_batches,
                activation_checkpointing=checkpointing,
                dtype=dtype,
                cp_mode=cp_mode,
                routing_imbalance=routing_imbalance,
            ),
            seq_len=seq_len,
            hardware=hw,
            gpu_memory=memory,
        )
        for checkpointing in (False, True)
    ]


def _model_config(config, dtype: Optional[str]) -> tuple:
    """The model (tp_ext's Qwen2Config, or an :class:`HFModel` for any other transformers
    decoder) and the dtype to plan in: ``dtype`` when given, else the file's."""
    file_dtype = None
    if isinstance(config, (str, os.PathLike)):  # a job YAML, a Hugging Face config or directory
        path = os.fspath(config)
        data = None if os.path.isdir(path) else read_mapping(path)[1]
        native = data is not None and (
            not is_hf_config_dict(data) or data["model_type"] in ("qwen2", "qwen")
        )  # a job file, or a config of the Qwen2 family tp_ext implements natively
        if native:
            config = Qwen2Config.from_file(path)
            file_dtype = _file_dtype(path, data)
        else:
            config = load_hf_config(path)
    if _is_transformers_config(config):
        name = getattr(config, "torch_dtype", None) or getattr(config, "dtype", None)
        name = str(name).removeprefix("torch.") if name is not None else None
        file_dtype = name if name in DTYPE_BYTES else None
        config = HFModel(config)
    if not isinstance(config, (Qwen2Config, HFModel)):
        raise TypeError(
            f"plan: config must be a tp_ext.models.Qwen2Config, a transformers config or the "
            f"path of a config file (a job YAML, a Hugging Face config.json or checkpoint "
            f"directory), got {type(config).__name__}"
        )
    return config, dtype or file_dtype or "bfloat16"


def _is_transformers_config(config) -> bool:
    """A transformers PretrainedConfig (told by its interface: importing transformers to check
    would cost every planner import seconds)."""
    return isinstance(getattr(config, "model_type", None), str) and hasattr(
        config, "to_json_string"
    )


def _file_dtype(path: str, data: dict) -> Optional[str]:
    """The dtype a config file trains in: a job file's parallel.dtype (the job's default when
    it has none), a Hugging Face config's torch_dtype (dtype in newer transformers) when it is
    one tp_ext trains in; None otherwise."""
    if "model_type" in data or "architectures" in data:
        name = data.get("torch_dtype") or data.get("dtype")
        return name if isinstance(name, str) and name in DTYPE_BYTES else None
    parallel = data.get("parallel") or {}
    if not isinstance(parallel, dict):
        return None
    name = parallel.get("dtype", JOB_DEFAULT_DTYPE)
    return check_dtype_name(name, f"{path}: parallel.dtype")


def _check_nodes(gpus: int, gpus_per_node: Optional[int]) -> int:
    """``gpus_per_node`` checked (default: all ``gpus`` in one node)."""
    gpus_per_node = check_int("gpus_per_node", gpus_per_node if gpus_per_node else gpus)
    if gpus % gpus_per_node and gpus > gpus_per_node:
        raise ValueError(
            f"gpus={gpus} is not a whole number of nodes of gpus_per_node={gpus_per_node}"
        )
    return gpus_per_node


def _ranked(estimates: list[Estimate], gpus_per_node: int) -> list[Estimate]:
    """Those that fit by step time, then those that do not by memory; each with its reason,
    the best also with why not its nearest alternatives."""
    fitting = sorted((e for e in estimates if e.fits), key=lambda e: e.step_time_s)
    over = sorted(
        (e for e in estimates if not e.fits),
        key=lambda e: (e.memory_bytes["total"], e.step_time_s),
    )
    ranked = fitting + over
    best = fitting[0] if fitting else None
    for est in ranked:
        est.reason = _reason(est, best, gpus_per_node)
    if best is not None:
        best.reason += _against_alternatives(best, estimates)
    return ranked
