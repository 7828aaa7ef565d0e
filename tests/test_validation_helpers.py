"""validation's one int check and one dtype-name map, as the modules that had their own copies
(sharding, data, compression, the planner, the footprint, safetensors_io) now use them."""

from __future__ import annotations

import os
import pickle

import pytest
import torch

from tp_ext.sharding import HeadLayout, StageSplit, shard_sizes
from tp_ext.validation import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    SAFETENSORS_DTYPE_NAMES,
    ArgumentError,
    ConfigError,
    as_torch_dtype,
    check_dtype_name,
    dtype_bytes,
)


def test_one_dtype_map_names_torch_dtypes_and_their_bytes():
    assert DTYPE_NAMES == ("float32", "bfloat16", "float16", "float64") == tuple(DTYPE_BYTES)
    for name in DTYPE_NAMES:
        assert as_torch_dtype(name).itemsize == DTYPE_BYTES[name] == dtype_bytes(name)
        assert check_dtype_name(name) == name
    assert set(SAFETENSORS_DTYPE_NAMES.values()) == set(DTYPE_NAMES)
    with pytest.raises(ValueError, match=r"dtype must be one of \['bfloat16', 'float16', "):
        check_dtype_name("fp8")
    with pytest.raises(ValueError, match=r"parallel.dtype must be one of .*, got None"):
        dtype_bytes(None, "parallel.dtype")


def test_argument_error_names_its_argument_and_pickles():
    e = ArgumentError("pipeline_split", "pipeline_split must be ...")
    assert isinstance(e, ConfigError) and isinstance(e, ValueError)
    copy = pickle.loads(pickle.dumps(e))
    assert type(copy) is ArgumentError and (copy.argument, str(copy)) == (e.argument, str(e))


def test_safetensors_checkpoint_dtype_reads_the_one_map(tmp_path):
    from safetensors.torch import save_file

    from tp_ext.checkpoint.safetensors_io import checkpoint_dtype

    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        folder = tmp_path / str(dtype).replace(".", "_")
        folder.mkdir()
        ints = torch.zeros(2, dtype=torch.int64)  # not a float: skipped
        save_file({"a": ints, "b": torch.zeros(2, dtype=dtype)},
                  os.path.join(folder, "model.safetensors"))  # fmt: skip
        assert checkpoint_dtype(str(folder)) is dtype


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: shard_sizes(-1, 2), "n must be an int >= 0, got -1"),
        (lambda: StageSplit(4, pp=True), "pp must be an int >= 1, got True"),
        (lambda: HeadLayout(8, 0, 2), "num_kv_heads must be an int >= 1, got 0"),
    ],
)
def test_sharding_checks_read_as_before(call, message):
    with pytest.raises(ValueError, match=message):
        call()
