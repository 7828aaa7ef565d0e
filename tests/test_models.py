"""Configs, the meta-device footprint (exact counts from ../shared/docs/qwen-72b.md), and the Qwen2
model on tp_ext layers against Hugging Face transformers."""

import json
import os
import subprocess
import sys

import pytest
import torch

from tp_ext.config import JobConfig
from tp_ext.models import ConfigError, Qwen2Config, Qwen2ForCausalLM, hf_to_tp_ext_names
from tp_ext.models.footprint import footprint

from .dist_utils import run_distributed
from .reference import hf_qwen2
from .test_layers import assert_rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(ROOT, "configs")


def _config(name):
    return Qwen2Config.from_file(os.path.join(CONFIGS, name))


def test_full_size_footprints_have_the_exact_counts():
    qwen2 = footprint(_config("qwen2-72b.yaml"), 8)
    assert qwen2["parameters_total"] == 72_706_203_648
    assert [r["parameters"] for r in qwen2["ranks"]] == [9_089_429_504] * 8
    assert qwen2["ranks"][0]["bytes"]["bfloat16"] == 18_178_859_008
    assert qwen2["kv_cache_bytes_per_token_total"] == 320 * 1024
    assert qwen2["ranks"][0]["kv_cache_bytes_per_token"] == 40 * 1024
    assert qwen2["all_reduce_bytes_per_token_per_layer"] == 2 * 8192 * 2
    assert (qwen2["ranks"][0]["query_heads"], qwen2["ranks"][0]["kv_heads"]) == (8, 1)
    qwen = footprint(_config("qwen-72b.yaml"), 8)
    assert qwen["parameters_total"] == 72_287_920_128
    # norms are replicated: per-rank sums exceed the total by (tp - 1) x the norm parameters
    norms = (2 * 80 + 1) * 8192
    assert sum(r["parameters"] for r in qwen["ranks"]) == 72_287_920_128 + 7 * norms
    uneven = footprint(_config("qwen2-mini.yaml"), 3)
    assert sum(r["parameters"] for r in uneven["ranks"]) == uneven["parameters_total"] + 2 * (
        2 * 2 * 64 + 64
    ) + 2 * 2 * 8 * (64 + 1)  # norms, and KV head 0's k and v rows on 2 ranks


def test_config_errors_name_the_field(tmp_path):
    good = open(os.path.join(CONFIGS, "qwen2-mini.yaml")).read()
    cases = {
        "unknown": (good.replace("rope_theta:", "rope_thetaa:"), "rope_thetaa"),
        "missing": (good.replace("  vocab_size: 1001\n", ""), "model.vocab_size"),
        "section": (good + "trainer: {}\n", "trainer"),
        "dtype": (good.replace("dtype: float32", "dtype: fp8"), "parallel.dtype"),
    }
    for name, (text, expected) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=expected):
            JobConfig.from_file(str(path))
    with pytest.raises(ConfigError, match=r"use one of \[1, 2, 3, 4, 5, 6, 7, 8\]"):
        _config("qwen2-mini.yaml").check_tp(9)


def test_hf_config_json_is_read(tmp_path):
    import transformers  # requirements-dev.txt; a missing reference fails the test

    hf = transformers.Qwen2Config(
        vocab_size=1001,
        hidden_size=64,
        intermediate_size=44,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
    )
    hf.save_pretrained(str(tmp_path))
    config = Qwen2Config.from_file(str(tmp_path))
    mini = _config("qwen2-mini.yaml")
    assert config == mini


def test_cli_plan_json(tp_ext_here):
    status, out, _ = tp_ext_here(
        "plan", os.path.join(CONFIGS, "qwen2-72b.yaml"), "--tp", 8, "--json"
    )
    assert status == 0
    plan = json.loads(out)
    assert plan["parameters_total"] == 72_706_203_648
    assert plan["ranks"][7]["parameters"] == 9_089_429_504
    status, _, err = tp_ext_here("plan", os.path.join(CONFIGS, "qwen2-mini.yaml"), "--tp", 9)
    assert status == 2 and "use one of" in err


