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
from tp_ext.validation import ConfigError, Field, check_fields, check_unknown, read_mapping

__all__ = ["Qwen2Config", "MODEL_FIELDS"]


def _size(high: int, why: str) -> Field:
    return Field("int", 1, high, why=why)


# Every model field's rule. Upper bounds are far above any published model (Qwen2-72B: vocab
# 152,064, hidden 8,192, MLP 29,568, 80 layers, 64 heads; Llama-3.1-405B: hidden 16,384, MLP
# 53,248, 126 layers, 128 heads; the largest vocabularies are ~256k) and exist so a typo such as
# 1e8 layers fails at once instead of building modules for hours.
MODEL_FIELDS = {
    "vocab_size": _size(2**22, "16x the largest published vocabularies"),
    "hidden_size": _size(2**17, "8x the widest published models"),
    "intermediate_size": _size(2**20, "20x the widest published MLPs"),
    "num_hidden_layers": _size(512, "4x the deepest published models; a plan builds each"),
    "num_attention_heads": _size(4096, "32x published models"),
    "num_key_value_heads": _size(4096, "32x published models"),
    "max_position_embeddings": _size(2**24, "512x Qwen2-72B's 32,768 tokens"),
    "rope_theta": Field("float", 0, low_open=True),
    "rms_norm_eps": Field("float", 0, 1, low_open=True, high_open=True),
    "tie_word_embeddings": Field("bool"),
    "attention_dropout": Field("float", 0, 1, high_open=True),
    "architecture": Field("choice", choices=("qwen2", "qwen")),
    "initializer_range": Field("float", 0, 1, low_open=True),
}


