"""tp_ext.parallelize's styles as classes (tp_ext.parallelize.Colwise(), ...): a plan written with
instances gives exactly the model the string plan gives (state dict and logits, bit for bit), each
option does what it says (compared with the unsharded module), and what is not a style is refused
naming the module, the value and what would work."""

import copy

import pytest
import torch
from torch import nn

import tp_ext
from tp_ext.layers import ParallelLMHead
from tp_ext.parallelize import (
    ALIASES,
    STYLES,
    Colwise,
    ParallelStyle,
    Replicate,
    Rowwise,
    SequenceParallel,
    StyleTarget,
    VocabParallel,
)

from .dist_utils import rank, run_distributed, world_size
from .test_layers import assert_rel
from .test_parallelize import _tiny_qwen2

_STRING_PLAN = {
    "model.embed_tokens": "vocab",
    "model.layers.*.input_layernorm": "sequence_parallel",
    "model.layers.*.post_attention_layernorm": "sequence_parallel",
    "model.norm": "sequence_parallel",
    "model.layers.*.self_attn.[qkv]_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "vocab",
}

# The same plan with instances, their options spelled out at their defaults (one entry left a
# string: a plan may mix them).
_CLASS_PLAN = {
    "model.embed_tokens": VocabParallel(gather_output=True),
    "model.layers.*.input_layernorm": SequenceParallel(gather_output=True),
    "model.layers.*.post_attention_layernorm": SequenceParallel(),
    "model.norm": SequenceParallel(),
    "model.layers.*.self_attn.[qkv]_proj": Colwise(parts=None, gather_output=False),
    "model.layers.*.self_attn.o_proj": Rowwise(input_is_parallel=True),
    "model.layers.*.mlp.gate_proj": Colwise(),
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": Rowwise(),
    "lm_head": VocabParallel(),
}


def _check_class_plan_matches_string_plan():
    reference = _tiny_qwen2()
    by_name, report = tp_ext.parallelize(copy.deepcopy(reference), _STRING_PLAN, return_report=True)
    by_class, class_report = tp_ext.parallelize(
        copy.deepcopy(reference), _CLASS_PLAN, return_report=True
    )
    assert class_report == report
    assert isinstance(by_class.lm_head, ParallelLMHead)
    expected, got = by_name.state_dict(), by_class.state_dict()
    assert list(got) == list(expected)
    for key, value in expected.items():
        assert torch.equal(got[key], value), key
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        logits = by_class(ids).logits
        assert torch.equal(logits, by_name(ids).logits)
        assert_rel(logits, reference(ids).logits, "logits of the class plan")
    return rank()


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_class_plan_gives_the_string_plans_model(ws):
    assert run_distributed(_check_class_plan_matches_string_plan, ws) == list(range(ws))


class _FusedMLP(nn.Module):
    """[gate | up] in one linear, the forward cutting its output in halves (whatever its width:
    the local halves after the split)."""

    def __init__(self, hidden=8, inter=10):
        super().__init__()
        self.fused = nn.Linear(hidden, 2 * inter)
        self.down = nn.Linear(inter, hidden)

    def forward(self, x):
        gate, up = self.fused(x).chunk(2, dim=-1)
        return self.down(nn.functional.silu(gate) * up)


