"""Model, parallel and optimizer settings for Qwen-family models, from YAML, JSON or a Hugging Face
config.json, validated with errors that name the field.

tp_ext's own files (configs/*.yaml) have three sections::

    model:     {architecture: qwen2 | qwen, vocab_size, hidden_size, intermediate_size, ...}
    parallel:  {tp, pp, dp, dtype, seed}
    optimizer: {lr, weight_decay, betas}

Every model field is required and unknown fields are errors. A Hugging Face config.json (it has
``model_type``) is read by its own names; fields tp_ext does not use are ignored there.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import yaml

from tp_ext.sharding import HeadLayout

__all__ = ["Qwen2Config", "ParallelSettings", "OptimizerSettings", "ConfigError"]


class ConfigError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class ParallelSettings:
    tp: int = 1
    pp: int = 1
    dp: Optional[int] = None
    dtype: str = "float32"
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if value is None and name == "dp":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"parallel.{name} must be an int >= 1, got {value!r}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise ConfigError(f"parallel.seed must be an int, got {self.seed!r}")


@dataclasses.dataclass(frozen=True)
class OptimizerSettings:
    """AdamW, with Megatron's defaults for large models."""
    lr: float = 1.5e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)

    def __post_init__(self) -> None:
        if isinstance(self.lr, bool) or not isinstance(self.lr, (int, float)) or self.lr <= 0:
            raise ConfigError(f"optimizer.lr must be a number > 0, got {self.lr!r}")
        if isinstance(self.weight_decay, bool) or not isinstance(self.weight_decay, (int, float)) \
                or self.weight_decay < 0:
            raise ConfigError(f"optimizer.weight_decay must be a number >= 0, got "
                              f"{self.weight_decay!r}")
        betas = tuple(self.betas) if isinstance(self.betas, (list, tuple)) else None
        if betas is None or len(betas) != 2 or not all(
                isinstance(b, (int, float)) and 0 <= b < 1 for b in betas):
            raise ConfigError(f"optimizer.betas must be two numbers in [0, 1), got {self.betas!r}")


