"""``tp-ext run --model DIR_OR_CONFIG``: the main job for any transformers decoder
parallelize("auto") converts: a small model of its family written by transformers, loaded in
slices, checked against transformers' single-process model (logits, greedy tokens, training
losses, trained logits), saved through DCP and reloaded bitwise, exported for from_pretrained."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys

import pytest
import torch
import transformers

from tp_ext.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = dict(num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, vocab_size=300)
CONFIGS = {
    "llama": ("LlamaConfig", dict(SMALL, hidden_size=48, intermediate_size=44)),
    "mixtral": (
        "MixtralConfig",
        dict(SMALL, hidden_size=48, intermediate_size=44, num_local_experts=4),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(SMALL, hidden_size=48, intermediate_size=44, head_dim=8, sliding_window=16),
    ),
    "gpt2": ("GPT2Config", dict(n_layer=4, n_head=6, n_embd=48, vocab_size=300)),
}


def _config_dir(tmp_path, arch: str) -> str:
    name, fields = CONFIGS[arch]
    path = str(tmp_path / arch)
    getattr(transformers, name)(**fields).save_pretrained(path)
    return path


def _report(argv) -> tuple[int, str]:
    """The status and the report (stdout) and messages (stderr) of `tp-ext run` here."""
    out = io.StringIO()
    with contextlib.redirect_stderr(out), contextlib.redirect_stdout(out):
        status = main(["run", *map(str, argv)])
    return status, out.getvalue()


def test_run_model_passes_every_check_on_one_rank(tmp_path):
    """Through a job config whose model: names a checkpoint directory (its config is what the
    job reads; the small model is derived from it)."""
    name, fields = CONFIGS["llama"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, name)(**fields))
    model.save_pretrained(tmp_path / "checkpoint")
    job = tmp_path / "job.yaml"
    job.write_text("model: checkpoint\nparallel: {seed: 5}\n")
    status, err = _report([job, "--steps", "3", "--max-new-tokens", "4"])
    assert status == 0, err[-4000:]
    assert "all checks passed on 1 ranks" in err
    assert err.count("  ok   ") == 10  # every check of steps 3-6 ran and passed


def test_run_model_refuses_small_and_bad_ep(tmp_path, monkeypatch):
    model = _config_dir(tmp_path, "llama")
    status, err = _report(["--model", model, "--small", model])
    assert status == 2 and "--small" in err and "drop --small" in err
    monkeypatch.setenv("WORLD_SIZE", "2")
    status, err = _report(["--model", model, "--dp", "2", "--ep", "2"])
    assert status == 2 and "--ep 2: Llama has no experts to split" in err


def _torchrun(nproc, *argv) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(nproc), "-m", "tp_ext", "run", *map(str, argv), "--steps", "3",
         "--max-new-tokens", "6"],
        capture_output=True, text=True, timeout=400, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-6000:]
    return done.stdout + done.stderr


# make test: GPT-2 over a pipeline (Conv1D weights, fused q|k|v, a tied head whose checkpoint
# tensor is the embedding's); test-all: the other architectures and dims
RUN_CASES = [
    ("gpt2", 2, ["--pp", "2"]),
    pytest.param("llama", 4, ["--tp", "2", "--pp", "2"], marks=pytest.mark.full_matrix),
    pytest.param("mixtral", 2, ["--dp", "2", "--ep", "2"], marks=pytest.mark.full_matrix),
    pytest.param("mixtral", 2, ["--tp", "2"], marks=pytest.mark.full_matrix),
    pytest.param(
        "mixtral", 4, ["--pp", "2", "--dp", "2", "--ep", "2"], marks=pytest.mark.full_matrix
    ),
    pytest.param("gemma2", 3, ["--tp", "3"], marks=pytest.mark.full_matrix),
    pytest.param("gpt2", 2, ["--tp", "2"], marks=pytest.mark.full_matrix),
    pytest.param(
        "llama", 2, ["--dp", "2", "--data-parallel", "fsdp"], marks=pytest.mark.full_matrix
    ),
]


@pytest.mark.parametrize("arch,nproc,flags", RUN_CASES)
def test_run_model_passes_every_check_under_torchrun(tmp_path, arch, nproc, flags):
    err = _torchrun(nproc, "--model", _config_dir(tmp_path, arch), *flags)
    assert f"all checks passed on {nproc} ranks" in err
    if arch == "mixtral":  # one tensor per expert, as transformers saves them: read by slices
        assert "read whole by from_pretrained" not in err and "rank 0 read " in err


def test_conv1d_weights_go_whole_into_the_sharded_checkpoint():
    """GPT-2's Conv1D weights ([in, out] in transformers' files, [out, in] in tp_ext's layers)
    and fused q|k|v: the DCP state holds every row (it held c_fc's first 64 of 256 rows)."""
    import tp_ext
    from tp_ext.checkpoint.dcp import checkpoint_tensors

    config = transformers.GPT2Config(n_layer=1, n_head=4, n_embd=64, vocab_size=500)
    model = tp_ext.parallelize(transformers.AutoModelForCausalLM.from_config(config), "auto")
    state = checkpoint_tensors(model)
    assert tuple(state["transformer.h.0.mlp.c_fc.weight"].shape) == (256, 64)
    assert tuple(state["transformer.h.0.mlp.c_proj.weight"].shape) == (64, 256)
    for k in range(3):  # q, k and v: a tensor each, the same keys at every TP degree
        assert tuple(state[f"transformer.h.0.attn.c_attn.weight.part{k}"].shape) == (64, 64)
        assert tuple(state[f"transformer.h.0.attn.c_attn.bias.part{k}"].shape) == (64,)