def _check_options():
    # Rowwise(input_is_parallel=False) slices a whole input itself; Colwise(gather_output=True)
    # hands the next module its whole output.
    torch.manual_seed(0)
    reference = nn.Sequential(
        nn.Linear(8, 10), nn.ReLU(), nn.Linear(10, 12), nn.GELU(), nn.Linear(12, 6), nn.Linear(6, 7)
    )
    plan = {
        "0": Rowwise(input_is_parallel=False),
        "2": Colwise(),
        "4": Rowwise(),
        "5": Colwise(gather_output=True),
    }
    model, report = tp_ext.parallelize(copy.deepcopy(reference), plan, return_report=True)
    assert report["5"].endswith("output gathered"), report["5"]
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, ref_out = model(x_tp), reference(x_ref)
    assert_rel(out, ref_out, "output with input_is_parallel=False and gather_output=True")
    out.square().sum().backward()
    ref_out.square().sum().backward()
    assert_rel(x_tp.grad, x_ref.grad, "input gradient")

    # Colwise(parts=...): each part of a fused column split on its own.
    torch.manual_seed(0)
    reference = _FusedMLP()
    model = tp_ext.parallelize(
        copy.deepcopy(reference), {"fused": Colwise(parts=[10, 10]), "down": Rowwise()}
    )
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert_rel(model(x), reference(x), "fused [gate | up] split part by part")

    # VocabParallel(gather_output=False): each rank keeps its slice of the vocabulary.
    reference = _tiny_qwen2()
    plan = {"model.embed_tokens": "vocab", "lm_head": VocabParallel(gather_output=False)}
    model = tp_ext.parallelize(copy.deepcopy(reference), plan)
    ids = torch.randint(0, 1001, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        local, full = model(ids).logits, reference(ids).logits
    assert_rel(local, model.lm_head.partition.local(full, -1, rank()), "this rank's logits")
    return rank()


@pytest.mark.parametrize("ws", [1, 2, 3])
def test_style_options_match_the_unsharded_module(ws):
    assert run_distributed(_check_options, ws) == list(range(ws))


class _Freeze(ParallelStyle):
    """A user's own style: leaves the module whole with its parameters frozen."""

    name = "freeze"
    shards_weights = False

    def apply(self, module, target: StyleTarget):
        module.requires_grad_(False)
        return module, f"frozen on {target.tp.size} ranks"


def _check_bad_styles_and_own_styles():
    reference = _tiny_qwen2()
    aliases = "'colwise', 'rowwise', 'vocab'"
    for value, hint in (
        ("Colwise", "aliases are lower case: 'colwise'"),
        (Colwise, "a class: write Colwise() for an instance"),
        (3, ""),
        (nn.Linear, ""),
    ):
        with pytest.raises(ValueError) as error:
            tp_ext.parallelize(copy.deepcopy(reference), {"lm_*": value})
        message = str(error.value)
        for part in ("plan['lm_*'] (for module lm_head)", repr(value), "is not a style", aliases):
            assert part in message, (part, message)
        assert "Colwise(), Rowwise(), VocabParallel()" in message, message
        assert hint in message, message
    with pytest.raises(ValueError, match=r"gather_output=False\) is for LM heads"):
        tp_ext.parallelize(
            copy.deepcopy(reference), {"model.embed_tokens": VocabParallel(gather_output=False)}
        )
    for bad in (Colwise(gather_output=True), Colwise(parts=[8, 8])):
        with pytest.raises(ValueError, match=r"q_proj: Colwise\(.*\) on an attention projection"):
            tp_ext.parallelize(copy.deepcopy(reference), {"*.q_proj": bad})
    with pytest.raises(ValueError, match=r"up_proj: Colwise\(parts=\[5, 5\]\) sums to 10, but"):
        tp_ext.parallelize(copy.deepcopy(reference), {"*.up_proj": Colwise(parts=[5, 5])})

    model, report = tp_ext.parallelize(
        copy.deepcopy(reference),
        {"model.norm": _Freeze(), "lm_head": Replicate()},
        return_report=True,
    )
    assert report["model.norm"] == f"freeze: frozen on {world_size()} ranks"
    assert report["lm_head"] == "replicate: unchanged"
    assert not model.model.norm.weight.requires_grad and model.lm_head.weight.requires_grad

    return rank()


@pytest.mark.parametrize("ws", [1, 2])
def test_bad_styles_are_refused_and_own_styles_apply(ws):
    assert run_distributed(_check_bad_styles_and_own_styles, ws) == list(range(ws))


def test_aliases_are_default_instances_and_options_are_checked():
    assert STYLES == tuple(ALIASES)
    assert ALIASES["colwise"] == Colwise() and ALIASES["replicate"] == Replicate()
    assert ALIASES["sequence_parallel_local"] == SequenceParallel(gather_output=False)
    assert ALIASES["sequence_parallel_local"].name == "sequence_parallel_local"
    assert {name: style.name for name, style in ALIASES.items()} == {n: n for n in ALIASES}
    assert Colwise(parts=[6, 14]).parts == (6, 14)
    with pytest.raises(ValueError, match=r"Colwise\(parts=\.\.\.\) must be a list .* got '10,10'"):
        Colwise(parts="10,10")
    with pytest.raises(
        ValueError, match=r"Colwise\(parts=\.\.\.\)\[1\] must be an int >= 1, got 0"
    ):
        Colwise(parts=[4, 0])
    with pytest.raises(ValueError, match=r"Rowwise\(input_is_parallel=\.\.\.\) must be True or"):
        Rowwise(input_is_parallel="yes")
    with pytest.raises(ValueError, match=r"VocabParallel\(gather_output=\.\.\.\) must be True or"):
        VocabParallel(gather_output=1)
    with pytest.raises(TypeError):
        ParallelStyle()  # abstract: a style says how it applies itself
