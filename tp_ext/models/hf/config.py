"""A Hugging Face model config read from a ``config.json`` or a checkpoint directory, for the
architectures ``parallelize(model, "auto")`` converts (Llama, Mistral, Qwen2/3, Gemma, Phi-3,
GPT-2, OPT, Mixtral, ...): nothing but the config is read."""

from __future__ import annotations

import json
import os
from typing import Any, Optional

from tp_ext.sharding import HeadLayout
from tp_ext.validation import ConfigError

__all__ = [
    "load_hf_config",
    "is_hf_config_dict",
    "hf_config_from_dict",
    "max_positions",
    "tp_problem",
]


def tp_problem(config, tp: int) -> Optional[str]:
    """Why ``tp`` ranks do not fit the model of ``config`` (None when they do): its attention
    heads split in whole heads (KV heads shared by ranks where fewer), and every rank holds at
    least one vocabulary row."""
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    if isinstance(heads, int):
        try:
            HeadLayout(heads, kv, tp)
        except ValueError as e:
            return str(e)
    if tp > config.vocab_size:
        return f"tp={tp} is more ranks than vocabulary rows ({config.vocab_size})"
    return None


def max_positions(config) -> int:
    """The longest sequence a transformers config allows (GPT-2 calls it n_positions; a model
    with neither field, such as an ALiBi one, has no bound of its own)."""
    return (
        getattr(config, "max_position_embeddings", None)
        or getattr(config, "n_positions", None)
        or 2**31
    )


def is_hf_config_dict(data: Any) -> bool:
    """A Hugging Face config (it names its ``model_type``), not a tp_ext job file."""
    return isinstance(data, dict) and isinstance(data.get("model_type"), str)


def _config_file(path: str) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        inner = os.path.join(path, "config.json")
        if not os.path.isfile(inner):
            raise ConfigError(
                f"{path}: a model directory needs a config.json (a transformers checkpoint "
                "directory, as save_pretrained writes it); none there"
            )
        return inner
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: no such file or directory (give a config.json or a directory)")
    return path


def load_hf_config(path: str):
    """The transformers ``PretrainedConfig`` of ``path`` (a config.json, or a directory holding
    one); ConfigError naming the file when it is not a Hugging Face config transformers knows."""
    file = _config_file(path)
    try:
        with open(file, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{file}: not readable as JSON ({e})") from None
    if not is_hf_config_dict(data):
        raise ConfigError(
            f"{file}: not a Hugging Face model config (it has no 'model_type' field); give the "
            "config.json of a transformers checkpoint"
        )
    return hf_config_from_dict(data, file)


def hf_config_from_dict(data: dict, where: str = "config"):
    """The transformers config class of ``data['model_type']`` built from ``data``."""
    from transformers import CONFIG_MAPPING

    model_type = data["model_type"]
    try:  # one lookup: `in` would import every architecture's config module
        config_class = CONFIG_MAPPING[model_type]
    except KeyError:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not an architecture the installed "
            f"transformers knows"
        ) from None
    return config_class.from_dict({k: v for k, v in data.items() if k != "model_type"})
