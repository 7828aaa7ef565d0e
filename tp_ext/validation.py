"""Reading and checking configuration values, for every config tp_ext has (model configs, the job
config, optimizer settings). The bottom layer: it imports nothing of tp_ext.

Errors name the field, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Optional

import yaml

__all__ = [
    "ConfigError",
    "Field",
    "check_fields",
    "read_mapping",
    "check_unknown",
    "is_number",
    "check_int",
    "as_torch_dtype",
    "check_dtype_name",
    "dtype_bytes",
    "ArgumentError",
    "DTYPE_NAMES",
    "DTYPE_BYTES",
    "SAFETENSORS_DTYPE_NAMES",
]


class ConfigError(ValueError):
    """A configuration value that is missing, of the wrong type or out of range."""


class ArgumentError(ConfigError):
    """A value that does not fit, raised where the value came from one named argument (``tp``,
    ``pipeline_split``, ``dtype``, ...): ``argument`` names it, so a command line can name its
    flag (``--pipeline-split``) and a config loader its field."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument

    def __reduce__(self):  # pickles (an error raised on a spawned rank) with its argument
        return type(self), (self.argument, str(self))


def read_mapping(path: str) -> tuple[str, dict[str, Any]]:
    """``(path, mapping)`` from a YAML or JSON file (``path`` may be a directory holding
    config.json). YAML goes through ``yaml.safe_load``: no Python objects are built."""
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"config file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:  # unreadable, or not text: name the file
        raise ConfigError(f"config file {path!r} cannot be read as UTF-8 text: {e}") from None
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


# The one dtype-name map: the names a config's parallel.dtype and --dtype take (also accepted
# where a model takes dtype=), each with its bytes per element.
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
DTYPE_NAMES = tuple(DTYPE_BYTES)
# a job's parameters when its config names no parallel.dtype (tp_ext.config, tp_ext.planner)
JOB_DEFAULT_DTYPE = "float32"
# safetensors' header codes of those dtypes
SAFETENSORS_DTYPE_NAMES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


def check_dtype_name(value, arg: str = "dtype") -> str:
    """``value`` if it is a name from DTYPE_NAMES; else a ValueError naming ``arg``."""
    if isinstance(value, str) and value in DTYPE_BYTES:
        return value
    raise ValueError(f"{arg} must be one of {sorted(DTYPE_BYTES)}, got {value!r}")


def dtype_bytes(name: str, arg: str = "dtype") -> int:
    """Bytes per element of dtype ``name`` (a name from DTYPE_NAMES)."""
    return DTYPE_BYTES[check_dtype_name(name, arg)]


def as_torch_dtype(value, arg: str = "dtype"):
    """``value`` as a torch.dtype: None stays None; a name from DTYPE_NAMES (as in a config, or
    transformers' ``torch_dtype``) is looked up; anything else is refused naming ``arg``."""
    import torch  # here, not at the top: reading a config needs no torch

    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str) and value in DTYPE_NAMES:
        return getattr(torch, value)
    raise TypeError(
        f"{arg}={value!r} is not a dtype: pass a torch.dtype (torch.bfloat16) or one of "
        f"{', '.join(DTYPE_NAMES)}"
    )


def check_int(name: str, value, low: int = 1, high: Optional[int] = None, why: str = "") -> int:
    """``value`` if it is an int (not a bool) in [low, high] (high None: no upper bound); else a
    ValueError naming ``name``, the value and the range (``why``: what the value is, said in
    parentheses after the range). The one int check of tp_ext's arguments."""
    note = f" ({why})" if why else ""
    if isinstance(value, int) and not isinstance(value, bool):
        if value >= low and (high is None or value <= high):
            return value
        if value >= low:
            raise ValueError(f"{name} must be an int in [{low}, {high:,}]{note}, got {value!r}")
    raise ValueError(f"{name} must be an int >= {low}{note}, got {value!r}")


def is_number(x) -> bool:
    """An int or float, not a bool (True is an int to Python, never a learning rate)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class Field:
    """The rule for one config value: its kind and, for numbers, its range.

    ``kind``: "int" (a whole number, not a bool, not a float such as 2.0 or a string "2"),
    "float" (an int or float, finite), "bool" (true or false only: the string "false" would be
    truthy), "choice" (one of ``choices``), "betas" (two floats in [0, 1)). ``low``/``high``
    bound numbers; ``low_open``/``high_open`` exclude the bound itself. ``why`` says where an
    upper bound comes from; it is part of the message. ``help`` says what the value does: the
    command-line flag that sets it shows it (tp_ext.cli.flags makes the flags from these)."""

    kind: str
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple = ()
    why: str = ""
    help: str = dataclasses.field(default="", compare=False)

    def allowed(self) -> str:
        """What is allowed, in words: the second half of every error message."""
        if self.kind == "bool":
            return "true or false"
        if self.kind == "choice":
            return f"one of {', '.join(map(str, self.choices))}"
        if self.kind == "betas":
            return "two numbers in [0, 1), e.g. [0.9, 0.95]"
        noun = "an integer" if self.kind == "int" else "a finite number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"{noun} in {left}{_num(self.low)}, {_num(self.high)}{right}"
        elif self.low is not None:
            text = f"{noun} {'>' if self.low_open else '>='} {_num(self.low)}"
        else:
            text = noun
        return text + (f" ({self.why})" if self.why else "")

    def ok(self, value) -> bool:
        if self.kind == "bool":
            return isinstance(value, bool)
        if self.kind == "choice":
            return isinstance(value, str) and value in self.choices
        if self.kind == "betas":
            beta = Field("float", 0, 1, high_open=True)
            return isinstance(value, (list, tuple)) and len(value) == 2 and all(map(beta.ok, value))
        if self.kind == "int" and (isinstance(value, bool) or not isinstance(value, int)):
            return False
        if not is_number(value) or not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        if self.high is not None and (value >= self.high if self.high_open else value > self.high):
            return False
        return True


def _num(x) -> str:
    return f"{x:,}" if isinstance(x, int) else f"{x:g}"


def check_fields(section: str, values: dict[str, Any], table: dict[str, Field]) -> None:
    """Check every value of ``values`` named in ``table`` (None is a bad value too; callers leave
    optional fields that are None out of ``values``). The error names ``section`` + the field,
    the value (and its type, when the type is wrong) and what is allowed."""
    for name, rule in table.items():
        if name not in values or rule.ok(values[name]):
            continue
        value = values[name]
        shown = repr(value)
        wrong_type = not is_number(value) and not isinstance(value, (list, tuple))
        if wrong_type or (rule.kind == "int" and isinstance(value, float)):
            shown += f" ({type(value).__name__})"
        raise ConfigError(f"{section}{name} must be {rule.allowed()}, got {shown}")
