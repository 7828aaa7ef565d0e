"""``tp-ext plan --model``: the footprint of any Hugging Face decoder parallelize("auto") converts,
from its config.json or checkpoint directory, counted on the meta device: the full model's
parameters equal transformers' model built on the meta device (Llama-3-70B 70,553,706,496,
Mixtral-8x7B 46,702,792,704), and each rank's equal what that rank holds after the real
conversion (``parallelize(model, "auto", parallel=state)`` over gloo) at world sizes 1 to 4,
with pipeline stages (a tied embedding's copy on the last), uneven TP and EP."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

import tp_ext
from tp_ext.cli import main
from tp_ext.models.hf import load_hf_config, meta_model
from tp_ext.models.hf.footprint import hf_pipeline_footprint

from .dist_utils import run_distributed
from .test_pipeline_hf import _hf_config

LLAMA_3_70B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=8192,
    rope_theta=500000.0,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)
MIXTRAL_8X7B = dict(
    model_type="mixtral",
    architectures=["MixtralForCausalLM"],
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=32000,
    max_position_embeddings=32768,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)


def _plan_json(capsys, *argv) -> dict:
    assert main(["plan", *map(str, argv), "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_llama_3_70b_counts_exactly(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_3_70B))
    fp = _plan_json(capsys, "--model", tmp_path, "--tp", 8)
    h, i, v, kv, layers = 8192, 28672, 128256, 1024, 80
    assert fp["parameters_total"] == 70_553_706_496
    assert fp["parameters_total"] == sum(
        p.numel() for p in meta_model(load_hf_config(tmp_path)).parameters()
    )
    # every width divides by 8: each rank an eighth of every matrix, the norms whole
    per_layer = (2 * h * h + 2 * kv * h + 3 * h * i) // 8 + 2 * h
    assert fp["max_rank_parameters"] == v * h // 8 * 2 + layers * per_layer + h
    assert {r["parameters"] for r in fp["ranks"]} == {fp["max_rank_parameters"]}
    assert fp["dtype"] == "bfloat16" and fp["max_rank_bytes"] == 2 * fp["max_rank_parameters"]
    assert fp["replicated"]["parameters"] == 7 * (2 * layers + 1) * h


def test_mixtral_8x7b_counts_exactly_with_ep(tmp_path, capsys):
    path = tmp_path / "mixtral.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    fp = _plan_json(capsys, "--model", path, "--tp", 2, "--dp", 4, "--ep", 4)
    assert fp["parameters_total"] == 46_702_792_704
    h, i, v, kv, layers, experts = 4096, 14336, 32000, 1024, 32, 8
    attention = (2 * h * h + 2 * kv * h) // 2
    expert_share = experts // 4 * 3 * h * i // 2  # 2 of 8 experts, halved over TP
    per_layer = attention + expert_share + experts * h + 2 * h  # router and norms whole
    assert fp["max_rank_parameters"] == 2 * v * h // 2 + layers * per_layer + h
    assert {(r["ep_rank"], r["tp_rank"]) for r in fp["ranks"]} == {
        (e, t) for e in range(4) for t in range(2)
    }
    # mesh (pp, dp, tp): DP index d is EP rank d % ep
    assert [r["global_ranks"] for r in fp["ranks"]] == [
        [d * 2 + t] for d in range(4) for t in (0, 1)
    ]


# --- each rank's count against what the real conversion leaves on it -----------------------


def _held(arch, tp, pp, dp, ep) -> tuple:
    state = tp_ext.init_parallel(tp=tp, pp=pp, dp=dp, ep=ep)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_hf_config(arch))
    converted = tp_ext.parallelize(model, "auto", parallel=state)
    held = sum(p.numel() for p in converted.parameters())
    ep_rank = state.ep_rank if ep > 1 else None
    return state.pp_rank, ep_rank, state.tp_rank, held


def _assert_ranks_match(arch, tp, pp, dp, ep):
    fp = hf_pipeline_footprint(_hf_config(arch), tp=tp, pp=pp, dp=dp, ep=ep, dtype="float32")
    expected = {
        (r["pp_rank"], r.get("ep_rank"), r["tp_rank"]): r["parameters"] for r in fp["ranks"]
    }
    measured = run_distributed(_held, tp * pp * dp, arch, tp, pp, dp, ep)
    assert {key[:3]: key[3] for key in measured} == {
        key: expected[key] for key in {m[:3] for m in measured}
    }
    assert len({m[:3] for m in measured}) == len(expected)
    assert fp["parameters_total"] == sum(
        p.numel()
        for p in transformers.AutoModelForCausalLM.from_config(_hf_config(arch)).parameters()
    )


# (arch, (tp, pp, dp, ep)): make test covers 2 to 4 ranks (1 rank: the 70B and 8x7B tests
# above), uneven TP (6 heads, 2 KV heads, a vocabulary of 101 over 3), stages with a tied head,
# EP; test-all the rest of the matrix
SUBSET = [
    ("gpt2", (1, 2, 1, 1)),  # tied: the last stage's own copy
    ("gemma2", (3, 1, 1, 1)),
    ("llama", (2, 2, 1, 1)),
    ("mixtral", (1, 1, 2, 2)),
]
FULL = [
    ("llama", (1, 1, 1, 1)),
    ("qwen3", (2, 2, 1, 1)),
    ("gpt2", (2, 2, 1, 1)),
    ("opt", (2, 2, 1, 1)),
    ("mixtral", (2, 1, 2, 2)),
    ("mixtral", (2, 2, 1, 1)),
    ("llama", (4, 1, 1, 1)),
    ("llama", (1, 3, 1, 1)),
]


@pytest.mark.parametrize("arch,layout", SUBSET)
def test_rank_counts_equal_the_converted_model(arch, layout):
    _assert_ranks_match(arch, *layout)


@pytest.mark.full_matrix
@pytest.mark.parametrize("arch,layout", FULL)
def test_rank_counts_equal_the_converted_model_full(arch, layout):
    _assert_ranks_match(arch, *layout)


def test_bad_input_is_refused_by_name(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dict(LLAMA_3_70B, num_hidden_layers=2)))
    cases = [
        (["--model", tmp_path, "--ep", 2], "argument --ep: ep=2 splits MoE experts"),
        (["--model", tmp_path, "--pp", 3], "argument --pp: pp=3"),
        (["--model", tmp_path / "missing"], "no such file or directory"),
        ([], "give a config file or --model DIR_OR_CONFIG"),
    ]
    for argv, message in cases:
        assert main(["plan", *map(str, argv)]) == 2
        assert message in capsys.readouterr().err
    (tmp_path / "job.json").write_text(json.dumps({"model": {}}))
    assert main(["plan", "--model", str(tmp_path / "job.json")]) == 2
    assert "no 'model_type' field" in capsys.readouterr().err