_DTYPES = ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """A Qwen2 / Qwen2.5 model, or the original Qwen (``architecture: qwen``: fused c_attn, no
    GQA; its config's ``intermediate_size`` counts w1 and w2 together, this one is per projection)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    rms_norm_eps: float
    tie_word_embeddings: bool = False
    architecture: str = "qwen2"
    parallel: ParallelSettings = ParallelSettings()
    optimizer: OptimizerSettings = OptimizerSettings()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} must be an int >= 1, got {value!r}")
        if self.architecture not in ("qwen2", "qwen"):
            raise ConfigError(f"model.architecture must be 'qwen2' or 'qwen', got "
                              f"{self.architecture!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(f"model.hidden_size={self.hidden_size} is not divisible by "
                              f"model.num_attention_heads={self.num_attention_heads}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"model.num_attention_heads={self.num_attention_heads} is not a "
                              f"multiple of model.num_key_value_heads={self.num_key_value_heads}")
        if self.parallel.dtype not in _DTYPES:
            raise ConfigError(f"parallel.dtype must be one of {_DTYPES}, got "
                              f"{self.parallel.dtype!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def valid_tp_sizes(self, limit: int = 64) -> list[int]:
        """TP degrees the heads can be split over (whole heads, KV heads replicated if needed)."""
        result = []
        for tp in range(1, limit + 1):
            try:
                HeadLayout(self.num_attention_heads, self.num_key_value_heads, tp)
            except ValueError:
                continue
            result.append(tp)
        return result

    def check_tp(self, tp: int) -> None:
        if tp not in self.valid_tp_sizes(max(tp, 1)):
            raise ConfigError(
                f"tp={tp} cannot split {self.num_attention_heads} attention heads / "
                f"{self.num_key_value_heads} KV heads; use one of {self.valid_tp_sizes()}")

    def replace(self, **changes) -> "Qwen2Config":
        return dataclasses.replace(self, **changes)

    def with_overrides(self, **flags) -> "Qwen2Config":
        """The config with command-line flags applied over its parallel and optimizer sections
        (``tp``, ``pp``, ``dp``, ``dtype``, ``seed``, ``lr``, ``weight_decay``, ``betas``);
        flags that are None are left as the file has them."""
        sections = {"parallel": {f.name for f in dataclasses.fields(ParallelSettings)},
                    "optimizer": {f.name for f in dataclasses.fields(OptimizerSettings)}}
        unknown = sorted(set(flags) - set().union(*sections.values()))
        if unknown:
            raise ConfigError(f"unknown override {unknown[0]!r}; known: "
                              f"{sorted(set().union(*sections.values()))}")
        changes = {}
        for section, names in sections.items():
            values = {k: v for k, v in flags.items() if k in names and v is not None}
            if values:
                if "betas" in values:
                    values["betas"] = tuple(values["betas"])
                changes[section] = dataclasses.replace(getattr(self, section), **values)
        return self.replace(**changes)

    def tiny(self) -> "Qwen2Config":
        """A CPU-sized model of the same family (architecture, biases, GQA or not, RoPE theta,
        eps, tying): 8 query heads, 2 KV heads under GQA, a vocabulary of 1001 (not divisible by
        8) and an MLP of 44 (uneven at TP 3 and 8); parallel and optimizer settings kept."""
        gqa = self.num_key_value_heads < self.num_attention_heads
        return self.replace(vocab_size=1001, hidden_size=64, intermediate_size=44,
                            num_hidden_layers=2, num_attention_heads=8,
                            num_key_value_heads=2 if gqa else 8,
                            max_position_embeddings=min(self.max_position_embeddings, 256))

    # -- files ----------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str) -> "Qwen2Config":
        """Read ``path``: tp_ext YAML/JSON (model/parallel/optimizer sections) or a Hugging Face
        config.json (or a directory holding one)."""
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.isfile(path):
            raise ConfigError(f"config file {path!r} does not exist")
        with open(path) as f:
            text = f.read()
        try:
            data = (json.loads(text) if path.endswith(".json") else yaml.safe_load(text))
        except (json.JSONDecodeError, yaml.YAMLError) as e:
            raise ConfigError(f"{path}: not valid {'JSON' if path.endswith('.json') else 'YAML'}: "
                              f"{e}") from e
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping at the top level")
        try:
            if "model_type" in data or "architectures" in data:
                return cls.from_hf_dict(data)
            return cls.from_dict(data)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Qwen2Config":
        unknown = sorted(set(data) - {"model", "parallel", "optimizer"})
        if unknown:
            raise ConfigError(f"unknown top-level field(s) {unknown}; expected model, parallel, "
                              "optimizer")
        if "model" not in data:
            raise ConfigError("missing field 'model'")
        model = dict(data["model"] or {})
        fields = {f.name for f in dataclasses.fields(cls)} - {"parallel", "optimizer"}
        unknown = sorted(set(model) - fields)
        if unknown:
            raise ConfigError(f"unknown field(s) model.{unknown[0]}"
                              f"{' (and ' + ', '.join(unknown[1:]) + ')' if unknown[1:] else ''}; "
                              f"known fields: {sorted(fields)}")
        required = [f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in model]
        if missing:
            raise ConfigError(f"missing field model.{missing[0]}"
                              f"{' (also ' + ', '.join(missing[1:]) + ')' if missing[1:] else ''}")
        return cls(**model, parallel=_section(ParallelSettings, "parallel", data),
                   optimizer=_section(OptimizerSettings, "optimizer", data))

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "Qwen2Config":
        architectures = data.get("architectures") or []
        if data.get("model_type") == "qwen" or "QWenLMHeadModel" in architectures:
            names = {"vocab_size": "vocab_size", "hidden_size": "hidden_size",
                     "num_hidden_layers": "num_hidden_layers",
                     "num_attention_heads": "num_attention_heads",
                     "max_position_embeddings": "max_position_embeddings",
                     "rope_theta": "rotary_emb_base", "rms_norm_eps": "layer_norm_epsilon"}
            values = _pick(data, names)
            _require(data, "intermediate_size")
            values.update(intermediate_size=data["intermediate_size"] // 2,
                          num_key_value_heads=values["num_attention_heads"],
                          tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                          architecture="qwen")
            return cls(**values)
        names = {n: n for n in ("vocab_size", "hidden_size", "intermediate_size",
                                "num_hidden_layers", "num_attention_heads",
                                "max_position_embeddings", "rms_norm_eps")}
        values = _pick(data, names)
        rope = data.get("rope_theta", (data.get("rope_parameters") or {}).get("rope_theta"))
        if rope is None:
            raise ConfigError("missing field rope_theta")
        values.update(rope_theta=float(rope),
                      num_key_value_heads=data.get("num_key_value_heads",
                                                   values["num_attention_heads"]),
                      tie_word_embeddings=bool(data.get("tie_word_embeddings", False)))
        return cls(**values)


def _require(data, name):
    if name not in data:
        raise ConfigError(f"missing field {name}")


def _pick(data: dict, names: dict[str, str]) -> dict:
    values = {}
    for ours, theirs in names.items():
        _require(data, theirs)
        values[ours] = data[theirs]
    return values


def _section(kind, name: str, data: dict):
    section = dict(data.get(name) or {})
    fields = {f.name for f in dataclasses.fields(kind)}
    unknown = sorted(set(section) - fields)
    if unknown:
        raise ConfigError(f"unknown field {name}.{unknown[0]}; known fields: {sorted(fields)}")
    if "betas" in section:
        section["betas"] = tuple(section["betas"])
    return kind(**section)
