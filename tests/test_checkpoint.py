"""Checkpoints: Hugging Face in (per-rank slice reads, both Qwen formats) and out (transformers
loads it), sharded DCP save/load across TP degrees (bitwise), kill-safe saves, and bad input
with an error on every rank. References: transformers' Qwen2ForCausalLM and exact equality."""

import json
import os
import pickle

import pytest
import torch
from safetensors.torch import load_file, save_file

import tp_ext
from tp_ext import checkpoint
from tp_ext.checkpoint import CheckpointError
from tp_ext.models import Qwen2Config, Qwen2ForCausalLM

from .dist_utils import rank, run_distributed
from .reference import hf_qwen2
from .test_layers import assert_rel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MINI = os.path.join(ROOT, "configs", "qwen2-mini.yaml")


def _hf_model(config: Qwen2Config, seed: int = 0):
    model = hf_qwen2(config, seed).eval()
    with torch.no_grad():  # transformers initialises biases to zero; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _ids(config, seed=1, shape=(2, 9)):
    return torch.randint(0, config.vocab_size, shape, generator=torch.Generator().manual_seed(seed))


def _write_original_qwen(hf_model, config: Qwen2Config, path: str) -> None:
    """The same weights in the original Qwen-72B format (QWenLMHeadModel names, fused c_attn,
    w2 the gate), with its config.json."""
    os.makedirs(path, exist_ok=True)
    sd = hf_model.state_dict()
    out = {
        "transformer.wte.weight": sd["model.embed_tokens.weight"],
        "transformer.ln_f.weight": sd["model.norm.weight"],
        "lm_head.weight": sd["lm_head.weight"],
    }
    for i in range(config.num_hidden_layers):
        a, b = f"model.layers.{i}.", f"transformer.h.{i}."
        for leaf in ("weight", "bias"):
            out[f"{b}attn.c_attn.{leaf}"] = torch.cat(
                [sd[f"{a}self_attn.{p}_proj.{leaf}"] for p in "qkv"]
            )
        out.update(
            {
                b + "ln_1.weight": sd[a + "input_layernorm.weight"],
                b + "ln_2.weight": sd[a + "post_attention_layernorm.weight"],
                b + "attn.c_proj.weight": sd[a + "self_attn.o_proj.weight"],
                b + "mlp.w1.weight": sd[a + "mlp.up_proj.weight"],
                b + "mlp.w2.weight": sd[a + "mlp.gate_proj.weight"],
                b + "mlp.c_proj.weight": sd[a + "mlp.down_proj.weight"],
            }
        )
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(
            {
                "architectures": ["QWenLMHeadModel"],
                "model_type": "qwen",
                "vocab_size": config.vocab_size,
                "hidden_size": config.hidden_size,
                "intermediate_size": 2 * config.intermediate_size,
                "num_hidden_layers": config.num_hidden_layers,
                "num_attention_heads": config.num_attention_heads,
                "kv_channels": config.head_dim,
                "max_position_embeddings": config.max_position_embeddings,
                "rotary_emb_base": config.rope_theta,
                "layer_norm_epsilon": config.rms_norm_eps,
            },
            f,
        )


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """The mini model (8 heads, 2 KV heads, vocabulary 1001) saved by transformers as one file
    and as a sharded index; and an MHA variant in the original Qwen format."""
    root = tmp_path_factory.mktemp("hf")
    config = Qwen2Config.from_file(MINI)
    model = _hf_model(config)
    model.save_pretrained(str(root / "single"))
    model.save_pretrained(str(root / "sharded"), max_shard_size="200KB")
    mha = config.replace(num_key_value_heads=config.num_attention_heads)
    _write_original_qwen(_hf_model(mha, seed=3), mha, str(root / "qwen"))
    _hf_model(mha, seed=3).save_pretrained(str(root / "qwen_as_qwen2"))
    return root


def _load_and_compare(path, reference_path):
    import transformers

    model = Qwen2ForCausalLM.from_pretrained(path, progress=rank() == 0)
    reference = transformers.Qwen2ForCausalLM.from_pretrained(reference_path).float().eval()
    ids = _ids(model.config)
    with torch.no_grad():
        assert_rel(model(ids), reference(ids).logits, "logits against transformers", rtol=1e-4)
        assert torch.equal(
            model.generate(ids[:, :4], 5),
            reference.generate(ids[:, :4], max_new_tokens=5, do_sample=False),
        )
    report = model.load_report
    # each rank read exactly its own slices: bytes read == the bytes it holds
    assert report["read_bytes"] == report["shard_bytes"], report
    return report