@dataclasses.dataclass(frozen=True)
class Qwen2Config:
    """A Qwen2 / Qwen2.5 model, or the original Qwen (``architecture: qwen``: fused c_attn, no
    GQA; its config's ``intermediate_size`` counts w1 and w2 together, this one is per
    projection). Every field is checked on construction (:data:`MODEL_FIELDS`, then the rules
    between fields), so no path builds a model from a bad value."""

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
    attention_dropout: float = 0.0  # training only; generation and eval run without dropout
    architecture: str = "qwen2"
    # the std of the random initial weights of a model built from this config (transformers')
    initializer_range: float = 0.02

    def __post_init__(self) -> None:
        check_fields("model.", dataclasses.asdict(self), MODEL_FIELDS)
        heads, kv = self.num_attention_heads, self.num_key_value_heads
        if self.hidden_size % heads:
            raise ConfigError(
                f"model.hidden_size={self.hidden_size} is not divisible by "
                f"model.num_attention_heads={heads}"
            )
        if self.head_dim % 2:
            raise ConfigError(
                f"model.hidden_size / model.num_attention_heads = {self.head_dim} (the head "
                "size) must be even: rotary embedding turns pairs of values"
            )
        if heads % kv:
            raise ConfigError(
                f"model.num_attention_heads={heads} is not a multiple of "
                f"model.num_key_value_heads={kv}"
            )
        if self.architecture == "qwen" and kv != heads:
            raise ConfigError(
                f"model.architecture 'qwen' (the original Qwen) has no grouped-query attention: "
                f"model.num_key_value_heads must equal model.num_attention_heads={heads}, got {kv}"
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
        check_fields("", {"tp": tp}, {"tp": Field("int", 1)})
        try:  # the one direct check: listing sizes up to a huge tp would loop for long
            HeadLayout(self.num_attention_heads, self.num_key_value_heads, tp)
        except ValueError:
            raise ConfigError(
                f"tp={tp} cannot split {self.num_attention_heads} attention heads / "
                f"{self.num_key_value_heads} KV heads; use one of {self.valid_tp_sizes()}"
            ) from None

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
        """From a Hugging Face config.json's fields. Values are checked under the file's own
        names (no coercion: "2" is not 2, "false" is not a bool); a null optional field takes
        transformers' default; RoPE scaling, which this model does not implement, is refused."""
        architectures = data.get("architectures") or []
        model_type = data.get("model_type")
        if model_type not in (None, "qwen2", "qwen") or not isinstance(architectures, list):
            # e.g. llama or qwen2_moe: same field names, another model; read as Qwen2 it would
            # plan and build the wrong thing
            raise ConfigError(
                f"model_type {model_type!r} (architectures {architectures!r}) is not a model "
                "tp_ext implements natively; it reads Qwen2/Qwen2.5 ('qwen2') and the original "
                "Qwen ('qwen'). Other transformers architectures go through "
                "tp_ext.parallelize(model, 'auto') (`tp-ext plan --model PATH` counts them)"
            )
        original = model_type == "qwen" or "QWenLMHeadModel" in architectures
        names = dict(_HF_NAMES, **(_QWEN_NAMES if original else {}))
        values = {o: _required(data, t) for o, t in names.items() if o != "rope_theta"}
        if data.get("use_sliding_window"):
            raise ConfigError(
                "use_sliding_window is true; this model implements full attention only, so it "
                "would compute wrong logits past the window"
            )
        values["rope_theta"] = _rope_theta(data, names["rope_theta"])
        tie = data.get("tie_word_embeddings")
        values["tie_word_embeddings"] = False if tie is None else tie
        dropout = data.get("attention_dropout")
        values["attention_dropout"] = 0.0 if dropout is None else dropout
        init_range = data.get("initializer_range")
        values["initializer_range"] = 0.02 if init_range is None else init_range
        if not original:  # null: transformers' default, no grouped-query attention
            kv = data.get("num_key_value_heads")
            values["num_key_value_heads"] = values["num_attention_heads"] if kv is None else kv
        check_fields("", {names.get(k, k): v for k, v in values.items()}, _hf_table(names))
        if original:  # its intermediate_size counts w1 and w2 together
            if values["intermediate_size"] % 2:
                raise ConfigError(
                    f"intermediate_size must be even for the original Qwen (w1 and w2 together),"
                    f" got {values['intermediate_size']}"
                )
            values["intermediate_size"] //= 2
            values.update(num_key_value_heads=values["num_attention_heads"], architecture="qwen")
        return cls(**values)


# Our field -> its name in a Hugging Face Qwen2 config.json, and where the original Qwen differs.
_HF_NAMES = {
    n: n
    for n in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
    )
}
_QWEN_NAMES = {"rope_theta": "rotary_emb_base", "rms_norm_eps": "layer_norm_epsilon"}


def _hf_table(names: dict) -> dict:
    table = {theirs: MODEL_FIELDS[ours] for ours, theirs in names.items()}
    same_name = (
        "tie_word_embeddings",
        "num_key_value_heads",
        "attention_dropout",
        "initializer_range",
    )
    for name in same_name:
        table[name] = MODEL_FIELDS[name]
    return table


def _required(data: dict, name: str):
    if name not in data:
        raise ConfigError(f"missing field {name}")
    return data[name]


def _rope_theta(data: dict, name: str):
    """RoPE's base, from ``rope_theta`` or transformers 5's ``rope_parameters`` (one dict, or
    one per attention type); only plain RoPE is implemented, so scaling is an error, never
    silently ignored."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention", params)  # per attention type: Qwen2 has one
    if params is not None and not isinstance(params, dict):
        raise ConfigError(f"rope_parameters must be a mapping, got {params!r}")
    for key, scaling in (("rope_parameters", params), ("rope_scaling", data.get("rope_scaling"))):
        kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if kind not in ("default", None):
            raise ConfigError(
                f"{key} has rope_type {kind!r}; only plain RoPE (rope_type 'default') is "
                "implemented, so this checkpoint would compute wrong logits"
            )
    top, nested = data.get(name), (params or {}).get("rope_theta")
    if top is not None and nested is not None and top != nested:
        raise ConfigError(
            f"{name}={top!r} and rope_parameters.rope_theta={nested!r} disagree; give one"
        )
    if top is None and nested is None:
        raise ConfigError(f"missing field {name} (or rope_parameters.rope_theta)")
    return top if top is not None else nested
