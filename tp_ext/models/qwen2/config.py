"""The Qwen2 / Qwen2.5 (and original Qwen) model config: architecture only. Read from a tp_ext
YAML/JSON file (its ``model:`` section; the job's other sections are
:class:`tp_ext.config.JobConfig`'s) or a Hugging Face config.json, validated with errors that
name the field.

Every model field is required and unknown fields are errors. A Hugging Face config.json (it has
``model_type``) is read by its own names; fields tp_ext does not use are ignored there.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tp_ext.sharding import HeadLayout
from tp_ext.validation import ConfigError, check_unknown, read_mapping

__all__ = ["Qwen2Config"]


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """A Qwen2 / Qwen2.5 model, or the original Qwen (``architecture: qwen``: fused c_attn, no
    GQA; its config's ``intermediate_size`` counts w1 and w2 together, this one is per
    projection)."""

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

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model.{name} must be an int >= 1, got {value!r}")
        if self.architecture not in ("qwen2", "qwen"):
            raise ConfigError(
                f"model.architecture must be 'qwen2' or 'qwen', got {self.architecture!r}"
            )
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={self.num_attention_heads}"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"model.num_attention_heads={self.num_attention_heads} is not a "
                f"multiple of model.num_key_value_heads={self.num_key_value_heads}"
            )

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
                f"{self.num_key_value_heads} KV heads; use one of {self.valid_tp_sizes()}"
            )

    def replace(self, **changes) -> "Qwen2Config":
        return dataclasses.replace(self, **changes)

    def tiny(self) -> "Qwen2Config":
        """A CPU-sized model of the same family (architecture, biases, GQA or not, RoPE theta,
        eps, tying): 8 query heads, 2 KV heads under GQA, a vocabulary of 1001 (not divisible by
        8) and an MLP of 44 (uneven at TP 3 and 8)."""
        gqa = self.num_key_value_heads < self.num_attention_heads
        return self.replace(
            vocab_size=1001,
            hidden_size=64,
            intermediate_size=44,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2 if gqa else 8,
            max_position_embeddings=min(self.max_position_embeddings, 256),
        )

    # -- files ----------------------------------------------------------------------------------

    @classmethod
    def from_file(cls, path: str) -> "Qwen2Config":
        """Read ``path``: a tp_ext YAML/JSON file (its ``model`` section) or a Hugging Face
        config.json (or a directory holding one)."""
        path, data = read_mapping(path)
        try:
            if "model_type" in data or "architectures" in data:
                return cls.from_hf_dict(data)
            if "model" not in data:
                raise ConfigError("missing field 'model'")
            return cls.from_dict(data["model"])
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    @classmethod
    def from_dict(cls, model: dict[str, Any]) -> "Qwen2Config":
        """From the fields of a ``model:`` section (tp_ext's names)."""
        if not isinstance(model, dict):
            raise ConfigError(f"model must be a mapping of fields, got {type(model).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        check_unknown("model.", model, fields)
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        missing = [name for name in required if name not in model]
        if missing:
            raise ConfigError(
                f"missing field model.{missing[0]}"
                f"{' (also ' + ', '.join(missing[1:]) + ')' if missing[1:] else ''}"
            )
        return cls(**model)

    @classmethod
    def from_hf_dict(cls, data: dict[str, Any]) -> "Qwen2Config":
        architectures = data.get("architectures") or []
        if data.get("model_type") == "qwen" or "QWenLMHeadModel" in architectures:
            names = {
                "vocab_size": "vocab_size",
                "hidden_size": "hidden_size",
                "num_hidden_layers": "num_hidden_layers",
                "num_attention_heads": "num_attention_heads",
                "max_position_embeddings": "max_position_embeddings",
                "rope_theta": "rotary_emb_base",
                "rms_norm_eps": "layer_norm_epsilon",
            }
            values = _pick(data, names)
            _require(data, "intermediate_size")
            values.update(
                intermediate_size=data["intermediate_size"] // 2,
                num_key_value_heads=values["num_attention_heads"],
                tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
                architecture="qwen",
            )
            return cls(**values)
        names = {
            n: n
            for n in (
                "vocab_size",
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "max_position_embeddings",
                "rms_norm_eps",
            )
        }
        values = _pick(data, names)
        rope = data.get("rope_theta", (data.get("rope_parameters") or {}).get("rope_theta"))
        if rope is None:
            raise ConfigError("missing field rope_theta")
        values.update(
            rope_theta=float(rope),
            num_key_value_heads=data.get("num_key_value_heads", values["num_attention_heads"]),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", False)),
        )
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