# 8 ranks (23 s on 2 cores) in `make test-all`: `make test`'s main job (test_run) loads its
# sharded index on 8 ranks and checks logits and tokens against the single-process model
@pytest.mark.parametrize("ws", [1, 2, 3, 4, pytest.param(8, marks=pytest.mark.full_matrix)])
def test_from_pretrained_sharded_index_matches_transformers(hf_dirs, ws):
    assert os.path.isfile(hf_dirs / "sharded" / "model.safetensors.index.json")
    reports = run_distributed(
        _load_and_compare, ws, str(hf_dirs / "sharded"), str(hf_dirs / "sharded"), timeout=300
    )
    total = reports[0]["checkpoint_bytes"]
    if ws >= 4:  # every rank holds (and reads) well under the whole checkpoint
        assert max(r["read_bytes"] for r in reports) < 0.45 * total


@pytest.mark.parametrize("ws", [1, 3])
def test_from_pretrained_single_file(hf_dirs, ws):
    run_distributed(_load_and_compare, ws, str(hf_dirs / "single"), str(hf_dirs / "single"))


@pytest.mark.parametrize("ws", [1, 3, 4])
def test_original_qwen_format_loads(hf_dirs, ws):
    """Fused c_attn split into this rank's q/k/v rows, w2 as the gate: same logits as
    transformers' Qwen2 on the same weights."""
    run_distributed(_load_and_compare, ws, str(hf_dirs / "qwen"), str(hf_dirs / "qwen_as_qwen2"))


def _peak_memory(path, chunk_bytes):
    checkpoint.READ_CHUNK_BYTES = chunk_bytes
    model = Qwen2ForCausalLM.from_pretrained(path, progress=False)
    return model.load_report


def test_peak_host_memory_near_the_shard(tmp_path):
    """A checkpoint dominated by the embedding and LM head (2 x 32 MiB): at TP=4 each rank's
    peak memory growth while loading stays near its quarter, far below the whole file."""
    config = Qwen2Config.from_file(MINI).replace(
        vocab_size=65536, hidden_size=128, num_hidden_layers=1
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(str(tmp_path / "big"))
    del model
    chunk = 2 * 2**20
    reports = run_distributed(_peak_memory, 4, str(tmp_path / "big"), chunk)
    for r in reports:
        # its shard, plus a read chunk in flight (mapped and copied) and some allocator slack
        assert r["peak_rss_increase_bytes"] < r["shard_bytes"] + 2 * chunk + 12 * 2**20, r
        assert r["peak_rss_increase_bytes"] < 0.45 * r["checkpoint_bytes"], r


# ---- Hugging Face export -------------------------------------------------------------------------


def _export(path, max_shard_bytes):
    torch.manual_seed(7)
    model = Qwen2ForCausalLM(Qwen2Config.from_file(MINI))
    model.save_pretrained(path, max_shard_bytes=max_shard_bytes)
    ids = _ids(model.config)
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("ws,max_shard_bytes", [(3, 5 * 1024**3), (4, 150_000)])
def test_export_merged_checkpoint_loads_in_transformers(tmp_path, ws, max_shard_bytes):
    import transformers

    path = str(tmp_path / "export")
    logits = run_distributed(_export, ws, path, max_shard_bytes)[0]
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json")) == (
        max_shard_bytes < 10**6
    )
    reference = transformers.Qwen2ForCausalLM.from_pretrained(path).float().eval()
    with torch.no_grad():
        assert_rel(
            reference(_ids(Qwen2Config.from_file(MINI))).logits,
            logits,
            "transformers on the export",
            rtol=1e-5,
        )


# ---- sharded checkpoints (DCP) -------------------------------------------------------------------


def _save_at(path, seed):
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config.from_file(MINI))
    checkpoint.save_sharded(model, path, step=seed)
    full = model.full_state_dict()
    if rank() == 0:
        save_file(full, path + ".expected.safetensors")


def _load_at(path):
    torch.manual_seed(99)  # different weights, all to be overwritten
    model = Qwen2ForCausalLM(Qwen2Config.from_file(MINI))
    info = checkpoint.load_sharded(model, path)
    expected = load_file(path + ".expected.safetensors")
    full = model.full_state_dict()
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    return info


def test_sharded_save_at_8_loads_bitwise_at_4_2_1_3(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_at, 8, path, 5)
    assert not any(name.endswith(".metadata") for name in os.listdir(path))
    for ws in (4, 2, 1, 3):
        info = run_distributed(_load_at, ws, path)[0]
        assert (info["tp"], info["step"]) == (8, 5)


