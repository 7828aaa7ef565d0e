"""The job config: what a training or inference job needs besides the model's architecture.

tp_ext's config files (configs/*.yaml) have one section per concern, each validated by the
class that owns it::

    model:      the architecture (tp_ext.models.Qwen2Config)
    parallel:   {tp, pp, dp, ep, dtype, seed,        (ParallelSettings, below)
                 schedule, virtual_stages, data_parallel,
                 micro_batches, activation_checkpointing}
    optimizer:  {lr, weight_decay, betas,           (tp_ext.training.OptimizerSettings)
                 lr_schedule, warmup_steps, min_lr, decay_steps}
    data:       {path, dtype, seq_len, global_batch, (DataSettings: tp-ext train)
                 micro_batch_size, seed}
    checkpoint: {dir, save_every, keep_last,        (CheckpointSettings: tp-ext train)
                 async_save}

Unknown sections and fields are errors that name them; every value is checked when the file is
read, before anything is built.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Union

from tp_ext.data import TOKEN_DTYPES
from tp_ext.dims import MAX_DEGREE, MAX_VIRTUAL_STAGES, ParallelDims
from tp_ext.layers.context import CP_MODES
from tp_ext.models import Qwen2Config
from tp_ext.models.hf.source import HFModelSource
from tp_ext.pipeline import DATA_PARALLEL, SCHEDULES
from tp_ext.pipeline.data_parallel import ZERO_STAGES
from tp_ext.pipeline.schedules import check_micro_batches, check_weight_split_supported
from tp_ext.training import OptimizerSettings
from tp_ext.validation import (
    DTYPE_NAMES,
    JOB_DEFAULT_DTYPE,
    ConfigError,
    Field,
    check_fields,
    check_unknown,
    read_mapping,
)

__all__ = [
    "JobConfig",
    "ParallelSettings",
    "DataSettings",
    "CheckpointSettings",
    "GenerationSettings",
    "DTYPES",
    "PARALLEL_FIELDS",
    "GENERATION_FIELDS",
    "check_expert_parallel",
    "check_pipeline_fields",
    "default_micro_batches",
    "flag_namer",
    "job_dims",
]

DTYPES = DTYPE_NAMES

# The degrees' bounds are ParallelDims' (tp_ext.dims); seeds up to 2**62: torch.manual_seed
# takes 64 bits, and the job adds small offsets to the seed.
_DEGREE = Field("int", 1, MAX_DEGREE)
PARALLEL_FIELDS = {
    "tp": dataclasses.replace(_DEGREE, help="tensor-parallel degree"),
    "pp": dataclasses.replace(_DEGREE, help="pipeline-parallel degree (stages)"),
    "dp": dataclasses.replace(_DEGREE, help="data-parallel degree"),
    "ep": dataclasses.replace(
        _DEGREE,
        help="expert-parallel degree (MoE models: each expert on one of this many of a stage's "
        "DP ranks; default 1)",
    ),
    "cp": dataclasses.replace(
        _DEGREE,
        help="context-parallel degree (each sequence's positions split over this many ranks; "
        "default 1)",
    ),
    "cp_mode": Field(
        "choice",
        choices=CP_MODES,
        help="attention over the CP ranks: ring (default) or all_to_all (Ulysses)",
    ),
    "dtype": Field("choice", choices=DTYPES, help="dtype of the parameters"),
    "seed": Field("int", 0, 2**62, help="seed of the model's initialisation and the data"),
    "schedule": Field(
        "choice",
        choices=tuple(SCHEDULES),
        help="pipeline schedule (default 1F1B); ZBVZeroBubble and DualPipeV need 2 virtual stages",
    ),
    # more stages per rank than this is never faster: each adds a send per micro-batch
    "virtual_stages": Field(
        "int",
        1,
        MAX_VIRTUAL_STAGES,
        help="pipeline stages per rank (default 1; >1 needs an interleaved or V schedule)",
    ),
    "data_parallel": Field(
        "choice",
        choices=DATA_PARALLEL + tuple(ZERO_STAGES),
        help="how DP replicas synchronise: ddp (default), fsdp (FSDP2, parameters sharded), "
        "zero1 / zero2 (optimizer state sharded; zero2 also the gradients)",
    ),
    "grad_reduce_dtype": Field(
        "choice",
        choices=("bfloat16", "float16", "float32"),
        help="dtype of the DP gradient sum on the wire (ddp, zero1, zero2; default: the "
        "gradients' own)",
    ),
    "overlap_param_gather": Field(
        "bool",
        help="ZeRO: each bucket's all-gather of the updated parameters waited for by the next "
        "forward, not at the end of the step (default off)",
    ),
    "micro_batches": Field(
        "int",
        1,
        1024,
        help="micro-batches per step (pipeline micro-batches and gradient accumulation; "
        "default max(2, pp x virtual stages))",
    ),
    "activation_checkpointing": Field(
        "bool", help="recompute each decoder layer in backward (default: the config's, else off)"
    ),
}


def default_micro_batches(pp: int, virtual_stages: int) -> int:
    """Pipeline micro-batches per step when the config leaves ``micro_batches`` out: one per
    stage (every schedule accepts that), and at least two (gradient accumulation)."""
    return max(2, pp * virtual_stages)


class _Stages:
    """What the schedule rules read of a stage split: the degrees, not the layers."""

    def __init__(self, pp: int, virtual_stages: int) -> None:
        self.pp, self.virtual_stages = pp, virtual_stages
        self.num_stages = pp * virtual_stages


def flag_namer(overrides: dict) -> Callable[[str], str]:
    """How a parallel field is called in a message: as the flag the user typed (``--pp``), or
    as the config field it came from (``parallel.pp``). ``overrides``: the fields the flags set
    (None: not given)."""

    def name(field: str) -> str:
        if overrides.get(field) is not None:
            return "--" + field.replace("_", "-")
        return f"parallel.{field}"

    return name


def check_pipeline_fields(values: dict[str, Any], name: Callable[[str], str]) -> None:
    """The rules between ``schedule``, ``virtual_stages``, ``pp`` and ``micro_batches``
    (``values``: every field of a ParallelSettings, ``micro_batches`` may be None). ``name``
    spells a field in the message: ``parallel.schedule`` for a config file, ``--schedule`` for
    the flag that set it."""
    schedule = SCHEDULES[values["schedule"]]
    v, pp = values["virtual_stages"], values["pp"]

    def fits(s) -> bool:
        return v == 2 if s.order == "v" else (s.multi_stage or v == 1)

    if not fits(schedule):
        works = [s.name for s in SCHEDULES.values() if fits(s)]
        raise ConfigError(
            f"{name('schedule')} {schedule.name!r} needs {schedule.requirement()}; got "
            f"{name('virtual_stages')} {v}, with which these schedules work: {works}"
        )
    try:
        check_weight_split_supported(schedule)
    except ValueError as e:
        raise ConfigError(f"{name('schedule')}: {e}") from None
    n = values.get("micro_batches")
    if n is None:
        return
    stages = _Stages(pp, v)

    def reason(count: int) -> Optional[str]:
        try:
            check_micro_batches(schedule, stages, count)
        except ValueError as e:
            return str(e).split("; got")[0]
        return None

    why = reason(n)
    if why is not None:
        works = [m for m in range(1, 4 * stages.num_stages + 2) if reason(m) is None][:6]
        raise ConfigError(
            f"{name('micro_batches')} {n} does not fit {name('pp')} {pp} x "
            f"{name('virtual_stages')} {v}: {why}; values that work include {works}"
        )


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """How the job is laid out over ranks (TP x PP x DP), how its pipeline runs, and the dtype
    and seed of its model.

    ``schedule`` (one of :data:`tp_ext.pipeline.SCHEDULES`) with ``virtual_stages`` stages per
    rank runs ``micro_batches`` micro-batches per step (None: :func:`default_micro_batches`);
    ``data_parallel`` ("ddp", "fsdp", "zero1" or "zero2") synchronises the DP replicas
    (``grad_reduce_dtype``: the gradient sum's dtype on the wire); ``activation_checkpointing``
    recomputes each decoder layer in backward."""

    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    ep: int = 1
    cp: int = 1
    cp_mode: str = "ring"
    dtype: str = JOB_DEFAULT_DTYPE
    seed: int = 1234
    schedule: str = "1F1B"
    virtual_stages: int = 1
    data_parallel: str = "ddp"
    grad_reduce_dtype: Optional[str] = None
    overlap_param_gather: bool = False
    micro_batches: Optional[int] = None
    activation_checkpointing: bool = False

    def __post_init__(self) -> None:
        values = dataclasses.asdict(self)
        # None: all ranks TP and PP leave; the default; the gradients' own dtype
        for optional in ("dp", "micro_batches", "grad_reduce_dtype"):
            if values[optional] is None:
                del values[optional]
        check_fields("parallel.", values, PARALLEL_FIELDS)
        check_pipeline_fields(dataclasses.asdict(self), lambda field: f"parallel.{field}")

    @property
    def pipeline_micro_batches(self) -> int:
        """``micro_batches``, or the default for this ``pp`` and ``virtual_stages``."""
        if self.micro_batches is not None:
            return self.micro_batches
        return default_micro_batches(self.pp, self.virtual_stages)

    @property
    def stage_order(self) -> str:
        """The stage order the schedule needs: "v" for ZBVZeroBubble and DualPipeV, else
        "loop"."""
        return SCHEDULES[self.schedule].order

    @property
    def dims(self) -> ParallelDims:
        """This section's degrees (tp, pp, dp, ep, cp, virtual_stages) as the one record of them;
        dp None until :meth:`ParallelDims.resolve` fills it."""
        return ParallelDims(
            tp=self.tp,
            pp=self.pp,
            dp=self.dp,
            ep=self.ep,
            virtual_stages=self.virtual_stages,
            cp=self.cp,
        )

    def describe(self, dims: ParallelDims) -> str:
        """One line for a job of these settings at ``dims`` (resolved): its ranks, pipeline
        and data parallelism."""
        stages = dims.stages
        per_rank = f"{dims.virtual_stages} per rank" + (
            f", {self.stage_order} order" if dims.virtual_stages > 1 else ""
        )
        return (
            f"dims tp={dims.tp} x pp={dims.pp} x dp={dims.dp}"
            + (f" (ep={dims.ep})" if dims.ep > 1 else "")
            + (f" (cp={dims.cp}, {self.cp_mode} attention)" if dims.cp > 1 else "")
            + f" on {dims.world_size} "
            f"ranks; pipeline schedule {self.schedule}, {stages} stage{'s' * (stages > 1)} "
            f"({per_rank}), {self.pipeline_micro_batches} micro-batches per step; data parallel "
            + (f"{self.data_parallel} over {dims.dp} replicas" if dims.dp > 1 else "none (dp=1)")
            + f"; activation checkpointing {'on' if self.activation_checkpointing else 'off'}"
        )


def job_dims(parallel: ParallelSettings, overrides: dict, world_size: int) -> ParallelDims:
    """The dims of a command's job (``tp-ext run``, ``tp-ext train``) over ``world_size``
    ranks: pp, dp and virtual_stages as the flags or the config say (dp None: the ranks TP and
    PP leave), tp as ``--tp`` says (not given: the ranks PP and DP leave; the config's
    parallel.tp is the degree ``tp-ext plan`` prints the footprint at). The one resolver's
    errors name each degree as the user gave it (:func:`flag_namer`)."""
    return parallel.dims.replace(tp=overrides.get("tp")).resolve(
        world_size, name=flag_namer(overrides), world_name="WORLD_SIZE"
    )


def check_expert_parallel(model, dims: ParallelDims, name: Callable[[str], str]) -> None:
    """``dims.ep`` > 1 needs a mixture-of-experts model with at least ``ep`` experts; ep
    dividing dp is :meth:`ParallelDims.resolve`'s rule. ``name`` spells
    a field as the user gave it (:func:`flag_namer`)."""
    if dims.ep == 1:
        return
    experts = getattr(model, "num_experts", 0)  # tp_ext's Qwen2 is dense
    if experts == 0:
        raise ConfigError(
            f"{name('ep')} {dims.ep}: {model.architecture} has no experts to split (expert "
            "parallelism is for mixture-of-experts models: Mixtral, Qwen2-MoE, ...); leave it at 1"
        )
    if dims.ep > experts:
        raise ConfigError(
            f"{name('ep')} {dims.ep}: more expert ranks than {model.architecture}'s {experts} "
            f"experts; use at most {experts}"
        )


# A token file of ~10^12 tokens at most, sequences up to 2**20; batches up to 2**24 sequences.
DATA_FIELDS = {
    "dtype": Field("choice", choices=tuple(TOKEN_DTYPES)),
    "seq_len": Field("int", 2, 2**20, help="tokens per sequence"),
    "global_batch": Field("int", 1, 2**24, help="sequences per step over all DP replicas"),
    "micro_batch_size": Field("int", 1, 2**20),
    "seed": Field("int", 0, 2**62),
}


@dataclasses.dataclass(frozen=True)
class DataSettings:
    """The token file of ``tp-ext train`` (``path``, or ``--data``) and how it is batched
    (:class:`tp_ext.data.TokenBatches`): ``global_batch`` sequences of ``seq_len`` tokens per
    step, over every DP rank, in micro-batches of ``micro_batch_size``."""

    path: Optional[str] = None
    dtype: Optional[str] = None  # None: the token file's sidecar's, else uint16
    seq_len: int = 128
    global_batch: int = 8
    micro_batch_size: int = 1
    seed: int = 1234

    def __post_init__(self) -> None:
        if self.path is not None and not isinstance(self.path, str):
            raise ConfigError(f"data.path must be a file path (a string), got {self.path!r}")
        values = dataclasses.asdict(self)
        if values["dtype"] is None:
            del values["dtype"]
        check_fields("data.", values, DATA_FIELDS)

    def micro_batches(self, dp: int, name: Callable[[str], str] = lambda f: f"data.{f}") -> int:
        """Micro-batches per step on each of ``dp`` DP ranks; an error when they cannot split."""
        per_step = dp * self.micro_batch_size
        if self.global_batch % per_step:
            works = list(range(per_step, 4 * per_step + 1, per_step))
            raise ConfigError(
                f"{name('global_batch')} {self.global_batch} must be divisible by dp x "
                f"{name('micro_batch_size')} = {dp} x {self.micro_batch_size} = {per_step}; "
                f"values that work: {works}"
            )
        return self.global_batch // per_step


# What tp-ext generate decodes with (tp_ext.generate's arguments): up to 2**20 new tokens.
GENERATION_FIELDS = {
    "max_new_tokens": Field("int", 1, 2**20, help="tokens to generate per prompt"),
    "do_sample": Field("bool", help="sample instead of greedy decoding"),
    "temperature": Field("float", 0, low_open=True, help="the sampling temperature"),
    "top_k": Field("int", 1, 2**31, help="sample among the k most likely tokens"),
    "top_p": Field("float", 0, 1, low_open=True, help="sample among the top-p probability mass"),
    "seed": Field("int", 0, 2**62, help="the draws' seed"),
    "micro_batches": Field("int", 1, 2**16, help="micro-batches in flight through the stages"),
}


@dataclasses.dataclass(frozen=True)
class GenerationSettings:
    """How ``tp-ext generate`` decodes (:func:`tp_ext.generate`'s arguments): greedy, or with
    ``do_sample`` drawn at ``temperature`` among the ``top_k`` tokens / the ``top_p`` mass, from
    ``seed``; ``micro_batches`` in flight through the pipeline stages (None: one per stage)."""

    max_new_tokens: int = 32
    do_sample: bool = False
    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None
    seed: int = 0
    micro_batches: Optional[int] = None

    def __post_init__(self) -> None:
        values = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        check_fields("generation.", values, GENERATION_FIELDS)


CHECKPOINT_FIELDS = {
    "save_every": Field("int", 1, 10**9, help="save every K steps, and after the last"),
    "keep_last": Field("int", 1, 10**6, help="keep the newest M checkpoints"),
    "async_save": Field("bool", help="write checkpoints while training goes on"),
}


@dataclasses.dataclass(frozen=True)
class CheckpointSettings:
    """Where and how often ``tp-ext train`` saves: ``dir`` (or ``--checkpoint-dir``) holds
    ``step-<N>`` checkpoints, one every ``save_every`` steps and one at the end, the newest
    ``keep_last`` kept (None: all); ``async_save`` writes them while training goes on."""

    dir: Optional[str] = None
    save_every: int = 100
    keep_last: Optional[int] = None
    async_save: bool = False

    def __post_init__(self) -> None:
        if self.dir is not None and not isinstance(self.dir, str):
            raise ConfigError(
                f"checkpoint.dir must be a directory path (a string), got {self.dir!r}"
            )
        values = dataclasses.asdict(self)
        if values["keep_last"] is None:
            del values["keep_last"]
        check_fields("checkpoint.", values, CHECKPOINT_FIELDS)


_SECTIONS = {
    "parallel": ParallelSettings,
    "optimizer": OptimizerSettings,
    "data": DataSettings,
    "checkpoint": CheckpointSettings,
}


@dataclasses.dataclass(frozen=True)
class JobConfig:
    model: Union[Qwen2Config, HFModelSource]  # tp_ext's Qwen2, or any transformers decoder
    parallel: ParallelSettings = ParallelSettings()
    optimizer: OptimizerSettings = OptimizerSettings()
    data: DataSettings = DataSettings()
    checkpoint: CheckpointSettings = CheckpointSettings()

    def __post_init__(self) -> None:  # each section checked its own values when it was built
        for name, kind in (("model", (Qwen2Config, HFModelSource)), *_SECTIONS.items()):
            if not isinstance(getattr(self, name), kind):
                kinds = kind if isinstance(kind, tuple) else (kind,)
                kinds = " or ".join(k.__name__ for k in kinds)
                raise ConfigError(
                    f"JobConfig.{name} must be a {kinds}, got {type(getattr(self, name)).__name__}"
                )

    @classmethod
    def from_file(cls, path: str) -> "JobConfig":
        """A tp_ext YAML/JSON job file, or a Hugging Face config.json (default settings)."""
        path, data = read_mapping(path)
        try:
            if "model_type" in data or "architectures" in data:
                return cls(model=Qwen2Config.from_hf_dict(data))
            return cls.from_dict(data, os.path.dirname(os.path.abspath(path)))
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def for_command(cls, config_path: Optional[str], model: Optional[str]) -> "JobConfig":
        """A command's job: the job file's (``config_path``), its model replaced by the
        transformers model ``model`` names (``--model DIR_OR_CONFIG``; no job file needed then:
        the other sections take their defaults)."""
        if config_path is None and model is None:
            raise ConfigError("no model: give a job config, or --model DIR_OR_CONFIG")
        if model is None:
            return cls.from_file(config_path)
        source = HFModelSource.from_path(model)
        if config_path is None:
            return cls(model=source)
        return dataclasses.replace(cls.from_file(config_path), model=source)

    @classmethod
    def from_dict(cls, data: dict[str, Any], base_dir: Optional[str] = None) -> "JobConfig":
        """``model``: tp_ext's Qwen2 fields, or the path of a transformers checkpoint directory
        or config.json (relative to ``base_dir``, the job file's directory, when it is there)."""
        check_unknown("", data, ["model", *_SECTIONS])
        if "model" not in data:
            raise ConfigError("missing field 'model'")
        sections = {name: _section(kind, name, data) for name, kind in _SECTIONS.items()}
        model = data["model"]
        if isinstance(model, str):
            near = os.path.join(base_dir, model) if base_dir else model
            path = near if os.path.exists(near) else model
            return cls(model=HFModelSource.from_path(path), **sections)
        return cls(model=Qwen2Config.from_dict(model), **sections)

    def with_overrides(self, **flags) -> "JobConfig":
        """The config with command-line flags applied over its parallel and optimizer sections
        (``tp``, ``pp``, ``dp``, ``ep``, ``dtype``, ``seed``, ``schedule``, ``virtual_stages``,
        ``data_parallel``, ``micro_batches``, ``activation_checkpointing``, ``lr``,
        ``weight_decay``, ``betas``); flags that are None are left as the file has them."""
        names = {  # data.seed / data.dtype are not parallel.seed / parallel.dtype
            section: {f.name for f in dataclasses.fields(_SECTIONS[section])}
            for section in ("parallel", "optimizer")
        }
        known = sorted(set().union(*names.values()))
        unknown = sorted(set(flags) - set(known))
        if unknown:
            raise ConfigError(f"unknown override {unknown[0]!r}; known: {known}")
        changes = {}
        for section, fields in names.items():
            values = {k: v for k, v in flags.items() if k in fields and v is not None}
            if values:
                if isinstance(values.get("betas"), list):
                    values["betas"] = tuple(values["betas"])
                changes[section] = dataclasses.replace(getattr(self, section), **values)
        return dataclasses.replace(self, **changes)


def _section(kind, name: str, data: dict):
    section = data.get(name)
    section = {} if section is None else section  # an empty section: the defaults
    if not isinstance(section, dict):
        raise ConfigError(f"{name} must be a mapping of fields, got {type(section).__name__}")
    check_unknown(f"{name}.", section, [f.name for f in dataclasses.fields(kind)])
    section = dict(section)
    if "betas" in section and isinstance(section["betas"], list):
        section["betas"] = tuple(section["betas"])
    return kind(**section)
