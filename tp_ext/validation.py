"""Reading and checking configuration values, for every config tp_ext has (model configs, the job
config, optimizer settings). The bottom layer: it imports nothing of tp_ext.

Errors name the field, the value and what is allowed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

__all__ = ["ConfigError", "read_mapping", "check_unknown", "is_number"]


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range."""


def read_mapping(path: str) -> tuple[str, dict[str, Any]]:
    """``(path, mapping)`` from a YAML or JSON file (``path`` may be a directory holding
    config.json). YAML goes through ``yaml.safe_load``: no Python objects are built."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    with open(path) as f:
        text = f.read()
    is_json = path.endswith(".json")
    try:
        data = json.loads(text) if is_json else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: not valid {'JSON' if is_json else 'YAML'}: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return path, data


def check_unknown(section: str, given, known) -> None:
    """An error naming the first field of ``given`` that is not in ``known``."""
    unknown = sorted(set(given) - set(known))
    if unknown:
        more = f" (and {', '.join(unknown[1:])})" if unknown[1:] else ""
        raise ConfigError(
            f"unknown field {section}{unknown[0]}{more}; known fields: {sorted(known)}"
        )


def is_number(x) -> bool:
    """An int or float, not a bool (True is an int to Python, never a learning rate)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)