def test_sharded_save_at_3_loads_at_8(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_at, 3, path, 6)
    run_distributed(_load_at, 8, path)


def test_loading_unpickles_nothing(tmp_path, monkeypatch):
    path = str(tmp_path / "ckpt")
    _save_at(path, 4)

    def refuse(*args, **kwargs):
        raise AssertionError("a checkpoint load unpickled something")

    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    _load_at(path)


# Killed saves, concurrent saves and loads, symlinked paths: tests/test_checkpoint_safety.py.


# ---- bad input, on every rank --------------------------------------------------------------------


def _expect_error(path, config_changes, pattern, only_rank=None, good_path=None):
    import re

    config = Qwen2Config.from_file(MINI).replace(**config_changes)
    model = Qwen2ForCausalLM(config)
    use = path if only_rank is None or rank() == only_rank else good_path
    try:
        checkpoint.load_hf_checkpoint(model, use, progress=False)
    except CheckpointError as e:
        if only_rank is None or rank() == only_rank:
            assert re.search(pattern, str(e)), str(e)
        else:
            assert f"failed on rank {only_rank}" in str(e) and re.search(pattern, str(e)), str(e)
        return str(e)
    raise AssertionError("no error")


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_fail_clearly_on_every_rank(hf_dirs, tmp_path):
    sharded = str(hf_dirs / "sharded")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    # missing tensor
    bad = _copy(sharded, tmp_path / "missing")
    index_missing = {
        **index,
        "weight_map": {
            k: v for k, v in index["weight_map"].items() if k != "model.layers.1.mlp.up_proj.weight"
        },
    }
    json.dump(index_missing, open(os.path.join(bad, "model.safetensors.index.json"), "w"))
    run_distributed(
        _expect_error, 3, str(bad), {}, "missing tensor 'model.layers.1.mlp.up_proj.weight'"
    )
    # extra tensor
    bad = _copy(str(hf_dirs / "single"), tmp_path / "extra")
    tensors = load_file(os.path.join(bad, "model.safetensors"))
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(3)
    save_file(tensors, os.path.join(bad, "model.safetensors"))
    run_distributed(
        _expect_error, 2, str(bad), {}, "'model.layers.0.mlp.extra.weight'.*does not use"
    )
    # config disagrees with the checkpoint: a shape mismatch naming the tensor
    run_distributed(
        _expect_error,
        3,
        sharded,
        {"intermediate_size": 40},
        r"'model.layers.0.mlp.gate_proj.weight' in .* has shape \[44, 64\].*"
        r"\[40, 64\]",
    )
    # truncated and corrupt files
    bad = _copy(sharded, tmp_path / "truncated")
    victim = os.path.join(bad, sorted(set(index["weight_map"].values()))[-1])
    data = open(victim, "rb").read()
    open(victim, "wb").write(data[: len(data) // 2])
    run_distributed(
        _expect_error, 3, str(bad), {}, f"{os.path.basename(victim)} is corrupt or truncated"
    )
    open(victim, "wb").write(b"not a safetensors file at all" * 10)
    run_distributed(_expect_error, 2, str(bad), {}, "corrupt or truncated")
    # a broken file seen by one rank only: the others raise too instead of going on
    run_distributed(_expect_error, 3, str(bad), {}, "corrupt or truncated", 1, sharded)
    with pytest.raises(CheckpointError, match="does not exist"):
        checkpoint.load_hf_checkpoint(
            Qwen2ForCausalLM(Qwen2Config.from_file(MINI)), str(tmp_path / "nowhere"), progress=False
        )


def _load_sharded_error(path, changes, pattern):
    import re

    model = Qwen2ForCausalLM(Qwen2Config.from_file(MINI).replace(**changes))
    with pytest.raises(CheckpointError) as info:
        checkpoint.load_sharded(model, path)
    assert re.search(pattern, str(info.value)), str(info.value)


def test_bad_sharded_checkpoints(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_at, 2, path, 4)
    run_distributed(
        _load_sharded_error,
        2,
        path,
        {"intermediate_size": 40},
        "intermediate_size=44.*intermediate_size=40",
    )
    shard = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[0]
    with open(os.path.join(os.path.realpath(path), shard), "r+b") as f:
        f.truncate(1000)
    run_distributed(_load_sharded_error, 3, path, {}, f"{shard} has 1000 bytes.*truncated")
    assert tp_ext  # imported for its ops