def _check_against_hf():
    config = _config("qwen2-mini.yaml")
    reference = hf_qwen2(config).eval()
    model = Qwen2ForCausalLM(config)
    seen = []
    model.apply(seen.append)  # nn.Module.apply reaches every submodule (none shadows it)
    assert len(seen) == len(list(model.modules()))
    model.load_full_state_dict(hf_to_tp_ext_names(reference.state_dict(), config))
    ids = torch.randint(0, config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert_rel(model(ids), reference(ids).logits, "logits against transformers", rtol=1e-4)
        assert torch.equal(
            model.generate(ids[:, :4], 6),
            reference.generate(ids[:, :4], max_new_tokens=6, do_sample=False),
        )


# 8 ranks (11 s on 2 cores) in `make test-all`: `make test`'s main job checks the 8-rank model's
# logits and greedy tokens against the single-process model
@pytest.mark.parametrize("ws", [1, 3, pytest.param(8, marks=pytest.mark.full_matrix)])
def test_qwen2_model_matches_transformers(ws):
    run_distributed(_check_against_hf, ws, timeout=300)


_LOAD_AND_MEASURE = """
import json, sys
from tp_ext.checkpoint import CheckpointError
from tp_ext.models import Qwen2ForCausalLM

def vm_peak():  # virtual peak: torch.empty maps pages without touching them, so RSS misses it
    for line in open("/proc/self/status"):
        if line.startswith("VmPeak:"):
            return int(line.split()[1]) * 1024

Qwen2ForCausalLM.from_pretrained  # imports done before measuring
before = vm_peak()
try:
    Qwen2ForCausalLM.from_pretrained(sys.argv[1], progress=False)
    error = None
except CheckpointError as e:
    error = str(e)
print(json.dumps({"error": error, "grew": vm_peak() - before}))
"""


def test_from_pretrained_checks_the_checkpoint_before_allocating(tmp_path):
    """config.json says a ~205 MB model; the checkpoint's tensors disagree (wrong shape, or one
    missing). The error must come before the model is allocated: the process's peak virtual
    memory (VmPeak, in a fresh process) grows by far less than the model."""
    from safetensors.torch import load_file, save_file

    small = _config("qwen2-mini.yaml").replace(hidden_size=512, intermediate_size=1024)
    Qwen2ForCausalLM(small).save_pretrained(str(tmp_path / "wrong_shape"))
    big = json.loads((tmp_path / "wrong_shape" / "config.json").read_text())
    big["vocab_size"] = 50_000  # 2 x 50,000 x 512 float32 = 205 MB of embeddings
    (tmp_path / "wrong_shape" / "config.json").write_text(json.dumps(big))
    missing = tmp_path / "missing"
    missing.mkdir()
    tensors = load_file(str(tmp_path / "wrong_shape" / "model.safetensors"))
    del tensors["model.layers.1.mlp.down_proj.weight"]
    tensors["model.embed_tokens.weight"] = torch.zeros(50_000, 1)  # a header only needs a shape
    tensors["lm_head.weight"] = torch.zeros(50_000, 1)
    save_file(tensors, str(missing / "model.safetensors"))
    (missing / "config.json").write_text(json.dumps(big))
    expected = {
        "wrong_shape": "tensor 'model.embed_tokens.weight' in {} has shape [1001, 512], but the "
        "model's config implies [50000, 512]: the config disagrees with the checkpoint",
        "missing": "checkpoint {} is missing tensor 'model.layers.1.mlp.down_proj.weight'; "
        "does the config match the checkpoint?",
    }
    for name, message in expected.items():
        where = tmp_path / name
        where = where / "model.safetensors" if name == "wrong_shape" else where
        done = subprocess.run(
            [sys.executable, "-c", _LOAD_AND_MEASURE, str(tmp_path / name)],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
        )
        result = json.loads(done.stdout.strip().splitlines()[-1])
        assert result["error"] == message.format(where), (result, done.stderr[-2000:])
        assert result["grew"] < 60 * 2**20, result  # the model is 205 MB


def test_from_pretrained_takes_dtype_names_as_configs_write_them(tmp_path):
    """dtype="bfloat16" (a config's parallel.dtype, transformers' torch_dtype) loads what
    dtype=torch.bfloat16 does; a name torch does not have is refused naming dtype."""
    config = _config("qwen2-mini.yaml").replace(num_hidden_layers=1)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(str(tmp_path))
    by_name = Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype="bfloat16", progress=False)
    by_dtype = Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16, progress=False)
    named, typed = by_name.state_dict(), by_dtype.state_dict()
    assert named.keys() == typed.keys()
    for key in named:
        assert named[key].dtype == torch.bfloat16 and torch.equal(named[key], typed[key]), key
    with pytest.raises(
        TypeError, match=r"dtype='fp16' is not a dtype: pass a torch.dtype .*float16"
    ):
        Qwen2ForCausalLM.from_pretrained(str(tmp_path), dtype="fp16", progress=False)
    with pytest.raises(TypeError, match="dtype='half' is not a dtype"):
        Qwen2ForCausalLM(config, dtype="half")


