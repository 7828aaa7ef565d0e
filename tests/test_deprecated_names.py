"""Renamed public names keep working for one release, with a DeprecationWarning that names the new
one (issue 34's words: a group, a stage split, a checkpoint map)."""

import importlib

import pytest
import torch

from tp_ext.checkpoint.layout import Piece, model_checkpoint_map
from tp_ext.distributed import ResolvedGroup
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM
from tp_ext.sharding import StageSplit


@pytest.mark.parametrize(
    "module, old, new",
    [
        ("tp_ext.distributed", "TPGroup", ResolvedGroup),
        ("tp_ext.distributed.groups", "TPGroup", ResolvedGroup),
        ("tp_ext.comm", "TPGroup", ResolvedGroup),
        ("tp_ext.layers", "TPGroup", ResolvedGroup),
        ("tp_ext.sharding", "StageLayout", StageSplit),
    ],
)
def test_old_names_warn_and_are_the_new_objects(module, old, new):
    with pytest.warns(DeprecationWarning, match=f"{old} is deprecated: use .*{new.__name__}"):
        value = getattr(importlib.import_module(module), old)
    assert value is new
    with pytest.raises(AttributeError, match="no attribute 'NoSuchName'"):
        importlib.import_module(module).NoSuchName


def _tiny() -> Qwen2Config:
    return Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, rms_norm_eps=1e-6,
    )  # fmt: skip


def test_a_models_old_method_and_attribute_names_warn():
    model = Qwen2ForCausalLM(_tiny(), device="meta")
    with pytest.warns(DeprecationWarning, match="use checkpoint_map"):
        old = model.checkpoint_layout()
    assert old == model.checkpoint_map()
    with pytest.warns(DeprecationWarning, match="use stage_split"):
        assert model.stage_layout is model.stage_split


def test_a_model_that_declares_only_checkpoint_layout_is_still_read():
    class OldStyle(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(3, 2))

        def checkpoint_layout(self, fmt=None):
            return {"w": [Piece("weight", 0, 3)]}

    with pytest.warns(DeprecationWarning, match="name the method checkpoint_map"):
        assert model_checkpoint_map(OldStyle()) == {"w": [Piece("weight", 0, 3)]}
