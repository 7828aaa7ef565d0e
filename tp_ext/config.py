"""The job config: what a training or inference job needs besides the model's architecture.

tp_ext's config files (configs/*.yaml) have one section per concern, each validated by the
class that owns it::

    model:     the architecture (tp_ext.models.Qwen2Config)
    parallel:  {tp, pp, dp, dtype, seed}           (ParallelSettings, below)
    optimizer: {lr, weight_decay, betas}           (tp_ext.training.OptimizerSettings)

Unknown sections and fields are errors that name them; every value is checked when the file is
read, before anything is built.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from tp_ext.models import Qwen2Config
from tp_ext.training import OptimizerSettings
from tp_ext.validation import ConfigError, Field, check_fields, check_unknown, read_mapping

__all__ = ["JobConfig", "ParallelSettings", "DTYPES", "PARALLEL_FIELDS"]

DTYPES = ("float32", "bfloat16", "float16", "float64")

# Degrees up to 2**16 ranks, far beyond any cluster tp_ext targets; seeds up to 2**62:
# torch.manual_seed takes 64 bits, and the job adds small offsets to the seed.
_DEGREE = Field("int", 1, 2**16)
PARALLEL_FIELDS = {
    "tp": _DEGREE,
    "pp": _DEGREE,
    "dp": _DEGREE,
    "dtype": Field("choice", choices=DTYPES),
    "seed": Field("int", 0, 2**62),
}


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    """How the job is laid out over ranks, and the dtype and seed of its model."""

    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    dtype: str = "float32"
    seed: int = 1234

    def __post_init__(self) -> None:
        values = dataclasses.asdict(self)
        if self.dp is None:  # None: all ranks not used by TP and PP
            del values["dp"]
        check_fields("parallel.", values, PARALLEL_FIELDS)


_SECTIONS = {"parallel": ParallelSettings, "optimizer": OptimizerSettings}


@dataclasses.dataclass(frozen=True)
class JobConfig:
    model: Qwen2Config
    parallel: ParallelSettings = ParallelSettings()
    optimizer: OptimizerSettings = OptimizerSettings()

    def __post_init__(self) -> None:  # each section checked its own values when it was built
        for name, kind in (("model", Qwen2Config), *_SECTIONS.items()):
            if not isinstance(getattr(self, name), kind):
                raise ConfigError(
                    f"JobConfig.{name} must be a {kind.__name__}, got "
                    f"{type(getattr(self, name)).__name__}"
                )

    @classmethod
    def from_file(cls, path: str) -> "JobConfig":
        """A tp_ext YAML/JSON job file, or a Hugging Face config.json (default settings)."""
        path, data = read_mapping(path)
        try:
            if "model_type" in data or "architectures" in data:
                return cls(model=Qwen2Config.from_hf_dict(data))
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobConfig":
        check_unknown("", data, ["model", *_SECTIONS])
        if "model" not in data:
            raise ConfigError("missing field 'model'")
        sections = {name: _section(kind, name, data) for name, kind in _SECTIONS.items()}
        return cls(model=Qwen2Config.from_dict(data["model"]), **sections)

    def with_overrides(self, **flags) -> "JobConfig":
        """The config with command-line flags applied over its parallel and optimizer sections
        (``tp``, ``pp``, ``dp``, ``dtype``, ``seed``, ``lr``, ``weight_decay``, ``betas``);
        flags that are None are left as the file has them."""
        names = {
            section: {f.name for f in dataclasses.fields(kind)}
            for section, kind in _SECTIONS.items()
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