def test_from_pretrained_names_a_missing_checkpoint_directory(tmp_path):
    (tmp_path / "file").write_text("")
    for path, says in ((tmp_path / "nowhere", "does not exist"), (tmp_path / "file", "is not a")):
        with pytest.raises(ConfigError, match=f"checkpoint directory '{path}' {says}"):
            Qwen2ForCausalLM.from_pretrained(str(path))


# ---- random initialisation from a config ---------------------------------------------------------


def _initial_weights(tp, pp, tied):
    """This rank's stages of a model built from a config at the dims, gathered over TP (a
    grid when ``tp`` is a (P, Q) pair), and the single-process model built from the same seed."""
    import tp_ext
    from tp_ext.distributed import ResolvedGroup

    config = Qwen2Config.from_dict({**_TINY, "tie_word_embeddings": tied})
    state = tp_ext.init_parallel(tp=tp, pp=pp)
    torch.manual_seed(7)
    model = Qwen2ForCausalLM.from_config(config, parallel=state, virtual_stages=1)
    torch.manual_seed(7)
    single = Qwen2ForCausalLM(config, tp_group=ResolvedGroup.local()).state_dict()
    if isinstance(tp, tuple):  # the 2D model keeps transformers' separate q/k/v, gate/up
        single = _as_hf_names(single, config)
    return model.full_state_dict(), single


def _as_hf_names(state, config):
    """Our full tensors under transformers' names (fused ones cut into their pieces)."""
    from tp_ext.models.qwen2.hf_checkpoint_map import checkpoint_map

    out = {}
    for name, pieces in checkpoint_map(config).items():
        offset = 0
        for piece in pieces:
            out[piece.name] = state[name][offset : offset + piece.rows]
            offset += piece.rows
    return out


_TINY = dict(
    vocab_size=301,
    hidden_size=48,
    intermediate_size=80,
    num_hidden_layers=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    initializer_range=0.05,
)


# all dims hold blocks of the one model the seed gives: TP degrees (uneven at 3), pipeline
# stages (a stage builds only its layers; a tied head on the last stage copies the embedding's
# draw), both, and a 2D grid
@pytest.mark.parametrize(
    "tp, pp, tied",
    [(1, 1, True), (2, 1, False), (3, 1, True), (1, 2, True), (2, 2, True), ((2, 2), 1, False)],
    ids=["tp1-tied", "tp2", "tp3-tied", "pp2-tied", "tp2-pp2-tied", "grid2x2"],
)
def test_initial_weights_are_the_same_at_all_dims(tp, pp, tied):
    world = (tp[0] * tp[1] if isinstance(tp, tuple) else tp) * pp
    results = run_distributed(_initial_weights, world, tp, pp, tied)
    for held, single in results:
        assert held, "every rank holds part of the model"
        for name, tensor in held.items():
            assert torch.equal(tensor, single[name]), name
    assert set().union(*(held for held, _ in results)) == set(single), "the whole model"


def test_initial_weights_follow_transformers():
    """N(0, initializer_range) for every linear and embedding weight, biases zero, norms one:
    a model built from a config starts at the loss of a uniform guess, ln(vocab), as
    transformers' Qwen2 does (the layers' torch.nn initialisation gave the tied embedding
    N(0, 1): a first loss of about 62 for configs/train-tiny.yaml)."""
    import math

    from transformers import Qwen2Config as HFQwen2Config
    from transformers import Qwen2ForCausalLM as HFQwen2

    config = _config("train-tiny.yaml")
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    std = config.initializer_range
    for name, tensor in model.state_dict().items():
        if name.endswith(".bias"):
            assert torch.count_nonzero(tensor) == 0, name
        elif "norm" in name:
            assert torch.equal(tensor, torch.ones_like(tensor)), name
        else:
            assert abs(tensor.std().item() - std) < 0.1 * std, (name, tensor.std().item())
            assert abs(tensor.mean().item()) < 0.1 * std, name
    ids = torch.randint(0, config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(1))

    def first_loss(logits):
        flat = logits[:, :-1].reshape(-1, config.vocab_size).float()
        return torch.nn.functional.cross_entropy(flat, ids[:, 1:].reshape(-1)).item()

    uniform = math.log(config.vocab_size)
    with torch.no_grad():
        ours = first_loss(model(ids))
        hf_config = HFQwen2Config(**_hf_fields(config))
        theirs = first_loss(HFQwen2(hf_config).eval()(ids).logits)
    assert abs(ours - uniform) < 0.05 and abs(theirs - uniform) < 0.05, (ours, theirs, uniform)


def _hf_fields(config):
    from tp_ext.models.qwen2.hf_checkpoint_map import hf_config

    fields = hf_config(config, torch.float32)
    assert fields["initializer_range"] == config.initializer_range
    return {k: v for k, v in fields.items() if k not in ("architectures", "torch_dtype")}
